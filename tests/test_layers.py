"""moe_ep's folders in layers: no module imports one of a folder above its own (docs/ARCHITECTURE.md §1).

Read from the source (every import statement, those inside functions and under TYPE_CHECKING too),
so it runs without torch in well under a second.
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "moe_ep"
# Each folder's floor, from the ground up: a module may import its own folder's and lower floors'.
FLOORS = {"core": 0, "native": 1, "kernels": 2, "internode": 3, "ops": 4, "moe": 5, "integrations": 6,
          "deep_ep": 6, "testing": 7, "tools": 7, "bench": 7}
# Imports allowed to run up, each with its reason: none but this one.
KNOWN_UP = {("moe_ep/kernels/recv_total.py", "internode")}  # the packed count waits on the proxy's header word too


def imported(path: pathlib.Path) -> list:
    """The absolute module names ``path`` imports (``from`` imports: the module and module.name)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    package = parts if parts[-1] == "__init__" else parts[:-1]
    package = package[:-1] if package[-1] == "__init__" else package
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out += [mod] + [f"{mod}.{a.name}" for a in node.names]
    return out


def folder_of(module: str) -> str:
    """``moe_ep.ops.buffer`` -> ``ops``; a top-level module or anything outside moe_ep: ``""``."""
    bits = module.split(".")
    return bits[1] if bits[0] == "moe_ep" and len(bits) > 1 and bits[1] in FLOORS else ""


def upward_imports(pkg: pathlib.Path = PKG) -> set:
    """``{(file, folder it imports)}`` for every import from a folder to one on a higher floor."""
    found = set()
    for path in sorted(pkg.rglob("*.py")):
        own = path.relative_to(pkg).parts[0]
        if own not in FLOORS:
            continue
        for module in imported(path):
            other = folder_of(module)
            if other and FLOORS[other] > FLOORS[own]:
                found.add((path.relative_to(ROOT).as_posix(), other))
    return found


def test_no_folder_imports_one_above_it():
    assert upward_imports() == KNOWN_UP


def test_every_folder_has_a_floor_and_says_its_job():
    folders = {p.parent.name for p in PKG.glob("*/__init__.py")}
    assert folders == set(FLOORS), folders ^ set(FLOORS)
    for name in folders:
        doc = ast.get_docstring(ast.parse((PKG / name / "__init__.py").read_text(encoding="utf-8")))
        assert doc and doc.strip(), f"moe_ep/{name}/__init__.py: no docstring saying the folder's job"
