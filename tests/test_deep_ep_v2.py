"""DeepEP V2's ElasticBuffer (moe_ep.deep_ep.elastic), deep_ep.utils' events and the branch/fork
keyword arguments of the low-latency pair, against a pure-torch oracle on CPU ranks (R = 1..4)."""
from __future__ import annotations

import contextlib
import time

import pytest
import torch

import dist_util

FP8 = torch.float8_e4m3fn
M, H, K = 6, 128, 3


def _inputs(rank: int, R: int, call: int):
    """This rank's (x bf16 [T, H], topk_idx int64 [T, K], topk_weights float32 [T, K]): T rotates
    over 0, M and M//2; ids may repeat within a token and may be -1."""
    g = torch.Generator().manual_seed(100 * call + 7 * rank + R)
    T = [0, M, M // 2][(call + rank) % 3]
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.randint(-1, 2 * R, (T, K), generator=g)
    if T:
        idx[0, 1] = idx[0, 0] = max(0, int(idx[0, 0]))  # a duplicate expert id
    return x, idx, torch.rand(T, K, generator=g) + 0.5


def _same(a, b) -> bool:
    """Bitwise equality of tensors or (x, scales) pairs."""
    if isinstance(a, tuple):
        return all(_same(p, q) for p, q in zip(a, b))
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _packs(rank: int, T: int) -> torch.Tensor:
    """int32 [T, H/128] scale packs of ``rank`` (four UE8M0 bytes each, no NaN pattern)."""
    t = torch.arange(T, dtype=torch.int32)[:, None] * 16 + torch.arange(H // 128, dtype=torch.int32)
    return 0x30303030 + rank * 256 + t


def _oracle_rows(xs, idxs, ws, rank: int, EL: int):
    """This rank's rows in (source rank, token) order: (x, local ids, weights, global source)."""
    rx, ri, rw, src = [], [], [], []
    for s, (x, idx, w) in enumerate(zip(xs, idxs, ws)):
        own = (idx >= rank * EL) & (idx < (rank + 1) * EL)
        for t in range(x.shape[0]):
            if own[t].any():
                rx.append(x[t]), ri.append(torch.where(own[t], idx[t] - rank * EL, -1))
                rw.append(torch.where(own[t], w[t], 0.0)), src.append(s * M + t)
    if not rx:
        return torch.zeros(0, H, dtype=torch.bfloat16), torch.zeros(0, K, dtype=torch.int64), torch.zeros(0, K), []
    return torch.stack(rx), torch.stack(ri), torch.stack(rw), src


def _combined_oracle(x, idx, R: int, EL: int, expand: bool) -> torch.Tensor:
    """float32 [T, H]: the combine of rows that rank r's experts scaled (rows: by 2^r; expanded: each
    selection of local expert e by 2^e, summed per rank and rounded): per receiving rank its row
    rounded to bf16, summed over ranks in float32 (round the result once to compare)."""
    exp32 = torch.zeros(x.shape[0], H)
    for r in range(R):
        own = (idx >= r * EL) & (idx < (r + 1) * EL)
        if expand:
            f = torch.where(own, 2.0 ** (idx - r * EL).clamp(min=0).float(), 0.0).sum(1)
            row = (x.float() * f[:, None]).to(torch.bfloat16)
        else:
            row = (x.float() * 2.0 ** r).to(torch.bfloat16) * own.any(1)[:, None]
        exp32 += row.float()
    return exp32


def _elastic_worker(rank, R, node_size=None, hybrid=True):
    """Every dispatch mode and its combine against the oracle; ``node_size`` < R: nodes of that many
    ranks, the other nodes through the proxy; ``hybrid``: ``allow_hybrid_mode`` (False: DeepEP's
    direct mode, one scale-up domain of every rank)."""
    import os

    import torch.distributed as dist

    import moe_ep.deep_ep as deep_ep
    from moe_ep.testing.reference import gather_inputs

    E, EL = 2 * R, 2
    if node_size is not None:
        os.environ["MOE_EP_NODE_SIZE"] = str(node_size)
    try:
        buf = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=M, hidden=H, num_topk=K,
                                    explicitly_destroy=True, num_gpu_timeout_secs=60, allow_hybrid_mode=hybrid)
    finally:
        os.environ.pop("MOE_EP_NODE_SIZE", None)
    nodes = R // (node_size or R)
    G = R // nodes if hybrid else R  # ranks per scale-up domain
    dev = buf.device  # inputs go there; results come back to the host for the oracle
    fails = []
    if buf.get_logical_domain_size() != (R // G, G) or buf.get_physical_domain_size() != (nodes, R // nodes) or \
            (buf.scaleout_rank_idx, buf.scaleup_rank_idx) != (rank // G, rank % G):
        fails.append(f"[R{R} rank {rank}] domains {buf.get_logical_domain_size()} {buf.get_physical_domain_size()}, "
                     f"indices {(buf.scaleout_rank_idx, buf.scaleup_rank_idx)} ({nodes} nodes, hybrid={hybrid})")
    qps = [buf.get_theoretical_num_qps(n) for n in (1, 4, 20)]
    if qps != ([17, 65, 65] if hybrid else [1, 4, 9]):  # DeepEP's rule, capped by num_allocated_qps
        fails.append(f"[R{R} rank {rank}] get_theoretical_num_qps {qps} (hybrid={hybrid})")
    for call, (expand, sync, align, fp8) in enumerate([(False, True, 1, True), (True, True, 4, False),
                                                      (False, False, 1, True), (True, False, 2, False)]):
        where = f"[R{R} G{G} rank {rank} call {call} expand={expand} sync={sync}]"
        x, idx, w = _inputs(rank, R, call)
        g = gather_inputs(buf.ep_group, x.to(dev), idx.to(dev), w.to(dev))
        ox, oi, ow, osrc = _oracle_rows(*([t.cpu() for t in ts] for ts in (g.x, g.topk_idx, g.topk_weights)),
                                        rank, EL)
        n = ox.shape[0]
        xin = x.to(dev)
        if fp8:  # pre-quantized with int32 scale packs (MXFP8 as vLLM packs them): they travel bit for bit
            packs = _packs(rank, x.shape[0])
            xin = (x.to(FP8).to(dev), packs.to(dev))
        stats = torch.zeros(EL, dtype=torch.int32, device=dev)
        guard = contextlib.nullcontext() if sync else _no_host_reads()
        idx_d, w_d = idx.to(dev), w.to(dev)
        with guard:
            rx, ri_d, rw_d, h, ev = buf.dispatch(xin, topk_idx=idx_d, topk_weights=w_d, num_experts=E,
                                                 expert_alignment=align, do_expand=expand, do_cpu_sync=sync,
                                                 cumulative_local_expert_recv_stats=stats,
                                                 num_max_tokens_per_rank=M if call % 2 else None)
        assert ev.event is None
        q, sc = (t.cpu() for t in rx) if fp8 else (rx.cpu(), None)
        ri, rw = None if ri_d is None else ri_d.cpu(), rw_d.cpu()
        counts = [int(((oi == e)).sum()) for e in range(EL)]
        if stats.tolist() != counts:
            fails.append(f"{where} stats {stats.tolist()} != {counts}")
        # received rows per source scale-up index (DeepEP's hybrid mode forwards them through that peer)
        psum_s = torch.tensor([sum(1 for s in osrc if (s // M) % G == i) for i in range(G)]).cumsum(0).tolist()
        if h.psum_num_recv_tokens_per_scaleup_rank.tolist() != psum_s:
            fails.append(f"{where} psum per scale-up rank {h.psum_num_recv_tokens_per_scaleup_rank.tolist()} "
                         f"!= {psum_s}")
        al = [-(-c // align) * align for c in counts]
        if h.num_recv_tokens_per_expert_list != (al if sync else []):
            fails.append(f"{where} list {h.num_recv_tokens_per_expert_list} != {al}")
        if not expand:
            rows = n if sync else R * M
            if q.shape[0] != rows or ri.shape != (rows, K):
                fails.append(f"{where} rows {q.shape[0]} != {rows}")
                continue
            if not (torch.equal(q[:n].to(torch.bfloat16) if not fp8 else q[:n].float(),
                                ox if not fp8 else ox.to(FP8).float())
                    and torch.equal(ri[:n], oi) and torch.equal(rw[:n], ow) and bool((ri[n:] == -1).all())):
                fails.append(f"{where} received rows differ from the oracle")
            if h.recv_src_metadata[:n, 0].tolist() != osrc or bool((h.recv_src_metadata[n:, 0] != -1).any()):
                fails.append(f"{where} recv_src_metadata")
            if fp8 and not torch.equal(sc[:n], torch.cat([_packs(sr // M, sr % M + 1)[-1:] for sr in osrc]
                                                        or [torch.zeros(0, H // 128, dtype=torch.int32)])):
                fails.append(f"{where} int32 scale packs did not travel bit for bit")
            if h.psum_num_recv_tokens_per_expert.tolist() != torch.tensor(al).cumsum(0).tolist():
                fails.append(f"{where} psum per expert")
            y = (q.float() * 2.0 ** rank).to(torch.bfloat16).to(dev)
            out, cw, _ = buf.combine(y, h, topk_weights=rw_d)
        else:
            N = sum(al) if sync else R * M * K + EL * (align - 1)
            if q.shape[0] != N or rw.shape != (N,) or ri is not None:
                fails.append(f"{where} expanded shape {list(q.shape)} != [{N}, {H}]")
                continue
            start = 0
            for e in range(EL):
                sel = [(r, k) for r in range(n) for k in range(K) if oi[r, k] == e]
                got_x, got_w = q[start:start + len(sel)], rw[start:start + len(sel)]
                if sel and not (torch.equal(got_x, torch.stack([ox[r] for r, _ in sel]))
                                and torch.equal(got_w, torch.tensor([float(ow[r, k]) for r, k in sel]))):
                    fails.append(f"{where} expert {e}: expanded rows differ from the oracle")
                if int(h.psum_num_recv_tokens_per_expert[e]) != start + len(sel):
                    fails.append(f"{where} expert {e}: psum {int(h.psum_num_recv_tokens_per_expert[e])}")
                start += -(-len(sel) // align) * align
            fac = torch.zeros(N)  # expert e's rows times 2^e (0 in padding)
            for e in range(EL):
                lo = int(h.psum_num_recv_tokens_per_expert[e]) - counts[e]
                fac[lo:lo + counts[e]] = 2.0 ** e
            y = (q.float() * fac[:, None]).to(torch.bfloat16).to(dev)
            with (contextlib.nullcontext() if sync else _no_host_reads()):
                out, cw, _ = buf.combine(y, h, topk_weights=rw_d)
        out, cw = out.cpu(), cw.cpu()
        exp32 = _combined_oracle(x.to(FP8).to(torch.bfloat16) if fp8 else x, idx, R, EL, expand)
        if not torch.equal(out, exp32.to(torch.bfloat16)):
            fails.append(f"{where} combined_x differs from the oracle (max {float((out.float() - exp32).abs().max())})")
        if not torch.equal(cw, torch.where(idx >= 0, w, 0.0)):
            fails.append(f"{where} combined_topk_weights differ")
        if not expand and sync:  # cached dispatch repeats the routing
            rx2, _, _, h2, _ = buf.dispatch(xin, handle=h)
            out2, _, _ = buf.combine(y, h2)
            if h2 is not h or not _same(rx2, rx) or not torch.equal(out2.cpu(), out):
                fails.append(f"{where} cached dispatch (and its combine) differs")
    slots = [s.epbuf for v in buf._v1._rows.values() for s in v]
    if len({id(s) for s in slots}) != len(buf._v1._rows) or len(slots) > 2:  # bf16 and fp8: one buffer each
        fails.append(f"[R{R} rank {rank}] {len(slots)} rows buffers for {len(buf._v1._rows)} shapes")
    # num_bytes: the bf16 rows buffer the dispatches made (across nodes with the proxy's regions)
    live = [s.epbuf.memory().total_bytes for k, v in buf._v1._rows.items() if k[3] == torch.bfloat16 for s in v]
    if [-(-b // (2 << 20)) * (2 << 20) for b in live] != [buf.num_bytes]:
        fails.append(f"[R{R} rank {rank}] num_bytes {buf.num_bytes} != the rows buffer's {live} (2 MiB-aligned)")
    buf.destroy()
    return fails


@pytest.mark.gpu
@pytest.mark.parametrize("R,node_size,hybrid", [(2, 2, True), (2, 1, False), (2, 1, True)],
                         ids=["1x2", "2x1-direct", "2x1-hybrid"])
def test_elastic_buffer_gpu(R, node_size, hybrid):
    """``_elastic_worker`` on GPU ranks sharing the GPU: one node, and two nodes of one rank through
    moe_ep's proxy."""
    dist_util.need_gpu()
    fails = [f for r in dist_util.run(R, _elastic_worker, node_size, hybrid, backend=dist_util.gpu_backend(R),
                                      timeout=300) for f in r]
    assert not fails, "\n".join(fails[:20])


@contextlib.contextmanager
def _no_host_reads():
    """``tolist`` / ``item`` (host reads of tensor values) raise inside: what ``do_cpu_sync=False``
    promises. (A call with a new shape or dtype still makes its buffer, collectively, once.)"""
    def refuse(*a, **k):
        raise AssertionError("a host read with do_cpu_sync=False")

    saved = torch.Tensor.tolist, torch.Tensor.item
    torch.Tensor.tolist, torch.Tensor.item = refuse, refuse
    try:
        yield
    finally:
        torch.Tensor.tolist, torch.Tensor.item = saved


@pytest.mark.parametrize("R", [1, 2, 3])
def test_elastic_buffer(R):
    fails = [f for r in dist_util.run(R, _elastic_worker) for f in r]
    assert not fails, "\n".join(fails[:20])


@pytest.mark.parametrize("R,node_size,hybrid", [(2, 1, False), (4, 2, True)], ids=["2x1-direct", "2x2-hybrid"])
def test_elastic_buffer_across_nodes(R, node_size, hybrid):
    """Two nodes of one and of two ranks: rows and expanded dispatches (zero-token ranks, duplicate
    expert ids) and their combines through moe_ep's proxy; the handle's scale-up prefix sums per
    source index in its scale-up domain (hybrid: the node; direct: every rank), the domains, the QP
    rule and num_bytes (the proxy's regions included)."""
    fails = [f for r in dist_util.run(R, _elastic_worker, node_size, hybrid, timeout=600) for f in r]
    assert not fails, "\n".join(fails[:20])


def _elastic_graph_worker(rank, R):
    """GPU ranks: an ElasticBuffer dispatch (``do_cpu_sync=False``, rows and expanded) and its
    combine captured in one CUDA graph, replayed with new routing copied into the captured inputs;
    each replay's combine against the oracle of ``_elastic_worker``."""
    import torch.distributed as dist

    import moe_ep.deep_ep as deep_ep

    dev = torch.device("cuda", torch.cuda.current_device())
    E, EL = 2 * R, 2
    buf = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=M, hidden=H, num_topk=K,
                                explicitly_destroy=True, num_gpu_timeout_secs=60)
    fails = []
    for expand in (False, True):
        xs = torch.zeros(M, H, dtype=torch.bfloat16, device=dev)
        ids = torch.full((M, K), -1, dtype=torch.int64, device=dev)
        ws = torch.zeros(M, K, device=dev)

        def step():
            rx, ri, rw, h, _ = buf.dispatch(xs, topk_idx=ids, topk_weights=ws, num_experts=E, do_expand=expand,
                                            do_cpu_sync=False)
            if expand:  # expert e's rows times 2^e, from the handle's prefix sums (no host read)
                ends = h.psum_num_recv_tokens_per_expert
                pos = torch.arange(rx.shape[0], device=dev)
                e = torch.searchsorted(ends, pos, right=True).clamp(max=EL - 1)
                y = (rx.float() * (2.0 ** e.float())[:, None]).to(torch.bfloat16)
            else:
                y = (rx.float() * 2.0 ** rank).to(torch.bfloat16)
            return buf.combine(y, h, topk_weights=rw)[:2]

        def load(call):
            x, idx, w = _inputs(rank, R, call + 10)
            x, idx, w = torch.cat([x, torch.zeros(M - x.shape[0], H, dtype=x.dtype)]), \
                torch.cat([idx, torch.full((M - idx.shape[0], K), -1)]), torch.cat([w, torch.zeros(M - w.shape[0], K)])
            xs.copy_(x), ids.copy_(idx), ws.copy_(w)
            return x, idx, w

        load(0)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # warm-up: buffers made, kernels compiled, outside the capture
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with _no_host_reads(), torch.cuda.graph(graph):
            out, cw = step()
        for call in range(3):
            x, idx, w = load(call)
            graph.replay()
            torch.cuda.synchronize()
            exp32 = _combined_oracle(x, idx, R, EL, expand)
            where = f"[R{R} rank {rank} expand={expand} replay {call}]"
            if not torch.equal(out.cpu(), exp32.to(torch.bfloat16)):
                fails.append(f"{where} combined_x differs (max {float((out.cpu().float() - exp32).abs().max())})")
            if not torch.equal(cw.cpu(), torch.where(idx >= 0, w, 0.0)):
                fails.append(f"{where} combined_topk_weights differ")
    buf.destroy()
    return fails


@pytest.mark.gpu
@pytest.mark.parametrize("R", [2])
def test_elastic_buffer_cuda_graph_gpu(R):
    """V2 dispatch + combine with ``do_cpu_sync=False`` captured in a CUDA graph on GPU ranks (ranks
    share the GPU when there are fewer GPUs than ranks), replayed with new routing."""
    dist_util.need_gpu()
    fails = [f for r in dist_util.run(R, _elastic_graph_worker, backend=dist_util.gpu_backend(R), timeout=300)
             for f in r]
    assert not fails, "\n".join(fails[:20])


# ---------------------------------------------------------------------------- streams and events
def _streams_worker(rank, R):
    """DeepEP's stream contract on ``ElasticBuffer`` (and V1's ``async_finish`` through the same
    path), observed by order, not by time: a slow kernel (``torch.cuda._sleep``) holds one stream
    while the other is checked. On CPU ranks the same calls run and their results are checked
    (events are complete there, nothing sleeps).

    1. ``previous_event`` recorded on a side stream after it writes x: the dispatch reads the new x;
       without it (control) the dispatch runs before the side stream and reads the old x.
    2. ``previous_event`` recorded before the caller queues more work: the call does not wait for
       that work (its event completes while the caller's stream still sleeps), and its own copies
       of the inputs (``topk_idx``) come after its wait, not on the caller's stream.
    3. ``async_with_compute_stream`` / ``async_finish``: the caller's stream does not wait (the event
       is not complete while the communication stream sleeps); after ``current_stream_wait()`` the
       output is right, even though the caller freed its inputs and reused their memory meanwhile.
    4. Outputs are recorded on the caller's stream: freed while the caller's stream still reads them,
       their memory is not handed to the next call's allocations on the communication stream.
    5. ``previous_event_before_epilogue``: the dispatch (rows) and the combine complete after it.
    6. ``barrier()`` returns after the work queued on the device.
    """
    import torch.distributed as dist

    import moe_ep.deep_ep as deep_ep
    from moe_ep.deep_ep.routing import dispatch_layout
    from moe_ep.deep_ep.utils import EventHandle, EventOverlap

    E, EL = 2 * R, 2
    buf = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=M, hidden=H, num_topk=K,
                                explicitly_destroy=True, num_gpu_timeout_secs=60)
    dev = buf.device
    gpu = dev.type == "cuda"
    v1 = deep_ep.Buffer(dist.group.WORLD, explicitly_destroy=True)
    cur = torch.cuda.current_stream() if gpu else None
    side = torch.cuda.Stream() if gpu else None
    fails = []

    def busy(stream=None):
        """A kernel holding ``stream`` (default: the current one) about a second; nothing on CPU."""
        if gpu:
            with torch.cuda.stream(stream or cur):
                torch.cuda._sleep(1 << 31)

    def busy_now(stream) -> bool:
        return gpu and not stream.query()

    def sync():
        if gpu:
            torch.cuda.synchronize()

    def combined(rx, h, rw):
        y = (rx.float() * 2.0 ** rank).to(torch.bfloat16)
        return buf.combine(y, h, topk_weights=rw)[0]

    x, idx, w = (t.to(dev) for t in _inputs(rank, R, 1))  # rank 0: M tokens, rank 1: M // 2
    want = _combined_oracle(x.cpu(), idx.cpu(), R, EL, False).to(torch.bfloat16)
    stale = torch.zeros_like(x)
    kw = dict(topk_idx=idx, topk_weights=w, num_experts=E)

    # 1. previous_event on a side stream
    for with_event in (True, False) if gpu else (True,):  # (the control needs streams)
        xs = stale.clone()
        if gpu:
            side.wait_stream(cur)
        with (torch.cuda.stream(side) if gpu else contextlib.nullcontext()):
            busy(side)
            xs.copy_(x)
            prev = EventOverlap(EventHandle())
        rx, _, rw, h, _ = buf.dispatch(xs, **kw, previous_event=prev if with_event else None,
                                       allocate_on_comm_stream=with_event)
        out = combined(rx, h, rw)
        sync()
        if with_event and not torch.equal(out.cpu(), want):
            fails.append(f"[rank {rank}] 1: with previous_event from the side stream the dispatch read the old x")
        if gpu and not with_event and torch.equal(out.cpu(), want):
            fails.append(f"[rank {rank}] 1 (control): without previous_event the dispatch still saw the side "
                         f"stream's x: the test cannot tell the order")

    # 2. work after previous_event is not waited for; the call's own input copies come after its wait
    prev = buf.capture()  # (V2's idiom: an EventHandle)
    busy()
    rx, _, rw, h, ev = buf.dispatch(x, **kw, previous_event=prev, allocate_on_comm_stream=True,
                                    async_with_compute_stream=True, do_cpu_sync=False)
    ev.event.synchronize()
    if gpu and not busy_now(cur):
        fails.append(f"[rank {rank}] 2: the dispatch waited for the caller's work queued after previous_event")
    ev.current_stream_wait()
    out = combined(rx, h, rw)
    sync()
    if not torch.equal(out.cpu(), want):
        fails.append(f"[rank {rank}] 2: the dispatch (previous_event, caller busy after it) differs from the oracle")

    # 3. async: the caller does not wait; its inputs, freed and their memory reused, still read right.
    # The inputs are copied before the sync, so that the caller's stream holds nothing of the test's
    # own when it is queried (ranks time-slicing one GPU can leave a just-queued copy unrun).
    x2, idx2, w2 = x.clone(), idx.clone(), w.clone()
    sync()
    busy(buf.get_comm_stream())
    rx, _, rw, h, ev = buf.dispatch(x2, topk_idx=idx2, topk_weights=w2, num_experts=E,
                                    async_with_compute_stream=True, do_cpu_sync=False)
    # By order: the caller's stream drains (its queued work may still be waiting for a time slice)
    # while the communication stream sleeps; a caller's stream that waited would drain only after.
    while gpu and busy_now(cur) and not ev.event.query():
        time.sleep(1e-4)
    if gpu and ev.event.query():
        fails.append(f"[rank {rank}] 3: async_with_compute_stream: the event completed before the caller's "
                     f"stream drained (the caller waited for the sleeping communication stream)")
    del x2, idx2, w2
    junk = (torch.full_like(x, 7.0), torch.full_like(idx, -1), torch.full_like(w, 3.0))  # (their freed memory)
    ev.current_stream_wait()
    out = combined(rx, h, rw)
    sync()
    if not torch.equal(out.cpu(), want):
        fails.append(f"[rank {rank}] 3: async dispatch differs after current_stream_wait (inputs freed early)")
    del junk
    # V1's async_finish on the same path. Called once first: a kernel's first launch in a process
    # may load its module, which CUDA may do with a context synchronization (lazy loading), and
    # that would wait for the sleep below whatever the call does.
    v1.get_dispatch_layout(idx, E)
    sync()
    busy(v1.get_comm_stream())
    layout = v1.get_dispatch_layout(idx, E, async_finish=True, allocate_on_comm_stream=True)
    if gpu and layout[-1].event.query():
        fails.append(f"[rank {rank}] 3: V1 async_finish: the event is complete while the communication stream sleeps")
    layout[-1].current_stream_wait()
    ref = dispatch_layout(idx, E, R, buf.ep_group.node_size)
    if not all(a is b is None or torch.equal(a, b) for a, b in zip(layout[:4], ref)):
        fails.append(f"[rank {rank}] 3: V1 get_dispatch_layout (async_finish) differs")

    # 4. outputs freed while the caller still reads them are not reused by the next call
    sync()
    rx, _, rw, h, _ = buf.dispatch(x, **kw)
    first, neg = rx.clone(), -x
    before = EventOverlap(EventHandle())
    busy()
    late = rx.float() * 1.0  # read after the sleep, on the caller's stream
    del rx
    rx2, _, rw2, h2, _ = buf.dispatch(neg, **kw, previous_event=before, allocate_on_comm_stream=True)
    sync()
    if not torch.equal(late.to(torch.bfloat16).cpu(), first.cpu()):
        fails.append(f"[rank {rank}] 4: a dispatch's recv_x, freed while the caller's stream read it, was "
                     f"overwritten by the next dispatch on the communication stream")
    if not torch.equal(rx2.cpu(), -first.cpu()):
        fails.append(f"[rank {rank}] 4: the second dispatch's rows differ")
    combined(rx2, h2, rw2)
    combined(first, h, rw)

    # 5. previous_event_before_epilogue: the call completes after it (dispatch on rows, and combine)
    sync()
    for what in ("dispatch", "combine"):
        if gpu:
            side.wait_stream(cur)
        with (torch.cuda.stream(side) if gpu else contextlib.nullcontext()):
            busy(side)
            late_ev = buf.capture()
        if what == "dispatch":
            rx, _, rw, h, ev = buf.dispatch(x, **kw, previous_event_before_epilogue=late_ev,
                                            async_with_compute_stream=True, do_cpu_sync=False)
        else:
            ev.current_stream_wait()
            y = (rx.float() * 2.0 ** rank).to(torch.bfloat16)
            out, _, ev = buf.combine(y, h, topk_weights=rw, previous_event_before_epilogue=late_ev,
                                     async_with_compute_stream=True)
        ev.event.synchronize()
        if busy_now(side):
            fails.append(f"[rank {rank}] 5: {what} completed before its previous_event_before_epilogue")
    ev.current_stream_wait()
    sync()
    if not torch.equal(out.cpu(), want):
        fails.append(f"[rank {rank}] 5: dispatch and combine with previous_event_before_epilogue differ")

    # 6. barrier(): every rank's queued work is done when it returns
    busy(buf.get_comm_stream())
    buf.barrier()
    if busy_now(buf.get_comm_stream()):
        fails.append(f"[rank {rank}] 6: barrier() returned while the communication stream still had work")
    sync()
    buf.destroy()
    v1.destroy()
    return fails


def _stream_order_worker(rank, R):
    """CPU ranks with a stand-in communication stream (the streams' bookkeeping of ``Buffer._issue``
    observed without a GPU): the copies a call makes of the caller's ``topk_idx`` / ``topk_weights``
    happen with the communication stream current, after its wait; with ``previous_event`` that
    stream does not wait for the caller's; with ``async_finish`` / ``async_with_compute_stream``
    the caller's inputs are recorded on the communication stream."""
    import torch.distributed as dist

    import moe_ep.deep_ep as deep_ep
    from moe_ep.deep_ep.utils import EventHandle, EventOverlap

    log, on_comm = [], [False]

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(("wait", self.name, other.name))

    comm, cur = Stream("comm"), Stream("cur")

    @contextlib.contextmanager
    def current(stream):
        saved, on_comm[0] = on_comm[0], stream is comm
        try:
            yield
        finally:
            on_comm[0] = saved

    class Caller(torch.Tensor):
        """A caller's tensor, taken for a CUDA one: logs its copies (and on which stream) and the
        streams it is recorded on; every op returns a plain tensor."""
        is_cuda = True

        def record_stream(self, stream):
            log.append(("record", stream.name))

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in ("clone", "contiguous"):
                log.append((name, "comm" if on_comm[0] else "cur"))
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))

    fails = []
    E = 2 * R
    x, idx, w = _inputs(rank, R, 1)
    x, idx, w = (t.as_subclass(Caller) for t in (x, idx, w))
    buf = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=M, hidden=H, num_topk=K,
                                explicitly_destroy=True)
    v1 = deep_ep.Buffer(dist.group.WORLD, explicitly_destroy=True)
    saved = torch.cuda.current_stream, torch.cuda.stream
    torch.cuda.current_stream, torch.cuda.stream = (lambda *a: cur), current
    buf._v1._comm_stream = v1._comm_stream = comm
    try:
        layout = dict(zip(("num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert",
                           "is_token_in_rank"), v1.get_dispatch_layout(idx, E)[:4]))
        for name, call in (
                ("ElasticBuffer.dispatch", lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                                                previous_event=EventOverlap(EventHandle()),
                                                                async_with_compute_stream=True)[4]),
                ("Buffer.dispatch", lambda: v1.dispatch(x, **layout, topk_idx=idx, topk_weights=w,
                                                        previous_event=EventOverlap(EventHandle()),
                                                        async_finish=True)[5])):
            log.clear()
            ev = call()
            copies = [e for e in log if e[0] in ("clone", "contiguous")]
            if not copies or any(e[1] != "comm" for e in copies):
                fails.append(f"{name}: the copies of the caller's tensors ran on {copies} (expected the "
                             f"communication stream, after its wait)")
            if ("wait", "comm", "cur") in log:
                fails.append(f"{name}: with previous_event the communication stream waited for the caller's")
            if sorted(e for e in log if e[0] == "record") != [("record", "comm")] * 3:
                fails.append(f"{name}: async: the caller's x, topk_idx, topk_weights recorded on "
                             f"{[e for e in log if e[0] == 'record']} (expected the communication stream)")
            if ev.event is None:
                fails.append(f"{name}: async: no event")
    finally:
        torch.cuda.current_stream, torch.cuda.stream = saved
        buf._v1._comm_stream = v1._comm_stream = None
    buf.destroy()
    v1.destroy()
    return fails


def test_stream_order_without_gpu():
    """``_stream_order_worker``: the order of a call's work on the streams, checked on a CPU rank."""
    fails = dist_util.run(1, _stream_order_worker)[0]
    assert not fails, "\n".join(fails)


def test_streams_and_events_cpu():
    """The stream contract's calls on CPU ranks: accepted, events complete, results the oracle's."""
    fails = [f for r in dist_util.run(2, _streams_worker) for f in r]
    assert not fails, "\n".join(fails[:20])


@pytest.mark.gpu
def test_streams_and_events_gpu():
    """The stream contract on real CUDA streams, two ranks sharing the GPU (``_streams_worker``)."""
    dist_util.need_gpu()
    fails = [f for r in dist_util.run(2, _streams_worker, backend=dist_util.gpu_backend(2), timeout=300) for f in r]
    assert not fails, "\n".join(fails[:20])


# ---------------------------------------------------------------------------- branch / fork options
def _forks_worker(rank, R):
    import torch.distributed as dist

    import moe_ep.deep_ep as deep_ep
    from moe_ep.deep_ep.utils import EventHandle, EventOverlap

    fails = []
    b = deep_ep.Buffer(dist.group.WORLD, 0, 0, low_latency_mode=True)
    E = 2 * R
    x = torch.randn(3, H).to(torch.bfloat16)
    idx = torch.tensor([[0, 1], [1, -1], [-1, -1]], dtype=torch.int64)
    w = torch.rand(3, 2)
    # asking for nothing: accepted, same result as without them
    prev = EventOverlap(EventHandle())
    rx, cnt, h, _, _ = b.low_latency_dispatch(x, idx, 4, E, use_fp8=False, use_nvfp4=False, x_global_scale=None)
    y = (rx.float() * 3).to(torch.bfloat16)
    ref, _, _ = b.low_latency_combine(y, idx, w, h)
    rx, cnt, h, _, _ = b.low_latency_dispatch(x, idx, 4, E, use_fp8=False)
    got, _, _ = b.low_latency_combine(y, idx, w, h, overlap=False, src_signals=None, src_signal_expect_value=0,
                                      packed_recv_count=None, comp_signal=None, block_m=64, threshold=0, num_sms=3)
    if not torch.equal(got, ref):
        fails.append("fork options at their defaults changed the combine")
    sig = torch.zeros(2, dtype=torch.int32)
    for name, kw, where in (("use_nvfp4", dict(use_nvfp4=True), "hybrid-ep"),
                            ("x_global_scale", dict(x_global_scale=torch.ones(1)), "hybrid-ep")):
        try:
            b.low_latency_dispatch(x, idx, 4, E, use_fp8=False, **kw)
            fails.append(f"{name}: accepted")
        except NotImplementedError as e:
            if name not in str(e) or where not in str(e):
                fails.append(f"{name}: the error does not name the option and its branch: {e}")
    for name, kw, where in (("overlap", dict(overlap=True), "single-batch overlap"),
                            ("src_signals", dict(src_signals=sig, src_signal_expect_value=1), "Blackwell"),
                            ("comp_signal", dict(comp_signal=sig, packed_recv_count=sig, block_m=64, threshold=1),
                             "antgroup-opt")):
        try:
            b.low_latency_combine(y, idx, w, h, **kw)
            fails.append(f"{name}: accepted")
        except NotImplementedError as e:
            if name not in str(e) or where not in str(e):
                fails.append(f"{name}: the error does not name the option and its fork: {e}")
    for call in (lambda: b.low_latency_dispatch(x, idx, 4, E, use_fp8=False, no_such_option=1),
                 lambda: b.low_latency_combine(y, idx, w, h, no_such_option=1)):
        try:
            call()
            fails.append("an unknown keyword argument was accepted")
        except TypeError as e:
            if "no_such_option" not in str(e):
                fails.append(f"unknown option: {e}")
    # deep_ep.utils' events: EventOverlap(EventHandle()) as previous_event, hooks, with-blocks
    _, _, _, _, _ = b.get_dispatch_layout(idx, E, previous_event=prev, async_finish=True)
    ev = EventOverlap(EventHandle())
    ev.register_hook_after_wait(lambda: 7)
    if ev.current_stream_wait() != 7 or ev.hook_after_wait is not None:
        fails.append("EventOverlap: the hook's result is not returned once")
    with ev(release_handle=True):
        pass
    if ev.event is not None:
        fails.append("EventOverlap: release_handle kept the event")
    eb = deep_ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=4, hidden=H, num_topk=2)
    _, _, _, hd, evd = eb.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, previous_event=eb.capture(),
                                   async_with_compute_stream=True)
    evd.current_stream_wait()
    if not isinstance(evd.event, EventHandle):
        fails.append("ElasticBuffer: async_with_compute_stream gives no EventHandle")
    for name, call, exc in (("num_cpu_bytes", lambda: deep_ep.ElasticBuffer(dist.group.WORLD, num_cpu_bytes=1 << 21),
                             NotImplementedError),
                            ("engram_fetch", lambda: eb.engram_fetch(idx), NotImplementedError),
                            ("num_max_tokens_per_rank", lambda: eb.dispatch(x, topk_idx=idx, num_experts=E,
                                                                            num_max_tokens_per_rank=8), ValueError),
                            ("destroy", lambda: eb.destroy(), RuntimeError)):
        try:
            call()
            fails.append(f"{name}: accepted")
        except exc as e:
            if name not in str(e) and "explicitly_destroy" not in str(e):
                fails.append(f"{name}: {e}")
    return fails


def test_branch_options_and_events():
    fails = dist_util.run(1, _forks_worker)[0]
    assert not fails, "\n".join(fails)


# ---------------------------------------------------------------------------- import deep_ep
def test_import_deep_ep_alias(tmp_path):
    """Install into a temporary directory, then a fresh interpreter's unedited ``import deep_ep``
    (as vLLM, SGLang and Megatron write it) loads moe_ep; a real DeepEP on the path is refused by
    name (install and import alike); uninstall removes only the alias; the doctor says which."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    site, real = tmp_path / "site", tmp_path / "real"
    site.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), repo])}

    def py(code: str, extra_path: str = ""):
        e = dict(env, PYTHONPATH=os.pathsep.join(filter(None, [env["PYTHONPATH"], extra_path])))
        return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120)

    from moe_ep.deep_ep import install as inst

    pkg = inst.install(str(site))
    user = py("import deep_ep, moe_ep.deep_ep as m\n"
              "from deep_ep.utils import EventHandle, EventOverlap\n"
              "assert deep_ep is m and deep_ep.utils is m.utils and deep_ep.EventOverlap is EventOverlap\n"
              "assert deep_ep.Buffer is m.Buffer and deep_ep.ElasticBuffer is m.ElasticBuffer and deep_ep.Config\n"
              "EventOverlap(EventHandle()).current_stream_wait()\n"
              "import importlib.util; assert importlib.util.find_spec('deep_ep') is not None\n"
              "from moe_ep.tools.doctor import deep_ep_alias; print(deep_ep_alias()['what'])")
    assert user.returncode == 0, user.stderr[-2000:]
    assert user.stdout.startswith("active") and str(site) in user.stdout
    # a real DeepEP beside the alias: import refuses naming it, install refuses too
    (real / "deep_ep").mkdir(parents=True)
    (real / "deep_ep" / "__init__.py").write_text("REAL = True\n")
    clash = py("import deep_ep", str(real))
    assert clash.returncode != 0 and str(real / "deep_ep") in clash.stderr and "shadow" in clash.stderr
    refused = subprocess.run([sys.executable, "-m", "moe_ep.deep_ep.install", "--target", str(tmp_path / "t2")],
                             env=dict(env, PYTHONPATH=os.pathsep.join([env["PYTHONPATH"], str(real)])),
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and str(real / "deep_ep") in refused.stderr
    assert not (tmp_path / "t2" / "deep_ep").exists()
    # uninstall removes the alias only, never a real package
    try:
        inst.uninstall(str(real))
        raise AssertionError("uninstall removed a real deep_ep")
    except RuntimeError as e:
        assert "not moe_ep's" in str(e)
    assert inst.uninstall(str(site)) == pkg and not os.path.exists(pkg)
