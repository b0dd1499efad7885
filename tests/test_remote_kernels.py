"""The inter-node path's formats (docs/ARCHITECTURE.md §10), read from real runs: one process per
rank, the native proxy over TCP loopback, the kernels under the interpreter.

After a dispatch and its combine, each rank checks byte by byte, against what it recomputes from
every rank's inputs (written from ARCHITECTURE.md, independently of the kernels): its send buffer
(``[HDR_p | rows_p]`` per peer in rank order: the count vector, the selections of each of ``p``'s
experts, then one row per token in token order with its trailer ``[token, lid[K], j[K], w[K]]``
and its payload); the round-1 headers every source delivered (the count matrix); the combine row
index of each token's partial row from a remote owner (``comb_row``); and the proxy's trace (a
header write to every peer, a rows write to each remote peer with round-1 rows, a header from
every source). The results themselves are checked against the oracle by tests/test_internode.py.
"""
from __future__ import annotations

import pytest
import torch

import dist_util
from moe_ep.internode.spec import REGIONS, RemoteSpec

E_PER_RANK, H, M, K = 2, 128, 6, 3


def _inputs(rank: int, R: int):
    """Rank ``rank``'s (x bf16 [T, H] integer-valued, topk_idx int64 [T, K] with -1s, weights
    float32 [T, K]); every rank can make every rank's."""
    g = torch.Generator().manual_seed(1000 + rank)
    T = [M, 0, M - 1, 4][rank % 4]
    E = E_PER_RANK * R
    x = torch.randint(-8, 9, (T, H), generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
    ids = ids.long()
    ids[torch.rand(T, K, generator=g) < 0.2] = -1
    w = torch.rand(T, K, generator=g)
    return x, ids, w


def _format_worker(rank, world_size, node_size, cap):
    import os

    import moe_ep

    os.environ["MOE_EP_PROXY_TRACE"] = "peers"  # the trace of every write posted and counted, checked below

    R, EL = world_size, E_PER_RANK
    group = moe_ep.EPGroup(node_size=node_size)
    x, ids, w = _inputs(rank, R)
    fails = []
    with moe_ep.EPBuffer(group, EL * R, H, M, K, timeout_s=20.0, private_capacity=cap) as buf:
        rp = buf.remote
        sp: RemoteSpec = rp.spec
        h = buf.dispatch(x, ids, w)
        buf.combine(torch.zeros(h.expert_x.shape, dtype=torch.bfloat16), h)
        send = rp.regions["disp_send"]
        words = send.view(torch.int32)
        hwords = rp.regions["hdr_send"].view(torch.int32)
        HDR, RB, PW = sp.hdr_bytes, sp.row_bytes, sp.payload_bytes // 4
        dst = torch.where(ids >= 0, ids // EL, -1)

        def rows_to(r_ids, p):  # tokens of a rank with a selection on p, ascending
            return [t for t in range(r_ids.shape[0]) if bool(((r_ids[t] >= 0) & (r_ids[t] // EL == p)).any())]
        cnt = [len(rows_to(ids, p)) for p in range(R)]
        # j: position of each selection among this rank's selections of its expert, order (token, k)
        j = torch.zeros_like(ids)
        seen: dict = {}
        for t in range(ids.shape[0]):
            for k in range(K):
                e = int(ids[t, k])
                if e >= 0:
                    j[t, k] = seen.get(e, 0)
                    seen[e] = j[t, k] + 1
        o, roff = 0, 0
        for p in range(R):
            hdr = hwords[p * HDR // 4:p * HDR // 4 + R + EL]  # (its own slot too: the proxy reads its counts there)
            if hdr[:R].tolist() != cnt:
                fails.append(f"rank {rank}: header for {p}: counts {hdr[:R].tolist()} != {cnt}")
            sel = [int((ids == p * EL + e).sum()) for e in range(EL)]
            if hdr[R:].tolist() != sel:
                fails.append(f"rank {rank}: header for {p}: selections {hdr[R:].tolist()} != {sel}")
            if sp.remote(p):
                for i, t in enumerate(rows_to(ids, p)):
                    row = o + i * RB
                    tr = words[row // 4 + PW:row // 4 + PW + 1 + 3 * K]
                    lid = torch.where(dst[t] == p, ids[t] - p * EL, -1)
                    want = [t] + lid.tolist() + torch.where(lid >= 0, j[t], tr[1 + K:1 + 2 * K].long()).tolist()
                    if tr[:1 + 2 * K].tolist() != want:
                        fails.append(f"rank {rank}: row {i} for {p}: trailer {tr[:1 + 2 * K].tolist()} != {want}")
                    wbits = w[t].view(torch.int32)
                    got_w = tr[1 + 2 * K:1 + 3 * K]
                    if not torch.equal(torch.where(lid >= 0, got_w, wbits), wbits):
                        fails.append(f"rank {rank}: row {i} for {p}: weights {got_w.tolist()} != {wbits.tolist()}")
                    if not torch.equal(send[row:row + 2 * H].view(torch.bfloat16), x[t]):
                        fails.append(f"rank {rank}: row {i} for {p}: payload differs from token {t}")
                    first = next(k for k in range(K) if int(dst[t, k]) == p)
                    if int(rp.state.comb_row[t, first]) != roff + i:
                        fails.append(f"rank {rank}: comb_row[{t}, {first}] = {int(rp.state.comb_row[t, first])}, "
                                     f"expected {roff + i}")
                roff += cnt[p]
                o += cnt[p] * RB
        # Selections that are not a token's first on a remote rank have no combine row.
        for t in range(ids.shape[0]):
            for k in range(K):
                p = int(dst[t, k])
                first_remote = p >= 0 and sp.remote(p) and all(int(dst[t, q]) != p for q in range(k))
                if not first_remote and int(rp.state.comb_row[t, k]) != -1:
                    fails.append(f"rank {rank}: comb_row[{t}, {k}] = {int(rp.state.comb_row[t, k])}, expected -1")
        # Received headers of epoch 1 (parity copy 1): every source's count vector.
        r1 = rp.regions["hdr_recv"].view(torch.int32)
        for s in range(R):
            if s == rank:
                continue
            at = (1 * R + s) * HDR // 4
            want = [len(rows_to(_inputs(s, R)[1], p)) for p in range(R)]
            if r1[at:at + R].tolist() != want:
                fails.append(f"rank {rank}: received header of {s}: {r1[at:at + R].tolist()} != {want}")
        # The trace of dispatch 1 (its combine, which carries its epoch, after disp_ready): what
        # was posted to and counted from whom.
        ev = [(kind, peer) for _, kind, peer, epoch in rp.proxy.trace() if epoch == 1]
        ev = ev[:ev.index(("disp_ready", -1)) + 1] if ("disp_ready", -1) in ev else ev
        peers = [p for p in range(R) if p != rank]
        for p in peers:
            if ("post_d0", p) not in ev or ("got_d0", p) not in ev:
                fails.append(f"rank {rank}: trace lacks a header to or from {p}: {ev}")
            has_rows = sp.remote(p) and min(cnt[p], sp.private_capacity) > 0
            if (("post_d1", p) in ev) != has_rows:
                fails.append(f"rank {rank}: trace: round-1 rows to {p} posted: {('post_d1', p) in ev}, "
                             f"expected {has_rows}")
        if ev.count(("hdr_ready", -1)) != 1 or ev[-1] != ("disp_ready", -1):
            fails.append(f"rank {rank}: trace of dispatch 1: {ev}")
    return fails


@pytest.mark.parametrize("R,node_size,cap", [(3, 1, 1), (4, 2, 0)], ids=["3x1-cap1", "2x2-cap0"])
def test_send_buffer_headers_and_trailers(R, node_size, cap):
    fails = [f for r in dist_util.run(R, _format_worker, node_size, cap, timeout=300) for f in r]
    assert not fails, "\n".join(fails[:20])


def test_sizes_match_the_proxy():
    from moe_ep.native import protocol, proxy

    for fp8, h, k in ((False, 128, 3), (True, 7168, 8), (True, 2064, 1)):
        sp = RemoteSpec(rank=1, world=4, node_size=2, num_experts=16, topk=k, hidden=h, max_tokens=32, fp8=fp8,
                        private_capacity=5, overflow_capacity=40)
        assert sp.row_bytes % 16 == 0 and sp.row_bytes >= sp.payload_bytes + 4 * (1 + 3 * k)
        assert sp.hdr_bytes == protocol.hdr_bytes(4, 4)
        need = proxy.proxy_region_bytes(4, node_size=2, num_local_experts=4, row_bytes=sp.row_bytes,
                                        comb_row_bytes=sp.comb_row_bytes, private_capacity=5, overflow_capacity=40,
                                        max_send_rows=sp.max_send_rows)
        assert [need[n] for n in REGIONS] == [sp.region_bytes()[n] for n in REGIONS]
    assert RemoteSpec(0, 2, 1, 2, 8, 7168, 128, True, 4, 8).row_bytes == 7504  # 7168 + 4*56 + 4*25, aligned
