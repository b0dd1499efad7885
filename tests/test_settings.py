"""``moe_ep.core.settings``: every variable moe_ep (or its native library) reads is declared there or in
``moe_ep.core.tuning``, only those two modules read ``MOE_EP_*`` variables from the environment, and the
settings parse as they did (a bad value raises naming its variable). No torch, no process group.
"""
from __future__ import annotations

import ast
import os
import re

import pytest

from native_hooks import ROOT, light_import

settings = light_import("core.settings")
tuning = light_import("core.tuning")

PKG = os.path.join(ROOT, "moe_ep")
CSRC = os.path.join(ROOT, "csrc", "proxy")
NAME = re.compile(r"\bMOE_EP_[A-Z0-9_]*[A-Z0-9]\b")
# Names of the MOE_EP_ form that are not environment variables.
NOT_VARIABLES = {"MOE_EP_BUILD_FLAGS", "MOE_EP_COMPILER", "MOE_EP_STR", "MOE_EP_STR2",  # C macros (capi.cc, -D)
                 "MOE_EP_TEST_HOOKS",  # a C macro: the tests' build of the library (tests/native_hooks.py)
                 "MOE_EP_NAME"}  # a placeholder in moe_ep.bench.variants' --point help
READERS = {"core/settings.py", "core/tuning.py"}  # the modules that read MOE_EP_* variables
# Reads left outside them, as (file under moe_ep/, variable): none.
KNOWN_READS: set = set()


def _files(top: str, exts: tuple) -> list:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(top) for f in fs if f.endswith(exts))


def _names_in(files: list) -> dict:
    """``{variable: first file naming it}`` over ``files``' text."""
    found: dict = {}
    for path in files:
        with open(path, encoding="utf-8") as f:
            for name in NAME.findall(f.read()):
                found.setdefault(name, os.path.relpath(path, ROOT))
    return found


def _env_reads(source: str) -> list:
    """The ``MOE_EP_*`` names ``source`` reads from an environment: ``getenv("MOE_EP_X")``,
    ``<env>.get/pop/setdefault("MOE_EP_X", ...)``, ``<env>["MOE_EP_X"]``, ``"MOE_EP_X" in <env>``,
    ``<env>.update(MOE_EP_X=...)``."""
    def name(node) -> str:
        ok = isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("MOE_EP_")
        return node.value if ok else ""

    reads = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            attr = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if attr in ("getenv", "get", "pop", "setdefault", "putenv") and name(node.args[0]):
                reads.append(name(node.args[0]))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update":
            reads += [k.arg for k in node.keywords if k.arg and k.arg.startswith("MOE_EP_")]
        if isinstance(node, ast.Subscript) and name(node.slice):
            reads.append(name(node.slice))
        if isinstance(node, ast.Compare) and name(node.left) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            reads.append(name(node.left))
    return reads


def env_reads_outside(pkg: str = PKG) -> list:
    """``[(file under pkg, variable)]`` for every read of a ``MOE_EP_*`` variable outside ``READERS``."""
    out = []
    for path in _files(pkg, (".py",)):
        rel = os.path.relpath(path, pkg)
        if rel not in READERS:
            with open(path, encoding="utf-8") as f:
                out += [(rel, n) for n in _env_reads(f.read())]
    return out


def test_every_variable_named_is_declared():
    """Every ``MOE_EP_*`` name in moe_ep's source and the native library's is a declared variable."""
    named = _names_in(_files(PKG, (".py",)) + _files(CSRC, (".cc", ".h")))
    declared = set(settings.NAMES)
    missing = {n: where for n, where in named.items() if n not in declared and n not in NOT_VARIABLES}
    assert not missing, f"named but not declared in moe_ep/core/settings.py (or tuning.py): {missing}"
    assert set(settings.TUNING) == {var for var, _ in tuning.ENV.values()} <= declared
    assert len(settings.NAMES) == len(set(settings.NAMES))


def test_native_reads_are_marked():
    """The variables csrc/proxy reads itself (``getenv``, ``env_int``, ``env_or``, and the first argument
    of ``load_table``, shared_lib.h's loader) are exactly those declared ``native=True``."""
    read = set()
    for path in _files(CSRC, (".cc", ".h")):
        with open(path, encoding="utf-8") as f:
            for args in re.findall(r"\b(?:getenv|env_int|env_or)\(([^;{]*?)\)", f.read()):
                read |= set(re.findall(r'"([A-Z][A-Z0-9_]*)"', args))
            f.seek(0)
            read |= set(re.findall(r'\bload_table<\w+>\(\s*"([A-Z][A-Z0-9_]*)"', f.read()))
    assert read == set(settings.NATIVE), (sorted(read), sorted(settings.NATIVE))


def test_only_settings_and_tuning_read_the_environment():
    reads = env_reads_outside()
    assert set(reads) <= KNOWN_READS, f"MOE_EP_* reads outside moe_ep/core/settings.py and tuning.py: {reads}"
    # the detector itself
    src = ('import os\nos.environ.get("MOE_EP_A")\nos.getenv("MOE_EP_B", "")\nenv["MOE_EP_C"]\n'
           '"MOE_EP_D" in os.environ\nos.environ.update(MOE_EP_E="1")\nos.environ.get("OTHER")\nraise X("MOE_EP_F")\n')
    assert sorted(_env_reads(src)) == ["MOE_EP_A", "MOE_EP_B", "MOE_EP_C", "MOE_EP_D", "MOE_EP_E"]


def test_declarations_are_complete():
    for v in settings.VARIABLES:
        assert v.name and v.accepts and v.default and v.meaning, v
    with pytest.raises(KeyError, match="MOE_EP_NOPE: not a variable"):
        settings.value("MOE_EP_NOPE", {})


def test_readme_table_lists_every_variable():
    """README's variables table names every declared variable (the tuning ones have their own list)."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    table = text[text.index("| variable | meaning |"):]
    table = table[:table.index("\n\n")]
    assert [v.name for v in settings.VARIABLES if f"`{v.name}`" not in table] == []


# ----------------------------------------------------------------------------- parsing

@pytest.mark.parametrize("call,env,want", [
    ("transport", {}, "auto"), ("transport", {"MOE_EP_TRANSPORT": " EFA "}, "efa"),
    ("node_memory", {}, None), ("node_memory", {"MOE_EP_NODE_MEMORY": "IPC "}, "ipc"),
    ("launch_path", {"MOE_EP_LAUNCH": ""}, "native"), ("launch_path", {"MOE_EP_LAUNCH": "triton"}, "triton"),
    ("fi_endpoints", {}, None), ("fi_endpoints", {"MOE_EP_FI_ENDPOINTS": " 8 "}, 8),
    ("fi_provider", {"FI_PROVIDER": "tcp"}, "tcp"),
    ("fi_provider", {"FI_PROVIDER": "tcp", "MOE_EP_FI_PROVIDER": "udp"}, "udp"),
    ("tcp_hello_timeout", {}, 10.0), ("tcp_hello_timeout", {"MOE_EP_TCP_HELLO_TIMEOUT": "0.3"}, 0.3),
    ("tcp_max_pending", {}, 256), ("tcp_max_pending", {"MOE_EP_TCP_MAX_PENDING": "3"}, 3),
    ("ib_devices", {"MOE_EP_IB_DEVICE": "a,,b:2"}, ["a", "b:2"]), ("ib_devices", {}, []),
    ("ib_nics", {"MOE_EP_IB_NICS": "0x2"}, 2), ("ib_nics", {"MOE_EP_IB_NICS": "two"}, 0),
    ("ib_port", {}, 0), ("node_size", {"MOE_EP_NODE_SIZE": "2"}, 2), ("node_size", {}, None),
    ("sysfs_root", {}, "/sys"), ("proxy_trace", {}, "phases"), ("cuda_lib", {}, "libcuda.so.1"),
    ("ibverbs_lib", {"MOE_EP_IBVERBS_LIB": "x.so"}, "x.so"), ("commit", {}, ""),
])
def test_values(call, env, want):
    assert getattr(settings, call)(env=env) == want


@pytest.mark.parametrize("call,var,text,msg", [
    ("transport", "MOE_EP_TRANSPORT", "rdma", "MOE_EP_TRANSPORT='rdma': expected one of auto, verbs, tcp, efa, libfabric"),
    ("node_memory", "MOE_EP_NODE_MEMORY", "shmem", "MOE_EP_NODE_MEMORY: expected one of symm, ipc, got 'shmem'"),
    ("launch_path", "MOE_EP_LAUNCH", "cuda", "MOE_EP_LAUNCH: expected one of native, triton, got 'cuda'"),
    ("fi_endpoints", "MOE_EP_FI_ENDPOINTS", "0", "MOE_EP_FI_ENDPOINTS='0': expected a positive integer"),
    ("fi_endpoints", "MOE_EP_FI_ENDPOINTS", "+2", "MOE_EP_FI_ENDPOINTS='+2': expected a positive integer"),
    ("tcp_hello_timeout", "MOE_EP_TCP_HELLO_TIMEOUT", "soon", "MOE_EP_TCP_HELLO_TIMEOUT='soon': expected a positive number"),
    ("tcp_hello_timeout", "MOE_EP_TCP_HELLO_TIMEOUT", "nan", "MOE_EP_TCP_HELLO_TIMEOUT='nan': expected a positive number"),
    ("tcp_max_pending", "MOE_EP_TCP_MAX_PENDING", "1.5", "MOE_EP_TCP_MAX_PENDING='1.5': expected a positive integer"),
    ("node_size", "MOE_EP_NODE_SIZE", "two", "MOE_EP_NODE_SIZE: expected an integer, got 'two'"),
])
def test_bad_values_name_the_variable(call, var, text, msg):
    with pytest.raises(ValueError) as e:
        getattr(settings, call)(env={var: text})
    assert str(e.value) == msg


def test_read_at_each_call(monkeypatch):
    """Nothing is cached: a variable set after import counts at the next call, in os.environ by default."""
    monkeypatch.delenv("MOE_EP_TRANSPORT", raising=False)
    assert settings.transport() == "auto" and settings.transport("TCP") == "tcp"
    monkeypatch.setenv("MOE_EP_TRANSPORT", "verbs")
    assert settings.transport() == "verbs" and settings.environment(["MOE_EP_TRANSPORT"]) == {"MOE_EP_TRANSPORT": "verbs"}
    monkeypatch.setenv("MOE_EP_DEVICE", "cpu")
    settings.set_device("cuda")
    assert os.environ["MOE_EP_DEVICE"] == "cuda" == settings.device()
