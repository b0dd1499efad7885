"""Cheap kernel launches.

``kernel[grid](...)`` costs ~12-40 us of Python per launch (argument binding, specialization
keys, cache lookup), and eager callers pay it every call. A ``Launcher`` (one per buffer) keeps
Triton's compiled kernel after the first launch of a configuration and afterwards calls its C
launcher directly with raw pointers. The caller names the configuration with a small ``key``: it
must hold everything of that call that can change the compiled code and is not fixed for the
buffer (the grid, constexprs that vary, the dtype and 16-byte alignment of user tensors); the
buffer's own tensors and sizes never change, so they need no key. ``launch()`` is the same path
with a key computed from every argument, for callers without a buffer. Under the interpreter the
plain ``kernel[grid]`` path runs.
"""
from __future__ import annotations

import os
from typing import Hashable, Optional

import torch


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def spec_of(args: tuple) -> tuple:
    """What of ``args`` can change Triton's compiled code: dtype and 16-byte alignment of each
    tensor, 32/64-bit width of each int."""
    return tuple((a.dtype, (a.data_ptr() & 15) == 0) if isinstance(a, torch.Tensor) else
                 (a >= 2**31 or a < -2**31) if isinstance(a, int) else a for a in args)


class Launcher:
    """Per-buffer cache of compiled kernels, called through Triton's C launcher."""

    def __init__(self, device: Optional[torch.device] = None):
        self.interp = _interpreting()
        self.device_index = device.index if device is not None and device.type == "cuda" else None
        self._plans: dict = {}

    def __call__(self, key: Hashable, fn, grid: int, args: tuple, consts, dynamic: Optional[tuple] = None) -> None:
        """Launches ``fn`` on ``grid`` programs with runtime ``args`` (kernel parameter order) and
        constexpr ``consts`` (the remaining parameters; a dict, or a function returning it, called
        only when the kernel must be compiled); ``key`` as in the module docstring. ``dynamic``:
        the positions in ``args`` that may change between calls with one key (default: all); the
        others are read once, when the kernel is compiled."""
        if self.interp:
            fn[(grid,)](*args, **(consts() if callable(consts) else consts))
            return
        plan = self._plans.get(key)
        if plan is None:
            consts = consts() if callable(consts) else consts
            compiled = fn[(grid,)](*args, **consts)
            vals = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
            self._plans[key] = (compiled, vals + [consts[n] for n in fn.arg_names[len(args):]],
                                range(len(args)) if dynamic is None else dynamic)
            return
        compiled, vals, dyn = plan
        vals = vals.copy()
        for i in dyn:
            a = args[i]
            vals[i] = a.data_ptr() if isinstance(a, torch.Tensor) else a
        dev = self.device_index if self.device_index is not None else torch.cuda.current_device()
        compiled.run(*leading_args(compiled, grid, torch._C._cuda_getCurrentRawStream(dev)), *vals)


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
    if _GLOBAL.interp != _interpreting():
        _GLOBAL.interp = _interpreting()
    key = (fn, grid, spec_of(args), tuple(consts.items())) if not _GLOBAL.interp else None
    _GLOBAL(key, fn, grid, args, consts)
