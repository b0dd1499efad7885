"""The kernel launcher's bindings (csrc/launch/launch.cc): a launch plan (a compiled kernel's
prepacked parameters, ``cuLaunchKernel`` with a few slots patched per launch) and the library's
``launch`` function, which launches a plan in one C call; a launch graph (plans as the nodes of
one CUDA graph, one ``cuGraphLaunch`` for all, ``launch_graph``). ``moe_ep.kernels.launch`` builds its
``NativePlan``s on them.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Sequence

from .library import I32, I64, SZ, U32, U64, Functions, NativeError, last_error, path

_native = Functions(
    moe_ep_launch_plan_create=(I32, U64, U32, U32, U32, I32, ctypes.POINTER(U32), ctypes.POINTER(U64), I32,
                               ctypes.POINTER(I32)),
    moe_ep_launch_plan_destroy=(None, I32), moe_ep_launch_plan_stage=(U64, I32),
    moe_ep_launch_plan_params=(I64, I32, ctypes.c_char_p, SZ),
    moe_ep_launch_graph_create=(I32, I32, ctypes.POINTER(I32)), moe_ep_launch_graph_destroy=(None, I32))
_HOT = None


def hot_library() -> ctypes.PyDLL:
    """The library again through ctypes.PyDLL: its calls keep the GIL (no release and re-take
    around a call that never blocks)."""
    global _HOT
    if _HOT is None:
        _HOT = ctypes.PyDLL(path())
    return _HOT


@functools.lru_cache(maxsize=None)
def _python_function(getter: str):
    """The Python function the library's ``getter`` returns (a ``py_object``, kept for the process)."""
    f = getattr(hot_library(), getter)
    f.restype = ctypes.py_object
    return f()


def launch_function():
    """The library's ``launch(plan_id, stream, values)`` (csrc/launch/launch.cc): a native plan
    launched with its slot values in one C call."""
    return _python_function("moe_ep_launch_function")


def launch_graph_function():
    """The library's ``launch_graph(graph_id, stream, values)``: a launch graph launched with each
    plan's slot values in one C call."""
    return _python_function("moe_ep_launch_graph_function")


class LaunchPlan:
    """One native plan of ``function`` (a ``CUfunction``) patching ``slots`` (parameter indices)
    per launch; ``sizes`` are the parameters' byte sizes, ``values`` their bits.

    ``launch(stream, values)`` launches it on ``stream`` with ``values`` (one per slot: pointers,
    or ints as two's complement); raises RuntimeError with the driver's message when the launch
    fails. It is the library's ``launch`` function with this plan's id bound (one C call, no
    Python frame: the eager path's every launch). Creating one the library refuses raises
    ``NativeError`` with its reason."""

    def __init__(self, function: int, grid: int, block: int, shared: int, sizes: Sequence[int],
                 values: Sequence[int], slots: Sequence[int]):
        L = _native()
        n = len(sizes)
        self._destroy = L.moe_ep_launch_plan_destroy
        self.id = L.moe_ep_launch_plan_create(
            function, grid, block, shared, n, (ctypes.c_uint32 * n)(*sizes), (ctypes.c_uint64 * n)(*values),
            len(slots), (ctypes.c_int * max(1, len(slots)))(*slots))
        if self.id < 0:
            raise NativeError(last_error())
        self.nslots = len(slots)
        self.launch = functools.partial(launch_function(), self.id)
        self.stage = (ctypes.c_uint64 * (1 + len(slots))).from_address(L.moe_ep_launch_plan_stage(self.id))
        self.params = L.moe_ep_launch_plan_params

    def packed(self, values) -> bytes:
        """The parameter bytes a launch with ``values`` passes (what ``launch`` would hand the driver)."""
        self.stage[:] = [0, *(v & (2**64 - 1) for v in values)]
        buf = ctypes.create_string_buffer(4096)
        n = self.params(self.id, buf, len(buf))
        return buf.raw[:n]

    def __del__(self):
        if getattr(self, "id", -1) >= 0:
            self._destroy(self.id)


class LaunchGraph:
    """``plans`` (``LaunchPlan``s, launchable, in order) as the kernel nodes of one CUDA graph, each
    after the one before, built in the current CUDA context.

    ``launch(stream, values)`` launches them with one ``cuGraphLaunch`` on ``stream``; ``values``
    holds each plan's slot values (a sequence per plan, as ``LaunchPlan.launch`` takes them),
    written into its node first. Keeps the plans alive. Creating one the library or the driver
    refuses raises ``NativeError`` with its reason."""

    def __init__(self, plans: Sequence[LaunchPlan]):
        L = _native()
        n = len(plans)
        self.plans = tuple(plans)
        self._destroy = L.moe_ep_launch_graph_destroy
        self.id = L.moe_ep_launch_graph_create(n, (ctypes.c_int * max(1, n))(*(p.id for p in plans)))
        if self.id < 0:
            raise NativeError(last_error())
        self.launch = functools.partial(launch_graph_function(), self.id)

    def __del__(self):
        if getattr(self, "id", -1) >= 0:
            self._destroy(self.id)
