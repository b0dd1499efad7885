"""The tests' build of the native library and its test hooks, which only tests call: fault
injection on an engine, a verbs engine's queue pairs destroyed as a crashed process would, the
memory type registration assumes, native threads adding to an ``ImmCounter`` at once, and a
goodbye taken after its peer was lost.

The hooks (csrc/testing/hooks.cc) are not in the library users install: importing this module
builds csrc/proxy, csrc/launch and csrc/testing with ``MOE_EP_TEST_HOOKS`` into
``build/moe_ep_native_test/`` (once; again when a source is newer) and points ``MOE_EP_NATIVE_LIB``
at it, for this process and the rank processes it starts (conftest.py imports it first). A
``MOE_EP_NATIVE_LIB`` set before (a sanitizer build, say) is kept: build that with
``-DMOE_EP_TEST_HOOKS`` and csrc/testing too. Imported without ``moe_ep`` itself where that is not
imported yet (``light_import``: no torch), so the rdma tests still run with ``--noconftest``.
"""
from __future__ import annotations

import ctypes
import fcntl
import importlib
import os
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def light_import(module: str):
    """``moe_ep.<module>``; without importing ``moe_ep`` when it is not imported yet (the package
    is then loaded under a private name, its ``__init__`` files skipped, so no torch)."""
    if "moe_ep" in sys.modules:
        return importlib.import_module("moe_ep." + module)
    light = "_moe_ep_light"
    for sub in ("", ".native", ".internode"):
        name, path = light + sub, os.path.join(ROOT, "moe_ep", *sub.split(".")[1:])
        if name not in sys.modules:
            m = types.ModuleType(name)
            m.__path__ = [path]
            sys.modules[name] = m
    return importlib.import_module(light + "." + module)


library = light_import("native.library")
TEST_BUILD = os.path.join(ROOT, "build", "moe_ep_native_test")


def _tests_library() -> str:
    """The tests' build of the library (one build at a time: pytest-xdist workers share it)."""
    os.makedirs(TEST_BUILD, exist_ok=True)
    with open(os.path.join(TEST_BUILD, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return library.build(TEST_BUILD, (*library.SRC_DIRS, os.path.join(library.CSRC, "testing")),
                             defines=("MOE_EP_TEST_HOOKS",))


if not os.environ.get("MOE_EP_NATIVE_LIB"):
    os.environ["MOE_EP_NATIVE_LIB"] = _tests_library()

_I32, _I64, _U32, _VP = ctypes.c_int, ctypes.c_int64, ctypes.c_uint32, ctypes.c_void_p
_hooks = library.Functions(moe_ep_set_fault=(_I32, _VP, _I64, _I32, _I32, _I64),
                           moe_ep_verbs_destroy_qp=(_I32, _VP, _I32), moe_ep_test_memory_type=(_I32, _I32),
                           moe_ep_imm_stress=(_I32, _VP, _U32, _I32, _I64),
                           moe_ep_test_late_goodbye=(_I32, _I32, ctypes.c_char_p, _I64))


def set_fault(engine, delay_us: int = 0, reorder: bool = False, cut_peer: int = -1, cut_after: int = 0) -> None:
    """Fault injection on ``engine`` (off by default): random per-shard delay up to ``delay_us``
    (tcp); ``reorder`` (tcp: random stream, random pick from the stream's queue); cut every
    connection with ``cut_peer`` when write number ``cut_after + 1`` to it is posted (every transport)."""
    _hooks().moe_ep_set_fault(engine.handle, delay_us, int(reorder), cut_peer, cut_after)


def destroy_qp(engine, peer: int) -> None:
    """Destroys a verbs ``engine``'s queue pairs to ``peer`` (as a crashed process would)."""
    library.check(_hooks().moe_ep_verbs_destroy_qp(engine.handle, peer))


def set_memory_type(kind: str | None) -> None:
    """Registration takes every pointer for ``"device"`` or ``"host"`` memory (None: asks the CUDA
    driver again, the default)."""
    _hooks().moe_ep_test_memory_type({None: -1, "host": 0, "device": 1}[kind])


def imm_stress(counter, imm: int, threads: int, adds_per_thread: int) -> None:
    """``threads`` native threads each add 1 to ``imm`` of ``counter`` (an ``ImmCounter``),
    ``adds_per_thread`` times, all at once."""
    library.check(_hooks().moe_ep_imm_stress(counter.handle, imm, threads, adds_per_thread))


def late_goodbye(error: bool) -> tuple[str, int]:
    """A peer (rank 1 of 3, seen from rank 0) lost by its link first, then its goodbye landing
    (``error``: one after an error naming peer 2 in combine epoch 6, else a clean one), taken as
    every transport takes it: ``(its loss text, 1 + the goodbye's peer where the goodbye counts, else 0)``."""
    out = ctypes.create_string_buffer(1024)
    counted = _hooks().moe_ep_test_late_goodbye(int(error), out, len(out))
    return out.value.decode(), counted
