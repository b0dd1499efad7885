"""Replayed calls (moe_ep/ops/replay.py): a dispatch or combine whose inputs have a signature that
passed validation before launches the recorded plans with only the input pointers patched.

On CPU the buffer's launcher is swapped for one whose plans run the kernels in the interpreter
(``_InterpLauncher``): a replayed launch rebuilds each patched tensor from its raw pointer, so
a stale or misplaced pointer reads or writes the wrong memory and the oracle check fails. One
rank (R=1), where the interpreter needs no host wait between a dispatch's two halves.
On a GPU the same calls run the native plans (``-m gpu``).
"""
from __future__ import annotations

import ctypes

import pytest
import torch

import dist_util
from ep_cases import DTYPES, Case, make_buffer, make_inputs, run_calls


class _InterpBound:
    """A bound launch that rebuilds the tensors at ``positions`` from their pointers."""

    def __init__(self, plan, args: tuple, positions):
        self.plan, self.args, self.positions = plan, args, list(positions)

    def launch(self, stream: int, values) -> None:
        args = list(self.args)
        for i, v in zip(self.positions, values):
            like = args[i]  # the recorded argument
            if not isinstance(like, torch.Tensor):
                args[i] = v  # a scalar: the token count or the chunking
            elif v == 0:
                args[i] = torch.empty(0, dtype=like.dtype)  # an empty input has no memory
            else:
                # The interpreter reaches a CPU tensor argument through its pointer (its storage
                # is not copied), so a tensor at this call's pointer stands for the call's tensor
                # whatever its token count; as large as the recorded one, since the interpreter
                # maps each storage once by address and a buffer tensor may share this one.
                n = max(like.numel(), 1)
                raw = (ctypes.c_char * (n * like.element_size())).from_address(v)
                args[i] = torch.frombuffer(raw, dtype=like.dtype)
        self.plan.launches.append(len(self.positions))
        self.plan.fn[(self.plan.grid,)](*args, **self.plan.consts)


class _InterpPlan:
    def __init__(self, fn, grid, consts, dynamic):
        self.fn, self.grid, self.consts, self.dynamic = fn, grid, consts, tuple(dynamic)
        self.launches = []

    def bind(self, args, positions):
        return _InterpBound(self, args, positions)

    @property
    def arg_names(self):
        return self.fn.arg_names


class _InterpLauncher:
    """Runs every launch in the interpreter and returns a plan for it (a fresh one per launch:
    which plan a replay binds is then visible to the test)."""

    def __init__(self):
        self.plans = []
        self.by_key = {}  # the latest plan of each key

    def stream(self) -> int:
        return 0

    def planned(self, key):
        return self.by_key.get(key)

    def __call__(self, key, fn, grid, args, consts, dynamic=None):
        consts = consts() if callable(consts) else consts
        fn[(grid,)](*args, **consts)
        self.plans.append(_InterpPlan(fn, grid, consts, range(len(args)) if dynamic is None else dynamic))
        self.by_key[key] = self.plans[-1]
        return self.plans[-1]


def _replayed(launcher) -> int:
    return sum(len(p.launches) for p in launcher.plans)


def _replay_worker(rank, world_size, cases, direct_max=None):
    import moe_ep
    import moe_ep.ops.dispatch

    group = moe_ep.EPGroup()
    fails, hits = [], {}
    kept = moe_ep.ops.dispatch.DIRECT_MAX  # (the pool's process runs later tests too)
    if direct_max is not None:  # prefill's launch structure (the routing histogram first) at small T
        moe_ep.ops.dispatch.DIRECT_MAX = direct_max
    try:
        for case in cases:
            with make_buffer(group, case, 20.0) as buf:
                buf.calls.launch = la = _InterpLauncher()
                fails += run_calls(group, buf, case)
                hits[case.name] = _replayed(la)
    finally:
        moe_ep.ops.dispatch.DIRECT_MAX = kept
    return fails, hits


# Token counts per call at R=1 cycle through max_tokens, 0, a middle count: calls 3-5 repeat the
# signatures of calls 0-2 with new tensors (call 5: call 0's values again).
_CALLS = ("uniform", "skewed", "sparse", "uniform", "skewed", "repeat")
# The packed and rows layouts replay with their received tensors allocated once ("worst"); sized
# per call (their default) each dispatch reads its rows on the host between its halves, so its
# dispatch is never replayed.
_WORST = {"packed": "worst", "rows": "worst"}


@pytest.mark.parametrize("dtype,layout,late", [("bf16", "masked", False), ("fp8", "packed", False),
                                               ("fp8pre", "masked", False), ("bf16", "masked", True),
                                               ("fp8", "packed", True), ("fp8", "rows", False)])
def test_replayed_calls_match_the_oracle(dtype, layout, late):
    """``late``: the weights come at combine (``topk_weights=``, pushed to the owners; dispatch
    gets wrong ones). The rows layout: every other combine takes the rows' weights and returns
    their sums in a new tensor."""
    case = Case(R=1, E=4, K=2, dtype=dtype, layout=layout, align=16 if layout == "packed" else 1, recv_rows=_WORST.get(layout), M=6,
                calls=_CALLS, seed=5, late_weights=late)
    (fails, hits), = dist_util.run(1, _replay_worker, [case], timeout=600)
    assert not fails, "\n".join(fails[:20])
    if layout == "rows":
        # Dispatches: every call after the first (two launches each). Combines with the rows'
        # weights (even calls) and without (odd calls) are entries of their own: the first of
        # each records (call 0, call 1), the later ones (calls 2, 4; 3, 5) replay, two launches each.
        assert hits[case.name] == 2 * 5 + 2 * 2 + 2 * 2, hits
        return
    # Every call after the first is replayed, whatever its token count (M, 0, a middle count): its
    # dispatch and its combine, two launches each under the interpreter (send and receive halves),
    # and with late weights the combine's push first.
    assert hits[case.name] == (5 if late else 4) * (len(_CALLS) - 1), hits


@pytest.mark.parametrize("dtype,layout,late", [("bf16", "masked", False), ("fp8pre", "packed", False),
                                               ("fp8", "masked", True), ("bf16", "rows", False)])
def test_replayed_hooked_calls_match_the_oracle(dtype, layout, late):
    """Calls with ``return_recv_hook=True`` replay too (the send half at the call, the recorded
    receive half in the hook), the caller overwriting its inputs between the call and the hook;
    ``late``: the weights pushed at combine, as DeepEP's low-latency combine with a hook."""
    case = Case(R=1, E=4, K=2, dtype=dtype, layout=layout, align=16 if layout == "packed" else 1, recv_rows=_WORST.get(layout), M=6,
                calls=_CALLS, seed=5, late_weights=late, hooks=True)
    (fails, hits), = dist_util.run(1, _replay_worker, [case], timeout=600)
    assert not fails, "\n".join(fails[:20])
    # An entry is recorded by a full-path call once an earlier hook launched its receive half (the
    # plan exists), and not by a call of no tokens whose empty inputs share the null pointer:
    # the dispatch's at call 2 (call 1 has no tokens), so calls 3-5 replay its two halves; the
    # combine's at call 1 (calls 2-5 replay its two halves), with late weights at call 2 (calls
    # 3-5 replay its push and two halves: call 1's empty weights and output share that pointer).
    # The rows layout: its combines with weights (even calls) record at call 2 and replay at call
    # 4; those without (odd calls) record at call 3 (call 1's hook made their receive half's plan)
    # and replay at call 5.
    combines = 2 * 2 if layout == "rows" else 3 * 3 if late else 2 * 4
    assert hits[case.name] == 2 * 3 + combines, hits


@pytest.mark.parametrize("dtype,layout", [("bf16", "masked"), ("fp8", "packed")])
def test_replayed_prefill_structure_matches_the_oracle(dtype, layout):
    """With the routing histogram launched first (as at prefill sizes; here at every T > 2), a
    replay patches the token count and the chunking into both kernels; the results stay the
    oracle's, and token counts of another chunking are not replayed from an entry of this one."""
    case = Case(R=1, E=4, K=2, dtype=dtype, layout=layout, align=16 if layout == "packed" else 1, recv_rows=_WORST.get(layout), M=6,
                calls=_CALLS, seed=3)  # T = 6, 0, 5, 6, 0, 6: T=5 chunks as T=6 does (2 tokens by 3)
    (fails, hits), = dist_util.run(1, _replay_worker, [case], 4, timeout=600)
    assert not fails, "\n".join(fails[:20])
    # Replayed: every combine after the first (2 launches each) and the dispatches of calls 2, 3
    # and 5 (the histogram and two halves: 3 launches). A dispatch of T = 0 is not recorded (its
    # empty inputs share the null pointer), so call 4 finds no entry of its structure.
    assert hits[case.name] == 2 * 5 + 3 * 3, hits


def _kind(plan) -> str:
    """``dispatch_send``, ``combine_recv``, ...: an inter-node plan's op and half (else its kernel's name)."""
    name = plan.fn.fn.__name__.replace("internode_", "").replace("_kernel", "")
    if "SEND" not in plan.consts:
        return name
    return name + {(True, False): "_send", (False, True): "_recv"}.get((plan.consts["SEND"], plan.consts["RECV"]), "")


def _across_worker(rank, world_size, node_size, cases):
    """``_replay_worker`` with peers on other nodes; returns (failures, replayed launches per
    case and kind (``dispatch_send``, ``combine_recv``, ...) on this rank)."""
    import moe_ep

    group = moe_ep.EPGroup(node_size=node_size)
    fails, hits = [], {}
    for case in cases:
        with make_buffer(group, case, 20.0) as buf:
            if buf.remote is None:
                return [f"rank {rank}: no peer on another node"], {}
            buf.calls.launch = la = _InterpLauncher()
            fails += run_calls(group, buf, case)
            hits[case.name] = {_kind(p): 0 for p in la.plans}
            for p in la.plans:
                hits[case.name][_kind(p)] += len(p.launches)
    return fails, hits


@pytest.mark.parametrize("R,node_size,dtype,layout,hooks", [(2, 1, "fp8", "masked", False),
                                                            (2, 1, "bf16", "rows", False),
                                                            (2, 1, "fp8pre", "packed", True),
                                                            (4, 2, "bf16", "masked", False)],
                         ids=["2x1-fp8-masked", "2x1-rows", "2x1-hooks", "2x2"])
def test_replayed_calls_across_nodes(R, node_size, dtype, layout, hooks):
    """Calls across nodes replay too: every launch of a dispatch (send and receive halves, through
    the launcher; under the interpreter the host waits between them) and of a combine, on every
    rank, with each call's pointers and token count patched; with hooks, the receive half in the
    hook. Every result equals the oracle."""
    case = Case(R=R, E=2 * R, K=2, dtype=dtype, layout=layout, align=16 if layout == "packed" else 1, recv_rows=_WORST.get(layout), M=6,
                calls=_CALLS, seed=5, hooks=hooks)
    results = dist_util.run(R, _across_worker, node_size, [case], timeout=600)
    fails = [f for r, _ in results for f in r]
    assert not fails, "\n".join(fails[:20])
    for r, (_, hits) in enumerate(results):
        h = hits[case.name]
        # Both halves of both ops are replayed alike (never one without the other), on every rank.
        assert h["dispatch_send"] == h["dispatch_recv"] > 0 and h["combine_send"] == h["combine_recv"] > 0, (r, h)
        # Calls 3-5 repeat the token counts of calls 0-2 with new tensors: each has an entry by then.
        assert h["dispatch_send"] >= 3 and h["combine_send"] >= 3, (r, h)


def _errors_worker(rank, world_size):
    """After calls that recorded replays, each input changed in one way raises what validation
    raises for it (same type, same message) and launches nothing; then a correct call still works."""
    import moe_ep
    from moe_ep.ops.dispatch import validate

    group = moe_ep.EPGroup()
    case = Case(R=1, E=4, K=2, dtype="bf16", layout="masked", M=6, calls=("uniform", "skewed", "sparse", "uniform"), seed=9)
    log = []
    with make_buffer(group, case, 20.0) as buf:
        buf.calls.launch = la = _InterpLauncher()
        assert not run_calls(group, buf, case)
        assert _replayed(la) > 0, "call 3 (call 0's token count) was not replayed"
        inp = make_inputs(case, 0)[0]
        x, idx, w = inp.x, inp.topk_idx, inp.topk_weights
        T, H = x.shape
        bad_dispatch = {
            "x shape": (torch.zeros(T, H + 16, dtype=torch.bfloat16), idx, w),
            "x dtype": (x.half(), idx, w),
            "x non-contiguous": (torch.zeros(T, 2 * H, dtype=torch.bfloat16)[:, ::2], idx, w),
            "x device": (x.to("meta"), idx, w),
            "x not a tensor": (x.tolist(), idx, w),
            "topk_idx shape": (x, idx[:, :1].contiguous(), w),
            "topk_idx fewer tokens than x": (x, idx[:-1].contiguous(), w),
            "topk_weights fewer tokens than x": (x, idx, w[:-1].contiguous()),
            "x fewer tokens than topk_idx": (x[:-1].contiguous(), idx, w),
            "topk_idx dtype": (x, idx.float(), w),
            "topk_weights non-contiguous": (x, idx, torch.zeros(T, 2 * case.K)[:, ::2]),
            "topk_weights dtype": (x, idx, w.double()),
            "too many tokens": (torch.zeros(T + 3, H, dtype=torch.bfloat16), torch.zeros(T + 3, case.K, dtype=torch.long),
                                torch.zeros(T + 3, case.K)),
        }
        for what, args in bad_dispatch.items():
            try:
                validate(buf.parts, *args, None)
                log.append(f"{what}: validation accepts it (test bug)")
                continue
            except (TypeError, ValueError) as e:
                want = (type(e), str(e))
            before = _replayed(la)
            try:
                buf.dispatch(*args)
                log.append(f"{what}: dispatch accepted it")
            except (TypeError, ValueError) as e:
                if (type(e), str(e)) != want:
                    log.append(f"{what}: dispatch raised {type(e).__name__}({e}), validation {want[0].__name__}({want[1]})")
            if _replayed(la) != before:
                log.append(f"{what}: a replayed launch ran")
        h = buf.dispatch(x, idx, w)
        y = torch.zeros(h.expert_x.shape, dtype=torch.bfloat16)
        buf.combine(y, h, out=torch.empty(T, H, dtype=torch.bfloat16))  # records the combine with out=
        h = buf.dispatch(x, idx, w)
        buf.combine(y, h, topk_weights=w)  # records the combine with pushed weights
        h = buf.dispatch(x, idx, w)
        shape = tuple(y.shape)
        bad_combine = {
            "expert_y dtype": ((y.half(), h), "expert_y"),
            "expert_y shape": ((y[:-1].contiguous(), h), "expert_y"),
            "expert_y non-contiguous": ((torch.zeros(shape[:-1] + (2 * H,), dtype=torch.bfloat16)[..., ::2], h),
                                        "expert_y"),
            "out shape": ((y, h, torch.empty(T + 1, H, dtype=torch.bfloat16)), "out"),
            "out dtype": ((y, h, torch.empty(T, H, dtype=torch.float16)), "out"),
            "out non-contiguous": ((y, h, torch.empty(T, 2 * H, dtype=torch.bfloat16)[:, ::2]), "out"),
            "out not a tensor": ((y, h, [0.0] * H), "out"),
            "topk_weights more tokens": ((y, h, torch.rand(T + 1, case.K)), "topk_weights"),
            "topk_weights fewer tokens": ((y, h, w[:-1].contiguous()), "topk_weights"),
            "topk_weights dtype": ((y, h, w.double()), "topk_weights"),
            "topk_weights non-contiguous": ((y, h, torch.zeros(T, 2 * case.K)[:, ::2]), "topk_weights"),
        }
        for what, (args, name) in bad_combine.items():
            before = _replayed(la)
            try:
                if name == "topk_weights":
                    buf.combine(args[0], args[1], topk_weights=args[2])
                elif name == "out":
                    buf.combine(args[0], args[1], out=args[2])
                else:
                    buf.combine(*args)
                log.append(f"{what}: combine accepted it")
            except (TypeError, ValueError) as e:
                if not str(e).startswith(f"{name}: expected"):
                    log.append(f"{what}: combine raised {type(e).__name__}({e}), not naming {name}")
            if _replayed(la) != before:
                log.append(f"{what}: a replayed launch ran")
        out = torch.full((T, H), float("nan"), dtype=torch.bfloat16)
        before = _replayed(la)
        got = buf.combine(y, h, out=out)
        if got is not out or _replayed(la) == before or bool(got.isnan().any()):
            log.append("combine(out=) after the bad calls: not replayed into out")
    return log


def test_changed_inputs_are_validated_on_the_fast_path():
    log, = dist_util.run(1, _errors_worker, timeout=600)
    assert not log, "\n".join(log)


def _scales_worker(rank, world_size):
    """Pre-quantized fp8 input: a dispatch like the latest replayed one with ``x_scales`` takes the
    fast path (no validation, a replayed launch); ``x_scales`` changed in one way raises what
    validation raises and launches nothing."""
    import moe_ep
    import moe_ep.ops.dispatch as D

    group = moe_ep.EPGroup()
    case = Case(R=1, E=4, K=2, dtype="fp8pre", layout="masked", M=6, calls=("uniform", "skewed", "sparse", "uniform"),
                seed=9)
    log, validated = [], []
    with make_buffer(group, case, 20.0) as buf:
        buf.calls.launch = la = _InterpLauncher()
        assert not run_calls(group, buf, case)
        inp = make_inputs(case, 0)[0]
        x, idx, w, xs = inp.x, inp.topk_idx, inp.topk_weights, inp.x_scales
        buf.dispatch(x, idx, w, x_scales=xs)
        real = D.validate
        D.validate = lambda *a: validated.append(1) or real(*a)
        try:
            before = _replayed(la)
            for T in (x.shape[0], 2):  # the recorded token count, then another
                buf.dispatch(x[:T].contiguous(), idx[:T].contiguous(), w[:T].contiguous(), x_scales=xs[:T].contiguous())
            if validated or _replayed(la) == before:
                log.append(f"x_scales dispatch: not on the fast path (validated {len(validated)}x)")
            bad = {
                "fewer tokens": xs[:-1].contiguous(),
                "dtype": xs.double(),
                "non-contiguous": torch.zeros(xs.shape[0], 2 * xs.shape[1])[:, ::2],
            }
            for what, b in bad.items():
                before = _replayed(la)
                try:
                    buf.dispatch(x, idx, w, x_scales=b)
                    log.append(f"x_scales {what}: accepted")
                except (TypeError, ValueError) as e:
                    if not str(e).startswith("x_scales: expected"):
                        log.append(f"x_scales {what}: {type(e).__name__}({e})")
                if _replayed(la) != before:
                    log.append(f"x_scales {what}: a replayed launch ran")
        finally:
            D.validate = real
    return log


def test_prequantized_dispatch_takes_the_fast_path():
    log, = dist_util.run(1, _scales_worker, timeout=600)
    assert not log, "\n".join(log)


def _fast_path_checks_worker(rank, world_size):
    """Once calls replay, the fast path still refuses what the full path refuses (a pending
    receive hook, a stale handle, an ``out`` over ``expert_y``, a kernel's error record, a closed
    buffer), with the full path's error and no replayed launch."""
    import moe_ep

    group = moe_ep.EPGroup()
    case = Case(R=1, E=4, K=2, dtype="bf16", layout="masked", M=6, calls=("uniform", "uniform"), seed=3)
    log = []
    buf = make_buffer(group, case, 20.0)
    buf.calls.launch = la = _InterpLauncher()
    assert not run_calls(group, buf, case)
    inp = make_inputs(case, 0)[0]
    x, idx, w = inp.x, inp.topk_idx, inp.topk_weights
    T, H = x.shape

    def refused(what, call, error, match):
        before = _replayed(la)
        dist_util.expect_error(log, what, call, [match], (error,))
        if _replayed(la) != before:
            log.append(f"{what}: a replayed launch ran")

    before = _replayed(la)
    h = buf.dispatch(x, idx, w)
    y = torch.zeros(h.expert_x.shape, dtype=torch.bfloat16)
    buf.combine(y, h)
    buf.combine(y, h, out=torch.empty(T, H, dtype=torch.bfloat16))
    h = buf.dispatch(x, idx, w)
    out = buf.combine(y, h)
    if _replayed(la) == before or out.shape != (T, H):
        log.append("the calls before the checks were not replayed")
    old = h
    for _ in range(2):  # the second records (the first's hook made the receive half's plan)
        h, hook = buf.dispatch(x, idx, w, return_recv_hook=True)
        hook()
    before = _replayed(la)
    h, hook = buf.dispatch(x, idx, w, return_recv_hook=True)  # replayed: the send half now
    if _replayed(la) != before + 1:
        log.append("a hooked dispatch like the last was not replayed")
    refused("dispatch with a receive hook pending", lambda: buf.dispatch(x, idx, w), ValueError, "receive hook")
    refused("hooked dispatch with a receive hook pending", lambda: buf.dispatch(x, idx, w, return_recv_hook=True),
            ValueError, "receive hook")
    refused("combine with a receive hook pending", lambda: buf.combine(y, h), ValueError, "receive hook")
    before = _replayed(la)
    hook()
    if _replayed(la) != before + 1:
        log.append("a replayed hook did not launch the recorded receive half")
    refused("a replayed hook called twice", hook, RuntimeError, "already called")
    refused("combine of a stale handle", lambda: buf.combine(y, old), ValueError, "stale")
    buf.combine(y, h)
    buf.combine(y, h, out=torch.empty(T, H, dtype=torch.bfloat16))  # the latest combine(out=) again
    yy = torch.zeros_like(y)
    over = yy.view(-1)[:T * H].view(T, H)  # an out like the last one, but over the rows of yy
    refused("combine into an out over expert_y", lambda: buf.combine(yy, h, out=over), ValueError, "overlaps expert_y")
    buf.check_usable()  # nothing recorded: no error
    buf.parts.memory.err[:5] = torch.tensor([1, 0, 0, 7, 0])  # as a kernel records a timeout waiting for rank 0
    if buf.calls.ready():
        log.append("the fast path is ready after a kernel's error")
    refused("dispatch after a kernel's error", lambda: buf.dispatch(x, idx, w), moe_ep.CommTimeoutError, "rank 0")
    refused("dispatch of a broken buffer", lambda: buf.dispatch(x, idx, w), moe_ep.BufferBrokenError, "unusable")
    refused("check_usable of a broken buffer", buf.check_usable, moe_ep.BufferBrokenError, "unusable")
    buf.close()
    refused("dispatch of a closed buffer", lambda: buf.dispatch(x, idx, w), RuntimeError, "closed")
    refused("check_usable of a closed buffer", buf.check_usable, RuntimeError, "closed")
    # A proxy error word with no proxy record behind it (none here: one node) is raised with the
    # whole record, so that whoever reads it can tell what the kernel saw.
    with make_buffer(group, case, 20.0) as other:
        other.parts.memory.err[:5] = torch.tensor([4, 1, 1, 9, 5])  # code PROXY, peer 1, combine, epoch 9, detail 5
        try:
            other.check_usable()
            log.append("a proxy error word without its record: did not raise")
        except RuntimeError as exc:
            missing = [w for w in ("rank 0", "error code 4", "peer 1", "combine epoch 9", "detail 5") if w not in str(exc)]
            if missing:
                log.append(f"a proxy error word without its record: {exc!r} does not name {missing}")
    return log


def test_fast_path_keeps_the_buffers_checks():
    log, = dist_util.run(1, _fast_path_checks_worker, timeout=600)
    assert not log, "\n".join(log)


@pytest.mark.gpu
@pytest.mark.parametrize("launch", ["native", "triton"])
def test_replayed_calls_match_the_oracle_gpu(launch):
    """The native (and Triton-launcher) plans replayed on a GPU, new tensors and a new token count
    every call (one case with the weights at combine, pushed in the fused launch; two with receive
    hooks, the caller overwriting its inputs before each hook); then with
    prefill's launch structure (the routing histogram first) at small T, as in
    ``test_replayed_prefill_structure_matches_the_oracle``."""
    dist_util.need_gpu()
    cases = [Case(R=1, E=4, K=2, dtype=d, layout=lay, align=16 if lay == "packed" else 1, recv_rows=_WORST.get(lay), M=6, calls=_CALLS, seed=5,
                  late_weights=late, hooks=hooks)
             for d, lay, late, hooks in (("bf16", "masked", False, False), ("fp8", "packed", False, False),
                                         ("fp8pre", "masked", False, False), ("fp8", "masked", True, False),
                                         ("bf16", "packed", False, True), ("fp8", "masked", True, True),
                                         ("fp8", "rows", False, False), ("bf16", "rows", False, True))]
    prefill = [Case(R=1, E=4, K=2, dtype=d, layout=lay, align=16 if lay == "packed" else 1, recv_rows=_WORST.get(lay), M=6, calls=_CALLS,
                    seed=3) for d, lay in (("bf16", "masked"), ("fp8", "packed"))]
    fails = []
    for cs, direct_max in ((cases, None), (prefill, 4)):
        results = dist_util.run(1, _gpu_worker, cs, launch, direct_max, timeout=600,
                                backend=dist_util.gpu_backend(1))
        fails += [f for r in results for f in r]
    assert not fails, "\n".join(fails[:20])


def _gpu_worker(rank, world_size, cases, launch, direct_max=None):
    import os

    import moe_ep
    import moe_ep.ops.dispatch
    from moe_ep.kernels.launch import NativePlan

    kept = moe_ep.ops.dispatch.DIRECT_MAX  # (the pool's process runs later tests too)
    if direct_max is not None:
        moe_ep.ops.dispatch.DIRECT_MAX = direct_max

    os.environ["MOE_EP_LAUNCH"] = launch  # the pool's process: read when a buffer is made
    group = moe_ep.EPGroup()
    fails = []
    try:
        for case in cases:
            with make_buffer(group, case, 20.0) as buf:
                fails += run_calls(group, buf, case)
                kinds = {type(p).__name__ for p in buf.calls.launch._plans.values()}
                if (launch == "native") != (kinds == {NativePlan.__name__}):
                    fails.append(f"[{case.name}] MOE_EP_LAUNCH={launch}: plans {kinds}")
                if not any(r._entries for r in (buf.calls.hooked if case.hooks else buf.calls.replays)):
                    fails.append(f"[{case.name}] nothing recorded for replay")
    finally:
        os.environ.pop("MOE_EP_LAUNCH", None)
        moe_ep.ops.dispatch.DIRECT_MAX = kept
    return fails


def test_issued_result_is_the_dataclass_one():
    """``DispatchResult.issued`` (the eager path's constructor) gives the object ``__init__`` gives."""
    import dataclasses

    from moe_ep.ops.result import DispatchResult

    names = [f.name for f in dataclasses.fields(DispatchResult)]
    shared = {n: object() for n in names if n not in ("buffer", "num_tokens", "serial")}
    buffer = object()
    a = DispatchResult.issued(shared, buffer, 3, 7)
    b = DispatchResult(**shared, buffer=buffer, num_tokens=3, serial=7)
    assert type(a) is DispatchResult
    assert [getattr(a, n) for n in names] == [getattr(b, n) for n in names]


class _FakePlan:
    """A plan of a kernel (x_ptr, idx_ptr, n) whose bound launches record what they were given."""
    dynamic = (0, 1, 2)
    arg_names = ("x_ptr", "idx_ptr", "n")

    def __init__(self):
        self.bound = []

    def bind(self, args, positions):
        self.bound.append(list(positions))
        return self

    def launch(self, stream, values):
        self.got = list(values)


def test_latest_hit_is_found_by_its_guard():
    """A call like the latest recorded one is found by the guard alone (no signature computed),
    whatever its token count; each kind of difference the signature sees makes the guard fail, and
    the Python signature then decides (a new signature: no entry; the same: the entry). Scalars
    are bound by argument name and come after the pointers."""
    from moe_ep.ops.replay import Replay, guard

    def inputs(T=4):
        return torch.zeros(T, 32, dtype=torch.bfloat16), torch.zeros(T, 2, dtype=torch.float32)

    x, idx = inputs()
    assert guard((x, idx), (0, 0)) is not None, "this torch has no TensorGuards: every replay takes the Python path"
    rep = Replay((0, 0))
    entry, sig, ptrs = rep.find((x, idx), "s")
    assert entry is None and sig is not None and list(ptrs) == [x.data_ptr(), idx.data_ptr()]
    plan = _FakePlan()
    rep.record(sig, (x, idx), [(plan, (x, idx, 4))], tuple(ptrs), "v", {"n": 0})
    assert plan.bound == [[0, 1, 2]]  # both pointers and the scalar n are patched per replay
    for T in (4, 7, 0):
        x2, idx2 = inputs(T)
        entry, sig, ptrs = rep.find((x2, idx2), "s")
        assert entry is not None and entry.value == "v" and sig is None, f"T={T}: the guard did not find the entry"
        assert list(ptrs) == [x2.data_ptr(), idx2.data_ptr()]
        entry.run(0, (*ptrs, T))
        assert plan.got == [x2.data_ptr(), idx2.data_ptr(), T]
    x2, idx2 = inputs()
    misses = {
        "hidden size": (torch.zeros(4, 48, dtype=torch.bfloat16), idx2),
        "dtype": (x2.half(), idx2),
        "strides": (torch.zeros(4, 64, dtype=torch.bfloat16)[:, ::2], idx2),
        "dimensions": (x2.view(4, 32, 1), idx2),
        "device": (x2.to("meta"), idx2),
        "not a tensor": (x2.tolist(), idx2),
    }
    for what, ts in misses.items():
        entry, sig, _ = rep.find(ts, "s")
        assert entry is None, f"{what}: found a recorded entry"
    entry, sig, _ = rep.find((x2, idx2), "t")
    assert entry is None, "another extra value found the entry"
    # requires_grad fails the guard, not the signature (the kernels only read the data).
    entry, sig, _ = rep.find((x2, torch.zeros(4, 2, requires_grad=True)), "s")
    assert entry is not None and sig is not None
    # A misaligned pointer fails the guard's alignment check; its signature is new.
    raw = torch.zeros(4 * 32 + 1, dtype=torch.bfloat16)
    entry, sig, _ = rep.find((raw[1:].view(4, 32), idx2), "s")
    assert entry is None and sig is not None
    # After misses, the recorded signature is still found (by the signature, then by the guard).
    entry, sig, _ = rep.find(inputs(5), "s")
    assert entry is not None
    # Without a token dimension every size is fixed.
    fixed = Replay((None, None))
    _, sig, ptrs = fixed.find((x, idx))
    fixed.record(sig, (x, idx), [(_FakePlan(), (x, idx, 4))], tuple(ptrs), None)
    assert fixed.find(inputs(4))[0] is not None and fixed.find(inputs(5))[0] is None


def test_new_output_is_a_fresh_tensor():
    """combine's output without ``out=``: a new contiguous [T, hidden] bfloat16 tensor on the
    buffer's device each call, sharing no memory with another call's or with its model."""
    from types import SimpleNamespace

    from moe_ep.ops.combine import _SHAPES, new_output

    parts = SimpleNamespace(shape=SimpleNamespace(hidden=24),
                            calls=SimpleNamespace(out_one=torch.empty(1, 1, dtype=torch.bfloat16), out_like={}))
    seen = []
    for T in (5, 5, 0, 1, 7, 5):
        out = new_output(parts, T)
        assert out.shape == (T, 24) and out.dtype == torch.bfloat16 and out.is_contiguous(), out
        assert out.untyped_storage().nbytes() >= T * 24 * 2
        out.fill_(T + len(seen))
        seen.append(out)
    for i, out in enumerate(seen):  # no call's tensor was written by a later one
        assert bool((out == out.shape[0] + i).all()), i
    for T in range(2 * _SHAPES):  # the kept shapes stay bounded
        new_output(parts, T)
    assert len(parts.calls.out_like) <= _SHAPES


def test_deleted_buffer_is_freed_without_the_collector():
    """A closed buffer that nobody references any more is freed at once (no reference cycle
    through its own fields), before and after a dispatch + combine whose results were dropped:
    on a GPU its expert layout goes back to torch's cache then, not at the next collection
    (tests/test_shared_gpu.py measures that memory)."""
    import gc
    import weakref

    import moe_ep

    gc.disable()
    try:
        g = moe_ep.EPGroup()
        for used in (False, True):
            buf = moe_ep.EPBuffer(g, 4, 128, 16, 2)
            if used:
                h = buf.dispatch(torch.randn(8, 128, dtype=torch.bfloat16), torch.randint(0, 4, (8, 2)),
                                 torch.rand(8, 2))
                out = buf.combine(h.expert_x.clone(), h)
                assert out.shape == (8, 128)
                del h, out
            ref = weakref.ref(buf)
            buf.close()
            del buf
            assert ref() is None, f"buffer (used={used}) kept alive by: " + \
                ", ".join(type(r).__name__ for r in gc.get_referrers(ref()))
    finally:
        gc.enable()


class _NativeFakePlan:
    """A plan of a kernel (x_ptr, idx_ptr, n) bound as a real native plan (through the stand-in
    driver): slots for the positions a replay patches, 0 elsewhere."""
    dynamic = (0, 1, 2)
    arg_names = ("x_ptr", "idx_ptr", "n")

    def __init__(self, function: int, grid: int):
        self.function, self.grid = function, grid

    def bind(self, args, positions):
        from moe_ep.native.launch import LaunchPlan

        return LaunchPlan(self.function, self.grid, 64, 0, [8, 8, 4], [0, 0, 0], list(positions))


def test_graph_launch_replays_every_launch_in_one_graph(tmp_path, monkeypatch):
    """``Replay(graph=True)``: an entry of two launches (steps, then ``later``) keeps them as one
    launch graph; ``run`` launches both with one cuGraphLaunch, each node with this call's
    pointers and scalar where its plan takes them, and ``run_later`` then launches nothing; an
    entry of one launch, a Replay without ``graph``, and an entry recorded inside a caller's CUDA
    graph capture launch one by one."""
    import ctypes
    import struct

    from stand_in_cuda import FakeLaunch, fake_cuda_lib

    from moe_ep.ops.replay import Replay

    lib = fake_cuda_lib(tmp_path)
    monkeypatch.setenv("MOE_EP_CUDA_LIB", lib)
    drv = ctypes.CDLL(lib)
    drv.fake_cuda_launches.restype = drv.fake_cuda_graph_launches.restype = ctypes.c_long
    drv.fake_cuda_expect_params(3)
    x, idx = torch.zeros(4, 32, dtype=torch.bfloat16), torch.zeros(4, 2, dtype=torch.float32)

    def node(i):
        got = FakeLaunch()
        drv.fake_cuda_graph_node(i, ctypes.byref(got))
        return got

    def capturing(on: bool):  # (what torch.cuda says of the current stream: a stand-in)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: on)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: on)

    for graph, launches, captured in ((True, 2, False), (False, 2, False), (True, 1, False), (True, 2, True)):
        capturing(captured)
        rep = Replay((0, 0), graph=graph)
        _, sig, ptrs = rep.find((x, idx), "s")
        send, recv = _NativeFakePlan(0xA1, 3), _NativeFakePlan(0xB2, 5)
        later = [(recv, (x, idx, 4))] if launches == 2 else []
        rep.record(sig, (x, idx), [(send, (x, idx, 4))], tuple(ptrs), "v", {"n": 0}, (4,), later=later)
        capturing(False)
        entry = rep.find((x, idx), "s")[0]
        assert (entry.graph is not None) == (graph and launches == 2 and not captured)
        n0, g0 = drv.fake_cuda_launches(), drv.fake_cuda_graph_launches()
        x2, idx2 = torch.zeros(7, 32, dtype=torch.bfloat16), torch.zeros(7, 2, dtype=torch.float32)
        assert entry.run(0x77, (x2.data_ptr(), idx2.data_ptr(), 7)) == "v"
        entry.run_later(0x77, (x2.data_ptr(), idx2.data_ptr(), 7))
        assert drv.fake_cuda_launches() == n0 + launches
        assert drv.fake_cuda_graph_launches() == g0 + (1 if entry.graph is not None else 0)
        if entry.graph is not None:
            for i, fn in enumerate((0xA1, 0xB2)):
                got = node(i)
                assert (got.function, got.stream, got.grid[0]) == (fn, 0x77, (3, 5)[i])
                assert bytes(got.params[:20]) == struct.pack("<QQi", x2.data_ptr(), idx2.data_ptr(), 7)


def _graph_launch_gpu_worker(rank, world_size, cases):
    """The cases at prefill's launch structure (the routing histogram, then the dispatch: two
    launches) with ``Tuning(graph_launch=True)``, against the oracle; some replay must have kept
    its launches as one graph."""
    import moe_ep
    import moe_ep.ops.dispatch

    kept = moe_ep.ops.dispatch.DIRECT_MAX
    moe_ep.ops.dispatch.DIRECT_MAX = 4  # (prefill's structure at small T)
    group = moe_ep.EPGroup()
    fails = []
    try:
        for case in cases:
            with moe_ep.EPBuffer(group, case.E, case.H, case.M, case.K, dispatch_dtype=DTYPES[case.dtype],
                                 layout=case.layout, expert_alignment=case.align, timeout_s=20.0,
                                 tuning=moe_ep.Tuning(graph_launch=True),
                                 **({"max_recv_rows": case.recv_rows} if case.recv_rows is not None else {})) as buf:
                fails += run_calls(group, buf, case)
                if not any(e.graph is not None for r in buf.calls.replays for e in r._entries.values()):
                    fails.append(f"[{case.name}] no replay took a launch graph")
    finally:
        moe_ep.ops.dispatch.DIRECT_MAX = kept
    return fails


@pytest.mark.gpu
def test_graph_launch_matches_the_oracle_gpu():
    """``Tuning(graph_launch=True)`` at R = 1 and with 2 ranks sharing the GPU: replayed calls of
    two launches issued as one CUDA graph, new tensors and token counts every call."""
    dist_util.need_gpu()
    fails = []
    for R in (1, 2):
        cases = [Case(R=R, E=4 * R, K=2, dtype=d, layout=lay, align=16 if lay == "packed" else 1,
                      recv_rows=_WORST.get(lay), M=6, calls=_CALLS, seed=11)
                 for d, lay in (("bf16", "masked"), ("fp8", "packed"))]
        results = dist_util.run(R, _graph_launch_gpu_worker, cases, timeout=600, backend=dist_util.gpu_backend(R))
        fails += [f for r in results for f in r]
    assert not fails, "\n".join(fails[:20])
