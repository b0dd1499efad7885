"""moe_ep.testing.reference (the oracle) against brute-force loops over every selection."""
from __future__ import annotations

import pytest
import torch

import dist_util
from ep_cases import Case, exact_expert, float_expert, make_inputs
from moe_ep.core.fp8 import dequantize_fp8, quantize_fp8
from moe_ep.core.group import EPGroup
from moe_ep.testing.reference import (GatheredInputs, dispatch_from_gathered, gather_inputs, reference_dispatch,
                              reference_moe)

FP8 = torch.float8_e4m3fn
DT = {"bf16": torch.bfloat16, "fp8": FP8, "fp8pre": FP8}


def _delivered(inp, dtype):
    if inp.x_scales is not None:
        return dequantize_fp8(inp.x, inp.x_scales), inp.x, inp.x_scales
    if dtype == FP8:
        q, s = quantize_fp8(inp.x)
        return dequantize_fp8(q, s), q, s
    return inp.x.float(), None, None


def brute_dispatch(all_inputs, rank, R, E, dtype):
    """{local expert: list of (src, t, k, row float32, q bytes or None, scales or None, weight)}."""
    EL = E // R
    out = {e: [] for e in range(EL)}
    for s, inp in enumerate(all_inputs):
        vals, q, sc = _delivered(inp, dtype)
        for t in range(inp.x.shape[0]):
            for k in range(inp.topk_idx.shape[1]):
                e = int(inp.topk_idx[t, k])
                if e == -1 or not (rank * EL <= e < (rank + 1) * EL):
                    continue
                out[e - rank * EL].append((s, t, k, vals[t], None if q is None else q[t], None if sc is None else sc[t],
                                           float(inp.topk_weights[t, k])))
    return out


def brute_moe(inp, dtype, fn):
    vals, _, _ = _delivered(inp, dtype)
    out = torch.zeros(inp.x.shape[0], inp.x.shape[1], dtype=torch.float64)
    for t in range(inp.x.shape[0]):
        for k in range(inp.topk_idx.shape[1]):
            e = int(inp.topk_idx[t, k])
            if e != -1:
                out[t] += float(inp.topk_weights[t, k]) * fn(e, vals[t:t + 1])[0].double()
    return out


def assert_same_dispatch(ref, brute, dtype):
    assert ref.counts == [len(brute[e]) for e in range(len(brute))]
    for e, sel in brute.items():
        assert ref.src_rank[e].tolist() == [s[0] for s in sel]
        assert ref.src_token[e].tolist() == [s[1] for s in sel]
        assert ref.src_k[e].tolist() == [s[2] for s in sel]
        assert ref.weight[e].tolist() == [s[6] for s in sel]
        want = torch.stack([s[3] for s in sel]) if sel else torch.zeros(0, ref.rows[e].shape[1])
        assert ref.rows[e].dtype == torch.float32 and torch.equal(ref.rows[e].cpu(), want)
        if dtype == FP8:
            wq = torch.stack([s[4] for s in sel]) if sel else torch.zeros(0, want.shape[1], dtype=FP8)
            ws = torch.stack([s[5] for s in sel]) if sel else torch.zeros(0, ref.scales[e].shape[1])
            assert torch.equal(ref.q[e].cpu().view(torch.uint8), wq.view(torch.uint8))
            assert torch.equal(ref.scales[e].cpu(), ws)
        else:
            assert ref.q is None and ref.scales is None


SINGLE = [Case(R=1, E=4, K=2), Case(R=1, E=8, K=8, dtype="fp8", data="random"),
          Case(R=1, E=3, K=1, dtype="fp8pre"), Case(R=1, E=2, K=8, H=144, dtype="fp8", M=16)]


@pytest.mark.parametrize("case", SINGLE, ids=lambda c: c.name)
def test_single_rank_against_brute_force(case):
    group = EPGroup()  # R=1 with nothing initialised
    dtype = DT[case.dtype]
    fn = exact_expert if case.data == "tagged" else float_expert
    for call in range(len(case.calls)):
        inp = make_inputs(case, call)[0]
        ref = reference_dispatch(group, case.E, inp.x, inp.topk_idx, inp.topk_weights, inp.x_scales, dtype)
        assert_same_dispatch(ref, brute_dispatch([inp], 0, 1, case.E, dtype), dtype)
        got = reference_moe(group, case.E, inp.x, inp.topk_idx, inp.topk_weights, fn, inp.x_scales, dtype)
        want = brute_moe(inp, dtype, fn)
        assert got.dtype == torch.float32 and got.shape == inp.x.shape
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-5)
        none = (inp.topk_idx == -1).all(dim=1)
        assert (got[none] == 0).all()


@pytest.mark.parametrize("case", [Case(R=3, E=6, K=2), Case(R=3, E=3, K=8, dtype="fp8", data="random"),
                                  Case(R=4, E=8, K=8, dtype="fp8pre"), Case(R=2, E=2, K=1)],
                         ids=lambda c: c.name)
def test_simulated_split(case):
    """dispatch_from_gathered for each rank of a split done in one process: every selection lands on
    exactly one rank, in the expert its id names, in (source, token, k) order."""
    dtype = DT[case.dtype]
    for call in range(len(case.calls)):
        inputs = make_inputs(case, call)
        g = GatheredInputs([i.x for i in inputs], [i.topk_idx.long() for i in inputs],
                           [i.topk_weights for i in inputs],
                           [i.x_scales for i in inputs] if case.dtype == "fp8pre" else None)
        total = 0
        for r in range(case.R):
            ref = dispatch_from_gathered(g, r, case.R, case.E, dtype)
            assert ref.first_expert == r * case.E // case.R and ref.num_local_experts == case.E // case.R
            assert_same_dispatch(ref, brute_dispatch(inputs, r, case.R, case.E, dtype), dtype)
            total += sum(ref.counts)
        assert total == sum(int((i.topk_idx != -1).sum()) for i in inputs)


def test_duplicates_and_no_expert_rows():
    group = EPGroup()
    x = torch.arange(3 * 16, dtype=torch.float32).view(3, 16).to(torch.bfloat16)
    idx = torch.tensor([[1, 1], [-1, -1], [0, 1]])
    w = torch.tensor([[0.5, 0.25], [7.0, 7.0], [1.0, 2.0]])
    ref = reference_dispatch(group, 2, x, idx, w)
    assert ref.counts == [1, 3]
    assert ref.src_token[1].tolist() == [0, 0, 2] and ref.src_k[1].tolist() == [0, 1, 1]
    out = reference_moe(group, 2, x, idx, w, lambda e, r: r * (e + 1))
    xf = x.float()
    assert torch.equal(out[0], xf[0] * 2 * 0.75)
    assert torch.equal(out[1], torch.zeros(16))
    assert torch.equal(out[2], xf[2] * 1 + 2 * xf[2] * 2)


def test_bad_expert_ids_raise():
    group = EPGroup()
    x = torch.zeros(2, 16, dtype=torch.bfloat16)
    w = torch.ones(2, 1)
    for bad in (4, -2):
        idx = torch.tensor([[0], [bad]])
        with pytest.raises(ValueError, match="topk_idx"):
            reference_dispatch(group, 4, x, idx, w)
        with pytest.raises(ValueError, match="topk_idx"):
            reference_moe(group, 4, x, idx, w, lambda e, r: r)


def test_empty_inputs():
    group = EPGroup()
    x = torch.zeros(0, 128, dtype=torch.bfloat16)
    idx = torch.zeros(0, 2, dtype=torch.int64)
    w = torch.zeros(0, 2)
    ref = reference_dispatch(group, 2, x, idx, w, dispatch_dtype=FP8)
    assert ref.counts == [0, 0] and ref.rows[0].shape == (0, 128) and ref.q[1].dtype == FP8
    assert reference_moe(group, 2, x, idx, w, lambda e, r: r).shape == (0, 128)


# ---------------------------------------------------------------------------- real ranks (gloo)
def _oracle_worker(rank, world_size, cases):
    group = EPGroup()
    for case in cases:
        dtype = DT[case.dtype]
        fn = exact_expert if case.data == "tagged" else float_expert
        for call in range(len(case.calls)):
            inputs = make_inputs(case, call)
            mine = inputs[rank]
            g = gather_inputs(group, mine.x, mine.topk_idx, mine.topk_weights, mine.x_scales)
            assert g.num_tokens == [i.x.shape[0] for i in inputs]
            for s, i in enumerate(inputs):
                assert g.x[s].dtype == i.x.dtype
                assert torch.equal(g.x[s].view(torch.uint8), i.x.view(torch.uint8)), (case.name, call, s)
                assert torch.equal(g.topk_idx[s], i.topk_idx.long())
                assert g.topk_idx[s].dtype == torch.int64
                assert torch.equal(g.topk_weights[s], i.topk_weights)
                if i.x_scales is not None:
                    assert torch.equal(g.x_scales[s], i.x_scales)
            ref = reference_dispatch(group, case.E, mine.x, mine.topk_idx, mine.topk_weights, mine.x_scales, dtype)
            assert_same_dispatch(ref, brute_dispatch(inputs, rank, world_size, case.E, dtype), dtype)
            got = reference_moe(group, case.E, mine.x, mine.topk_idx, mine.topk_weights, fn, mine.x_scales, dtype)
            torch.testing.assert_close(got.double(), brute_moe(mine, dtype, fn), rtol=1e-6, atol=1e-5)
    return True


@pytest.mark.parametrize("R", [2, 3])
def test_oracle_on_ranks(R):
    cases = [Case(R=R, E=2 * R, K=2), Case(R=R, E=R, K=8, dtype="fp8", data="random"),
             Case(R=R, E=4 * R, K=1, dtype="fp8pre", H=256)]
    assert dist_util.run(R, _oracle_worker, cases, timeout=300) == [True] * R


def _bad_ids_on_one_rank_worker(rank, world_size):
    """Only rank 1 has an id outside [-1, E): reference_moe (collective) raises on every rank,
    naming rank 1, where moe_local (one rank's view) would answer on the others."""
    group = EPGroup()
    x = torch.ones(2, 16, dtype=torch.bfloat16)
    idx = torch.tensor([[0], [4 if rank == 1 else 1]])
    w = torch.ones(2, 1)
    try:
        reference_moe(group, 4, x, idx, w, lambda e, r: r)
    except ValueError as exc:
        return str(exc)
    return None


def test_reference_moe_checks_every_rank():
    msgs = dist_util.run(2, _bad_ids_on_one_rank_worker, timeout=120)
    assert all(m is not None and "ranks [1]" in m and "topk_idx" in m for m in msgs), msgs
