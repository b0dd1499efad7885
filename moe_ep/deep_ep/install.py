"""``python -m moe_ep.deep_ep.install [--target DIR] [--uninstall]``: writes (or removes) the small
forwarding ``deep_ep`` package that makes ``import deep_ep`` load ``moe_ep.deep_ep``."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import sysconfig
from typing import List, Optional

from ..deep_ep_alias import MARKER, is_alias, real_deep_ep

_INIT = f'''# {MARKER}: `import deep_ep` loads moe_ep.deep_ep (DeepEP's API on moe_ep).
# Written by `python -m moe_ep.deep_ep.install`; `python -m moe_ep.deep_ep.uninstall` removes it.
from moe_ep.deep_ep_alias import activate as _activate

_activate(__name__, __file__)
'''


def default_target() -> str:
    """This interpreter's site-packages (``purelib``)."""
    return sysconfig.get_paths()["purelib"]


def install(target: Optional[str] = None) -> str:
    """Writes ``<target>/deep_ep/__init__.py`` (the forwarding package); returns its directory.
    Refuses (``RuntimeError`` naming it) when a real DeepEP is importable in this interpreter or
    ``<target>/deep_ep`` exists and is not moe_ep's."""
    target = os.path.abspath(target or default_target())
    pkg = os.path.join(target, "deep_ep")
    init = os.path.join(pkg, "__init__.py")
    real = real_deep_ep()
    if real:
        raise RuntimeError(f"DeepEP is installed at {real[0]}: moe_ep will not shadow it (uninstall it first, or "
                           f"keep `import moe_ep.deep_ep as deep_ep` in your own code)")
    if os.path.exists(pkg) and not is_alias(init):
        raise RuntimeError(f"{pkg} exists and is not moe_ep's forwarding package: not touched")
    os.makedirs(pkg, exist_ok=True)
    with open(init, "w", encoding="utf-8") as f:
        f.write(_INIT)
    return pkg


def uninstall(target: Optional[str] = None) -> Optional[str]:
    """Removes ``<target>/deep_ep`` when it is moe_ep's forwarding package; returns what was removed
    (None: nothing there). Refuses (``RuntimeError``) to remove anything else."""
    pkg = os.path.join(os.path.abspath(target or default_target()), "deep_ep")
    if not os.path.exists(pkg):
        return None
    if not is_alias(os.path.join(pkg, "__init__.py")):
        raise RuntimeError(f"{pkg} is not moe_ep's forwarding package: not removed")
    shutil.rmtree(pkg)
    return pkg


def main(argv: Optional[List[str]] = None, remove: bool = False) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_ep.deep_ep." + ("uninstall" if remove else "install"),
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help=f"the directory on sys.path to write into (default: this "
                                                   f"interpreter's site-packages, {default_target()})")
    if not remove:
        ap.add_argument("--uninstall", action="store_true", help="remove the forwarding package instead")
    a = ap.parse_args(argv)
    try:
        if remove or a.uninstall:
            gone = uninstall(a.target)
            print(f"removed {gone}" if gone else "nothing to remove")
        else:
            pkg = install(a.target)
            on_path = os.path.dirname(pkg) in [os.path.abspath(p or os.getcwd()) for p in sys.path]
            print(f"wrote {pkg}: import deep_ep now loads moe_ep.deep_ep"
                  + ("" if on_path else f" (once {os.path.dirname(pkg)} is on sys.path / PYTHONPATH)"))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
