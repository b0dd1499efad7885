"""``python -m moe_ep.doctor`` (the README's command): runs ``moe_ep.tools.doctor``."""
import runpy

if __name__ == "__main__":
    runpy.run_module("moe_ep.tools.doctor", run_name="__main__", alter_sys=True)
