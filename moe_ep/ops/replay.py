"""Replaying the launches of an earlier call: eager dispatch and combine at the cost of a launch.

A call's *signature* is what its validation and its launch configuration depend on: of each input
tensor its shape but the token count, dtype, device, contiguity and 16-byte alignment
(``signature``), and what the op adds (``extra``: the launch structure its token count selects,
e.g. whether the dispatch launches the routing histogram). A call whose signature is one that
passed validation before on the same buffer and op, and whose token count the op has checked, is
valid for the same reasons and launches the same plans with the same arguments but for the input
pointers and the values derived from the token count (*scalars*: T, the chunking); so it skips the
checks, the key and the argument tuple, and only patches those (``Replay``). Any other signature
(a new hidden size, dtype, device, a non-contiguous view, a misaligned pointer, a non-tensor)
takes the full path and gets its full validation and errors.

The token count is a tensor dimension the signature leaves out (``token_dims``: which dimension
of each input holds it, None for an input without one), so one entry serves every token count of
a launch structure: an eager decode whose batch changes every step replays as well as one whose
batch does not. What the signature cannot see, the op checks before it replays: that the inputs
agree on the token count, that it is at most the buffer's ``max_tokens``, and that it selects the
entry's launch structure (``extra``). Everything else in a launch comes from the buffer.

A call's tensors are given without the optional ones it leaves out (``None``): each op keeps one
``Replay`` per set of inputs it takes (dispatch with or without ``x_scales``, combine with or
without ``out``), so the tensors of one ``Replay`` always number the same. Calls with a receive
hook have ``Replay``s of their own, whose entries keep the hook's launches (``later``) apart from
the call's.

The common case, a call like the latest replayed one, costs one C call: each entry keeps a guard
(torch's ``TensorGuards``, the check torch.compile runs before reusing a graph: dtype, device,
dispatch keys, requires_grad, every size but the token count, every stride) built when it is
recorded; the latest hit's guard and its pointers' alignment are checked first, and only a call
that fails them computes the signature in Python. A torch without that guard takes the Python
path every call.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..core.capture import capturing
from ..native.launch import LaunchGraph, LaunchPlan
from ..native.library import NativeError

MAX_SIGNATURES = 16  # per buffer and op; beyond, the oldest is forgotten (a workload of many signatures)


try:  # torch's own metadata check (torch/csrc/dynamo/guards.cpp); absent from some builds
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover
    _TensorGuards = None


# (data pointers, OR of their low 4 bits) of the 1-4 input tensors of a call, unrolled: a
# comprehension or map over them costs three times as much (this runs on every replayed call).
_POINTERS = {
    1: lambda a: ((p := a.data_ptr(),), p & 15),
    2: lambda a, b: ((p := a.data_ptr(), q := b.data_ptr()), (p | q) & 15),
    3: lambda a, b, c: ((p := a.data_ptr(), q := b.data_ptr(), r := c.data_ptr()), (p | q | r) & 15),
    4: lambda a, b, c, d: ((p := a.data_ptr(), q := b.data_ptr(), r := c.data_ptr(), u := d.data_ptr()),
                           (p | q | r | u) & 15),
}


def signature(tensors: Sequence[torch.Tensor], token_dims: Sequence[Optional[int]]) -> tuple[Optional[tuple], list]:
    """``(signature, data pointers)`` of ``tensors``; the signature is None when one is not a
    tensor. Each tensor's shape without its ``token_dims`` entry (None: all of it). A few
    attribute reads per tensor, no device work (each pointer is read once)."""
    sig, ptrs = [], []
    for t, d in zip(tensors, token_dims):
        if not isinstance(t, torch.Tensor):
            return None, []
        p = t.data_ptr()
        shape = tuple(t.shape) if d is None or d >= t.dim() else (*t.shape[:d], None, *t.shape[d + 1:])
        sig.append((shape, t.dtype, t.device, t.is_contiguous(), p & 15))
        ptrs.append(p)
    return tuple(sig), ptrs


def guard(tensors: Sequence[torch.Tensor], token_dims: Sequence[Optional[int]]):
    """A ``TensorGuards`` passing exactly the tensors with the dtype, device, dispatch keys,
    requires_grad, sizes (any token count at ``token_dims``) and strides of ``tensors`` (None
    where torch has none, or it refuses)."""
    if _TensorGuards is None:
        return None
    sizes = [[None if i == d else n for i, n in enumerate(t.shape)] for t, d in zip(tensors, token_dims)]
    try:
        return _TensorGuards(*tensors, dynamic_dims_sizes=sizes, dynamic_dims_strides=[list(t.stride()) for t in tensors])
    except Exception:  # noqa: BLE001  (an internal API: any refusal means the Python path)
        return None


class _Entry:
    """The launches of one signature: each a bound plan and which inputs feed its slots; ``steps``
    run when the call is made, ``later`` (calls with a receive hook: the receive half) when its
    hook is called.

    ``guard`` passes a call of any token count with the signature's tensors (None: no entry is
    tried by guard); ``exact`` passes only the recorded call's token count too, whose scalars are
    ``scalars``: a call it passes needs no token-count checks (the common case of an eager loop
    at one batch size)."""

    __slots__ = ("steps", "later", "value", "extra", "guard", "exact", "scalars", "graph", "picks")

    def __init__(self, steps: tuple, later: tuple, value, extra, guard, exact, scalars: tuple, graph=None):
        self.steps, self.later, self.value, self.extra, self.guard = steps, later, value, extra, guard
        self.exact, self.scalars = exact, scalars
        # Every launch, steps then later, as one launch graph (``Replay(graph=True)``), else None.
        self.graph = graph
        self.picks = tuple(pick for _, pick in (*steps, *later))

    def run(self, stream: int, inputs: tuple):
        """Launches every step on ``stream`` with this call's ``inputs`` (pointers, then scalars);
        returns the recorded value. With a launch graph, the ``later`` steps too, in the same
        graph launch (such an entry's caller launches its later steps at once, never from a hook)."""
        if self.graph is not None:
            self.graph.launch(stream, tuple(inputs if pick is None else [inputs[k] for k in pick]
                                            for pick in self.picks))
            return self.value
        for bound, pick in self.steps:
            bound.launch(stream, inputs if pick is None else [inputs[k] for k in pick])
        return self.value

    def run_later(self, stream: int, inputs: tuple) -> None:
        """Launches the ``later`` steps (a receive hook's) on ``stream`` with the call's ``inputs``
        (nothing with a launch graph: ``run`` launched them)."""
        if self.graph is not None:
            return
        for bound, pick in self.later:
            bound.launch(stream, inputs if pick is None else [inputs[k] for k in pick])


class Replay:
    """The replayable calls of one op on one buffer with one set of inputs, by signature.
    ``token_dims``: per input tensor, the dimension holding the token count (None: none)."""

    def __init__(self, token_dims: Sequence[Optional[int]], graph: bool = False):
        self.token_dims = tuple(token_dims)
        # Entries of two launches or more keep them as one launch graph (``Tuning.graph_launch``:
        # eager calls without a receive hook, on a GPU, not under the interpreter's host waits).
        self.graph = graph
        self._entries: dict = {}
        # The latest hit whose guard can be tried first (None: none yet). Read by the ops' eager
        # fast paths (``dispatch.replayed``, ``combine.replayed``), which inline ``latest``.
        self.last: Optional[_Entry] = None

    def find(self, tensors: tuple, extra=None,
             latest_tried: bool = False) -> tuple[Optional[_Entry], Optional[tuple], list]:
        """``(entry, signature, pointers)`` for a call with ``tensors`` (its 1-4 inputs, none left
        out) and ``extra`` (what else fixes its launches: a hashable the inputs' shapes do not
        give, e.g. the launch structure its token count selects). The caller has validated the
        call: the guards leave the token count free. ``entry`` is None when no call like it was
        recorded; ``signature`` is None when
        the latest hit's guard passed (no need for it) or an input is not a tensor.
        ``latest_tried``: the caller's ``latest`` just failed for this call, so it is not tried
        again (skipping it is always safe: the signature finds the same entry, only slower)."""
        got = None if latest_tried else self.latest(tensors, extra)
        if got is not None:
            return got[0], None, got[1]
        sig, ptrs = signature(tensors, self.token_dims)
        if sig is None:
            return None, None, ptrs
        sig = (sig, extra)
        entry = self._entries.get(sig)
        if entry is not None and entry.guard is not None:
            self.last = entry
        return entry, sig, ptrs

    def latest(self, tensors: tuple, extra=None) -> Optional[tuple]:
        """``(entry, pointers)`` when a call with ``tensors`` and ``extra`` is like the latest hit
        (its guard passes and every pointer is 16-byte aligned), else None: one C call and the
        pointer reads (``find`` decides the rest). The guard leaves the token count free: the
        caller checks it (the ops' fast paths write this out with those checks)."""
        last = self.last
        if last is not None and last.extra == extra and last.guard.check(*tensors):
            ptrs, low = _POINTERS[len(tensors)](*tensors)
            if not low:  # the guard is kept only for entries whose pointers were all aligned
                return last, ptrs
        return None

    def record(self, sig: Optional[tuple], tensors: tuple, launches: list, pointers: tuple, value,
               scalar_names: Optional[dict] = None, scalars: tuple = (), later: list = ()) -> None:
        """Keeps ``launches`` (``(plan, args)`` in launch order, as the Launcher returned them)
        for ``sig`` (as ``find`` gave it for ``tensors``), with ``value`` (what the op keeps with
        the entry for its replays); ``later``: the launches a receive hook makes, the same way. A
        replay's inputs are ``pointers`` (data pointers of the call) followed by its scalars;
        ``scalar_names`` maps a kernel argument name to its index among them (e.g. ``{"T": 0}``):
        those arguments are patched per replay; ``scalars`` are this call's. Each tensor among a
        plan's dynamic arguments must be one of ``pointers`` and no other; every other dynamic
        argument keeps this call's value. A call with aliased pointers, or a plan that cannot be
        bound, is not recorded (it keeps taking the full path)."""
        if sig is None or len(set(pointers)) != len(pointers) or any(p is None for p, _ in (*launches, *later)):
            return
        scalar_names = scalar_names or {}
        steps = self._bind(launches, pointers, scalar_names)
        after = self._bind(later, pointers, scalar_names)
        if steps is None or after is None:
            return
        if len(self._entries) >= MAX_SIGNATURES:
            self._entries.pop(next(iter(self._entries)))
        aligned = all(p & 15 == 0 for _, _, _, _, p in sig[0])
        guarded = guard(tensors, self.token_dims) if aligned else None
        exact = guard(tensors, (None,) * len(tensors)) if guarded is not None else None
        self._entries[sig] = entry = _Entry(steps, after, value, sig[1], guarded if exact is not None else None,
                                            exact, tuple(scalars), self._graph_of(steps + after))
        if entry.guard is not None:
            self.last = entry

    def _graph_of(self, steps: tuple):
        """A launch graph of ``steps`` (bound native plans) where this Replay keeps them and there
        are two or more, else None (also where the driver refuses one, or the call is recorded
        inside a caller's CUDA graph capture: the launches go one by one)."""
        if not self.graph or len(steps) < 2 or not all(isinstance(b, LaunchPlan) for b, _ in steps):
            return None
        if capturing():
            return None  # recorded inside a caller's capture: no graph built there; launched one by one
        try:
            return LaunchGraph([b for b, _ in steps])
        except NativeError:
            return None

    @staticmethod
    def _bind(launches, pointers: tuple, scalar_names: dict) -> Optional[tuple]:
        """``launches`` as replay steps: each plan bound with its per-call arguments left open, and
        which of a replay's inputs feed them; None when one cannot be."""
        n = len(pointers) + len(scalar_names)
        steps = []
        for plan, args in launches:
            positions, pick = [], []
            for i in plan.dynamic:
                name = plan.arg_names[i]
                if name in scalar_names:
                    positions.append(i)
                    pick.append(len(pointers) + scalar_names[name])
                elif isinstance(args[i], torch.Tensor):
                    p = args[i].data_ptr()
                    if p not in pointers:
                        return None  # a pointer that changes per call but is not an input
                    positions.append(i)
                    pick.append(pointers.index(p))
            bound = plan.bind(args, positions)
            if bound is None:
                return None
            steps.append((bound, None if pick == list(range(n)) else tuple(pick)))
        return tuple(steps)
