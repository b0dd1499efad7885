"""``python -m moe_ep.demo`` (the README's command): runs ``moe_ep.tools.demo``."""
import runpy

if __name__ == "__main__":
    runpy.run_module("moe_ep.tools.demo", run_name="__main__", alter_sys=True)
