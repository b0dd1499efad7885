"""Cheap kernel launches.

``kernel[grid](...)`` costs ~15-40 us of Python per launch (argument binding, specialization
keys, cache lookup), which an eager dispatch+combine pays five times. After the first launch of a
configuration we keep Triton's compiled kernel and call its C launcher directly with raw
pointers: only what can change the compiled code goes into our cache key (grid, constexprs,
16-byte alignment of each pointer, 32/64-bit width of each int). Under the interpreter the plain
path runs.
"""
from __future__ import annotations

import os

import torch

_CACHE: dict = {}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def launch(fn, grid: int, args: tuple, consts: dict) -> None:
    """Launches Triton kernel ``fn`` on ``grid`` programs (1-D) with runtime ``args`` (in the
    kernel's parameter order) and constexpr ``consts`` (the remaining parameters)."""
    if _interpreting():
        fn[(grid,)](*args, **consts)
        return
    spec = tuple((a.data_ptr() & 15) == 0 if isinstance(a, torch.Tensor) else
                 (a >= 2**31 or a < -2**31) if isinstance(a, int) else a for a in args)
    cv = tuple(consts.values())
    key = (fn, grid, spec, cv)
    hit = _CACHE.get(key)
    if hit is None:
        compiled = fn[(grid,)](*args, **consts)
        names = list(consts)
        _CACHE[key] = (compiled, [names.index(n) for n in fn.arg_names[len(args):]])
        return
    compiled, perm = hit
    vals = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
    stream = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())
    compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                 *vals, *[cv[i] for i in perm])
