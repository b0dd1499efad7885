"""EPBuffer construction is collective and bounded: arguments that differ across ranks raise a
ValueError naming the argument on every rank, a rank whose arguments are refused makes the others
raise at once (naming it), a rank that arrives too late is named in a CommTimeoutError within
timeout_s, and timeout_s itself is checked before any memory is touched."""
from __future__ import annotations

import math
import re
import time

import pytest
import torch

import dist_util

BASE = dict(num_experts=4, hidden=128, max_tokens=4, topk=2)
# (argument, rank 0's value, rank 1's value): each must be refused when the ranks differ
DIFFERING = [("hidden", 128, 256), ("topk", 2, 1), ("dispatch_dtype", torch.bfloat16, torch.float8_e4m3fn),
             ("max_tokens", 4, 8), ("num_experts", 4, 8), ("layout", "masked", "packed"),
             ("expert_alignment", 1, 16), ("num_programs", 2, 3), ("expert_capacity", 3, 4),
             ("max_recv_rows", 8, "worst"), ("overflow_budget_bytes", 1 << 20, 1 << 21)]
# arguments that exist only with another layout than BASE's
LAYOUT_OF = {"max_recv_rows": "packed"}


def _outcome(fn):
    """(exception type name or None, message, seconds)."""
    t0 = time.monotonic()
    try:
        fn()
        return None, "", time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc), time.monotonic() - t0


def _round_trip(group) -> bool:
    """A dispatch + combine on a fresh buffer gives the oracle's answer (construction still works)."""
    import moe_ep
    from moe_ep.testing.reference import reference_moe

    R = group.world_size
    x = torch.full((3, 128), float(group.rank + 1), dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1], [2 * R - 1, -1], [1, 0]])
    w = torch.tensor([[0.5, 0.25], [2.0, 0.0], [1.0, 1.0]])
    with moe_ep.EPBuffer(group, 2 * R, 128, 4, 2, timeout_s=20) as buf:
        h = buf.dispatch(x, idx, w)
        y = torch.zeros(h.expert_x.shape, dtype=torch.bfloat16)
        y[:] = h.expert_x.float() * 3  # expert e: 3 * x
        out = buf.combine(y, h)
    want = reference_moe(group, 2 * R, x, idx, w, lambda e, rows: rows * 3)
    return torch.equal(out.float(), want)


def _differing_worker(rank, world_size, differing):
    import moe_ep

    group = moe_ep.EPGroup()
    res = []
    for name, v0, v1 in differing:
        kw = dict(BASE, timeout_s=60, **{name: (v0, v1)[rank]})
        kw.setdefault("layout", LAYOUT_OF.get(name, "masked"))
        res.append((name, *_outcome(lambda: moe_ep.EPBuffer(group, **kw).close())))
    return res, _round_trip(group)


def test_differing_arguments_raise_naming_them():
    results = dist_util.run(2, _differing_worker, DIFFERING, timeout=300)
    for rank, (res, ok) in enumerate(results):
        for (name, v0, v1), (got_name, typ, msg, secs) in zip(DIFFERING, res):
            assert typ == "ValueError", (rank, name, typ, msg)
            assert msg.startswith(f"{name}: expected the same value on every rank"), (rank, msg)
            assert f"{v0!s} on rank 0" in msg.replace("'", "") and f"{v1!s} on rank 1" in msg.replace("'", ""), msg
            assert secs < 30, (rank, name, secs)  # answered by the exchange, not by the 60 s deadline
        assert ok, f"rank {rank}: a correct buffer after the refused ones gave a wrong answer"


def _differing_tuning_worker(rank, world_size, knobs):
    import moe_ep

    group = moe_ep.EPGroup()
    res = []
    for name, v0, v1 in knobs:
        tuning = moe_ep.Tuning(**{name: (v0, v1)[rank]})
        res.append(_outcome(lambda: moe_ep.EPBuffer(group, **BASE, timeout_s=60, tuning=tuning).close()))
    return res


# (Tuning field, rank 0's value, rank 1's value): the knobs that change what peers read
DIFFERING_TUNING = [("max_chunks", 2, 4), ("split", False, True), ("max_chunks", None, 2)]


def test_differing_layout_tuning_raises_naming_the_knob():
    """Ranks whose Tuning differs in a knob that changes the workspace or the launches peers wait
    for (max_chunks, split) are refused on every rank, the knob named; other knobs may differ."""
    for rank, res in enumerate(dist_util.run(2, _differing_tuning_worker, DIFFERING_TUNING, timeout=300)):
        for (name, v0, v1), (typ, msg, secs) in zip(DIFFERING_TUNING, res):
            assert typ == "ValueError", (rank, name, typ, msg)
            assert msg.startswith(f"tuning.{name}: expected the same value on every rank"), (rank, msg)
            assert f"{v0} on rank 0" in msg and f"{v1} on rank 1" in msg, msg
            assert secs < 30, (rank, name, secs)


def _tuning_may_differ_worker(rank, world_size):
    import moe_ep

    tuning = moe_ep.Tuning(num_warps=(2, 4)[rank], tile=(1, 2)[rank])
    with moe_ep.EPBuffer(moe_ep.EPGroup(), **BASE, timeout_s=60, tuning=tuning) as buf:
        return buf.tuning.num_warps


def test_launch_tuning_may_differ_across_ranks():
    """Knobs that shape only a rank's own launches (warps, tiles) may differ."""
    assert dist_util.run(2, _tuning_may_differ_worker, timeout=300) == [2, 4]


def _node_size_worker(rank, world_size):
    import moe_ep

    group = moe_ep.EPGroup(node_size=(2, 1)[rank])
    return _outcome(lambda: moe_ep.EPBuffer(group, **BASE, timeout_s=20).close())


def test_differing_node_size_raises():
    for rank, (typ, msg, _) in enumerate(dist_util.run(2, _node_size_worker, timeout=120)):
        assert typ == "ValueError" and msg.startswith("node_size: expected the same value"), (rank, typ, msg)
        assert "2 on rank 0, 1 on rank 1" in msg, msg


def _refused_worker(rank, world_size, timeout_s):
    """Rank 0's hidden is refused; rank 1's arguments are valid."""
    import moe_ep

    group = moe_ep.EPGroup()
    kw = dict(BASE, timeout_s=timeout_s, hidden=100 if rank == 0 else 128)
    return _outcome(lambda: moe_ep.EPBuffer(group, **kw).close()), _round_trip(group)


def test_refused_rank_is_named_and_nobody_hangs():
    timeout_s = 60.0
    (r0, ok0), (r1, ok1) = dist_util.run(2, _refused_worker, timeout_s, timeout=300)
    assert r0[0] == "ValueError" and r0[1].startswith("hidden: expected a multiple of 16"), r0
    assert r1[0] == "RuntimeError", r1
    assert "rank 1: EPBuffer construction failed on rank(s) [0]" in r1[1] and "hidden" in r1[1], r1
    assert r1[2] < timeout_s / 2, f"rank 1 waited {r1[2]:.1f} s: for its deadline, not for rank 0's error"
    assert ok0 and ok1


def _late_worker(rank, world_size, timeout_s, late_s):
    """Rank 0 reaches the constructor ``late_s`` after rank 1, which waits ``timeout_s``."""
    import moe_ep

    group = moe_ep.EPGroup()
    if rank == 0:
        time.sleep(late_s)
    out = _outcome(lambda: moe_ep.EPBuffer(group, **BASE, timeout_s=timeout_s).close())
    return out, _round_trip(group)


def test_rank_that_does_not_arrive_is_named_within_the_deadline():
    timeout_s, late_s = 3.0, 20.0  # late by far more than the deadline, whatever the machine's load
    (r0, ok0), (r1, ok1) = dist_util.run(2, _late_worker, timeout_s, late_s, timeout=300)
    typ, msg, secs = r1
    assert typ == "CommTimeoutError", r1
    assert "rank 1: rank(s) [0] did not reach EPBuffer construction" in msg, msg
    assert timeout_s * 0.9 <= secs <= timeout_s + 10.0, secs
    # The late rank does not go on alone: it learns that rank 1 gave up, and says so.
    assert r0[0] == "RuntimeError" and r0[1].startswith("rank 0: EPBuffer construction failed on rank(s) [1]: "
                                                        "rank 1: CommTimeoutError"), r0
    assert ok0 and ok1  # the ranks still construct together afterwards


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 0, -1.0, True, 1e7, "30"])
def test_timeout_s_is_checked_before_memory(bad, monkeypatch):
    import moe_ep
    import moe_ep.ops.buffer as B
    import moe_ep.ops.buffer_memory as BM

    def no_memory(*a, **k):
        raise AssertionError("memory was allocated before timeout_s was checked")

    monkeypatch.setattr(BM, "SymmetricWorkspace", no_memory)
    with pytest.raises(ValueError, match=r"^timeout_s: expected a finite number of seconds") as e:
        moe_ep.EPBuffer(moe_ep.EPGroup(), **BASE, timeout_s=bad)
    assert repr(bad) in str(e.value)
    assert math.isfinite(B.MAX_TIMEOUT_S)


@pytest.mark.parametrize("kw,error,match", [
    (dict(column_major_scales=1), TypeError, "column_major_scales: expected a bool, got int"),
    (dict(column_major_scales=True), ValueError, "column_major_scales: only with layout='masked' and "
                                                 "dispatch_dtype=torch.float8_e4m3fn"),
    (dict(column_major_scales=True, dispatch_dtype=torch.float8_e4m3fn, layout="packed"), ValueError,
     "column_major_scales: only with layout='masked'")])
def test_column_major_scales_is_checked_before_memory(kw, error, match, monkeypatch):
    """``column_major_scales`` takes a bool, and True only for a masked fp8 buffer; refused,
    naming it, before any memory is touched."""
    import moe_ep
    import moe_ep.ops.buffer_memory as BM

    def no_memory(*a, **k):
        raise AssertionError("memory was allocated before column_major_scales was checked")

    monkeypatch.setattr(BM, "SymmetricWorkspace", no_memory)
    with pytest.raises(error, match="^" + re.escape(match)):
        moe_ep.EPBuffer(moe_ep.EPGroup(), **BASE, **kw)


@pytest.mark.parametrize("var,bad", [("MOE_EP_COMBINE_TOKENS", "0"), ("MOE_EP_OWN_TOKENS", "x"),
                                     ("MOE_EP_COMBINE_WARPS", "3"), ("MOE_EP_COMBINE_WARPS", "64"),
                                     ("MOE_EP_MAXNREG", "8"), ("MOE_EP_MAXNREG", "max")])
def test_tuning_variables_are_checked_before_memory(var, bad, monkeypatch):
    """A bad tuning variable is refused, naming it, before any memory is touched."""
    import moe_ep
    import moe_ep.ops.buffer_memory as BM

    def no_memory(*a, **k):
        raise AssertionError(f"memory was allocated before {var} was checked")

    monkeypatch.setattr(BM, "SymmetricWorkspace", no_memory)
    monkeypatch.setenv(var, bad)
    with pytest.raises(ValueError, match=f"^{var}: expected .*got '{bad}'"):
        moe_ep.EPBuffer(moe_ep.EPGroup(), **BASE)


def test_combine_warps_apply_to_combine_only(monkeypatch):
    """MOE_EP_COMBINE_WARPS sets the combine launch's warps; the dispatch keeps num_warps."""
    import moe_ep

    monkeypatch.setenv("MOE_EP_COMBINE_WARPS", "8")
    warps = {}
    with moe_ep.EPBuffer(moe_ep.EPGroup(), **BASE) as buf:
        launch = buf.calls.launch

        def spy(key, fn, grid, args, consts, dynamic=None):
            c = consts() if callable(consts) else consts
            warps.setdefault(fn.fn.__name__, set()).add(c["num_warps"])
            return launch(key, fn, grid, args, consts, dynamic)

        buf.calls.launch = spy
        x = torch.randn(4, 128, dtype=torch.bfloat16)
        h = buf.dispatch(x, torch.tensor([[0, 1]] * 4), torch.ones(4, 2))
        buf.combine(torch.zeros(h.expert_x.shape, dtype=torch.bfloat16), h)
        assert buf.tuning.combine_warps == 8 != buf.tuning.num_warps
    assert warps == {"node_dispatch_kernel": {buf.tuning.num_warps}, "node_combine_kernel": {8}}, warps


def test_combine_shape_by_default():
    """Packed prefill on <= 64 programs of a GPU: the combine in 32 warps, steps of 4 tokens and the
    whole register file; every other buffer the dispatch's shape (the measurements are in
    ``combine_shape``'s docstring)."""
    from moe_ep.ops.buffer import CombineShape, combine_shape

    few = CombineShape(32, 4, "full")
    assert combine_shape("packed", 32, 4096 * 8, True) == few == combine_shape("packed", 64, 2049, True)
    same = CombineShape(None, None, "")
    for args in (("packed", 132, 4096 * 8, True), ("packed", 65, 4096 * 8, True),   # many SMs
                 ("packed", 32, 128 * 8, True), ("packed", 32, 2048, True),       # decode sizes
                 ("masked", 32, 4096 * 8, True), ("rows", 32, 4096 * 8, True),    # other layouts
                 ("packed", 32, 4096 * 8, False)):                                  # CPU
        assert combine_shape(*args) == same, args


def test_maxnreg_reaches_the_compiled_launches(monkeypatch):
    """MOE_EP_MAXNREG=full gives the dispatch and combine launches the register file over their
    own warps (recorded as a GPU would compile them, nothing run); under the interpreter none."""
    import moe_ep

    monkeypatch.setenv("MOE_EP_MAXNREG", "full")
    monkeypatch.setenv("MOE_EP_COMBINE_WARPS", "8")
    with moe_ep.EPBuffer(moe_ep.EPGroup(), **BASE) as buf:
        assert buf.launch_options("combine") == {"num_warps": 8}  # interpreted: no register budget
        with pytest.raises(ValueError, match="^kernel: expected 'dispatch' or 'combine', got 'route'"):
            buf.launch_options("route")
        seen = {}

        def spy(key, fn, grid, args, consts, dynamic=None):
            c = consts() if callable(consts) else consts
            seen[fn.fn.__name__] = (c["num_warps"], c.get("maxnreg"))

        buf.parts.tuning, buf.parts.interp, buf.calls.launch = buf.tuning.replace(fused=True), False, spy
        h = buf.dispatch(torch.zeros(4, 128, dtype=torch.bfloat16), torch.tensor([[0, 1]] * 4), torch.ones(4, 2))
        buf.combine(torch.zeros(h.expert_x.shape, dtype=torch.bfloat16), h)
        buf.parts.interp = True  # (so that close() takes the CPU path it was built for)
    W = buf.tuning.num_warps
    assert seen == {"node_dispatch_kernel": (W, min(65536 // (32 * W), 255)), "node_combine_kernel": (8, 255)}, seen
