"""Replaying the launches of an earlier call: eager dispatch and combine at the cost of a launch.

A call's *signature* is what its validation and its launch configuration depend on: of each input
tensor its shape, dtype, device, contiguity and 16-byte alignment (``signature``). A call
whose signature is one that passed validation before on the same buffer and op is valid for the
same reasons, and launches the same plans with the same arguments but for the input pointers; so
it skips the checks, the key and the argument tuple, and only patches those pointers (``Replay``).
Any other signature (a new shape, dtype, device, a non-contiguous view, a misaligned pointer, a
non-tensor) takes the full path and gets its full validation and errors.

The signature must fix every launch argument that is not an input pointer: the callers' token
counts and chunking come from input shapes, everything else from the buffer.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

MAX_SIGNATURES = 16  # per buffer and op; beyond, the oldest is forgotten (a workload of many shapes)


def signature(tensors: Sequence[Optional[torch.Tensor]]) -> tuple[Optional[tuple], list]:
    """``(signature, data pointers)`` of ``tensors`` (None entries: None and 0); the signature is
    None when an entry is not a tensor. Cheap: a few attribute reads per tensor, no device work
    (this runs on every eager call: each pointer is read once)."""
    sig, ptrs = [], []
    for t in tensors:
        if t is None:
            sig.append(None)
            ptrs.append(0)
        elif isinstance(t, torch.Tensor):
            p = t.data_ptr()
            sig.append((t.shape, t.dtype, t.device, t.is_contiguous(), p & 15))
            ptrs.append(p)
        else:
            return None, []
    return tuple(sig), ptrs


class _Entry:
    """The launches of one signature: each a bound plan and which inputs feed its slots."""

    __slots__ = ("steps", "value")

    def __init__(self, steps: tuple, value):
        self.steps, self.value = steps, value

    def run(self, stream: int, inputs: tuple):
        """Launches every step on ``stream`` with this call's ``inputs``; returns the recorded value."""
        for bound, pick in self.steps:
            bound.launch(stream, inputs if pick is None else [inputs[k] for k in pick])
        return self.value


class Replay:
    """The replayable calls of one op on one buffer, by signature."""

    def __init__(self):
        self._entries: dict = {}
        self._last: tuple = (None, None)  # the latest hit: an equality test is cheaper than a hash

    def get(self, sig: Optional[tuple]) -> Optional[_Entry]:
        """The entry of ``sig`` (None: never recorded, or ``sig`` is None)."""
        if sig is None:
            return None
        last, entry = self._last
        if sig == last:
            return entry
        entry = self._entries.get(sig)
        if entry is not None:
            self._last = (sig, entry)
        return entry

    def record(self, sig: Optional[tuple], launches: list, inputs: tuple, value) -> None:
        """Keeps ``launches`` (``(plan, args)`` in launch order, as the Launcher returned them)
        for ``sig``, with ``value`` (what the call derived from its inputs, e.g. the token count).
        Each tensor among a plan's dynamic arguments must be one of ``inputs`` (data pointers of
        this call) and no other: a call with aliased inputs, or a plan that cannot be bound, is not
        recorded (it keeps taking the full path)."""
        if sig is None or len(set(inputs)) != len(inputs) or any(p is None for p, _ in launches):
            return
        steps = []
        for plan, args in launches:
            positions, pick = [], []
            for i in plan.dynamic:
                if isinstance(args[i], torch.Tensor):
                    p = args[i].data_ptr()
                    if p not in inputs:
                        return  # a pointer that changes per call but is not an input
                    positions.append(i)
                    pick.append(inputs.index(p))
            bound = plan.bind(args, positions)
            if bound is None:
                return
            steps.append((bound, None if pick == list(range(len(inputs))) else tuple(pick)))
        if len(self._entries) >= MAX_SIGNATURES:
            self._entries.pop(next(iter(self._entries)))
        self._entries[sig] = entry = _Entry(tuple(steps), value)
        self._last = (sig, entry)
