"""Cheap kernel launches.

``kernel[grid](...)`` costs ~12-40 us of Python per launch (argument binding, specialization
keys, cache lookup), and eager callers pay it every call. A ``Launcher`` (one per buffer) keeps a
*plan* per configuration after its first launch (which compiles through ``kernel[grid]``):

- ``NativePlan`` (the default on a GPU): the compiled kernel's ``CUfunction`` and every parameter
  packed once, the way Triton's launcher passes them (``param_sizes``); a launch is one call of
  the native library's ``launch`` function with the stream and the values that change, which
  patches them in and calls ``cuLaunchKernel`` (csrc/launch/launch.cc);
- ``TritonPlan``: Triton's own C launcher (``CompiledKernel.run``) with raw values: the fallback
  for what the native path does not cover (scratch memory, clusters, cooperative or PDL launches,
  a Triton release whose launcher it was not checked against), and the path ``MOE_EP_LAUNCH=triton``
  forces;
- ``JitPlan``: ``kernel[grid]`` every time, when a value meant to change was specialized into the
  compiled code (Triton's launcher would ignore a new value there).

The caller names the configuration with a small ``key``: it must hold everything of that call
that can change the compiled code and is not fixed for the buffer (the grid, constexprs that vary,
the dtype and 16-byte alignment of user tensors); the buffer's own tensors and sizes never change,
so they need no key. ``launch()`` is the same path with a key computed from every argument, for
callers without a buffer. Under the interpreter the plain ``kernel[grid]`` path runs.
"""
from __future__ import annotations

import functools
import inspect
import struct
from typing import Hashable, Optional, Sequence

import torch
import triton
import triton.language as tl

from ..core import settings
from ..core.interpret import interpreting
from ..native.launch import LaunchPlan
from ..native.library import NativeError

LAUNCH_PATHS = settings.LAUNCH_PATHS
# Triton releases whose launcher (backends/nvidia/driver.py: make_launcher) the native packing was
# checked against: tests/test_launch.py compares param_sizes with it. Others take TritonPlan.
NATIVE_TRITON = ((3, 6),)


def launch_path() -> str:
    """``MOE_EP_LAUNCH``: ``native`` (default) or ``triton`` (Triton's C launcher for every cached
    launch). Raises ValueError naming the variable for any other value."""
    return settings.launch_path()


REGISTERS_PER_SM = 65536  # 32-bit registers of an SM's register file (sm_80, sm_90): one program's at most


def register_budget(spec: str, warps: int, name: str = "maxnreg") -> Optional[int]:
    """``maxnreg`` for a program of ``warps`` warps from ``spec``: "" or "none" (None: ptxas
    chooses), "full" (the register file over the program's threads) or a count (at most that).
    Raises ValueError naming ``name`` for any other spec. ptxas left to itself may keep fewer
    loads in flight than the registers allow (sm_90, a combine step at 32 warps: 45 registers and
    4 of 8 loads ahead; 56 and all 8 given 64)."""
    if spec not in ("", "none", "full") and not (spec.isdigit() and 16 <= int(spec) <= 255):
        raise ValueError(f"{name}: expected 'none', 'full' or a register count from 16 to 255, got {spec!r}")
    if spec in ("", "none"):
        return None
    full = min(REGISTERS_PER_SM // (32 * warps), 255)  # (255: the most a thread can address)
    return full if spec == "full" else min(int(spec), full)


def compile_options(warps: int, maxnreg: str = "") -> dict:
    """A Triton launch's compile options: ``num_warps``, and ``maxnreg`` where the spec
    ``maxnreg`` (as ``register_budget`` reads it) gives one."""
    budget = register_budget(maxnreg, warps)
    return dict(num_warps=warps) if budget is None else dict(num_warps=warps, maxnreg=budget)


def spec_of(args: tuple) -> tuple:
    """What of ``args`` can change Triton's compiled code: dtype and 16-byte alignment of each
    tensor; of each int, its width (32/64 bit) and the values Triton specializes (1, multiple of 16)."""
    return tuple((a.dtype, (a.data_ptr() & 15) == 0) if isinstance(a, torch.Tensor) else
                 (a >= 2**31 or a < -2**31, a == 1, a % 16 == 0) if isinstance(a, int) and not isinstance(a, bool)
                 else a for a in args)


_RUNTIME_NAMES: dict = {}  # kernel -> its runtime parameters' names


def _runtime_names(fn) -> tuple:
    """The names of ``fn``'s runtime (not constexpr) parameters, in order; they must come first."""
    names = _RUNTIME_NAMES.get(fn)
    if names is None:  # (the Python function's annotations: compiled and interpreted kernels alike)
        params = inspect.signature(fn.fn).parameters.values()
        flags = [p.annotation is tl.constexpr or str(p.annotation).split(".")[-1] == "constexpr" for p in params]
        names = tuple(p.name for p, c in zip(params, flags) if not c)
        if any(flags[:len(names)]):
            raise TypeError(f"{fn.__name__}: its runtime parameters must come before its constexprs")
        _RUNTIME_NAMES[fn] = names
    return names


def runtime_args(fn, **named) -> tuple:
    """``fn``'s runtime arguments given by name, as the positional tuple a launch takes (parameter
    order). TypeError naming the kernel and the names missing or unknown, before any launch."""
    names = _runtime_names(fn)
    try:  # (map over the names: the cheapest form; this runs on every launch a replay does not cover)
        args = tuple(map(named.__getitem__, names))
    except KeyError:
        args = ()
    if len(args) != len(named) or len(args) != len(names):
        missing, unknown = [n for n in names if n not in named], [n for n in named if n not in names]
        raise TypeError(f"{fn.__name__}: runtime arguments missing {missing}, unknown {unknown}")
    return args


def arg_positions(fn, *names: str) -> tuple:
    """Positions of the runtime parameters ``names`` in ``runtime_args``' tuple (a Launcher's
    ``dynamic``). TypeError naming an unknown one."""
    order = _runtime_names(fn)
    bad = [n for n in names if n not in order]
    if bad:
        raise TypeError(f"{fn.__name__}: no runtime parameters {bad}")
    return tuple(order.index(n) for n in names)


# Bytes of each scalar parameter type as Triton's launcher passes it (ty_to_cpp, FLOAT_STORAGE_TYPE
# in triton/backends/nvidia/driver.py); pointers ("*...") are 8.
_SIZES = {"i1": 1, "i8": 1, "u1": 1, "u8": 1, "i16": 2, "u16": 2, "fp16": 2, "bf16": 2, "i32": 4, "u32": 4,
          "fp32": 4, "f32": 4, "i64": 8, "u64": 8, "fp64": 8}
_FLOATS = ("fp16", "bf16", "fp32", "f32", "fp64")
SCRATCH_PARAMS = 2  # Triton 3.6 passes every kernel a global and a profile scratch pointer, last


def param_sizes(signature: Sequence[str]) -> list[int]:
    """Bytes of each parameter cuLaunchKernel gets for a kernel of Triton ``signature`` (its
    argument types in order, ``constexpr`` for those compiled in): one per non-constexpr
    argument, then the two scratch pointers. Raises ValueError for types it does not pack
    (tensor descriptors, tuples)."""
    out = []
    for ty in signature:
        if ty == "constexpr":
            continue
        if not isinstance(ty, str) or not (ty.startswith("*") or ty in _SIZES):
            raise ValueError(f"signature: no native packing for parameter type {ty!r}")
        out.append(8 if ty.startswith("*") else _SIZES[ty])
    return out + [8] * SCRATCH_PARAMS


def _raw(ty: str, v) -> int:
    """The bits of value ``v`` for a parameter of type ``ty`` (two's complement for ints; floats
    as Triton packs them: bf16 is the top half of the float32)."""
    if isinstance(v, torch.Tensor):
        return v.data_ptr()
    if ty in _FLOATS:
        if ty == "fp64":
            return struct.unpack("<Q", struct.pack("<d", v))[0]
        if ty == "fp16":
            return struct.unpack("<H", struct.pack("<e", v))[0]
        f32 = struct.unpack("<I", struct.pack("<f", v))[0]
        return f32 >> 16 if ty == "bf16" else f32
    return int(v or 0) & (2**64 - 1)


class NativeUnavailable(Exception):
    """Why a compiled kernel cannot take the native path (the plan falls back to Triton's)."""


def _native_plan(function: int, grid: int, block: int, shared: int, sizes: list, values: list,
                 slots: list) -> LaunchPlan:
    """The native library's plan of these (``moe_ep.native.launch.LaunchPlan``); the library's
    refusal as ``NativeUnavailable``."""
    try:
        return LaunchPlan(function, grid, block, shared, sizes, values, slots)
    except NativeError as e:
        raise NativeUnavailable(str(e)) from None


class NativePlan:
    """A compiled kernel launched through ``cuLaunchKernel`` with prepacked parameters; ``dynamic``
    (positions in ``args``) are read again at each ``launch``. Every plan has ``dynamic`` and
    ``arg_names`` (the kernel's, in order: what ``moe_ep.ops.replay`` binds by name)."""

    def __init__(self, compiled, grid: int, args: tuple, consts: dict, dynamic: Sequence[int], arg_names):
        md = compiled.metadata
        if tuple(int(v) for v in triton.__version__.split(".")[:2]) not in NATIVE_TRITON:
            raise NativeUnavailable(f"triton {triton.__version__} (the native packing knows {NATIVE_TRITON})")
        for what, bad in (("global scratch", md.global_scratch_size), ("profile scratch", md.profile_scratch_size),
                          ("a cluster", getattr(md, "num_ctas", 1) != 1),
                          ("a cooperative launch", md.launch_cooperative_grid), ("PDL", md.launch_pdl)):
            if bad:
                raise NativeUnavailable(f"kernel {compiled.name} needs {what}")
        sig = compiled.src.signature
        types = [sig[n] for n in arg_names]
        sizes = param_sizes(types)
        values, param_of = [], {}
        vals = list(args) + [consts.get(n) for n in arg_names[len(args):]]
        for i, (ty, v) in enumerate(zip(types, vals)):
            if ty != "constexpr":
                param_of[i] = len(values)
                values.append(_raw(ty, v))
        values += [0] * SCRATCH_PARAMS
        for i in dynamic:
            if i not in param_of:
                raise NativeUnavailable(f"argument {arg_names[i]} was compiled in")
            if types[i] in _FLOATS:
                raise NativeUnavailable(f"argument {arg_names[i]} is a float that changes")
        compiled.run  # noqa: B018  (loads the module: compiled.function is set once loaded)
        self.compiled, self.grid, self.types, self.param_of = compiled, grid, types, param_of
        self.arg_names = tuple(arg_names)
        self._shape = (compiled.function, grid, 32 * md.num_warps, md.shared, sizes, values)
        self.dynamic = tuple(dynamic)
        self._all = _native_plan(*self._shape, [param_of[i] for i in self.dynamic])
        self._bound: dict = {}

    def launch(self, args: tuple, stream: int) -> None:
        self._all.launch(stream, [_raw(self.types[i], args[i]) for i in self.dynamic])

    def bind(self, args: tuple, positions: Sequence[int]):
        """A launch like ``launch(args)`` but for ``positions`` (of ``args``), whose values it takes
        as ints at each ``launch(stream, values)``. Bound launches are kept by what they fix."""
        fixed = tuple((i, _raw(self.types[i], args[i])) for i in self.dynamic if i not in positions)
        k = (tuple(positions), fixed)
        b = self._bound.get(k)
        if b is None:
            function, grid, block, shared, sizes, values = self._shape
            values = list(values)
            for i, v in fixed:
                values[self.param_of[i]] = v
            b = self._bound[k] = _native_plan(function, grid, block, shared, sizes, values,
                                         [self.param_of[i] for i in positions])
        return b


class TritonPlan:
    """A compiled kernel launched through Triton's C launcher (``CompiledKernel.run``)."""

    def __init__(self, compiled, grid: int, args: tuple, consts: dict, dynamic: Sequence[int], arg_names):
        self.compiled, self.grid, self.dynamic = compiled, grid, tuple(dynamic)
        self.arg_names = tuple(arg_names)
        self.vals = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
        self.vals += [consts[n] for n in arg_names[len(args):]]  # (kernel_consts filled the defaults)

    def launch(self, args: tuple, stream: int) -> None:
        vals = self.vals.copy()
        for i in self.dynamic:
            a = args[i]
            vals[i] = a.data_ptr() if isinstance(a, torch.Tensor) else a
        self.compiled.run(*leading_args(self.compiled, self.grid, stream), *vals)

    def bind(self, args: tuple, positions: Sequence[int]):
        """As ``NativePlan.bind``."""
        vals = self.vals.copy()
        for i in self.dynamic:
            a = args[i]
            vals[i] = a.data_ptr() if isinstance(a, torch.Tensor) else a
        return _TritonBound(self.compiled, self.grid, vals, tuple(positions))


class _TritonBound:
    def __init__(self, compiled, grid: int, vals: list, positions: tuple):
        self.compiled, self.grid, self.vals, self.positions = compiled, grid, vals, positions

    def launch(self, stream: int, values) -> None:
        vals = self.vals.copy()
        for i, v in zip(self.positions, values):
            vals[i] = v
        self.compiled.run(*leading_args(self.compiled, self.grid, stream), *vals)


class JitPlan:
    """``kernel[grid]`` every launch (for a kernel whose changing values Triton compiled in)."""

    def __init__(self, fn, grid: int, consts: dict, dynamic: Sequence[int]):
        self.fn, self.grid, self.consts, self.dynamic = fn, grid, consts, tuple(dynamic)
        self.arg_names = tuple(fn.arg_names)

    def launch(self, args: tuple, stream: int) -> None:
        self.fn[(self.grid,)](*args, **self.consts)

    def bind(self, args: tuple, positions: Sequence[int]):
        return None  # not replayable: the caller keeps calling launch()


def kernel_consts(fn, consts: dict) -> dict:
    """The constexprs ``fn`` declares, from ``consts`` (which may hold more: one dict serves both
    halves of an op) or else from the kernel's defaults; a plan replays every one of them by name."""
    declared = _DECLARED.get(fn)
    if declared is None:
        params = inspect.signature(fn.fn).parameters.values()   # (the interpreter's kernels have no .params)
        declared = _DECLARED[fn] = [(p.name, _NO_DEFAULT if p.default is p.empty else p.default)
                                    for p in params if "constexpr" in str(p.annotation)]
    out = {}
    for name, default in declared:
        if name in consts:
            out[name] = consts[name]
        elif default is not _NO_DEFAULT:   # (none: Triton names the missing argument)
            out[name] = default
    return out


_DECLARED: dict = {}   # kernel -> [(constexpr name, its default or _NO_DEFAULT)]
_NO_DEFAULT = object()


def make_plan(compiled, fn, grid: int, args: tuple, consts: dict, dynamic: Sequence[int], path: str):
    """The plan for a kernel just compiled (and launched) by ``fn[(grid,)](*args, **consts)``."""
    sig = compiled.src.signature
    if any(sig.get(fn.arg_names[i]) == "constexpr" for i in dynamic):
        return JitPlan(fn, grid, consts, dynamic)
    if path == "native":
        try:
            return NativePlan(compiled, grid, args, consts, dynamic, fn.arg_names)
        except NativeUnavailable:
            pass
    return TritonPlan(compiled, grid, args, consts, dynamic, fn.arg_names)


class Launcher:
    """Per-buffer cache of launch plans (see the module docstring)."""

    def __init__(self, device: Optional[torch.device] = None):
        self.interp = interpreting()
        self.path = launch_path() if device is not None else None  # a buffer's: its env checked at construction
        self.device_index = device.index if device is not None and device.type == "cuda" else None
        self._plans: dict = {}
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # (absent from CPU builds)
        if self.device_index is not None and raw is not None:  # the method without its Python frame (every launch)
            self.stream = functools.partial(raw, self.device_index)

    def stream(self) -> int:
        """The current CUDA stream of this launcher's device (its raw handle)."""
        dev = self.device_index if self.device_index is not None else torch.cuda.current_device()
        return torch._C._cuda_getCurrentRawStream(dev)

    def planned(self, key: Hashable):
        """The plan of ``key`` if a launch made it already, else None (nothing is compiled or launched)."""
        return self._plans.get(key)

    def __call__(self, key: Hashable, fn, grid: int, args: tuple, consts, dynamic: Optional[tuple] = None):
        """Launches ``fn`` on ``grid`` programs with runtime ``args`` (kernel parameter order) and
        constexpr ``consts`` (the remaining parameters; a dict, or a function returning it, called
        only when the kernel must be compiled); ``key`` as in the module docstring. ``dynamic``:
        the positions in ``args`` that may change between calls with one key (default: all); the
        others are read once, when the kernel is compiled. Returns the plan (None under the
        interpreter)."""
        if self.interp:
            fn[(grid,)](*args, **kernel_consts(fn, consts() if callable(consts) else consts))
            return None
        plan = self._plans.get(key)
        if plan is None:
            consts = kernel_consts(fn, consts() if callable(consts) else consts)
            compiled = fn[(grid,)](*args, **consts)
            dyn = range(len(args)) if dynamic is None else dynamic
            self.path = self.path or launch_path()
            self._plans[key] = make_plan(compiled, fn, grid, args, consts, dyn, self.path)
            return self._plans[key]
        plan.launch(args, self.stream())
        return plan


# What Triton's own launch (``JITFunction.run`` in triton 3.6) passes to ``CompiledKernel.run``
# before the kernel's arguments; ``leading_args`` gives the same values in the same order (no
# launch metadata, no enter/exit hooks: profiler hooks do not see cached launches).
TRITON_LEADING = ("grid_0", "grid_1", "grid_2", "stream", "kernel.function", "kernel.packed_metadata",
                  "launch_metadata", "knobs.runtime.launch_enter_hook", "knobs.runtime.launch_exit_hook")


def leading_args(compiled, grid: int, stream: int) -> tuple:
    """The values of ``TRITON_LEADING`` for a 1-D ``grid`` on ``stream``."""
    return (grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None)


_GLOBAL = Launcher()


def launch(fn, grid: int, args: tuple, consts: dict) -> None:
    """``Launcher`` with a key computed from every argument (no buffer to hold fixed ones)."""
    if _GLOBAL.interp != interpreting():
        _GLOBAL.interp = interpreting()
    key = (fn, grid, spec_of(args), tuple(consts.items())) if not _GLOBAL.interp else None
    _GLOBAL(key, fn, grid, args, consts)
