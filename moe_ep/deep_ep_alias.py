"""``import deep_ep`` answered by moe_ep (torch-free, so the doctor can ask): what the forwarding
package written by ``python -m moe_ep.deep_ep.install`` runs (``activate``), and where ``deep_ep`` resolves
(``status``, for ``python -m moe_ep.doctor``)."""
from __future__ import annotations

import importlib
import os
import sys
from importlib.machinery import PathFinder
from typing import List, Optional

MARKER = "moe_ep-deep_ep-alias"  # the first line of the forwarding package's __init__.py names it
# moe_ep.deep_ep's modules registered as deep_ep.<name> (DeepEP's deep_ep.utils among them)
SUBMODULES = ("utils", "buffer", "elastic", "config", "event", "forks")


def is_alias(init_path: Optional[str]) -> bool:
    """True when ``init_path`` is the ``__init__.py`` of a forwarding package this module wrote."""
    if not init_path or not os.path.isfile(init_path):
        return False
    with open(init_path, "r", encoding="utf-8", errors="replace") as f:
        return MARKER in f.readline()


def find_deep_ep(paths: Optional[List[str]] = None) -> List[str]:
    """Every ``deep_ep`` importable from ``paths`` (default ``sys.path``), in import order: the
    origin of each (a package's ``__init__.py``, or an extension module's file)."""
    found: List[str] = []
    for entry in (sys.path if paths is None else paths):
        try:
            spec = PathFinder.find_spec("deep_ep", [entry or os.getcwd()])
        except (ImportError, OSError, ValueError):
            continue
        if spec is None:
            continue
        where = spec.origin or (list(spec.submodule_search_locations or [])[:1] or [entry])[0]
        if where not in found:
            found.append(where)
    return found


def real_deep_ep(paths: Optional[List[str]] = None) -> List[str]:
    """The ``deep_ep`` packages on ``paths`` that are not moe_ep's forwarding package."""
    return [p for p in find_deep_ep(paths) if not is_alias(p)]


class RealDeepEPError(ImportError):
    """A real DeepEP is installed: moe_ep will not shadow it."""


def activate(name: str, init_file: str) -> None:
    """Run by the forwarding package (``name`` "deep_ep", ``init_file`` its ``__init__.py``):
    ``sys.modules["deep_ep"]`` and ``sys.modules["deep_ep.<sub>"]`` become ``moe_ep.deep_ep`` and
    its modules (one copy of each class: ``deep_ep.EventOverlap is moe_ep.deep_ep.EventOverlap``).
    Raises ``RealDeepEPError`` naming it when a real DeepEP is importable too (it would be shadowed)."""
    others = real_deep_ep()
    if others:
        raise RealDeepEPError(
            f"import deep_ep: moe_ep's alias ({os.path.dirname(init_file)}) would shadow the DeepEP installed at "
            f"{others[0]}; remove one of them (python -m moe_ep.deep_ep.uninstall removes the alias)")
    target = importlib.import_module("moe_ep.deep_ep")
    for sub in SUBMODULES:
        sys.modules[f"{name}.{sub}"] = importlib.import_module(f"moe_ep.deep_ep.{sub}")
    target.ALIAS_PATH = os.path.dirname(os.path.abspath(init_file))
    sys.modules[name] = target


def status() -> dict:
    """Where ``import deep_ep`` goes in this interpreter, without importing it: ``{"active": True
    when it loads moe_ep, "alias": the forwarding package's directory or None, "real": the real
    DeepEP packages found (paths), "what": one line}``."""
    loaded = sys.modules.get("deep_ep")
    found = find_deep_ep()
    alias = next((os.path.dirname(p) for p in found if is_alias(p)), None)
    real = [p for p in found if not is_alias(p)]
    if loaded is not None and getattr(loaded, "__name__", "") == "moe_ep.deep_ep":
        return {"active": True, "alias": getattr(loaded, "ALIAS_PATH", alias), "real": real,
                "what": f"active: import deep_ep loads moe_ep.deep_ep (alias {getattr(loaded, 'ALIAS_PATH', alias)})"}
    if alias is not None and real:
        return {"active": False, "alias": alias, "real": real,
                "what": f"refused: the alias at {alias} and the DeepEP at {real[0]} are both installed "
                        f"(import deep_ep raises; remove one)"}
    if alias is not None:
        return {"active": True, "alias": alias, "real": [],
                "what": f"active: import deep_ep loads moe_ep.deep_ep (alias {alias})"}
    if real:
        return {"active": False, "alias": None, "real": real,
                "what": f"inactive: import deep_ep loads DeepEP ({real[0]})"}
    return {"active": False, "alias": None, "real": [],
            "what": "inactive: no deep_ep (python -m moe_ep.deep_ep.install makes import deep_ep load moe_ep)"}
