"""EPBuffer.dispatch / combine against the oracle, on CPU ranks (gloo, Triton interpreter) and GPUs.

Every configuration runs several calls on one buffer (uniform, skewed, sparse routing, then the
first call's inputs again for determinism), with ragged T per rank including 0 and max_tokens.
Per local expert: counts, offsets/layout, the multiset of received rows (bit-exact: bf16 values,
or fp8 bytes and scales), then combine of a known expert function against the oracle (exact on
integer data, a bf16 tolerance on random data). Outputs are NaN-poisoned after each call.
"""
from __future__ import annotations

import dataclasses
import itertools
import time

import pytest
import torch

import dist_util
from ep_cases import DTYPES, FP8, Case, make_buffer, make_inputs, matrix_worker, run_calls

RANKS = [1, 2, 3, 4]
KS = [1, 2, 8]
LOCAL_EXPERTS = [1, 2, 4]


def matrix_cases(R: int, dtype: str, full: bool = False):
    """A covering design: every (layout, alignment) for the dtype, with K, experts per rank and the
    data kind rotating so each R x dtype sees every K, several E and both data kinds. At R=4 (the
    slowest on CPU; ``full`` on GPUs: test_matrix_gpu) half of them, rotating with the dtype so
    that the three dtypes together reach every (layout, alignment)."""
    d = list(DTYPES).index(dtype)
    cases = []
    for i, (layout, align) in enumerate(itertools.product(["masked", "packed"], [1, 16])):
        if R == 4 and not full and (i + d) % 4 not in (0, 1):
            continue
        K = KS[(i + R + d) % 3]
        EL = LOCAL_EXPERTS[(i + 2 * d + R) % 3]
        E = EL * R
        data = "tagged" if (i + d) % 2 == 0 else "random"
        cases.append(Case(R=R, E=E, K=K, dtype=dtype, layout=layout, align=align, data=data, seed=10 * R + i + 100 * d))
    return cases


def edge_cases(R: int):
    """Sizes and sequences the rotation does not reach."""
    long_calls = ("uniform", "none", "skewed", "sparse", "uniform", "repeat")
    return [
        Case(R=R, E=4 * R if 4 * R <= 16 else R * (16 // R), K=8, dtype="bf16", layout="packed", align=16, H=256, M=16,
             calls=long_calls, seed=1 + R),
        Case(R=R, E=R, K=2, dtype="fp8", layout="masked", H=144, M=3, data="random", seed=2 + R),  # partial fp8 block
        Case(R=R, E=2 * R, K=2, dtype="fp8pre", layout="packed", align=16, H=256, M=1, seed=3 + R),  # max_tokens 1
        Case(R=R, E=2 * R, K=1, dtype="fp8", layout="packed", align=1, H=256, M=16, calls=long_calls, seed=4 + R),
    ]


def _run_matrix(R, cases, backend="gloo", timeout=600):
    results = dist_util.run(R, matrix_worker, cases, 60.0, timeout=timeout, backend=backend)
    fails = [f for rank_fails, _ in results for f in rank_fails]
    assert not fails, f"{len(fails)} failed checks:\n" + "\n".join(fails[:40])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("R", RANKS)
def test_matrix(R, dtype):
    _run_matrix(R, matrix_cases(R, dtype))


@pytest.mark.parametrize("R", [1, 3])  # R=2 and 4 add no size the others miss (GPUs run them: test_matrix_gpu)
def test_edges(R):
    _run_matrix(R, edge_cases(R))


def _one_launch_worker(rank, world_size, cases):
    import moe_ep

    group = moe_ep.EPGroup()
    fails = []
    for case in cases:
        with make_buffer(group, case) as buf:
            # Both halves in one launch, as on a GPU. The interpreter runs its programs one after
            # another, which a one-rank launch survives: every wait there is for a chunk the
            # waiting program sent itself or for the header program 0 wrote first.
            buf.parts.tuning = buf.tuning.replace(fused=True)
            fails += run_calls(group, buf, case)
    return fails


def test_one_launch_at_one_rank():
    """The GPUs' one-launch dispatch and combine (a program receives its own chunks without a
    flag, ``SELF_SYNC``), on a CPU rank: every layout, with and without combine-time weights."""
    cases = [Case(R=1, E=4, K=2, dtype="fp8", layout="masked", data="random", seed=71),
             Case(R=1, E=2, K=8, dtype="bf16", layout="packed", align=16, seed=72, late_weights=True),
             Case(R=1, E=4, K=3, dtype="fp8", layout="rows", data="random", seed=73),
             Case(R=1, E=2, K=2, dtype="bf16", layout="rows", seed=74)]
    fails = [f for rank_fails in dist_util.run(1, _one_launch_worker, cases, timeout=600) for f in rank_fails]
    assert not fails, f"{len(fails)} failed checks:\n" + "\n".join(fails[:40])


def _combine_step(buf) -> int:
    """The tokens a step of combine's receive half takes by default on ``buf`` (in sub-blocks)."""
    from moe_ep.ops.buffer import combine_shape
    from moe_ep.core.workspace import COMBINE_STEP_TOKENS

    shape = combine_shape(buf.layout, buf.num_programs, buf.max_tokens * buf.topk, buf.device.type == "cuda")
    return shape.tokens or COMBINE_STEP_TOKENS


# The tuning variables that cut a chunk into sub-blocks: the launch shape's field each sets, and its
# default on a buffer (None: the whole chunk).
_KNOBS = {"MOE_EP_COMBINE_TOKENS": ("combine_recv_tokens", _combine_step),
          "MOE_EP_OWN_TOKENS": ("block_ts", None)}


def _sub_block_worker(rank, world_size, cases, fused, var, tokens):
    """The cases with a chunk's loops in sub-blocks of ``tokens`` tokens, set through ``var``
    (one of ``_KNOBS``, whose bad value must be refused first), or None: that loop's default."""
    import os

    import moe_ep

    attr, default = _KNOBS[var]
    group = moe_ep.EPGroup()
    fails = []
    try:
        os.environ[var] = "0"
        try:
            make_buffer(group, cases[0])
            fails.append(f"{var}=0 was accepted")
        except ValueError as e:
            if var not in str(e):
                fails.append(f"the error does not name {var}: {e}")
        os.environ.pop(var)
        for case in cases:
            if tokens:
                os.environ[var] = str(tokens)
            with make_buffer(group, case) as buf:
                step = tokens or default(buf)
                if not getattr(buf.tuning, attr) == step < buf.sizes.block_t:
                    fails.append(f"{case.name}: {attr} {getattr(buf.tuning, attr)} of chunks of {buf.sizes.block_t}, "
                                 f"expected {step}")
                buf.parts.tuning = buf.tuning.replace(fused=fused)
                fails += run_calls(group, buf, case)
            os.environ.pop(var, None)
    finally:
        os.environ.pop(var, None)
    return fails


@pytest.mark.parametrize("R", [1, 2])
def test_combine_in_token_sub_blocks(R):
    """Combine's receive half in sub-blocks of 2 tokens of its chunks of 4 (MOE_EP_COMBINE_TOKENS,
    the tuning knob), every layout, with combine-time weights; R=1 in one launch (its own tokens'
    pre-reduction with no flag), R=2 in two halves (the peer's rows through the workspace)."""
    cases = [Case(R=R, E=2 * R, K=2, dtype="fp8", layout="masked", M=16, data="random", seed=81),
             Case(R=R, E=4 * R, K=8, dtype="bf16", layout="packed", align=16, M=16, seed=82, late_weights=True),
             Case(R=R, E=2 * R, K=3, dtype="fp8", layout="rows", M=16, data="random", seed=83)]
    results = dist_util.run(R, _sub_block_worker, cases, R == 1, "MOE_EP_COMBINE_TOKENS", 2, timeout=600)
    fails = [f for rank_fails in results for f in rank_fails]
    assert not fails, f"{len(fails)} failed checks:\n" + "\n".join(fails[:40])


@pytest.mark.parametrize("R", [1, 2])
def test_own_rows_in_token_sub_blocks(R):
    """Dispatch's own rows (straight from x) in sub-blocks of 2 tokens of chunks of 4
    (MOE_EP_OWN_TOKENS, the tuning knob): masked and packed store each token as K rows, fp8
    quantized in the kernel and bf16; R=1 in one launch, R=2 in two halves."""
    cases = [Case(R=R, E=2 * R, K=3, dtype="fp8", layout="masked", M=16, data="random", seed=91),
             Case(R=R, E=4 * R, K=8, dtype="fp8", layout="packed", align=16, M=16, data="random", seed=92),
             Case(R=R, E=4 * R, K=2, dtype="bf16", layout="packed", M=16, seed=93)]
    results = dist_util.run(R, _sub_block_worker, cases, R == 1, "MOE_EP_OWN_TOKENS", 2, timeout=600)
    fails = [f for rank_fails in results for f in rank_fails]
    assert not fails, f"{len(fails)} failed checks:\n" + "\n".join(fails[:40])


def _column_major_worker(rank, world_size, cases):
    import moe_ep

    group = moe_ep.EPGroup()
    fails = []
    for case in cases:
        with make_buffer(group, case) as buf:
            s = buf.parts.memory.expert_scales
            cap, nb = buf.sizes.capacity, buf.sizes.num_scale_blocks
            if tuple(s.shape) != (case.E // case.R, cap, nb) or s.stride() != (nb * cap, 1, cap):
                fails.append(f"[{case.name}] expert_scales {list(s.shape)} strides {s.stride()}, expected "
                             f"[{case.E // case.R}, {cap}, {nb}] strides ({nb * cap}, 1, {cap})")
            fails += run_calls(group, buf, case)
            if buf.parts.memory.expert_scales.data_ptr() != s.data_ptr():
                fails.append(f"[{case.name}] expert_scales moved")
    return fails


@pytest.mark.parametrize("R", [1, 2])
def test_column_major_scales(R):
    """``column_major_scales=True`` (masked fp8): ``expert_scales`` is a column-major view (DeepEP's
    low-latency layout) whose values are the oracle's, for fp8 quantized in the kernel and
    pre-quantized, a rank's own rows (from x) and a peer's (through the workspace), three scale
    blocks the last of them partial (H = 320), with and without receive hooks."""
    cases = [Case(R=R, E=2 * R, K=2, dtype="fp8", layout="masked", H=320, M=6, data="random", seed=71, cm_scales=True),
             Case(R=R, E=4 * R, K=3, dtype="fp8pre", layout="masked", H=320, M=5, seed=72, cm_scales=True,
                  hooks=True)]
    results = dist_util.run(R, _column_major_worker, cases, timeout=600)
    fails = [f for rank_fails in results for f in rank_fails]
    assert not fails, f"{len(fails)} failed checks:\n" + "\n".join(fails[:40])


def _mixed_scales_worker(rank, world_size, case):
    import moe_ep

    group = moe_ep.EPGroup()
    mine = dataclasses.replace(case, cm_scales=rank == 0)  # rank 0 column-major, rank 1 row-major
    with make_buffer(group, mine) as buf:
        s = buf.parts.memory.expert_scales
        if (s.stride(1) == 1) != (rank == 0):
            return [f"rank {rank}: expert_scales strides {s.stride()}"]
        return run_calls(group, buf, mine)


def test_column_major_scales_is_local():
    """``column_major_scales`` is each rank's own choice (no peer writes another's scales, so
    it is not agreed at construction): with rank 0 column-major and rank 1 row-major, both
    ranks' dispatches and combines match the oracle."""
    case = Case(R=2, E=4, K=2, dtype="fp8", layout="masked", H=320, M=6, data="random", seed=74)
    results = dist_util.run(2, _mixed_scales_worker, case, timeout=600)
    fails = [f for rank_fails in results for f in rank_fails]
    assert not fails, f"{len(fails)} failed checks:\n" + "\n".join(fails[:40])


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 2])
def test_column_major_scales_gpu(R):
    """``test_column_major_scales`` on a GPU (its kernels as sm_90 compiles them), plus the decode
    preset's shape (T = 128, H = 7168, K = 8: 56 scale blocks, the layout DeepEP's low-latency
    dispatch returns)."""
    dist_util.need_gpu()
    cases = [Case(R=R, E=2 * R, K=2, dtype="fp8", layout="masked", H=320, M=6, data="random", seed=71, cm_scales=True),
             Case(R=R, E=4 * R, K=3, dtype="fp8pre", layout="masked", H=320, M=5, seed=72, cm_scales=True,
                  hooks=True),
             Case(R=R, E=32 * R, K=8, dtype="fp8", layout="masked", H=7168, M=128, data="random", seed=73,
                  cm_scales=True)]
    results = dist_util.run(R, _column_major_worker, cases, timeout=900, backend=dist_util.gpu_backend(R))
    fails = [f for rank_fails in results for f in rank_fails]
    assert not fails, f"{len(fails)} failed checks:\n" + "\n".join(fails[:40])


def test_matrix_covers_the_contract():
    """The rotation really reaches every value the issue lists."""
    cases = [c for R in RANKS for d in DTYPES for c in matrix_cases(R, d)] + [c for R in (1, 3) for c in edge_cases(R)]
    assert {c.R for c in cases} == set(RANKS)
    assert {c.K for c in cases} == set(KS)
    every = {("masked", 1), ("masked", 16), ("packed", 1), ("packed", 16)}
    for R in RANKS:
        for d in DTYPES:
            mine = matrix_cases(R, d)
            assert {c.K for c in mine} == set(KS) or R == 4, (R, d)
            assert {(c.layout, c.align) for c in mine} == every or R == 4
            assert {c.data for c in mine} == {"tagged", "random"}
        assert len({c.E for d in DTYPES for c in matrix_cases(R, d)}) >= 2 or R == 1
        assert {(c.layout, c.align) for d in DTYPES for c in matrix_cases(R, d)} == every
        assert {c.K for d in DTYPES for c in matrix_cases(R, d)} == set(KS)
    for c in cases:
        assert c.E % c.R == 0 and c.E <= 16 and c.M <= 16
        Ts = [T for call in range(len(c.calls)) for T in c.token_counts(call)]
        assert 0 in Ts and c.M in Ts
        assert len(set(c.calls) - {"repeat"}) >= 3 and "repeat" in c.calls


# ---------------------------------------------------------------------------- GPUs
GPU_RANKS = [1, 2, 4, 8]


@pytest.mark.gpu
@pytest.mark.parametrize("R", GPU_RANKS)
def test_matrix_gpu(R):
    """R ranks on the GPUs there are (sharing them when fewer than R: CUDA IPC node memory)."""
    dist_util.need_gpu()
    cases = [c for d in DTYPES for c in matrix_cases(min(R, 4), d, full=True)] + edge_cases(min(R, 4))
    cases = [Case(**{**c.__dict__, "R": R, "E": c.E // c.R * R if c.E // c.R * R <= 64 else R}) for c in cases]
    _run_matrix(R, cases, backend=dist_util.gpu_backend(R), timeout=1200)


@pytest.mark.gpu
@pytest.mark.parametrize("layout,dtype,warps", [("packed", "fp8", "16"), ("packed", "bf16", ""), ("masked", "fp8", "32")])
def test_register_budget_gives_the_same_bits_gpu(layout, dtype, warps, monkeypatch):
    """A register budget changes how ptxas allocates registers, not what the kernels compute: the
    expert layout, its scales and combine's output with MOE_EP_MAXNREG=full equal those with none
    bit for bit (R=1, hidden 7168, 1024 tokens, 32 programs; a third of the tokens with one
    selection -1; packed there has the combine's budget by default). Ranks may then set it
    differently."""
    import moe_ep

    dist_util.need_gpu()
    T, H, E, K = 1024, 7168, 64, 8
    group = moe_ep.EPGroup()
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(group.device)
    idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    idx[::3, -1] = -1
    idx, w = idx.to(group.device), torch.rand(T, K, generator=g).to(group.device)
    monkeypatch.setenv("MOE_EP_COMBINE_WARPS", warps)
    got = []
    for budget in ("none", "full"):
        monkeypatch.setenv("MOE_EP_MAXNREG", budget)
        dt = FP8 if dtype == "fp8" else torch.bfloat16
        with moe_ep.EPBuffer(group, E, H, T, K, dispatch_dtype=dt, layout=layout, num_programs=32) as buf:
            h = buf.dispatch(x, idx, w)
            counts = h.expert_counts.cpu()
            def valid(t):  # the rows dispatch wrote, as bytes
                if layout == "masked":
                    return torch.cat([t[e, :int(n)] for e, n in enumerate(counts)]).view(torch.uint8).cpu()
                return t[:int(h.expert_offsets[-1])].view(torch.uint8).cpu()

            y = (torch.randn(h.expert_x.shape, generator=torch.Generator().manual_seed(12)) / 4).to(torch.bfloat16)
            got.append({"expert rows": valid(h.expert_x),
                        "expert scales": valid(h.expert_scales) if h.expert_scales is not None else torch.empty(0),
                        "combine output": buf.combine(y.to(group.device), h).view(torch.int16).cpu()})
    for what in got[0]:
        a, b = got[0][what], got[1][what]
        assert torch.equal(a, b), f"{what}: {(a != b).sum().item()} bytes or elements differ"


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 2])
def test_combine_in_token_sub_blocks_gpu(R):
    """Combine's receive half in sub-blocks on the GPU (ranks sharing it when fewer than R), at
    prefill chunk sizes, with 4096 tokens (chunks of 16) in the default steps: packed on every
    SM and masked on 32 programs in steps of 8 tokens, packed on 32 programs in steps of 4 with
    32 warps and a register budget (``combine_shape``); the rows layout on 2 programs (chunks of
    128) in steps of 2 by the knob."""
    dist_util.need_gpu()
    cases = [Case(R=R, E=2 * R, K=2, dtype="fp8", layout="masked", M=4096, programs=32, data="random", seed=84),
             Case(R=R, E=4 * R, K=8, dtype="bf16", layout="packed", align=16, M=4096, seed=85, late_weights=True),
             Case(R=R, E=4 * R, K=8, dtype="fp8", layout="packed", M=4096, programs=32, data="random", seed=87)]
    rows = [Case(R=R, E=2 * R, K=3, dtype="fp8", layout="rows", M=256, programs=2, data="random", seed=86)]
    backend = dist_util.gpu_backend(R)
    knob = "MOE_EP_COMBINE_TOKENS"
    results = (dist_util.run(R, _sub_block_worker, cases, R == 1, knob, None, timeout=900, backend=backend)
               + dist_util.run(R, _sub_block_worker, rows, R == 1, knob, 2, timeout=900, backend=backend))
    fails = [f for rank_fails in results for f in rank_fails]
    assert not fails, f"{len(fails)} failed checks:\n" + "\n".join(fails[:40])


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 2, 4])
def test_rows_matrix_gpu(R):
    """The rows layout's CPU matrix (tests/test_rows.py) on the GPUs there are (ranks sharing them
    when fewer than R: CUDA IPC node memory), plus prefill-sized cases (routing histogram), two
    of them on 4 programs: chunks of up to 96 tokens, whose own rows go in sub-blocks of 16."""
    from test_rows import rows_cases

    dist_util.need_gpu()
    cases = rows_cases(R) + [Case(R=R, E=8 * R, K=8, dtype="fp8", layout="rows", H=512, M=384, data="random",
                                  calls=("uniform", "skewed", "repeat"), seed=500 + R)]
    cases += [Case(R=R, E=8 * R, K=8, dtype=d, layout="rows", H=1024, M=384, data="random", programs=4,
                   calls=("uniform", "sparse", "repeat"), seed=520 + R) for d in ("fp8", "bf16")]
    _run_matrix(R, cases, backend=dist_util.gpu_backend(R), timeout=1200)


def _graph_worker(rank, world_size, case_kw, node_size=None):
    """Captures dispatch -> expert -> combine into a CUDA graph once, replays with new routing.
    ``node_size`` < R: other nodes through the proxy (in a gloo-cuda pool ranks may share a GPU).
    Rows layout: combine also hands back weights (``rows_wy``), whose sums are checked."""
    import moe_ep
    from ep_cases import _check_weights, check_combine, check_dispatch, expert_fn_for, reference_for, rows_wy
    from moe_ep.testing.reference import moe_local, reference_moe, rows_combine_local

    group = moe_ep.EPGroup(node_size=node_size)
    dev = group.device
    fails = []
    # Fixed T per rank (shapes are static in a graph); routing changes per replay.
    calls = ("uniform", "skewed", "sparse", "uniform", "none", "skewed")
    case = Case(**{**case_kw, "calls": calls})
    first = rank * (case.E // case.R)
    fn = expert_fn_for(case)
    dt = DTYPES[case.dtype]
    inputs = [make_inputs(case, c)[rank] for c in range(len(calls))]
    T = case.M
    pad = [_pad_inputs(i, T, case) for i in inputs]
    buf = make_buffer(group, case, 60.0)
    with buf:
        sx, sidx, sw = (pad[0][0].to(dev), pad[0][1].to(dev), pad[0][2].to(dev))
        ssc = pad[0][3].to(dev) if pad[0][3] is not None else None

        def step():
            h = buf.dispatch(sx, sidx, sw, x_scales=ssc) if ssc is not None else buf.dispatch(sx, sidx, sw)
            vals = h.expert_x.float()
            if h.expert_scales is not None:
                vals = vals * h.expert_scales.repeat_interleave(128, dim=-1)[..., :case.H]
            y = _expert_all_rows(fn, vals, h, case, first)
            if case.layout == "rows":
                return h, buf.combine(y, h, topk_weights=rows_wy(rank, h.recv_topk_idx, h.recv_topk_weights))
            return h, buf.combine(y, h)

        step()  # warm-up (compiles the kernels) outside the graph
        if case.graph_launch:  # a second call replays; the capture then meets the launch graph
            step()
            if not any(e.graph is not None for r in buf.calls.replays for e in r._entries.values()):
                fails.append(f"[graph {case.name} rank {rank}] no replay took a launch graph")
        from ep_cases import _table
        for e in range(case.E // case.R):  # expert constants on the device before capture (no host copies)
            for kind in ("offsets", "bias"):
                _table(kind, first + e, case.H, dev)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            h, out_w = step()
        if buf.sizes.recv_rows_mode == "per_call":  # packed, rows: no host read in a graph, the worst case
            if h.expert_x.shape[0] != buf.sizes.worst_rows:
                fails.append(f"[graph {case.name} rank {rank}] captured {case.layout} expert_x has "
                             f"{h.expert_x.shape[0]} rows, expected the worst case {buf.sizes.worst_rows}")
            case = dataclasses.replace(case, recv_rows="worst")  # (what check_dispatch holds the rows to)
        for c in range(len(calls)):
            x, idx, w, sc = pad[c]
            sx.copy_(x.to(dev)); sidx.copy_(idx.to(dev)); sw.copy_(w.to(dev))
            if ssc is not None:
                ssc.copy_(sc.to(dev))
            g.replay()
            torch.cuda.synchronize()
            where = f"[graph {case.name} rank {rank} replay {c} {calls[c]}]"
            ref = reference_for(group, case, sx, sidx, sw, ssc)
            f = check_dispatch(h, ref, case, where)
            fails += f
            exp = reference_moe(group, case.E, sx, sidx, sw, fn, x_scales=ssc, dispatch_dtype=dt)
            if case.layout == "rows":
                out, wout = out_w
                exp_w = rows_combine_local(case.E, case.R, sx, sidx, sw, lambda r, v, i, ww: rows_wy(r, i, ww),
                                           x_scales=ssc, dispatch_dtype=dt)
                if not f:
                    fails += _check_weights(wout, exp_w, case, where)
            else:
                out = out_w
            if not f:
                exp_abs = moe_local(case.E, sx, sidx, sw.abs(), lambda e, r: fn(e, r).abs(), x_scales=ssc,
                                    dispatch_dtype=dt)
                fails += check_combine(out, exp, exp_abs, T, case, where)
    return fails


def _pad_inputs(inp, T, case):
    """Inputs with exactly T tokens (extra tokens select no expert)."""
    n = inp.x.shape[0]
    x = torch.zeros(T, case.H, dtype=inp.x.dtype)
    x[:n] = inp.x
    idx = torch.full((T, case.K), -1, dtype=torch.int64)
    idx[:n] = inp.topk_idx
    w = torch.ones(T, case.K)
    w[:n] = inp.topk_weights
    sc = None
    if inp.x_scales is not None:
        sc = torch.ones(T, inp.x_scales.shape[1])
        sc[:n] = inp.x_scales
    return x.contiguous(), idx.contiguous(), w.contiguous(), sc


def _expert_all_rows(fn, vals, h, case, first):
    """The expert function on every row of the layout (no host sync; invalid rows are ignored)."""
    EL = case.E // case.R
    if case.layout == "masked":
        return torch.stack([fn(first + e, vals[e]) for e in range(EL)]).to(torch.bfloat16)
    if case.layout == "rows":  # each row reduced over its local experts (rows past num_recv: ignored)
        ids, w = h.recv_topk_idx, h.recv_topk_weights
        y = torch.zeros_like(vals)
        for e in range(EL):
            fe = fn(first + e, vals)
            for k in range(case.K):
                y += torch.where((ids[:, k] == e).unsqueeze(1), w[:, k:k + 1] * fe, 0.0)
        return y.to(torch.bfloat16)
    rows = torch.arange(vals.shape[0], device=vals.device)
    owner = (torch.bucketize(rows, h.expert_offsets[1:].long(), right=True)).clamp(max=EL - 1)
    y = torch.zeros_like(vals)
    for e in range(EL):
        y = torch.where((owner == e).unsqueeze(1), fn(first + e, vals), y)
    return y.to(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 2, 4])
@pytest.mark.parametrize("kw", [dict(dtype="fp8", layout="masked", K=8, data="random"),
                                dict(dtype="bf16", layout="packed", align=16, K=2, data="tagged"),
                                dict(dtype="fp8", layout="rows", K=8, data="tagged"),
                                dict(dtype="bf16", layout="rows", K=3, data="random")],
                         ids=["fp8-masked", "bf16-packed", "fp8-rows", "bf16-rows"])
def test_cuda_graph_replay(R, kw):
    dist_util.need_gpu()
    case_kw = dict(R=R, E=4 * R, H=256, M=16, seed=77, **kw)
    results = dist_util.run(R, _graph_worker, case_kw, timeout=600, backend=dist_util.gpu_backend(R))
    fails = [f for r in results for f in r]
    assert not fails, "\n".join(fails[:40])


# ---------------------------------------------------------------------------- input validation
def _bad_dispatch_calls(buf, case, log):
    """Every kind of bad dispatch / combine argument, on one rank, on a usable buffer."""
    T, H, K, M = 4, case.H, case.K, case.M
    fp8 = DTYPES[case.dtype] == FP8
    x = torch.zeros(T, H, dtype=torch.bfloat16)
    idx = torch.zeros(T, K, dtype=torch.int64)
    w = torch.ones(T, K)
    kw = {}
    if fp8 and case.dtype == "fp8pre":
        from moe_ep.core.fp8 import quantize_fp8

        x, s = quantize_fp8(x)
        kw = {"x_scales": s}
    d = buf.dispatch
    tag = f"[{case.dtype} {case.layout}]"
    if not fp8 or case.dtype == "fp8":
        dist_util.expect_error(log, f"{tag} x float32", lambda: d(x.float(), idx, w), ["x"])
        dist_util.expect_error(log, f"{tag} x float16", lambda: d(x.half(), idx, w), ["x"])
    dist_util.expect_error(log, f"{tag} x 1-D", lambda: d(x.flatten(), idx, w, **kw), ["x"])
    dist_util.expect_error(log, f"{tag} x 3-D", lambda: d(x.unsqueeze(0), idx, w, **kw), ["x"])
    dist_util.expect_error(log, f"{tag} x wrong hidden", lambda: d(torch.zeros(T, H + 16, dtype=x.dtype), idx, w, **kw), ["x", "hidden"])
    dist_util.expect_error(log, f"{tag} x non-contiguous",
            lambda: d(torch.zeros(T, 2 * H, dtype=x.dtype)[:, ::2], idx, w, **kw), ["x", "contiguous"])
    dist_util.expect_error(log, f"{tag} x on meta device", lambda: d(x.to("meta"), idx, w, **kw), ["x"])
    dist_util.expect_error(log, f"{tag} x not a tensor", lambda: d(x.tolist(), idx, w, **kw), ["x"])
    xb = torch.zeros(M + 1, H, dtype=x.dtype)
    kwb = {"x_scales": torch.ones(M + 1, kw["x_scales"].shape[1])} if kw else {}
    dist_util.expect_error(log, f"{tag} T > max_tokens",
            lambda: d(xb, torch.zeros(M + 1, K, dtype=torch.int64), torch.ones(M + 1, K), **kwb), ["max_tokens"])
    dist_util.expect_error(log, f"{tag} topk_idx float", lambda: d(x, idx.float(), w, **kw), ["topk_idx"])
    dist_util.expect_error(log, f"{tag} topk_idx int16", lambda: d(x, idx.short(), w, **kw), ["topk_idx"])
    dist_util.expect_error(log, f"{tag} topk_idx K+1 columns",
            lambda: d(x, torch.zeros(T, K + 1, dtype=torch.int64), torch.ones(T, K + 1), **kw), ["topk", "topk_idx"])
    dist_util.expect_error(log, f"{tag} topk_idx K+1 columns (weights right)",
            lambda: d(x, torch.zeros(T, K + 1, dtype=torch.int64), w, **kw), ["topk", "topk_idx"])
    dist_util.expect_error(log, f"{tag} topk_idx T mismatch", lambda: d(x, idx[:T - 1].contiguous(), w, **kw), ["topk_idx"])
    dist_util.expect_error(log, f"{tag} topk_idx non-contiguous",
            lambda: d(x, torch.zeros(T, 2 * K, dtype=torch.int64)[:, ::2], w, **kw), ["topk_idx"])
    dist_util.expect_error(log, f"{tag} topk_idx on meta", lambda: d(x, idx.to("meta"), w, **kw), ["topk_idx"])
    dist_util.expect_error(log, f"{tag} topk_weights bf16", lambda: d(x, idx, w.bfloat16(), **kw), ["topk_weights"])
    dist_util.expect_error(log, f"{tag} topk_weights float64", lambda: d(x, idx, w.double(), **kw), ["topk_weights"])
    dist_util.expect_error(log, f"{tag} topk_weights K+1",
            lambda: d(x, idx, torch.ones(T, K + 1), **kw), ["topk_weights"])
    dist_util.expect_error(log, f"{tag} topk_weights T mismatch", lambda: d(x, idx, w[:T - 1].contiguous(), **kw), ["topk_weights"])
    dist_util.expect_error(log, f"{tag} topk_weights non-contiguous",
            lambda: d(x, idx, torch.ones(T, 2 * K)[:, ::2], **kw), ["topk_weights"])
    dist_util.expect_error(log, f"{tag} topk_weights on meta", lambda: d(x, idx, w.to("meta"), **kw), ["topk_weights"])
    if case.dtype == "bf16":
        from moe_ep.core.fp8 import quantize_fp8

        q, s = quantize_fp8(x)
        dist_util.expect_error(log, f"{tag} x_scales with a bf16 buffer", lambda: d(q, idx, w, x_scales=s), ["x_scales", "x"])
        dist_util.expect_error(log, f"{tag} x_scales with bf16 x on a bf16 buffer", lambda: d(x, idx, w, x_scales=s),
                ["x_scales", "x"])
    if case.dtype == "fp8pre":
        s = kw["x_scales"]
        nb = s.shape[1]
        dist_util.expect_error(log, f"{tag} fp8 x without x_scales", lambda: d(x, idx, w), ["x_scales", "x"])
        dist_util.expect_error(log, f"{tag} x_scales float16", lambda: d(x, idx, w, x_scales=s.half()), ["x_scales"])
        dist_util.expect_error(log, f"{tag} x_scales wrong blocks", lambda: d(x, idx, w, x_scales=torch.ones(T, nb + 1)), ["x_scales"])
        dist_util.expect_error(log, f"{tag} x_scales T mismatch", lambda: d(x, idx, w, x_scales=torch.ones(T + 1, nb)), ["x_scales"])
        dist_util.expect_error(log, f"{tag} x_scales non-contiguous",
                lambda: d(x, idx, w, x_scales=torch.ones(T, 2 * nb)[:, ::2]), ["x_scales"])
        dist_util.expect_error(log, f"{tag} x_scales on meta", lambda: d(x, idx, w, x_scales=s.to("meta")), ["x_scales"])
        dist_util.expect_error(log, f"{tag} x_scales with bf16 x",
                lambda: d(torch.zeros(T, H, dtype=torch.bfloat16), idx, w, x_scales=s), ["x_scales", "x"])


def _bad_combine_calls(buf, h, log, tag):
    shape = tuple(h.expert_x.shape)
    c = buf.combine
    y = torch.zeros(shape, dtype=torch.bfloat16)
    dist_util.expect_error(log, f"{tag} expert_y float16", lambda: c(y.half(), h), ["expert_y"])
    dist_util.expect_error(log, f"{tag} expert_y wrong shape",
                           lambda: c(torch.zeros((shape[0] + 1,) + shape[1:], dtype=torch.bfloat16), h), ["expert_y"])
    dist_util.expect_error(log, f"{tag} expert_y wrong hidden",
            lambda: c(torch.zeros(shape[:-1] + (shape[-1] + 16,), dtype=torch.bfloat16), h), ["expert_y"])
    if shape[0] > 0:  # (a packed layout sized per call may have no rows: an empty tensor is contiguous)
        dist_util.expect_error(log, f"{tag} expert_y non-contiguous",
                lambda: c(torch.zeros(shape[:-1] + (2 * shape[-1],), dtype=torch.bfloat16)[..., ::2], h), ["expert_y"])
    dist_util.expect_error(log, f"{tag} handle not a dispatch result", lambda: c(y, object()), ["handle"])


def _validation_worker(rank, world_size):
    """Bad arguments on rank 0 only, then a correct round trip on every rank: a bad call must raise
    before anything reaches a peer (else the next call's flags would not match)."""
    import moe_ep

    group = moe_ep.EPGroup()
    R = world_size
    log = []
    # Construction (every rank, before any collective).
    mk = lambda **kw: moe_ep.EPBuffer(group, **{**dict(num_experts=2 * R, hidden=128, max_tokens=8, topk=2), **kw})
    if R > 1:
        dist_util.expect_error(log, "E % R != 0", lambda: mk(num_experts=2 * R + 1), ["num_experts"])
    dist_util.expect_error(log, "hidden % 16 != 0", lambda: mk(hidden=100), ["hidden"])
    dist_util.expect_error(log, "layout unknown", lambda: mk(layout="ragged"), ["layout"])
    dist_util.expect_error(log, "dispatch_dtype float16", lambda: mk(dispatch_dtype=torch.float16), ["dispatch_dtype"])
    dist_util.expect_error(log, "dispatch_dtype float32", lambda: mk(dispatch_dtype=torch.float32), ["dispatch_dtype"])
    dist_util.expect_error(log, "combine_dtype int32", lambda: mk(combine_dtype=torch.int32), ["combine_dtype"])
    dist_util.expect_error(log, "expert_alignment 0", lambda: mk(expert_alignment=0), ["expert_alignment"])
    dist_util.expect_error(log, "num_experts 0", lambda: mk(num_experts=0), ["num_experts"])
    dist_util.expect_error(log, "topk 0", lambda: mk(topk=0), ["topk", "topk_idx"])
    dist_util.expect_error(log, "group not an EPGroup", lambda: moe_ep.EPBuffer(None, 2 * R, 128, 8, 2), ["group"])
    fails = []
    # One checked call after the rejected ones shows nothing reached a peer (the matrix covers routing).
    for case in (Case(R=R, E=2 * R, K=2, dtype="bf16", layout="masked", calls=("skewed",)),
                 Case(R=R, E=2 * R, K=8, dtype="fp8pre", layout="packed", align=16, calls=("sparse",)),
                 Case(R=R, E=4 * R, K=2, dtype="fp8", layout="packed", calls=("uniform",))):
        buf = make_buffer(group, case, 20.0)
        with buf:
            if rank == 0:
                _bad_dispatch_calls(buf, case, log)
            fails += run_calls(group, buf, case)
            # Combine validation needs a live handle: one more (correct) dispatch on every rank.
            inp = make_inputs(case, 0)[rank]
            h = buf.dispatch(inp.x, inp.topk_idx, inp.topk_weights, x_scales=inp.x_scales) \
                if inp.x_scales is not None else buf.dispatch(inp.x, inp.topk_idx, inp.topk_weights)
            if rank == 0:
                _bad_combine_calls(buf, h, log, f"[{case.dtype} {case.layout}]")
            y = torch.zeros(h.expert_x.shape, dtype=torch.bfloat16)
            out = buf.combine(y, h)
            if out.shape != (inp.x.shape[0], case.H) or (out != 0).any():
                fails.append(f"[{case.name}] combine of zero expert outputs after bad calls is not 0")
            if case.layout == "masked":
                # A float32 out gets the same sum unrounded: rounding it gives the bf16 result, and
                # with two owners of every token (R = 2: experts 0 and E-1) some sums are not bf16 values.
                g = torch.Generator().manual_seed(rank)
                h = buf.dispatch(torch.randn(4, case.H, generator=g).to(torch.bfloat16),
                                 torch.tensor([[0, case.E - 1]] * 4), torch.rand(4, 2, generator=g))
                y = torch.randn(h.expert_x.shape, generator=g).to(torch.bfloat16)
                o16 = buf.combine(y, h)
                o32 = buf.combine(y, h, out=torch.empty(o16.shape, dtype=torch.float32))
                if o32.dtype != torch.float32 or not torch.equal(o32.to(torch.bfloat16), o16):
                    fails.append(f"[{case.name}] combine(out=float32) is not the bf16 result unrounded")
                elif R > 1 and bool((o32 == o32.to(torch.bfloat16).float()).all()):
                    fails.append(f"[{case.name}] combine(out=float32) returned only bf16 values (rounded?)")
    return log, fails


@pytest.mark.parametrize("R", [1, 2])
def test_validation(R):
    results = dist_util.run(R, _validation_worker, timeout=600)
    log = [m for lg, _ in results for m in lg]
    fails = [f for _, fl in results for f in fl]
    assert not log, f"{len(log)} validation problems:\n" + "\n".join(log)
    assert not fails, "round trip after rejected calls failed:\n" + "\n".join(fails[:40])


def _bad_ids_worker(rank, world_size):
    """Out-of-range expert ids raise ValueError naming topk_idx (at dispatch, or at the latest at
    the buffer's next synchronize on CPU) and never write out of bounds."""
    import moe_ep

    group = moe_ep.EPGroup()
    log = []
    E, H, M, K = 4, 128, 8, 2
    for bad in (E, E + 100, -2, -1000):
        for layout in ("masked", "packed"):
            buf = moe_ep.EPBuffer(group, E, H, M, K, layout=layout, timeout_s=10)
            with buf:
                x = torch.ones(3, H, dtype=torch.bfloat16)
                idx = torch.tensor([[0, 1], [2, bad], [3, -1]], dtype=torch.int64)
                w = torch.ones(3, K)

                def call():
                    buf.dispatch(x, idx, w)
                    if hasattr(buf, "synchronize"):
                        buf.synchronize()

                dist_util.expect_error(log, f"expert id {bad} ({layout})", call, ["topk_idx"], types=(ValueError,))
    return log


def test_bad_expert_ids():
    log = dist_util.run(1, _bad_ids_worker, timeout=300)[0]
    assert not log, "\n".join(log)


# ---------------------------------------------------------------------------- deadlines
def _timeout_worker(rank, world_size, phase, timeout_s):
    """Rank R-1 never calls ``phase``; the others must raise CommTimeoutError in about timeout_s."""
    import moe_ep

    group = moe_ep.EPGroup()
    silent = world_size - 1
    case = Case(R=world_size, E=2 * world_size, K=2, calls=("uniform",), M=4)
    inp = make_inputs(case, 0)[rank]
    dev = group.device
    x, idx, w = inp.x.to(dev), inp.topk_idx.to(dev), inp.topk_weights.to(dev)
    res = {"rank": rank}
    buf = moe_ep.EPBuffer(group, case.E, case.H, case.M, case.K, timeout_s=timeout_s)
    try:
        if phase == "combine":
            h = buf.dispatch(x, idx, w)
        if rank != silent:
            t0 = time.monotonic()
            try:
                if phase == "dispatch":
                    buf.dispatch(x, idx, w)
                else:
                    buf.combine(torch.zeros(h.expert_x.shape, dtype=torch.bfloat16, device=dev), h)
                if hasattr(buf, "synchronize"):
                    buf.synchronize()
                res["error"] = None
            except moe_ep.CommTimeoutError as exc:
                res["error"] = dict(rank=exc.rank, peer=exc.peer, phase=exc.phase, msg=str(exc))
            except Exception as exc:  # noqa: BLE001
                res["error"] = dict(other=f"{type(exc).__name__}: {exc}")
            res["elapsed"] = time.monotonic() - t0
    finally:
        group.barrier()  # the silent rank waits here until the others have given up
        buf.close()
    return res


def _rank_of(rank, world_size):
    return rank


@pytest.mark.gpu
@pytest.mark.parametrize("phase", ["dispatch", "combine"])
def test_timeout_gpu(phase):
    """On GPUs the kernel itself gives up (globaltimer deadline) and the host raises at synchronize()."""
    R, timeout_s, slack = 2, 3.0, 20.0
    dist_util.need_gpu()
    results = dist_util.run(R, _timeout_worker, phase, timeout_s, timeout=120, backend=dist_util.gpu_backend(R))
    for res in results[:-1]:
        err = res["error"]
        assert err is not None and "other" not in err, (res["rank"], err)
        assert (err["rank"], err["peer"], err["phase"]) == (res["rank"], R - 1, phase), err
        assert timeout_s * 0.9 <= res["elapsed"] <= timeout_s + slack, res


@pytest.mark.parametrize("phase", ["dispatch", "combine"])
def test_timeout(phase):
    R, timeout_s, slack = 3, 3.0, 20.0
    dist_util.run(R, _rank_of)  # the pool is up: what is timed below is the call alone
    t0 = time.monotonic()
    results = dist_util.run(R, _timeout_worker, phase, timeout_s, timeout=120)
    # every rank, the silent one included (it waits for the others to give up), is back in time
    assert time.monotonic() - t0 < timeout_s + slack
    for res in results[:-1]:
        err = res["error"]
        assert err is not None, f"rank {res['rank']}: {phase} returned although rank {R - 1} never called it"
        assert "other" not in err, f"rank {res['rank']}: expected CommTimeoutError, got {err['other']}"
        assert (err["rank"], err["peer"], err["phase"]) == (res["rank"], R - 1, phase), err
        assert timeout_s * 0.9 <= res["elapsed"] <= timeout_s + slack, res
    # The pool (and a fresh buffer) still work afterwards.
    _run_matrix(R, [Case(R=R, E=R, K=2, M=4, calls=("uniform", "sparse", "repeat"), seed=99)], timeout=300)
