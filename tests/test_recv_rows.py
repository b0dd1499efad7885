"""The packed and rows layouts' received tensors sized per call, to a cap, or for the worst case
(``EPBuffer(max_recv_rows=)``), on CPU ranks against the oracle (the rows layout: the section
below, the same three modes, ``test_rows_*``):

- per call (the default): each dispatch's ``expert_x`` has exactly the rows the oracle's counts
  give (each expert's block padded to ``expert_alignment``), its rows and the combine equal the
  oracle, on a node of 2 and on 2 nodes of 1 (the proxy over TCP), with and without receive hooks;
  ``memory()`` equals ``memory_plan(recv_rows=)`` of the largest call so far;
- a cap that fits: ``expert_x`` is the cap, results equal the oracle, no host read;
- a cap a call exceeds: ``CapacityError`` on every rank naming the rank, the expert and the rows
  needed (across nodes the source hears it in the rank's goodbye); nothing is written past the cap;
- ``"worst"``: today's size, results equal the oracle.
"""
from __future__ import annotations

import pytest
import torch

import dist_util
from ep_cases import Case, check_combine, check_dispatch, expert_fn_for, first_expert, make_expert_y, make_inputs, \
    reference_for, _hooked


def _need(ref, align: int) -> int:
    """The oracle's packed rows: each local expert's selections padded to ``align``."""
    return sum(-(-c // align) * align for c in ref.counts)


def _calls_worker(rank, world_size, node_size, mode, dtype, hooks):
    import moe_ep
    from moe_ep.testing.reference import moe_local, reference_moe

    group = moe_ep.EPGroup(node_size=node_size)
    dev = group.device
    case = Case(R=world_size, E=4 * world_size, K=3, dtype=dtype, layout="packed", align=4, M=8,
                calls=("uniform", "skewed", "sparse", "uniform"), hooks=hooks)
    fn = expert_fn_for(case)
    kw = dict(num_experts=case.E, hidden=case.H, max_tokens=case.M, topk=case.K, layout="packed",
              expert_alignment=case.align, dispatch_dtype=torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16)
    cap = {"per_call": None, "worst": "worst"}.get(mode, mode)
    fails, rows, needs = [], [], []
    with moe_ep.EPBuffer(group, timeout_s=60.0, max_recv_rows=cap, **kw) as buf:
        for call in range(len(case.calls)):
            where = f"[{mode} {dtype} G={node_size} hooks={hooks} rank {rank} call {call}]"
            inp = make_inputs(case, call)[rank]
            x, idx, w = inp.x.to(dev), inp.topk_idx.to(dev), inp.topk_weights.to(dev)
            ref = reference_for(group, case, x, idx, w, None)
            h = _hooked(buf.dispatch, x, idx, w) if hooks else buf.dispatch(x, idx, w)
            rows.append(h.expert_x.shape[0])
            needs.append(_need(ref, case.align))
            f = check_dispatch(h, ref, case, where)
            fails += f
            y = make_expert_y(h, case, fn, first_expert(ref, case)) if not f else \
                torch.zeros(h.expert_x.shape, dtype=torch.bfloat16, device=dev)
            out = _hooked(buf.combine, y, h) if hooks else buf.combine(y, h)
            exp = reference_moe(group, case.E, x, idx, w, fn, dispatch_dtype=kw["dispatch_dtype"])
            if not f:
                exp_abs = moe_local(case.E, x, idx, w.abs(), lambda e, r: fn(e, r).abs(),
                                    dispatch_dtype=kw["dispatch_dtype"])
                fails += check_combine(out, exp, exp_abs, x.shape[0], case, where)
        live = buf.memory()
    plan_rows = max(needs) if mode == "per_call" else None
    plan = moe_ep.memory_plan(world_size=world_size, node_size=node_size, device="cpu", max_recv_rows=cap,
                              recv_rows=plan_rows, **kw)
    return fails, rows, needs, plan, live


@pytest.mark.parametrize("node_size,dtype,hooks", [(2, "bf16", False), (2, "fp8", True), (1, "bf16", False),
                                                   (1, "fp8", True)],
                         ids=["node2-bf16", "node2-fp8-hooks", "2x1-bf16", "2x1-fp8-hooks"])
def test_per_call_rows_are_exact(node_size, dtype, hooks):
    for rank, (fails, rows, needs, plan, live) in enumerate(
            dist_util.run(2, _calls_worker, node_size, "per_call", dtype, hooks, timeout=300)):
        assert not fails, "\n".join(fails)
        assert rows == needs, f"rank {rank}: expert_x rows {rows}, the oracle's padded counts {needs}"
        assert [(r.name, r.where, r.bytes) for r in plan.regions] == [(r.name, r.where, r.bytes) for r in live.regions]


@pytest.mark.parametrize("mode", [40, "worst"])
def test_cap_that_fits_and_worst_case(mode):
    worst = 2 * 8 * 3 + 4 * 3  # R*M*K + EL*(alignment-1), as today (E = 8, EL = 4)
    for rank, (fails, rows, needs, plan, live) in enumerate(dist_util.run(2, _calls_worker, 2, mode, "bf16", False,
                                                                          timeout=300)):
        assert not fails, "\n".join(fails)
        assert max(needs) <= 40 and rows == [40 if mode == 40 else worst] * len(rows), (rank, rows, needs)
        assert [(r.name, r.where, r.bytes) for r in plan.regions] == [(r.name, r.where, r.bytes) for r in live.regions]


def _over_worker(rank, world_size, node_size, layout="packed"):
    """Every token of both ranks lists rank 1's experts 4 and 5 (K = 2): packed, rank 1 needs 2 * 2
    * 8 = 32 rows (alignment 1) against a cap of 20; rows, 2 * 8 = 16 (one per token) against a
    cap of 10; rank 0 needs none."""
    import moe_ep
    from moe_ep.native.library import PeerLostError

    group = moe_ep.EPGroup(node_size=node_size)
    dev = group.device
    E, H, M, K = 8, 128, 8, 2
    x = torch.ones(M, H, dtype=torch.bfloat16, device=dev)
    idx = torch.tensor([[4, 5]] * M, dtype=torch.int64, device=dev)
    w = torch.ones(M, K, device=dev)
    out = {}
    cap = 20 if layout == "packed" else 10
    with moe_ep.EPBuffer(group, E, H, M, K, layout=layout, max_recv_rows=cap, timeout_s=60.0) as buf:
        buf.parts.memory.expert_x.fill_(7.0)
        try:
            h = buf.dispatch(x, idx, w)
            buf.combine(torch.zeros(h.expert_x.shape, dtype=torch.bfloat16, device=dev), h)
            buf.synchronize()
            out["error"] = None
        except (moe_ep.CapacityError, PeerLostError) as exc:
            out["error"], out["peer"] = f"{type(exc).__name__}: {exc}", exc.peer
        # packed, rank 1's 20 rows: expert 4's 16, then 4 of expert 5's; rows, the first 10 tokens
        # (nothing past the cap, none dropped silently)
        out["written"] = int((buf.parts.memory.expert_x.float() == 1.0).all(dim=1).sum())
        if layout == "rows":  # the rows' sources too: rank 0's 8 tokens, then rank 1's first 2
            out["sources"] = buf.parts.memory.recv_src.tolist()
        try:
            buf.dispatch(x, idx, w)
            out["after"] = "no error"
        except moe_ep.BufferBrokenError:
            out["after"] = "BufferBrokenError"
    group.barrier()
    return out


def test_cap_exceeded_raises_on_every_rank():
    r0, r1 = dist_util.run(2, _over_worker, 2, timeout=300)
    for rank, out in enumerate((r0, r1)):
        assert out["error"] is not None and out["error"].startswith("CapacityError: "), (rank, out)
        assert "expert 5" in out["error"] and "needs 32 rows" in out["error"] and "max_recv_rows=20" in out["error"], \
            (rank, out["error"])
        assert out["after"] == "BufferBrokenError", (rank, out)
    assert "rank 1" in r0["error"] and "this rank" in r1["error"], (r0, r1)
    assert r1["written"] == 20 and r0["written"] == 0, (r0["written"], r1["written"])


def test_max_recv_rows_refused_before_memory():
    import moe_ep

    base = dict(world_size=2, node_size=2, num_experts=4, hidden=128, max_tokens=8, topk=2, device="cpu")
    for bad, layout in ((0, "packed"), (2 * 8 * 2 + 1, "packed"), ("some", "packed"), (True, "packed"),
                        (8, "masked"), ("worst", "masked"), (0, "rows"), (2 * 8 + 1, "rows"), (1.5, "rows")):
        with pytest.raises(ValueError, match="^max_recv_rows: "):
            moe_ep.memory_plan(layout=layout, max_recv_rows=bad, **base)
    with pytest.raises(ValueError, match="^recv_rows: only for a packed or rows buffer sized per call"):
        moe_ep.memory_plan(layout="packed", max_recv_rows=8, recv_rows=4, **base)
    with pytest.raises(ValueError, match=r"^recv_rows: expected an int in \[0, 32\]"):
        moe_ep.memory_plan(layout="packed", recv_rows=33, **base)


@pytest.mark.parametrize("layout", ["packed", "rows"])
def test_cap_exceeded_across_nodes(layout):
    """Across nodes (2 x 1) the rank over its cap raises the same ``CapacityError``; a source on
    another node learns it from that rank's goodbye, which carries the error's kind: a
    ``CapacityError`` too (not a ``PeerLostError``), naming rank 1 as the rank over its cap (its
    ``peer``, and the message), never a deadline or a wrong result."""
    r0, r1 = dist_util.run(2, _over_worker, 1, layout, timeout=300)
    need, cap = (32, 20) if layout == "packed" else (16, 10)
    mine = "rank 1: expert 5 on this rank" if layout == "packed" else "rank 1: this rank needs"
    assert r1["error"].startswith(f"CapacityError: {mine}") and f"needs {need} rows" in r1["error"] \
        and f"max_recv_rows={cap}" in r1["error"], r1
    assert r0["error"].startswith("CapacityError: rank 0: ") and r0["peer"] == 1 and \
        "closed after a CapacityError: rank 1 received more rows than its max_recv_rows" in r0["error"], r0
    assert r1["written"] == cap and r0["written"] == 0, (r0["written"], r1["written"])


# ---------------------------------------------------------------------------- the rows layout
def _rows_worker(rank, world_size, node_size, mode, dtype, hooks):
    """The rows layout's calls (dispatch checked row for row, combine with and without weights:
    ``ep_cases.run_calls``) on a buffer of ``mode``; returns the failures, each call's received
    rows and the oracle's count (``num_recv``), the plan after the largest call and the live memory."""
    import moe_ep
    from ep_cases import make_buffer, run_calls

    group = moe_ep.EPGroup(node_size=node_size)
    dev = group.device
    cap = {"per_call": None, "worst": "worst"}.get(mode, mode)
    case = Case(R=world_size, E=4 * world_size, K=2, dtype=dtype, layout="rows", M=8,
                calls=("uniform", "skewed", "sparse", "uniform"), hooks=hooks, recv_rows=cap)
    needs = []
    for call in range(len(case.calls)):  # the oracle's rows of each call (check_rows holds each call to it)
        inp = make_inputs(case, call)[rank]
        ref = reference_for(group, case, inp.x.to(dev), inp.topk_idx.to(dev), inp.topk_weights.to(dev),
                            None if inp.x_scales is None else inp.x_scales.to(dev))
        needs.append(ref.num_recv)
    with make_buffer(group, case) as buf:
        fails = run_calls(group, buf, case)
        rows = buf.parts.memory.expert_x.shape[0]
        live = buf.memory()
    plan = moe_ep.memory_plan(world_size=world_size, node_size=node_size, device="cpu", num_experts=case.E,
                              hidden=case.H, max_tokens=case.M, topk=case.K, layout="rows", max_recv_rows=cap,
                              recv_rows=max(needs) if cap is None else None,
                              dispatch_dtype=torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16)
    return fails, rows, needs, plan, live


@pytest.mark.parametrize("mode,node_size,dtype,hooks",
                         [("per_call", 2, "bf16", False), ("per_call", 1, "fp8", True), (12, 2, "fp8", False),
                          (12, 1, "bf16", True), ("worst", 2, "bf16", False), ("worst", 1, "fp8", False)],
                         ids=["per_call-node2-bf16", "per_call-2x1-fp8-hooks", "cap-node2-fp8", "cap-2x1-bf16-hooks",
                              "worst-node2-bf16", "worst-2x1-fp8"])
def test_rows_layout_sizing(mode, node_size, dtype, hooks):
    """The rows layout sized per call, to a cap that fits (12 of R*M = 16 rows) and for the worst
    case: every call's rows, ids, weights, sources and combine equal the oracle (``check_rows``
    holds the received tensors to exactly the oracle's ``num_recv`` rows per call: a host total
    off by one fails), on a node of 2 and on 2 nodes of 1; the plan equals the live buffer."""
    for fails, rows, needs, plan, live in _check_rows_modes(mode, node_size, dtype, hooks):
        assert [(r.name, r.where, r.bytes) for r in plan.regions] == [(r.name, r.where, r.bytes) for r in live.regions]


def _check_rows_modes(mode, node_size: int, dtype: str, hooks: bool, **run_kw) -> list:
    """``_rows_worker`` on 2 ranks: no failure, and the buffer's rows are the largest call's
    (per call), the cap or ``R*M`` = 16; returns each rank's results."""
    results = dist_util.run(2, _rows_worker, node_size, mode, dtype, hooks, timeout=600, **run_kw)
    for rank, (fails, rows, needs, plan, live) in enumerate(results):
        assert not fails, "\n".join(fails)
        want = {"per_call": max(needs), "worst": 16}.get(mode, mode)
        assert rows == want and max(needs) <= want, (rank, rows, needs)
    return results


def test_rows_cap_exceeded_raises_on_every_rank():
    """Rows layout over its cap on a node of 2: ``CapacityError`` on both ranks naming rank 1 and
    the 16 rows it needs; rank 1's first 10 rows written (rank 0's 8 tokens, rank 1's first 2), none
    past the cap; the buffer broken after."""
    r0, r1 = dist_util.run(2, _over_worker, 2, "rows", timeout=300)
    for rank, out in enumerate((r0, r1)):
        assert out["error"] is not None and out["error"].startswith("CapacityError: "), (rank, out)
        assert "needs 16 rows" in out["error"] and "max_recv_rows=10" in out["error"], (rank, out["error"])
        assert out["after"] == "BufferBrokenError", (rank, out)
    assert "rank 0: rank 1 needs" in r0["error"] and "rank 1: this rank needs" in r1["error"], (r0, r1)
    assert r1["written"] == 10 and r0["written"] == 0, (r0["written"], r1["written"])
    assert r1["sources"] == list(range(8)) + [8, 9], r1["sources"]


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["per_call", 40, "worst"])
def test_modes_gpu(mode):
    """The same on GPU ranks (the counting kernel's wait and the stream sync for real)."""
    dist_util.need_gpu()
    for rank, (fails, rows, needs, plan, live) in enumerate(dist_util.run(
            2, _calls_worker, 2, mode, "fp8", False, timeout=600, backend=dist_util.gpu_backend(2))):
        assert not fails, "\n".join(fails)
        if mode == "per_call":
            assert rows == needs, (rank, rows, needs)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["packed", "rows"])
def test_cap_exceeded_gpu(layout):
    dist_util.need_gpu()
    r0, r1 = dist_util.run(2, _over_worker, 2, layout, timeout=300, backend=dist_util.gpu_backend(2))
    assert r0["error"].startswith("CapacityError: ") and r1["error"].startswith("CapacityError: "), (r0, r1)
    cap = 20 if layout == "packed" else 10
    assert r1["written"] == cap and r0["written"] == 0, (r0["written"], r1["written"])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["per_call", 12, "worst"])
def test_rows_layout_sizing_gpu(mode):
    """The rows layout's modes on GPU ranks (the counting kernel's wait and the stream sync for real)."""
    dist_util.need_gpu()
    _check_rows_modes(mode, 2, "fp8", False, backend=dist_util.gpu_backend(2))


def _time_worker(rank, world_size, T):
    """Host-side p50 (us) of an eager packed dispatch of T tokens, sized per call and ``"worst"``."""
    import time

    import moe_ep

    group = moe_ep.EPGroup()
    dev = group.device
    E, H, K = 32 * world_size, 2048, 8
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    out, rows = {}, {}
    for mode in (None, "worst"):
        with moe_ep.EPBuffer(group, E, H, T, K, layout="packed", max_recv_rows=mode) as buf:
            times = []
            for i in range(30):
                group.barrier()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                d = buf.dispatch(x, idx, w)
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e6)
            out[str(mode)] = sorted(times[5:])[len(times[5:]) // 2]
            n = int(d.expert_offsets[-1])
            rows[str(mode)] = (d.expert_x.shape[0], d.expert_x[:n].cpu())
    same = rows["None"][0] == rows["None"][1].shape[0] and torch.equal(rows["None"][1], rows["worst"][1])
    return out, same


@pytest.mark.gpu
@pytest.mark.parametrize("T", [128, 4096])
def test_per_call_cost_gpu(T):
    """Prints what sizing per call costs an eager dispatch (synchronized wall time, p50), against
    ``"worst"`` (a measurement for docs/ARCHITECTURE.md §2, no bound); both give the same rows."""
    dist_util.need_gpu()
    results = dist_util.run(2, _time_worker, T, timeout=600, backend=dist_util.gpu_backend(2))
    print(f"T={T}: p50 us per rank, sized per call / worst:", [r[0] for r in results])
    assert all(r[1] for r in results), "sized per call, the rows differ from the worst-case buffer's"
