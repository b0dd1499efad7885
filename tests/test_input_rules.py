"""The input rules of README ("Input rules"), each against the oracle on CPU ranks:

- combine does not read the caller's ``topk_idx`` again: the caller may reuse it after dispatch;
- non-finite values: bf16 dispatch carries them bit for bit, an fp8 block holding one becomes NaN
  (scale and bytes, as ``moe_ep.core.fp8`` defines), and combine propagates them;
- a masked-layout overflow raises ``CapacityError`` on the receiving rank and on the senders
  (naming the receiving rank and expert), never a timeout.
"""
from __future__ import annotations

import pytest
import torch

import dist_util

FP8 = torch.float8_e4m3fn


def _inputs(rank: int, T: int, H: int, E: int, K: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = (torch.randn(T, H, generator=g) * 4).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[1::4, -1] = -1
    w = torch.rand(T, K, generator=g)
    return x, idx, w


def _expert(e: int, rows: torch.Tensor) -> torch.Tensor:
    return rows * (1.0 + 0.25 * e) - e


def _apply_experts(h, buf, first: int) -> torch.Tensor:
    """expert_y for ``_expert`` from a dispatch result (masked or packed), bf16."""
    from moe_ep.core.fp8 import dequantize_fp8

    y = torch.zeros(h.expert_x.shape, dtype=torch.bfloat16, device=h.expert_x.device)
    for e in range(buf.num_local_experts):
        c = int(h.expert_counts[e])
        o = 0 if h.expert_offsets is None else int(h.expert_offsets[e])
        sl = (e, slice(0, c)) if h.expert_offsets is None else (slice(o, o + c),)
        rows = h.expert_x[sl]
        vals = rows.float() if h.expert_scales is None else dequantize_fp8(rows, h.expert_scales[sl])
        y[sl] = _expert(first + e, vals).to(torch.bfloat16)
    return y


def _close(out: torch.Tensor, want: torch.Tensor) -> bool:
    """Two bf16 roundings (the owners' partial sums, then the output) against a float32 oracle;
    non-finite values must be where the oracle has them (NaN for NaN, inf of the same sign)."""
    out, want = out.float().cpu(), want.float().cpu()
    fin = torch.isfinite(want)
    same = torch.equal(out.isnan(), want.isnan()) and torch.equal(out.isinf(), want.isinf()) and \
        torch.equal(out[want.isinf()], want[want.isinf()])
    return same and bool(((out[fin] - want[fin]).abs() <= 2e-2 * want[fin].abs() + 1e-2).all())


# ---------------------------------------------------------------------------- topk_idx reuse
def _reuse_worker(rank, world_size, node_size, layout, dtype):
    import moe_ep
    from moe_ep.testing.reference import reference_moe

    group = moe_ep.EPGroup(node_size=node_size)
    E, H, M, K = 2 * world_size, 128, 8, 2
    x, idx, w = (t.to(group.device) for t in _inputs(rank, 6, H, E, K, seed=1))
    keep = idx.clone()
    want = reference_moe(group, E, x, keep, w, _expert, dispatch_dtype=dtype)
    res = {}
    with moe_ep.EPBuffer(group, E, H, M, K, dispatch_dtype=dtype, layout=layout, timeout_s=20) as buf:
        first = rank * buf.num_local_experts
        for how in ("fill -1", "other experts"):
            h = buf.dispatch(x, idx, w)
            y = _apply_experts(h, buf, first)
            # The caller reuses its routing tensor before combine (the next micro-batch's router).
            idx.copy_(torch.full_like(idx, -1) if how == "fill -1" else (keep + 1) % E)
            out = buf.combine(y, h)
            res[how] = _close(out, want)
            idx.copy_(keep)
    return res


@pytest.mark.parametrize("node_size,layout,dtype", [(2, "masked", torch.bfloat16), (2, "packed", FP8),
                                                     (1, "packed", torch.bfloat16)],
                         ids=["node-masked-bf16", "node-packed-fp8", "internode-packed-bf16"])
def test_combine_does_not_reread_topk_idx(node_size, layout, dtype):
    results = dist_util.run(2, _reuse_worker, node_size, layout, dtype, timeout=300)
    for rank, res in enumerate(results):
        assert all(res.values()), f"rank {rank}: combine after the caller reused topk_idx: {res}"


@pytest.mark.gpu
@pytest.mark.parametrize("node_size", [2, 1], ids=["node", "internode"])
def test_combine_does_not_reread_topk_idx_gpu(node_size):
    """The same on GPUs (the compiled kernel writes the buffer's copy on the device)."""
    dist_util.need_gpu()
    results = dist_util.run(2, _reuse_worker, node_size, "packed", FP8, timeout=300,
                            backend=dist_util.gpu_backend(2))
    for rank, res in enumerate(results):
        assert all(res.values()), f"rank {rank}: combine after the caller reused topk_idx: {res}"


# ---------------------------------------------------------------------------- non-finite input
def _nonfinite_worker(rank, world_size, dtype_name, layout, node_size):
    """NaN and +-inf in x (full and partial fp8 blocks): the dispatched rows equal the oracle's
    bit for bit (fp8: ``moe_ep.core.fp8``'s NaN blocks) and combine puts NaN / inf where the oracle does."""
    import moe_ep
    from ep_cases import Case, check_dispatch
    from moe_ep.testing.reference import reference_dispatch, reference_moe

    group = moe_ep.EPGroup(node_size=node_size) if node_size else moe_ep.EPGroup()
    dev, R = group.device, world_size
    dt = FP8 if dtype_name == "fp8" else torch.bfloat16
    E, H, M, K = 2 * R, 320, 8, 2  # blocks of 128, 128 and a partial 64
    x, idx, w = _inputs(rank, 7, H, E, K, seed=2)
    nan, inf = float("nan"), float("inf")
    x[0, 5], x[1, 130], x[2, 7], x[3, 3], x[3, 300], x[4, 319] = nan, inf, -inf, inf, nan, -inf
    x, idx, w = x.to(dev), idx.to(dev), w.to(dev)
    case = Case(R=R, E=E, K=K, dtype=dtype_name, layout=layout, H=H, M=M, data="random")
    ref = reference_dispatch(group, E, x, idx, w, dispatch_dtype=dt)
    with moe_ep.EPBuffer(group, E, H, M, K, dispatch_dtype=dt, layout=layout, timeout_s=30) as buf:
        h = buf.dispatch(x, idx, w)
        fails = check_dispatch(h, ref, case, f"[rank {rank} {dtype_name} {layout} node_size {node_size}]")
        out = buf.combine(_apply_experts(h, buf, rank * buf.num_local_experts), h)
    want = reference_moe(group, E, x, idx, w, _expert, dispatch_dtype=dt)
    if not _close(out, want):
        fails.append(f"rank {rank}: combine: NaN at {out.float().isnan().nonzero().tolist()[:6]}..., expected "
                     f"{want.isnan().nonzero().tolist()[:6]}...; inf {out.float().isinf().sum().item()} "
                     f"vs {want.isinf().sum().item()}")
    if dt == FP8 and not bool(out[0, :128].float().isnan().all()):
        fails.append(f"rank {rank}: the block holding x[0, 5] = NaN did not come back NaN")
    return fails


@pytest.mark.parametrize("R,dtype,layout,node_size", [(1, "fp8", "masked", None), (2, "fp8", "packed", None),
                                                      (2, "bf16", "masked", None), (2, "fp8", "masked", 1)],
                         ids=["R1-fp8", "R2-fp8", "R2-bf16", "R2-fp8-internode"])
def test_nonfinite_input(R, dtype, layout, node_size):
    fails = [f for r in dist_util.run(R, _nonfinite_worker, dtype, layout, node_size, timeout=300) for f in r]
    assert not fails, "\n".join(fails)


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_nonfinite_input_gpu(R, dtype):
    """The compiled kernels: the hardware fp8 conversion (cvt.rn.satfinite saturates inf and keeps
    NaN) must give moe_ep.core.fp8's NaN blocks too."""
    from test_layer import run_on_gpus

    run_on_gpus(R, _nonfinite_worker, dtype, "masked" if R == 1 else "packed", None)


def _nonfinite_rows_worker(rank, world_size, sub_blocks=False):
    """Rows layout, fp8 quantized in the kernel (its scales stored from the block maxima's layout
    on a GPU, kernels/common.py: store_in_place): NaN and +-inf blocks come out as moe_ep.core.fp8's,
    bytes and scale bits alike. R=1 and every token routed here, so received row i is token i.
    ``sub_blocks``: chunks of 19 tokens on two programs, whose own rows go in sub-blocks (16 + 3),
    the non-finite values in both."""
    import moe_ep
    from moe_ep.core.fp8 import quantize_fp8

    group = moe_ep.EPGroup()
    dev = group.device
    E, H, K = 4, 320, 2  # blocks of 128, 128 and a partial 64
    M, T, programs = (40, 37, 2) if sub_blocks else (8, 7, None)
    x, idx, w = _inputs(rank, T, H, E, K, seed=3)
    idx[1::4, -1] = 2  # no -1: every token has a row
    nan, inf = float("nan"), float("inf")
    for t0 in ((0, 17, 30) if sub_blocks else (0,)):
        x[t0, 5], x[t0 + 1, 130], x[t0 + 2, 7], x[t0 + 3, 3], x[t0 + 3, 300], x[t0 + 4, 319] = \
            nan, inf, -inf, inf, nan, -inf
    q, sc = quantize_fp8(x)
    with moe_ep.EPBuffer(group, E, H, M, K, dispatch_dtype=FP8, layout="rows", timeout_s=30,
                         **({"num_programs": programs} if programs else {})) as buf:
        if sub_blocks:
            assert buf.tuning.block_ts < buf.sizes.block_t, "no sub-blocks in this buffer"
        h = buf.dispatch(x.to(dev), idx.to(dev), w.to(dev))
        n = int(h.num_recv[0])
        got_q = h.expert_x[:n].cpu().view(torch.uint8)
        got_s = h.expert_scales[:n].cpu().view(torch.int32)
    fails = []
    if n != T:
        fails.append(f"num_recv {n}, expected {T}")
    elif not torch.equal(got_q, q.view(torch.uint8)):
        fails.append(f"bytes differ at {(got_q != q.view(torch.uint8)).nonzero().tolist()[:6]}")
    elif not torch.equal(got_s, sc.view(torch.int32)):
        fails.append(f"scales differ: got {got_s.tolist()} expected {sc.view(torch.int32).tolist()}")
    return fails


@pytest.mark.parametrize("sub_blocks", [False, True], ids=["chunk", "sub-blocks"])
def test_nonfinite_input_rows(sub_blocks):
    fails = [f for r in dist_util.run(1, _nonfinite_rows_worker, sub_blocks, timeout=300) for f in r]
    assert not fails, "\n".join(fails)


@pytest.mark.gpu
@pytest.mark.parametrize("sub_blocks", [False, True], ids=["chunk", "sub-blocks"])
def test_nonfinite_input_rows_gpu(sub_blocks):
    from test_layer import run_on_gpus

    run_on_gpus(1, _nonfinite_rows_worker, sub_blocks)


# ---------------------------------------------------------------------------- masked overflow
def _overflow_worker(rank, world_size, timeout_s):
    """Rank 0's tokens list rank 1's expert 1 four times: 16 rows for a masked capacity of R*M = 8."""
    import time

    import moe_ep

    group = moe_ep.EPGroup()
    dev = group.device
    E, H, M, K = 2, 128, 4, 4
    T = 4 if rank == 0 else 2
    x = torch.ones(T, H, dtype=torch.bfloat16, device=dev)
    idx = torch.full((T, K), 1 if rank == 0 else -1, dtype=torch.int64, device=dev)
    if rank == 1:
        idx[:, 0] = 0
    w = torch.ones(T, K, device=dev)
    t0 = time.monotonic()
    with moe_ep.EPBuffer(group, E, H, M, K, layout="masked", timeout_s=timeout_s) as buf:
        try:
            h = buf.dispatch(x, idx, w)
            buf.combine(torch.zeros(h.expert_x.shape, dtype=torch.bfloat16, device=dev), h)
            buf.synchronize()
            return None, "", time.monotonic() - t0
        except Exception as exc:  # noqa: BLE001
            return type(exc).__name__, str(exc), time.monotonic() - t0


def _check_overflow(results, timeout_s):
    (t0, m0, s0), (t1, m1, s1) = results
    assert t0 == "CapacityError", f"the sender got {t0}: {m0}"
    assert "rank 0: expert 1 on rank 1 received 16 rows in dispatch epoch 1" in m0 and "packed" in m0, m0
    assert t1 == "CapacityError" and "rank 1: expert 1 on this rank received 16 rows" in m1, (t1, m1)
    assert s0 < timeout_s / 2 and s1 < timeout_s / 2, (s0, s1)  # no deadline ran out


def test_masked_overflow_reaches_the_sender():
    timeout_s = 60.0
    _check_overflow(dist_util.run(2, _overflow_worker, timeout_s, timeout=120), timeout_s)


@pytest.mark.gpu
def test_masked_overflow_reaches_the_sender_gpu():
    """The same on GPUs: the receiver's dispatch kernel aborts the sender's combine wait."""
    dist_util.need_gpu()
    timeout_s = 30.0
    _check_overflow(dist_util.run(2, _overflow_worker, timeout_s, timeout=120, backend=dist_util.gpu_backend(2)),
                    timeout_s)


# ---------------------------------------------------------------------------- masked expert_capacity
def _expert_capacity_worker(rank, world_size):
    """A masked buffer with ``expert_capacity=3`` rows per expert (R*M = 16): a dispatch that fits
    is exact; one that brings an expert 4 rows raises CapacityError on both ranks."""
    import moe_ep

    group = moe_ep.EPGroup()
    dev = group.device
    E, H, M, K = 4, 128, 8, 2
    out = {}
    for bad in (dict(layout="packed", expert_capacity=3), dict(layout="masked", expert_capacity=0),
                dict(layout="masked", expert_capacity=17)):
        try:
            moe_ep.EPBuffer(group, E, H, M, K, **bad).close()
            out[str(bad)] = "accepted"
        except ValueError as exc:
            out[str(bad)] = "expert_capacity" in str(exc)
    with moe_ep.EPBuffer(group, E, H, M, K, layout="masked", expert_capacity=3, timeout_s=60.0) as buf:
        out["shape"] = tuple(buf.parts.memory.expert_x.shape)
        x = torch.stack([torch.full((H,), float(10 * rank + t + 1)) for t in range(2)]).to(torch.bfloat16).to(dev)
        w = torch.tensor([[0.5, 0.25]] * 2, device=dev)
        idx = torch.tensor([[0, 1], [2, 3]], dtype=torch.int64, device=dev)  # every expert: one row per rank
        h = buf.dispatch(x, idx, w)
        got = buf.combine(h.expert_x.clone(), h)
        out["fits"] = (h.expert_counts.cpu().tolist(), torch.equal(got.float().cpu(), 0.75 * x.float().cpu()))
        try:  # expert 0 (rank 0's) gets two rows from each rank: 4 > 3
            h = buf.dispatch(x, torch.tensor([[0, 1], [0, 1]], dtype=torch.int64, device=dev), w)
            buf.combine(h.expert_x.clone(), h)
            buf.synchronize()
            out["over"] = None
        except moe_ep.CapacityError as exc:
            out["over"] = str(exc)
    return out


def test_masked_expert_capacity():
    for rank, out in enumerate(dist_util.run(2, _expert_capacity_worker, timeout=180)):
        refused = [k for k, v in out.items() if k.startswith("{") and v is not True]
        assert not refused, f"rank {rank}: not refused with a ValueError naming expert_capacity: {refused}"
        assert out["shape"] == (2, 3, 128), out["shape"]
        assert out["fits"] == ([2, 2], True), out["fits"]
        assert out["over"] is not None and "expert 0" in out["over"] and "received 4 rows" in out["over"] \
            and "expert_capacity" in out["over"], (rank, out["over"])
