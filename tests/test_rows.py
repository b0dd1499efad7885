"""The rows layout (``EPBuffer(layout="rows")``) on CPU ranks against ``moe_ep.testing.reference.reference_rows``.

Every received row is checked in order (the order (source rank, source token) is part of the
contract) with its payload bit for bit (bf16 values, or fp8 bytes and scales), local ids, weights
and source, plus ``num_recv`` and ``expert_counts``; combine of the caller's reduced rows against
the MoE oracle, and on every other call the combine weights' sums (tests/ep_cases.py). Ragged T
per rank including 0 and max_tokens; uniform, skewed, sparse (-1 ids, a token listing an expert
twice, tokens with no expert) and empty routing; the routing-histogram path (prefill sizes) as
well as the decode path; receive hooks; across nodes through the proxy; the argument errors.
"""
from __future__ import annotations

import pytest
import torch

import dist_util
import test_internode
import test_overlap
from ep_cases import DTYPES, Case, matrix_worker

RANKS = [1, 2, 3]  # CPU ranks; R=4 and up run on GPUs (the *_gpu tests)


def rows_cases(R: int):
    """One case per dispatch dtype; K, local experts, data kind, max_tokens and the decode /
    histogram path rotate so that every R meets each of them (fp8 with a partial scale block:
    H=144). The histogram case's dispatches all take the prefill path (``DIRECT_MAX``)."""
    out = []
    for d, dtype in enumerate(DTYPES):
        i = d + R
        calls = ("sparse", "skewed", "none", "repeat") if d == R % 3 else ("uniform", "sparse", "repeat")
        out.append(Case(R=R, E=(1, 2, 4)[i % 3] * R, K=(1, 2, 8)[(i + 1) % 3], dtype=dtype, layout="rows",
                        data=("tagged", "random")[i % 2], H=144 if dtype == "fp8" else 128, M=(8, 16)[i % 2],
                        calls=calls, seed=300 + 10 * R + d))
    return out


def histogram_case(R: int) -> int:
    """Which of ``rows_cases(R)`` runs with the routing histogram."""
    return (R + 1) % 3


def _matrix_worker(rank, world_size, cases, histogram):
    """``matrix_worker`` case by case, the ones flagged in ``histogram`` with the routing histogram
    forced (every dispatch takes the prefill path)."""
    from moe_ep.ops import dispatch

    saved, fails = dispatch.DIRECT_MAX, []
    try:
        for case, hist in zip(cases, histogram):
            dispatch.DIRECT_MAX = -1 if hist else saved
            fails += matrix_worker(rank, world_size, [case])[0]
    finally:
        dispatch.DIRECT_MAX = saved
    return fails


@pytest.mark.parametrize("R", RANKS)
def test_rows_matrix(R):
    cases = rows_cases(R)
    hist = [i == histogram_case(R) for i in range(len(cases))]
    results = dist_util.run(R, _matrix_worker, cases, hist, timeout=900)
    fails = [f for rank_fails in results for f in rank_fails]
    assert not fails, f"{len(fails)} failed checks:\n" + "\n".join(fails[:40])


@pytest.mark.parametrize("R", [1, 2])
def test_rows_chunk_sub_blocks(R):
    """Chunks larger than the payload loops' tile (``OWN_TILE_TOKENS``): a rank's own rows go in
    sub-blocks, full and partial, each one's rows read back from ``recv_pos``, the next one's first
    tile loaded by the last step of the one before. M=40 on two programs: chunks of 20 tokens (16 +
    4) at T = M, one partial sub-block at the in-between T."""
    from moe_ep.core.workspace import OWN_TILE_TOKENS, max_chunks, pow2

    M = 40
    assert pow2(-(-M // max_chunks(M, 2))) > OWN_TILE_TOKENS  # the buffer's chunks do take sub-blocks
    cases = [Case(R=R, E=2 * R, K=8, dtype=d, layout="rows", data="tagged" if d == "bf16" else "random",
                  H=144 if d != "bf16" else 128, M=M, calls=("uniform", "sparse", "repeat"), seed=500 + i)
             for i, d in enumerate(DTYPES)]
    hist = [i == 1 for i in range(len(cases))]  # one case on the routing-histogram path
    results = dist_util.run(R, _matrix_worker, cases, hist, timeout=900)
    fails = [f for rank_fails in results for f in rank_fails]
    assert not fails, f"{len(fails)} failed checks:\n" + "\n".join(fails[:40])


def test_rows_cases_cover_the_contract():
    cases = [c for R in RANKS for c in rows_cases(R)]
    assert {c.dtype for c in cases} == set(DTYPES) and {c.K for c in cases} == {1, 2, 8}
    assert {c.E // c.R for c in cases} == {1, 2, 4} and {c.data for c in cases} == {"tagged", "random"}
    assert {c.H for c in cases} == {128, 144} and {c.M for c in cases} == {8, 16}
    for R in RANKS:
        mine = rows_cases(R)
        assert {c.dtype for c in mine} == set(DTYPES)
        assert {mine[histogram_case(R)].dtype for R in RANKS} == set(DTYPES)
        assert sum("none" in c.calls for c in mine) == 1 and sum("skewed" in c.calls for c in mine) == 1
    for c in cases:
        Ts = [T for call in range(len(c.calls)) for T in c.token_counts(call)]
        assert 0 in Ts and c.M in Ts and "sparse" in c.calls and "repeat" in c.calls


@pytest.mark.parametrize("R,node_size", [(2, None), (3, 1)], ids=["R2", "R3-across-nodes"])
def test_rows_receive_hooks(R, node_size):
    """Two micro-batches on two rows buffers: both send halves, then the receive hooks."""
    cases = [Case(R=R, E=2 * R, K=2, dtype="bf16", layout="rows", calls=("uniform", "sparse"), seed=21),
             Case(R=R, E=R, K=3, dtype="fp8", layout="rows", data="random", calls=("skewed", "uniform"), seed=22)]
    # (deadlines of 120 s: a loaded 2-core machine once kept a rank's send half from its peer for 30 s)
    results = dist_util.run(R, test_overlap._worker, cases, node_size, R == 2, 120.0, timeout=600)
    fails = [f for r in results for f in r]
    assert not fails, "\n".join(fails[:40])


@pytest.mark.parametrize("topo", ["2x2-pc0-faults", "3x1-default"])
def test_rows_across_nodes(topo):
    """Node peers by stores, other nodes through the proxy (TCP; delay and reorder injection in
    2 x 2): rows of every source of every node in one order."""
    R, G, pc, faults = test_internode.TOPOLOGIES[topo]
    cases = [Case(R=R, E=2 * R, K=4, dtype="bf16", layout="rows", calls=("uniform", "sparse", "skewed", "repeat"),
                  seed=70),
             Case(R=R, E=R, K=3, dtype="fp8" if G == 1 else "fp8pre", layout="rows", data="random" if G == 1 else
                  "tagged", calls=("skewed", "uniform", "none"), seed=71)]
    results = dist_util.run(R, test_internode._matrix_worker, G, pc, faults, cases, timeout=600)
    fails = [f for r in results for f in r]
    assert not fails, f"{len(fails)} failed checks:\n" + "\n".join(fails[:30])


def _errors_worker(rank, world_size):
    """What the rows layout refuses, each naming the argument; then a good round trip."""
    import moe_ep
    from moe_ep.moe.rows import row_groups

    group = moe_ep.EPGroup()
    R, E, H, M, K = world_size, 2 * world_size, 128, 4, 2
    log = []

    def expect(what, fn, word, types=(ValueError, TypeError)):
        dist_util.expect_error(log, what, fn, [word], types)

    expect("rows with expert_alignment 16",
           lambda: moe_ep.EPBuffer(group, E, H, M, K, layout="rows", expert_alignment=16), "expert_alignment")
    expect("MoELayer with rows", lambda: moe_ep.MoELayer(H, 32, E, K, group=group, max_tokens=M, layout="rows"),
           "layout")
    x = torch.ones(3, H, dtype=torch.bfloat16)
    idx = torch.tensor([[0, E - 1], [E - 1, -1], [-1, -1]], dtype=torch.int64)
    w = torch.ones(3, K)
    with moe_ep.EPBuffer(group, E, H, M, K, layout="masked") as buf:
        h = buf.dispatch(x, idx, w)
        y = torch.zeros(h.expert_x.shape, dtype=torch.bfloat16)
        expect("combine topk_weights with masked", lambda: buf.combine(y, h, topk_weights=torch.ones(R * M, K)),
               "topk_weights")
        buf.combine(y, h)
    with moe_ep.EPBuffer(group, E, H, M, K, layout="rows") as buf:
        h = buf.dispatch(x, idx, w)
        expect("row_groups of a rows result", lambda: row_groups(h, "rows"), "rows")
        y = torch.zeros(h.expert_x.shape, dtype=torch.bfloat16)
        n = h.expert_x.shape[0]  # (sized per call: the rows received)
        for what, wy in (("topk_weights bf16", torch.ones(n, K, dtype=torch.bfloat16)),
                         ("topk_weights [R*M, K]", torch.ones(R * M, K)),
                         ("topk_weights K+1", torch.ones(n, K + 1))):
            expect(what, lambda: buf.combine(y, h, topk_weights=wy), "topk_weights")
        expect("expert_y [T, H]", lambda: buf.combine(torch.zeros(3, H, dtype=torch.bfloat16), h), "expert_y")
        y = torch.zeros(h.expert_x.shape, dtype=torch.bfloat16)
        n = int(h.num_recv[0])
        y[:n] = h.expert_x[:n]  # identity experts, reduced: the token comes back once per rank that has it
        out, wsum = buf.combine(y, h, topk_weights=torch.ones(h.expert_x.shape[0], K))
        ranks = torch.tensor([len({int(e) // 2 for e in row if e >= 0}) for row in idx], dtype=torch.float32)
        if not torch.equal(out.float(), x.float() * ranks[:, None]) or not torch.equal(wsum, ranks[:, None].expand(3, K)):
            log.append(f"round trip after refused calls: out {out[:, 0].tolist()} weights {wsum.tolist()}, "
                       f"expected per token {ranks.tolist()}")
    return log


@pytest.mark.parametrize("R", [1, 2])
def test_rows_errors(R):
    logs = dist_util.run(R, _errors_worker, timeout=300)
    log = [m for lg in logs for m in lg]
    assert not log, "\n".join(log)


def _hook_inputs_worker(rank, world_size):
    """Dispatch and combine with receive hooks, every layout, while the caller overwrites its inputs
    between the call and the hook: the hook must not read them again (a rank's own rows, which a
    plain call reads from x / expert_y in its receive half, go through the workspace when a hook is
    asked for)."""
    from moe_ep.testing.reference import moe_local, reference_moe
    from ep_cases import (DTYPES, check_combine, check_dispatch, expert_fn_for, first_expert, make_buffer,
                          make_expert_y, make_inputs, reference_for, rows_expert_y)

    fails = []
    for dtype, layout in (("bf16", "rows"), ("fp8", "rows"), ("fp8", "masked"), ("bf16", "packed")):
        case = Case(R=world_size, E=2 * world_size, K=2, dtype=dtype, layout=layout, data="random",
                    calls=("uniform",), seed=70 + rank)
        inp = make_inputs(case, 0)[rank]
        x, idx, w = inp.x.clone(), inp.topk_idx.clone(), inp.topk_weights.clone()
        where = f"[{case.name} rank {rank}]"
        with make_buffer(_group(), case) as buf:
            ref = reference_for(buf.group, case, inp.x, inp.topk_idx, inp.topk_weights, None)
            h, hook = buf.dispatch(x, idx, w, return_recv_hook=True)
            x.fill_(float("nan"))
            idx.fill_(0)
            w.fill_(5.0)
            hook()
            bad = check_dispatch(h, ref, case, where + " dispatch hook after x, topk_idx, topk_weights changed")
            fails += bad
            fn = expert_fn_for(case)
            if layout == "rows":
                y, _ = rows_expert_y(h, case, fn, rank)
            else:
                y = make_expert_y(h, case, fn, first_expert(ref, case)) if not bad else \
                    torch.zeros(h.expert_x.shape, dtype=torch.bfloat16)
            out, chook = buf.combine(y, h, return_recv_hook=True)
            y.fill_(float("nan"))
            chook()
            if not bad:
                dt = DTYPES[dtype]
                exp = reference_moe(buf.group, case.E, inp.x, inp.topk_idx, inp.topk_weights, fn, dispatch_dtype=dt)
                exp_abs = moe_local(case.E, inp.x, inp.topk_idx, inp.topk_weights.abs(),
                                    lambda e, rows: fn(e, rows).abs(), dispatch_dtype=dt)
                fails += check_combine(out, exp, exp_abs, inp.x.shape[0], case,
                                       where + " combine hook after expert_y changed")
    return fails


def _group():
    import moe_ep

    return moe_ep.EPGroup()


@pytest.mark.parametrize("R", [1, 2])
def test_hooks_do_not_reread_inputs(R):
    fails = [f for r in dist_util.run(R, _hook_inputs_worker, timeout=300) for f in r]
    assert not fails, "\n".join(fails[:20])


def test_own_prefetch_depth(monkeypatch):
    """The rows dispatch's L2 prefetch of its own rows: one sub-block ahead for fp8 quantized in the
    kernel on <= 32 programs, none otherwise (bf16, pre-quantized input, more programs), and
    ``MOE_EP_PREFETCH`` overrides the rule."""
    import moe_ep
    from moe_ep.ops.dispatch import own_prefetch_depth

    monkeypatch.delenv("MOE_EP_PREFETCH", raising=False)
    g = moe_ep.EPGroup()

    def depth(dtype, programs, fp8_in=False):
        buf = moe_ep.EPBuffer(g, 8, 128, 16, 2, dispatch_dtype=dtype, layout="rows", num_programs=programs)
        try:
            return own_prefetch_depth(buf.parts, fp8_in)
        finally:
            buf.close()

    fp8 = torch.float8_e4m3fn
    assert [depth(fp8, 32), depth(fp8, 2), depth(fp8, 33), depth(torch.bfloat16, 32), depth(fp8, 32, True)] == \
        [1, 1, 0, 0, 0]
    monkeypatch.setenv("MOE_EP_PREFETCH", "3")
    assert depth(torch.bfloat16, 132) == 3
