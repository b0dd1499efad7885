"""moe_ep.deep_ep against the pure-torch model of DeepEP's calls (tests/deep_ep_model.py), on CPU
rank pools (R = 1..4) and, marked gpu, on one GPU (R=1 and several ranks sharing it)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import deep_ep_model as model
import dist_util

FP8 = torch.float8_e4m3fn
RANKS = [1, 2, 3]  # CPU ranks; R=4 and up run on GPUs (the *_gpu tests)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------- inputs
def _inputs(rank: int, R: int, E: int, K: int, H: int, M: int, call: int, holes: bool = True):
    """This rank's (x bf16 [T, H], topk_idx int64 [T, K], topk_weights float32 [T, K]) of ``call``:
    T rotates over M, 0 and a middle count; distinct experts per token; some -1 ids."""
    g = torch.Generator().manual_seed(1000 * call + 17 * rank + R)
    T = [M, 0, max(1, M // 2)][(call + rank) % 3]
    # 128-channel blocks of different magnitudes, so fp8 scales differ from block to block
    x = (torch.randn(T, H, generator=g) * 2.0 ** (torch.arange(H) // 128 % 4)).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.int64)
    if holes and T:
        idx[torch.rand(T, K, generator=g) < 0.2] = -1
    w = torch.rand(T, K, generator=g) + 0.5
    return x, idx.to(torch.int64), w


def _gather(group, x, idx, w):
    from moe_ep.testing.reference import gather_inputs

    g = gather_inputs(group, x, idx, w)
    return [t.cpu() for t in g.x], [t.cpu() for t in g.topk_idx], [t.cpu() for t in g.topk_weights]


def _expert_scale(e: int) -> float:
    return 1.0 + 0.25 * (e % 4)


def _close(got: torch.Tensor, exp: torch.Tensor, bound: torch.Tensor) -> bool:
    return bool(((got.float().cpu() - exp).abs() <= bound + 1e-6).all())


# ---------------------------------------------------------------------------- low-latency mode
def _ll_worker(rank, R, dtypes, E_per_rank, K, H, M, node_size=None):
    """One low-latency dispatch + combine per entry of ``dtypes`` ("bf16", "fp8", "pow2":
    round_scale, "ue8m0": round_scale and use_ue8m0), checked against the model; calls 1 and 2 of
    every 4 use receive hooks, the others async_finish events. ``node_size`` < R: other nodes
    through the proxy (each (token, k) travels as a token of its own)."""
    import torch.distributed as dist

    import moe_ep.deep_ep as deep_ep
    from moe_ep.core.fp8 import dequantize_fp8, quantize_fp8

    if node_size is not None:
        os.environ["MOE_EP_NODE_SIZE"] = str(node_size)
    try:
        buffer = deep_ep.Buffer(dist.group.WORLD, 0, 1 << 20, low_latency_mode=True, num_qps_per_rank=E_per_rank)
    finally:
        os.environ.pop("MOE_EP_NODE_SIZE", None)
    if node_size is not None and buffer.ep_group.node_size != node_size:
        return [f"[ll rank {rank}] node_size {buffer.ep_group.node_size} != {node_size}"]
    group, dev = buffer.ep_group, buffer.device
    E, EL = E_per_rank * R, E_per_rank
    K = min(K, E)
    fails = []
    for call, dt in enumerate(dtypes):
        fp8, pow2, ue8m0 = dt != "bf16", dt in ("pow2", "ue8m0"), dt == "ue8m0"
        where = f"[ll R{R} {dt} rank {rank} call {call}]"
        x, idx, w = _inputs(rank, R, E, K, H, M, call)
        x, idx, w = x.to(dev), idx.to(dev), w.to(dev)
        xs, idxs, _ = _gather(group, x, idx, w)
        ref = model.ll_dispatch(xs, idxs, rank, E, fp8, pow2, ue8m0)
        hook_mode = call % 4 in (1, 2)
        stats = torch.full((EL,), 5, dtype=torch.int32, device=dev)
        recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(
            x, idx, M, E, cumulative_local_expert_recv_stats=stats, use_fp8=fp8, round_scale=pow2, use_ue8m0=ue8m0,
            async_finish=not hook_mode, return_recv_hook=hook_mode)
        if hook_mode:
            assert event.event is None
            hook()
        else:
            event.current_stream_wait()
        counts = recv_count.cpu().tolist()
        if counts != ref.counts:
            fails.append(f"{where} recv_count {counts} != {ref.counts}")
            continue
        if stats.cpu().tolist() != [5 + c for c in ref.counts]:
            fails.append(f"{where} cumulative stats {stats.tolist()} != 5 + {ref.counts}")
        q, sc = (recv_x if fp8 else (recv_x, None))
        if tuple(q.shape) != (EL, R * M, H) or q.dtype != (FP8 if fp8 else torch.bfloat16):
            fails.append(f"{where} recv_x {q.dtype} {list(q.shape)}")
            continue
        if fp8:
            # DeepEP's layout: [E_local, R*M, H/128] (UE8M0: int32 [.., H/512]), column-major in the last two dims.
            if tuple(sc.shape) != (EL, R * M, H // (512 if ue8m0 else 128)) or sc.stride()[1] != 1 or \
                    sc.dtype != (torch.int32 if ue8m0 else torch.float32):
                fails.append(f"{where} scales shape {list(sc.shape)} strides {sc.stride()}")
                continue
        for e in range(EL):
            n = counts[e]
            if fp8:
                steps = model.e4m3_steps(q[e, :n].cpu(), ref.rows[e])
                if n and int(steps.max()) > (0 if pow2 else 1):  # power-of-two scales: exactly DeepEP's bytes
                    fails.append(f"{where} expert {e}: fp8 bytes {int(steps.max())} e4m3 steps from DeepEP's")
                if not (torch.equal(sc[e, :n].cpu(), ref.scales[e]) if pow2 else
                        torch.allclose(sc[e, :n].cpu(), ref.scales[e], rtol=1e-6, atol=0)):
                    fails.append(f"{where} expert {e}: scales differ from DeepEP's")
            elif not torch.equal(q[e, :n].cpu(), ref.rows[e]):
                fails.append(f"{where} expert {e}: rows differ (order: source rank, then token)")
        # Experts: a per-expert scale of the received values, bf16 out; combine with new weights.
        if ue8m0:  # four exponent bytes per int32 -> float32 scales per 128 channels
            exps = torch.stack([(sc >> (8 * i)) & 0xFF for i in range(4)], dim=-1).flatten(-2)
            sc = torch.ldexp(torch.ones(exps.shape, device=dev), exps - 127)
        vals = (q.float() * sc.repeat_interleave(128, dim=-1)) if fp8 else q.float()
        scale = torch.tensor([_expert_scale(rank * EL + e) for e in range(EL)], device=dev).view(EL, 1, 1)
        y = (vals * scale).to(torch.bfloat16)
        w2 = (torch.rand(w.shape, generator=torch.Generator().manual_seed(call + 99 * rank)) + 0.25).to(dev)
        out_t = torch.empty(x.shape[0], H, dtype=torch.bfloat16, device=dev) if call % 3 == 2 else None
        combined, cev, chook = buffer.low_latency_combine(y, idx, w2, handle, async_finish=not hook_mode,
                                                          return_recv_hook=hook_mode, out=out_t)
        if hook_mode:
            chook()
        else:
            cev.current_stream_wait()
        if out_t is not None and combined is not out_t:
            fails.append(f"{where} combine did not return out")
        # Model: what the source's own tokens become (the source can compute moe_ep's fp8 values,
        # and DeepEP's power-of-two ones, which moe_ep matches exactly).
        if pow2:
            pq, ps = model.deepep_quantize(x.cpu(), round_scale=True)
            mine = pq.float() * ps.repeat_interleave(128, dim=-1)
        else:
            mine = dequantize_fp8(*quantize_fp8(x.cpu())) if fp8 else x.cpu().float()
        exp = model.ll_combine(idx.cpu(), w2.cpu(),
                               lambda e, t: (mine[t] * _expert_scale(e)).to(torch.bfloat16).float(), H)
        bound = model.ll_combine(idx.cpu(), w2.cpu(),
                                 lambda e, t: (mine[t] * _expert_scale(e)).abs(), H) * 2.0 ** -7
        if tuple(combined.shape) != (x.shape[0], H) or not _close(combined, exp, bound):
            fails.append(f"{where} combined_x differs from sum_k w*y (max err "
                         f"{(combined.float().cpu() - exp).abs().max().item() if combined.numel() else 0})")
    return fails


LL_CALLS = ("bf16", "fp8", "bf16", "fp8")


@pytest.mark.parametrize("R", RANKS)
def test_low_latency(R):
    # (H = 256: two scale blocks, so a row-major scale layout cannot pass for DeepEP's column-major one)
    fails = dist_util.run(R, _ll_worker, LL_CALLS, 1 if R == 3 else 2, 3, 256, 4)
    fails = [f for r in fails for f in r]
    assert not fails, "\n".join(fails[:20])


def test_low_latency_across_nodes():
    """3 nodes of one rank and 2 nodes of two: DeepEP's low-latency pair through moe_ep's proxy."""
    for R, node_size in ((3, 1), (4, 2)):  # call 0: fp8 with an event, call 1: bf16 with receive hooks
        fails = dist_util.run(R, _ll_worker, ("fp8", "bf16"), 2, 3, 256, 4, node_size)
        fails = [f for r in fails for f in r]
        assert not fails, f"R={R} node_size={node_size}:\n" + "\n".join(fails[:20])


def test_low_latency_round_scale():
    """round_scale (power-of-two scales) and use_ue8m0 (their exponents packed in int32), H=512."""
    fails = dist_util.run(2, _ll_worker, ("pow2", "ue8m0"), 1, 2, 512, 3)
    fails = [f for r in fails for f in r]
    assert not fails, "\n".join(fails[:20])


# ---------------------------------------------------------------------------- normal mode
NORMAL_CALLS = ("bf16", "fp8pre", "notopk", "worst", "bf16")


def _normal_buffer(node_size=None):
    """A ``deep_ep.Buffer`` on the world group (``node_size``: ranks a node, else the hosts')."""
    import torch.distributed as dist

    import moe_ep.deep_ep as deep_ep

    if node_size is not None:
        os.environ["MOE_EP_NODE_SIZE"] = str(node_size)
    try:
        return deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 20)
    finally:
        os.environ.pop("MOE_EP_NODE_SIZE", None)


def _normal_worker(rank, R, E_per_rank, K, H, M, calls, node_size=None):
    """The normal-mode calls of ``calls`` checked against the model; ``node_size`` < R: other
    nodes through the proxy."""
    from moe_ep.core.fp8 import dequantize_fp8, quantize_fp8

    buffer = _normal_buffer(node_size)
    group, dev = buffer.ep_group, buffer.device
    E = E_per_rank * R
    K = min(K, E)
    fails = []
    for call, mode in enumerate(calls):
        where = f"[normal R{R} rank {rank} call {call} {mode}]"
        x, idx, w = _inputs(rank, R, E, K, H, M, call)
        x, idx, w = x.to(dev), idx.to(dev), w.to(dev)
        T = x.shape[0]
        xs, idxs, ws = _gather(group, x, idx, w)
        # get_dispatch_layout against the model
        ntr, ntrr, nte, itr, ev = buffer.get_dispatch_layout(idx, E, async_finish=call % 2 == 1)
        if call % 2 == 1:
            ev.current_stream_wait()  # async_finish: the results are ready once the event is (DeepEP's rule)
        exp_layout = model.layout(idx.cpu(), E, R, group.node_size)
        for name, got, want in zip(("num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert",
                                    "is_token_in_rank"), (ntr, ntrr, nte, itr), exp_layout):
            if (got is None) != (want is None) or (got is not None and not torch.equal(got.cpu(), want)):
                fails.append(f"{where} {name}: {got} != {want}")
        fp8 = mode == "fp8pre"
        align = 3 if call % 2 == 0 else 1
        if fp8:
            q, s = quantize_fp8(x)
            x_in = (q, s.T.contiguous().T)  # DeepEP callers pass column-major scales too
            vals = dequantize_fp8(q, s).cpu()
            qs = [quantize_fp8(t) for t in xs]
            ref = model.normal_dispatch([a for a, _ in qs], [b for _, b in qs], idxs, ws, rank, E, align)
        else:
            x_in, vals = x, x.cpu().float()
            ref = model.normal_dispatch(xs, None, idxs, ws, rank, E, align)
        with_topk = mode != "notopk"
        worst = R * M if mode == "worst" else 0
        prev = buffer.capture() if call % 2 == 0 else None
        recv_x, r_idx, r_w, lst, handle, event = buffer.dispatch(
            x_in, num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=ntrr, is_token_in_rank=itr,
            num_tokens_per_expert=nte, topk_idx=idx if with_topk else None, topk_weights=w if with_topk else None,
            expert_alignment=align, num_worst_tokens=worst, previous_event=prev, async_finish=call % 2 == 1)
        if call % 2 == 1:
            event.current_stream_wait()
        n = ref.x.shape[0]
        rx, rs = recv_x if fp8 else (recv_x, None)
        rows = worst or n
        if rx.shape[0] != rows:
            fails.append(f"{where} recv_x has {rx.shape[0]} rows, expected {rows}")
            continue
        same = torch.equal(rx[:n].cpu().view(torch.uint8), ref.x.view(torch.uint8)) and \
            (rs is None or torch.equal(rs[:n].cpu(), ref.scales))
        if not same:
            fails.append(f"{where} recv_x differs from the model (order: source rank, then token)")
        if lst != ([] if worst else ref.counts):
            fails.append(f"{where} num_recv_tokens_per_expert_list {lst} != {[] if worst else ref.counts}")
        if with_topk:
            if r_idx.dtype != torch.int64 or not torch.equal(r_idx[:n].cpu(), ref.topk_idx) or \
                    not torch.equal(r_w[:n].cpu(), ref.topk_weights):
                fails.append(f"{where} recv_topk_idx / recv_topk_weights differ from the model")
            if worst and not bool((r_idx[n:] == -1).all()):
                fails.append(f"{where} rows past the received count must have top-k ids -1")
        elif r_idx is not None or r_w is not None:
            fails.append(f"{where} without top-k, recv_topk_idx / recv_topk_weights must be None")
        if mode == "notopk":  # cached dispatch: the handle's routing again, new data
            x2 = (x * 2).to(torch.bfloat16)
            rx2, *rest, ev2 = buffer.dispatch(x2, handle=handle)
            exp2 = model.normal_dispatch([(t * 2).to(torch.bfloat16) for t in xs], None, idxs, ws, rank, E).x
            if any(v is not None for v in rest) or not torch.equal(rx2.cpu(), exp2):
                fails.append(f"{where} cached dispatch differs from the model")
            rx = rx2
            vals = x2.cpu().float()
        # Experts: rank r sends back bf16(row * (r + 1)); combine sums them over the receiving ranks.
        got_vals = (rx.float() * rs.repeat_interleave(128, dim=-1)) if fp8 else rx.float()
        y = (got_vals * (rank + 1)).to(torch.bfloat16)
        bias = (torch.full((T, H), 0.5, dtype=torch.bfloat16, device=dev) if call % 3 == 0 else None)
        cx, cw, cev = buffer.combine(y, handle, topk_weights=r_w if with_topk else None, bias=bias,
                                     async_finish=call % 2 == 1)
        if call % 2 == 1:
            cev.current_stream_wait()
        fn = lambda r, v: (v * (r + 1)).to(torch.bfloat16).float()  # noqa: E731
        exp = model.normal_combine(vals, idx.cpu(), E, R, fn) + (0.5 if bias is not None else 0.0)
        bound = model.normal_combine(vals.abs(), idx.cpu(), E, R, lambda r, v: v * (r + 1)) * 2.0 ** -7 + \
            (2.0 ** -8 * exp.abs() if bias is not None else 0.0)
        if tuple(cx.shape) != (T, H) or cx.dtype != torch.bfloat16 or not _close(cx, exp, bound):
            fails.append(f"{where} combined_x differs from the model")
        elif bias is not None and not torch.equal(cx.cpu(), exp.to(torch.bfloat16)):
            # (the rows' float32 sum is exact here: a few bf16 values of like magnitude) DeepEP
            # rounds once, after the bias: a rounding before it lands elements one bf16 step off.
            fails.append(f"{where} combined_x with bias is not the sum plus bias rounded once")
        if with_topk:
            if cw is None or not torch.equal(cw.cpu(), model.combined_weights(idx.cpu(), w.cpu())):
                fails.append(f"{where} combined_topk_weights differ from the model")
        elif cw is not None:
            fails.append(f"{where} combined_topk_weights must be None without topk_weights")
    return fails


@pytest.mark.parametrize("R", RANKS)
def test_normal(R):
    fails = dist_util.run(R, _normal_worker, 1 if R == 3 else 2, 3, 128, 4, NORMAL_CALLS)
    fails = [f for r in fails for f in r]
    assert not fails, "\n".join(fails[:20])


def _worst_cap_worker(rank, R, node_size=None):
    """``num_worst_tokens`` as the rows buffer's cap: every token of both ranks selects rank 1's
    experts (M = 4 tokens a rank, so rank 1 receives 8 rows, rank 0 none). With 8 rows (fits):
    exactly 8 rows come back on each rank (rank 0's all past the count: ids -1, weights 0), the
    buffer holds 8 rows (not R * max_tokens = 128), no host read of the count (``recv_rows``, the
    per-call read, and ``Tensor.tolist`` made to raise), and the combine equals the model. With 7:
    ``CapacityError`` naming rank 1 and the 8 rows it needs, on both ranks (the source learns it
    in its combine), never a silent truncation. Returns the failures."""
    import moe_ep
    import moe_ep.ops.dispatch

    buffer = _normal_buffer(node_size)
    dev, fails = buffer.device, []
    E, K, H, M = 8, 2, 128, 4
    x = (torch.arange(M * H, dtype=torch.float32).view(M, H) % 7 + rank).to(torch.bfloat16).to(dev)
    idx = torch.tensor([[4, 6]] * M, dtype=torch.int64, device=dev)
    w = torch.full((M, K), 0.5, device=dev)
    ntr, _, nte, itr, _ = buffer.get_dispatch_layout(idx, E)
    kw = dict(num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte, topk_idx=idx, topk_weights=w)

    def no_host_read(*a, **k):
        raise AssertionError("a host read of the received count")
    saved = (moe_ep.ops.dispatch.recv_rows, torch.Tensor.tolist)
    moe_ep.ops.dispatch.recv_rows = torch.Tensor.tolist = no_host_read
    try:
        rx, r_idx, r_w, lst, handle, _ = buffer.dispatch(x, num_worst_tokens=2 * M, **kw)
    finally:
        moe_ep.ops.dispatch.recv_rows, torch.Tensor.tolist = saved
    epbuf = handle.slot.epbuf
    if (epbuf.sizes.max_recv_rows, epbuf.sizes.recv_rows_mode, epbuf.parts.memory.expert_x.shape[0]) != (2 * M, "cap",
                                                                                                          2 * M):
        fails.append(f"rank {rank}: the rows buffer is not capped at num_worst_tokens: max_recv_rows "
                     f"{epbuf.sizes.max_recv_rows}, expert_x rows {epbuf.parts.memory.expert_x.shape[0]}")
    n = 2 * M if rank == 1 else 0
    if rx.shape[0] != 2 * M or lst != []:
        fails.append(f"rank {rank}: recv_x has {rx.shape[0]} rows (expected {2 * M}), list {lst}")
    elif not (bool((r_idx[n:] == -1).all()) and bool((r_w[n:] == 0).all())):
        fails.append(f"rank {rank}: rows past the received count must have ids -1 and weights 0")
    elif rank == 1 and not (bool((r_idx == torch.tensor([0, 2])).all()) and torch.equal(rx[M:].cpu(), x.cpu())):
        fails.append(f"rank 1: received rows differ from rank 1's own tokens (rows {M}..{2 * M - 1})")
    y = (rx.float() * 3).to(torch.bfloat16)
    cx, cw, _ = buffer.combine(y, handle, topk_weights=r_w)
    if not torch.equal(cx.cpu(), (x.float() * 3).to(torch.bfloat16).cpu()):  # one owner: its row as it is
        fails.append(f"rank {rank}: combined_x differs from rank 1's rows times 3")
    try:
        rx, r_idx, r_w, lst, handle, _ = buffer.dispatch(x, num_worst_tokens=2 * M - 1, **kw)
        buffer.combine((rx.float()).to(torch.bfloat16), handle, topk_weights=r_w)
        buffer.ep_group.barrier()
        fails.append(f"rank {rank}: num_worst_tokens={2 * M - 1} < {2 * M} rows received: no error")
    except moe_ep.CapacityError as e:
        want = ("rank 1: this rank needs 8 rows" if rank == 1 else "rank 0: rank 1 needs 8 rows")
        if want not in str(e) or f"max_recv_rows={2 * M - 1}" not in str(e):
            fails.append(f"rank {rank}: CapacityError does not say {want!r} and the cap: {e}")
    except Exception as e:  # noqa: BLE001
        fails.append(f"rank {rank}: expected CapacityError, got {type(e).__name__}: {e}")
    return fails


def test_normal_num_worst_tokens_is_a_cap():
    fails = dist_util.run(2, _worst_cap_worker, timeout=300)
    fails = [f for r in fails for f in r]
    assert not fails, "\n".join(fails[:20])


def test_normal_across_nodes():
    """3 nodes of one rank: every row through moe_ep's proxy (DeepEP's RDMA path)."""
    fails = dist_util.run(3, _normal_worker, 1, 3, 128, 4, NORMAL_CALLS, 1)
    fails = [f for r in fails for f in r]
    assert not fails, "\n".join(fails[:20])


def _waiting_worker(rank, R):
    """DeepEP's handles outlive later dispatches: two micro-batches dispatched before either is
    combined (and combined in the other order) each get the model's result; a handle combined
    and then overtaken by later dispatches asks for a cached dispatch first, after which it works;
    more than MAX_WAITING dispatches waiting for their combine is refused, naming the limit; another
    Buffer's handle is refused."""
    import torch.distributed as dist

    import moe_ep.deep_ep as deep_ep
    from moe_ep.deep_ep.buffer import MAX_WAITING

    buffer = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 20, explicitly_destroy=True)
    group, dev = buffer.ep_group, buffer.device
    E, K, H, M = 2 * R, 2, 128, 4
    fails = []

    def dispatch(call, scale=1):
        x, idx, w = (t.to(dev) for t in _inputs(rank, R, E, K, H, M, call, holes=False))
        x = (x * scale).to(torch.bfloat16)
        ntr, ntrr, nte, itr, _ = buffer.get_dispatch_layout(idx, E)
        recv_x, _, r_w, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=ntrr,
                                                       is_token_in_rank=itr, num_tokens_per_expert=nte,
                                                       topk_idx=idx, topk_weights=w)
        return dict(x=x, idx=idx, w=w, recv_x=recv_x, r_w=r_w, handle=handle)

    def combine(where, b, recv_x=None):
        y = ((b["recv_x"] if recv_x is None else recv_x).float() * (rank + 1)).to(torch.bfloat16)
        cx, cw, _ = buffer.combine(y, b["handle"], topk_weights=b["r_w"])
        vals = b["x"].cpu().float()
        exp = model.normal_combine(vals, b["idx"].cpu(), E, R, lambda r, v: (v * (r + 1)).to(torch.bfloat16).float())
        bound = model.normal_combine(vals.abs(), b["idx"].cpu(), E, R, lambda r, v: v * (r + 1)) * 2.0 ** -7
        if not _close(cx, exp, bound):
            fails.append(f"[rank {rank}] {where}: combined_x differs from the model")
        if not torch.equal(cw.cpu(), model.combined_weights(b["idx"].cpu(), b["w"].cpu())):
            fails.append(f"[rank {rank}] {where}: combined_topk_weights differ from the model")

    a, b = dispatch(0), dispatch(3)  # same shape (call 3 has call 0's token counts)
    combine("B combined while A waits", b)
    combine("A combined after B", a)
    c, d = dispatch(6), dispatch(9)  # take both free buffers
    _expect(fails, "combine of A after later dispatches took its buffer", lambda: combine("stale A", a), ValueError,
            ["handle", "dispatch(x, handle=handle)"])
    recv2, *_ = buffer.dispatch((a["x"] * 2).to(torch.bfloat16), handle=a["handle"])  # cached: A's routing again
    a2 = dict(a, x=(a["x"] * 2).to(torch.bfloat16))
    combine("A after its cached dispatch", a2, recv_x=recv2)
    combine("D", d)
    combine("C", c)
    held = [dispatch(12 + 3 * i) for i in range(MAX_WAITING)]
    _expect(fails, "one dispatch more than MAX_WAITING waiting", lambda: dispatch(24), ValueError,
            ["MAX_WAITING", "combine one first"])
    for i, h in enumerate(held):
        combine(f"held {i}", h)
    last = dispatch(24)
    other = deep_ep.Buffer(dist.group.WORLD, num_nvl_bytes=1 << 20, explicitly_destroy=True)
    y = last["recv_x"].to(torch.bfloat16)
    _expect(fails, "another Buffer's handle", lambda: other.combine(y, last["handle"]), ValueError,
            ["handle", "another Buffer"])
    _expect(fails, "another Buffer's handle (cached dispatch)", lambda: other.dispatch(last["x"], handle=last["handle"]),
            ValueError, ["handle", "another Buffer"])
    combine("after the refusal", last)
    other.destroy()
    buffer.destroy()
    return fails


def test_handles_outlive_later_dispatches():
    fails = [f for r in dist_util.run(2, _waiting_worker) for f in r]
    assert not fails, "\n".join(fails[:20])


# ---------------------------------------------------------------------------- EPBuffer: weights at combine
def _late_weights_worker(rank, R, layout):
    import moe_ep
    from ep_cases import Case, run_calls

    group = moe_ep.EPGroup()
    case = Case(R=R, E=2 * R, K=2, layout=layout, late_weights=True, seed=R, calls=("uniform", "sparse"))
    with moe_ep.EPBuffer(group, case.E, case.H, case.M, case.K, layout=layout, timeout_s=60.0) as buf:
        return run_calls(group, buf, case)


@pytest.mark.parametrize("R", [1, 3])
@pytest.mark.parametrize("layout", ["masked", "packed"])
def test_combine_time_weights(R, layout):
    """EPBuffer.combine(topk_weights=) replaces the dispatch's weights (which are wrong on purpose)."""
    fails = [f for r in dist_util.run(R, _late_weights_worker, layout) for f in r]
    assert not fails, "\n".join(fails[:20])


def _missing_weights_worker(rank, R):
    import moe_ep

    group = moe_ep.EPGroup()
    with moe_ep.EPBuffer(group, 2 * R, 128, 2, 1, timeout_s=3.0) as buf:
        x = torch.ones(2, 128, dtype=torch.bfloat16)
        idx = torch.tensor([[0], [2 * R - 1]])
        d = buf.dispatch(x, idx, torch.zeros(2, 1))
        y = torch.ones(d.expert_x.shape, dtype=torch.bfloat16)
        try:
            # Rank 0 brings no combine-time weights: rank 1's owner half must not use stale ones.
            buf.combine(y, d, topk_weights=None if rank == 0 else torch.ones(2, 1))
        except moe_ep.CommTimeoutError as exc:
            return ("timeout", exc.peer)
        return ("returned", None)


def test_missing_combine_weights_time_out():
    got = dist_util.run(2, _missing_weights_worker)
    assert got == [("timeout", 1), ("timeout", 0)], got


# ---------------------------------------------------------------------------- refused options, bad input
def _expect(fails, what, fn, exc, words):
    try:
        fn()
    except exc as e:
        if not all(w in str(e) for w in words):
            fails.append(f"{what}: {type(e).__name__} does not name {words}: {e}")
        return
    except Exception as e:  # noqa: BLE001
        fails.append(f"{what}: expected {exc.__name__}, got {type(e).__name__}: {e}")
        return
    fails.append(f"{what}: no error")


def _options_worker(rank, R):
    import torch.distributed as dist

    import moe_ep
    import moe_ep.deep_ep as deep_ep

    G = dist.group.WORLD
    fails = []
    NI = NotImplementedError
    _expect(fails, "enable_shrink", lambda: deep_ep.Buffer(G, enable_shrink=True), NI, ["enable_shrink"])
    _expect(fails, "comm", lambda: deep_ep.Buffer(None, comm=object()), NI, ["comm"])
    _expect(fails, "group None", lambda: deep_ep.Buffer(None), ValueError, ["group"])
    _expect(fails, "num_nvl_bytes", lambda: deep_ep.Buffer(G, num_nvl_bytes=-1), ValueError, ["num_nvl_bytes"])
    b = deep_ep.Buffer(G, 0, 0, low_latency_mode=True)
    E, H, M, K = 2 * R, 128, 4, 2
    x = torch.randn(3, H).to(torch.bfloat16)
    idx = torch.tensor([[0, 1], [1, -1], [-1, -1]], dtype=torch.int64)
    w = torch.rand(3, K)
    _expect(fails, "use_ue8m0 alone", lambda: b.low_latency_dispatch(x, idx, M, E, use_ue8m0=True), ValueError,
            ["use_ue8m0", "round_scale"])
    _expect(fails, "round_scale bf16", lambda: b.low_latency_dispatch(x, idx, M, E, use_fp8=False, round_scale=True),
            ValueError, ["round_scale", "use_fp8"])
    _expect(fails, "ue8m0 hidden", lambda: b.low_latency_dispatch(x, idx, M, E, round_scale=True, use_ue8m0=True),
            ValueError, ["hidden", "512"])
    _expect(fails, "dispatch_wait_recv_cost_stats",
            lambda: b.low_latency_dispatch(x, idx, M, E, dispatch_wait_recv_cost_stats=torch.zeros(R, R,
                                                                                                   dtype=torch.int64)),
            NI, ["dispatch_wait_recv_cost_stats"])
    _expect(fails, "ll too many tokens", lambda: b.low_latency_dispatch(x, idx, 2, E), ValueError, ["x", "2"])
    _expect(fails, "ll x dtype", lambda: b.low_latency_dispatch(x.float(), idx, M, E), ValueError, ["x"])
    _expect(fails, "ll experts", lambda: b.low_latency_dispatch(x, idx, M, 0), ValueError, ["num_experts"])
    _expect(fails, "ll fp8 hidden", lambda: b.low_latency_dispatch(torch.zeros(1, 144, dtype=torch.bfloat16),
                                                                   idx[:1], M, E), ValueError, ["hidden", "128"])
    _expect(fails, "ll stats", lambda: b.low_latency_dispatch(x, idx, M, E, use_fp8=False,
                                                              cumulative_local_expert_recv_stats=torch.zeros(7)),
            ValueError, ["cumulative_local_expert_recv_stats"])
    recv_x, count, handle, _, _ = b.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    y = torch.ones(recv_x.shape, dtype=torch.bfloat16)
    _expect(fails, "use_logfmt", lambda: b.low_latency_combine(y, idx, w, handle, use_logfmt=True), NI, ["use_logfmt"])
    _expect(fails, "combine_wait_recv_cost_stats",
            lambda: b.low_latency_combine(y, idx, w, handle, combine_wait_recv_cost_stats=torch.zeros(1)), NI,
            ["combine_wait_recv_cost_stats"])
    _expect(fails, "zero_copy without buffer", lambda: b.low_latency_combine(y, idx, w, handle, zero_copy=True),
            ValueError, ["zero_copy", "get_next_low_latency_combine_buffer"])
    _expect(fails, "ll combine x shape", lambda: b.low_latency_combine(y[:, :1], idx, w, handle), ValueError, ["x"])
    _expect(fails, "ll combine weights", lambda: b.low_latency_combine(y, idx, w.double(), handle), TypeError,
            ["topk_weights"])
    _expect(fails, "ll combine out", lambda: b.low_latency_combine(y, idx, w, handle, out=torch.empty(3, 7)),
            ValueError, ["out"])
    _expect(fails, "ll handle", lambda: b.low_latency_combine(y, idx, w, object()), TypeError, ["handle"])
    # zero copy: the buffer handed out is what combine reads
    zc = b.get_next_low_latency_combine_buffer(handle)
    zc.copy_(y * 2)
    a, _, _ = b.low_latency_combine(None, idx, w, handle, zero_copy=True)
    recv_x, count, handle, _, _ = b.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    c, _, _ = b.low_latency_combine(y * 2, idx, w, handle)
    if not torch.equal(a, c):
        fails.append("zero_copy combine differs from the same input passed as x")
    # The checks still hold after calls that passed them (a signature is checked in full once, then
    # by a tensor guard over the same tensors, which these fail)
    _expect(fails, "ll x dtype, later", lambda: b.low_latency_dispatch(x.float(), idx, M, E, use_fp8=False),
            ValueError, ["x"])
    _expect(fails, "ll topk_idx dtype, later", lambda: b.low_latency_dispatch(x, idx.short(), M, E, use_fp8=False),
            TypeError, ["topk_idx"])
    _expect(fails, "ll topk_idx rows, later", lambda: b.low_latency_dispatch(x, idx[:2], M, E, use_fp8=False),
            ValueError, ["topk_idx"])
    _expect(fails, "ll too many tokens, later",
            lambda: b.low_latency_dispatch(torch.zeros(M + 1, H, dtype=torch.bfloat16),
                                           torch.zeros(M + 1, K, dtype=torch.int64), M, E, use_fp8=False),
            ValueError, ["x", str(M)])
    _expect(fails, "ll experts as a float, later", lambda: b.low_latency_dispatch(x, idx, M, float(E), use_fp8=False),
            ValueError, ["num_experts"])
    _expect(fails, "ll combine x dtype, later", lambda: b.low_latency_combine((y * 2).float(), idx, w, handle),
            ValueError, ["x"])
    _expect(fails, "ll combine topk_idx, later", lambda: b.low_latency_combine(y * 2, idx[:, :1], w, handle),
            ValueError, ["topk_idx"])
    _expect(fails, "ll combine out, later", lambda: b.low_latency_combine(y * 2, idx, w, handle, out=torch.empty(3, 7)),
            ValueError, ["out"])
    for name, call in (("get_local_buffer_tensor", lambda: b.get_local_buffer_tensor(torch.bfloat16)),
                       ("low_latency_update_mask_buffer", lambda: b.low_latency_update_mask_buffer(0, True)),
                       ("low_latency_query_mask_buffer", lambda: b.low_latency_query_mask_buffer(torch.zeros(R))),
                       ("low_latency_clean_mask_buffer", lambda: b.low_latency_clean_mask_buffer())):
        _expect(fails, name, call, NI, [name])
    _expect(fails, "destroy", lambda: b.destroy(), RuntimeError, ["explicitly_destroy"])
    # normal mode
    ntr, _, nte, itr, _ = b.get_dispatch_layout(idx, E)
    kw = dict(num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte)
    _expect(fails, "topk without weights", lambda: b.dispatch(x, topk_idx=idx, **kw), ValueError, ["topk_weights"])
    _expect(fails, "bad layout", lambda: b.dispatch(x, topk_idx=idx, topk_weights=w, **{**kw, "is_token_in_rank": ~itr}),
            ValueError, ["is_token_in_rank"])
    _expect(fails, "x dtype", lambda: b.dispatch(x.half(), topk_idx=idx, topk_weights=w, **kw), ValueError, ["x"])
    _expect(fails, "fp8 scales", lambda: b.dispatch((x.to(FP8), torch.ones(3, 2)), topk_idx=idx, topk_weights=w, **kw),
            ValueError, ["scales"])
    _expect(fails, "alignment", lambda: b.dispatch(x, topk_idx=idx, topk_weights=w, expert_alignment=0, **kw),
            ValueError, ["expert_alignment"])
    _expect(fails, "config", lambda: b.dispatch(x, topk_idx=idx, topk_weights=w, config=object(), **kw), TypeError,
            ["config"])
    _expect(fails, "worst too small", lambda: b.dispatch(x, topk_idx=idx, topk_weights=w, num_worst_tokens=2, **kw),
            ValueError, ["num_worst_tokens"])
    rx, ri, rw, lst, h, _ = b.dispatch(x, topk_idx=idx, topk_weights=w, config=deep_ep.Config(), **kw)
    _expect(fails, "cached with topk", lambda: b.dispatch(x, handle=h, topk_idx=idx), ValueError, ["topk_idx"])
    _expect(fails, "combine x rows", lambda: b.combine(rx[:0].bfloat16() if rx.shape[0] else rx[:1], h), ValueError,
            ["x"])
    _expect(fails, "combine bias", lambda: b.combine(rx, h, bias=torch.zeros(2, H)), ValueError, ["bias"])
    _expect(fails, "combine handle", lambda: b.combine(rx, handle), TypeError, ["handle"])
    _expect(fails, "previous_event", lambda: b.combine(rx, h, previous_event=object()), TypeError, ["previous_event"])
    # The static API and tuning-only objects
    if not (isinstance(deep_ep.Buffer.get_low_latency_rdma_size_hint(M, H, R, E), int) and
            deep_ep.Buffer.get_low_latency_rdma_size_hint(M, H, R, E) > 0):
        fails.append("get_low_latency_rdma_size_hint: expected a positive int")
    cfg = deep_ep.Buffer.get_dispatch_config(R)
    if not isinstance(cfg, deep_ep.Config) or not isinstance(deep_ep.Buffer.get_combine_config(R), deep_ep.Config) \
            or cfg.get_nvl_buffer_size_hint(2 * H, R) <= 0 or cfg.get_rdma_buffer_size_hint(2 * H, R) <= 0:
        fails.append("get_dispatch_config / get_combine_config / Config size hints")
    _expect(fails, "set_num_sms odd", lambda: deep_ep.Buffer.set_num_sms(3), ValueError, ["new_num_sms"])
    deep_ep.Buffer.set_num_sms(24)
    if deep_ep.Buffer.num_sms != 24 or deep_ep.Buffer.get_dispatch_config(R).num_sms != 24:
        fails.append("set_num_sms: not kept")
    ev = deep_ep.Buffer.capture()
    ev.current_stream_wait()
    with ev:
        pass
    _expect(fails, "event without async", lambda: deep_ep.EventOverlap(None).current_stream_wait(), RuntimeError,
            ["async_finish"])
    # destroy (explicitly_destroy=True), then every call refuses
    d = deep_ep.Buffer(G, explicitly_destroy=True)
    d.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    d.destroy()
    _expect(fails, "after destroy", lambda: d.low_latency_dispatch(x, idx, M, E), RuntimeError, ["destroyed"])
    # EPBuffer: combine-time weights with the wrong shape
    with moe_ep.EPBuffer(b.ep_group, E, H, M, K) as eb:
        d = eb.dispatch(x, idx, w)
        _expect(fails, "EPBuffer topk_weights", lambda: eb.combine(torch.ones(d.expert_x.shape, dtype=torch.bfloat16),
                                                                   d, topk_weights=w[:1]), ValueError, ["topk_weights"])
    return fails


def test_refused_options_and_bad_input():
    fails = dist_util.run(1, _options_worker)[0]
    assert not fails, "\n".join(fails)


# ---------------------------------------------------------------------------- the example
def test_example_runs():
    """examples/deep_ep_user.py, as a DeepEP user runs it (2 CPU ranks of its own)."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("WORLD_SIZE", None)
    p = subprocess.run([sys.executable, os.path.join(REPO, "examples", "deep_ep_user.py"), "--ranks", "2"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]


# ---------------------------------------------------------------------------- GPU
GPU_RANKS = [1, 2, 4]


@pytest.mark.gpu
@pytest.mark.parametrize("R", GPU_RANKS)
def test_deep_ep_gpu(R):
    """Both modes at R=1 and with several ranks on the GPUs there are (sharing one: CUDA IPC)."""
    dist_util.need_gpu()
    backend = dist_util.gpu_backend(R)
    fails = []
    fails += [f for r in dist_util.run(R, _ll_worker, LL_CALLS * 2, 2, 4, 256, 8, backend=backend) for f in r]
    fails += [f for r in dist_util.run(R, _ll_worker, ("pow2", "ue8m0"), 2, 4, 1024, 8, backend=backend) for f in r]
    fails += [f for r in dist_util.run(R, _normal_worker, 2, 4, 256, 8, NORMAL_CALLS, backend=backend) for f in r]
    assert not fails, "\n".join(fails[:20])


def _ll_graph_worker(rank, R, fp8, node_size=None):
    """The low-latency pair captured in a CUDA graph once, replayed with new inputs and routing
    (``node_size`` < R: across nodes, through the proxy)."""
    import torch.distributed as dist

    import moe_ep.deep_ep as deep_ep
    from moe_ep.core.fp8 import dequantize_fp8, quantize_fp8

    if node_size is not None:
        os.environ["MOE_EP_NODE_SIZE"] = str(node_size)
    try:
        buffer = deep_ep.Buffer(dist.group.WORLD, low_latency_mode=True)
    finally:
        os.environ.pop("MOE_EP_NODE_SIZE", None)
    dev = buffer.device
    E, EL, K, H, M = 4 * R, 4, 4, 256, 8
    x, idx, w = (torch.zeros(M, H, dtype=torch.bfloat16, device=dev), torch.zeros(M, K, dtype=torch.int64, device=dev),
                 torch.zeros(M, K, device=dev))
    scale = torch.tensor([_expert_scale(rank * EL + e) for e in range(EL)], device=dev).view(EL, 1, 1)

    def step():
        recv_x, count, handle, _, _ = buffer.low_latency_dispatch(x, idx, M, E, use_fp8=fp8)
        vals = (recv_x[0].float() * recv_x[1].repeat_interleave(128, dim=-1)) if fp8 else recv_x.float()
        out, _, _ = buffer.low_latency_combine((vals * scale).to(torch.bfloat16), idx, w, handle)
        return out

    def load(call):
        g = torch.Generator().manual_seed(call * 13 + rank)
        x.copy_(torch.randn(M, H, generator=g).to(torch.bfloat16))
        i = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)])
        i[torch.rand(M, K, generator=g) < 0.2] = -1
        idx.copy_(i)
        w.copy_(torch.rand(M, K, generator=g) + 0.5)

    load(0)
    step()
    step()  # both buffers of the shape exist before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    fails = []
    for call in range(1, 5):
        load(call)
        graph.replay()
        torch.cuda.synchronize()
        mine = dequantize_fp8(*quantize_fp8(x.cpu())) if fp8 else x.cpu().float()
        exp = model.ll_combine(idx.cpu(), w.cpu(), lambda e, t: (mine[t] * _expert_scale(e)).to(torch.bfloat16).float(), H)
        bound = model.ll_combine(idx.cpu(), w.cpu(), lambda e, t: (mine[t] * _expert_scale(e)).abs(), H) * 2.0 ** -7
        if not _close(out, exp, bound):
            fails.append(f"[graph R{R} fp8={fp8} rank {rank} replay {call}] combined_x differs from the model")
    return fails


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_low_latency_cuda_graph(R, fp8):
    dist_util.need_gpu()
    fails = [f for r in dist_util.run(R, _ll_graph_worker, fp8, backend=dist_util.gpu_backend(R)) for f in r]
    assert not fails, "\n".join(fails)


@pytest.mark.gpu
def test_low_latency_cuda_graph_across_nodes():
    """Two nodes of one rank: the pair through the proxy (each (token, k) a token) in a graph."""
    dist_util.need_gpu()
    fails = [f for r in dist_util.run(2, _ll_graph_worker, True, 1, backend=dist_util.gpu_backend(2)) for f in r]
    assert not fails, "\n".join(fails)


def test_combine_time_weights_compile_for_sm90(monkeypatch, tmp_path):
    """The combine kernel with combine-time weights (the push, the owner's wait) compiles for
    sm_90 on a machine without a GPU: fused (one launch) and as separate push / send / receive."""
    pytest.importorskip("triton.backends.nvidia")
    import moe_ep
    from moe_ep.testing.aot import signature
    from test_compile_sm90 import _compile, gpu_chunking

    gpu_chunking(monkeypatch)
    rec = []

    def spy(key, fn, grid, args, consts, dynamic=None):
        consts = consts() if callable(consts) else consts
        if fn.fn.__name__ == "node_combine_kernel":
            rec.append((fn.fn.__module__, fn.fn.__name__, signature(fn.arg_names, args, consts)))

    g = moe_ep.EPGroup()
    T, H, K = 128, 7168, 8
    for fused in (True, False):
        buf = moe_ep.EPBuffer(g, 256, H, T, K, layout="masked", num_programs=132)
        buf.parts.tuning, buf.parts.interp = buf.tuning.replace(num_warps=8, fused=fused), False
        buf.calls.launch = spy
        h = buf.dispatch(torch.zeros(T, H, dtype=torch.bfloat16), torch.zeros(T, K, dtype=torch.int64),
                         torch.zeros(T, K))
        buf.combine(torch.empty(h.expert_x.shape, dtype=torch.bfloat16), h, topk_weights=torch.ones(T, K))
        buf.close()
    assert len(rec) == 1 + 3, [r[1] for r in rec]  # fused: one launch; else push, send, receive
    for i, (name, vec_stores, byte_stores, timers, _) in enumerate(_compile(rec, tmp_path)):
        # The push-only launch (i == 1) stores weights (4-byte words) and waits for nothing; the
        # send half alone in its node (i == 2) has only this rank's own tokens, which its receive
        # half pre-reduces from expert_y: it stores no rows.
        assert byte_stores == 0 and timers > 0 and (vec_stores > 0 or i in (1, 2)), (i, vec_stores, byte_stores,
                                                                                    timers)


def test_dispatch_layout_counts_only_ids_in_range():
    """``dispatch_layout`` (V1's ``get_dispatch_layout``, counted on the device without a host
    read): -1 and ids at or past ``num_experts`` count for no expert and no rank; every other id
    once per selection for its expert, once per token for its rank."""
    from moe_ep.deep_ep.routing import dispatch_layout

    E, R = 8, 4
    idx = torch.tensor([[0, 1, -1], [7, 8, 3], [-1, -1, -1], [2, 2, 15], [6, 5, 4]])
    per_rank, per_node, per_expert, in_rank = dispatch_layout(idx, E, R, 2)
    valid = idx[(idx >= 0) & (idx < E)]
    assert torch.equal(per_expert, torch.bincount(valid, minlength=E).to(torch.int32))
    want = torch.zeros(idx.shape[0], R, dtype=torch.bool)
    for t, row in enumerate(idx.tolist()):
        for e in row:
            if 0 <= e < E:
                want[t, e // (E // R)] = True
    assert torch.equal(in_rank, want) and torch.equal(per_rank, want.sum(0, dtype=torch.int32))
    assert torch.equal(per_node, want.view(-1, 2, 2).any(2).sum(0, dtype=torch.int32))
