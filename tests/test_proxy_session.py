"""start_proxy: a proxy per rank from an EPGroup (endpoints exchanged over gloo), one dispatch and
one combine round trip per epoch, rows checked where docs/ARCHITECTURE.md §10 puts them."""
import numpy as np
import pytest

import dist_util

RB, CRB, EL = 32, 16, 2


def _rows(e, s, p, n):
    v = (np.arange(n * RB, dtype=np.int64) * 7 + 1000 * e + 100 * s + 10 * p) % 251
    return v.astype(np.uint8).reshape(n, RB)


def _session_worker(rank, R, node_size, cap):
    import moe_ep
    from moe_ep.internode.session import start_proxy

    group = moe_ep.EPGroup(node_size=node_size)
    rng = np.random.default_rng(7)
    counts = [rng.integers(0, 6, size=(R, R)) for _ in range(3)]
    for C in counts:
        np.fill_diagonal(C, 0)
    px = start_proxy(group, num_local_experts=EL, row_bytes=RB, comb_row_bytes=CRB, private_capacity=cap,
                     overflow_capacity=R * 8, max_send_rows=R * 8, timeout_s=20, streams=2)
    got = []
    try:
        for e, C in enumerate(counts, start=1):
            for p in range(R):
                hdr = px.header(p)
                hdr[:R] = C[rank]
                hdr[R:R + EL] = e
            for p, off in px.disp_offsets(C[rank]).items():
                n = int(C[rank, p])
                px.disp_send[off:off + n * RB] = _rows(e, rank, p, n).reshape(-1)
            px.ring("dispatch", e)
            px.wait_ready("dispatch", e, 20)
            received = {}
            for s in range(R):
                if s == rank:
                    continue
                base = px.round1_offset(e, s)
                hdr = px.received_header(e, s)
                assert hdr[:R].tolist() == C[s].tolist() and hdr[R:R + EL].tolist() == [e] * EL
                if px.remote(s):
                    c = int(C[s, rank])
                    n1 = min(c, cap)
                    o = sum(max(0, int(C[q, rank]) - cap) for q in range(s) if q != rank and px.remote(q))
                    o = px.overflow_offset(e) + o * RB
                    rows = np.concatenate([px.round1[base:base + n1 * RB].reshape(n1, RB),
                                           px.overflow[o:o + (c - n1) * RB].reshape(c - n1, RB)])
                    assert np.array_equal(rows, _rows(e, s, rank, c)), (e, s)
                    received[s] = rows
            # combine: one CRB-byte row back per received row (its first CRB bytes), in order
            o = 0
            for s in sorted(received):
                back = received[s][:, :CRB].reshape(-1)
                px.comb_send[o:o + back.size] = back
                o += back.size
            px.ring("combine", e)
            px.wait_ready("combine", e, 20)
            o = px.comb_recv_offset(e) // CRB
            for p in range(R):
                if p != rank and px.remote(p):
                    c = int(C[rank, p])
                    assert np.array_equal(px.comb_recv[o * CRB:(o + c) * CRB].reshape(c, CRB),
                                          _rows(e, rank, p, c)[:, :CRB]), (e, p)
                    o += c
            got.append(int(px.phases_done))
            group.barrier()
    finally:
        px.close()
        px.engine.close()
    return got


@pytest.mark.parametrize("R,node_size,cap", [(4, 2, 1), (3, 1, 0), (4, 1, 64)])
def test_start_proxy_round_trips(R, node_size, cap):
    results = dist_util.run(R, _session_worker, node_size, cap, timeout=120)
    # phases_done right after each epoch's combine is ready: a dispatch and a combine per epoch, each
    # counted before its ready word is stored
    assert results == [[2, 4, 6]] * R, results


def _identity_worker(rank, R):
    import moe_ep
    from moe_ep.internode.session import start_proxy

    group = moe_ep.EPGroup(node_size=1)
    out = []
    for _ in range(2):  # two sessions, one after the other
        px = start_proxy(group, num_local_experts=EL, row_bytes=RB, comb_row_bytes=CRB, private_capacity=1,
                         overflow_capacity=8, max_send_rows=8, timeout_s=20, streams=2)
        try:
            e = px.engine
            group.barrier()  # every rank connected: nothing of this session may have been refused
            out.append((e.identity.secret, e.identity.session, e.refused().total,
                        [e.peer_error(p) for p in range(R) if p != rank]))
            group.barrier()
        finally:
            px.close()
            px.engine.close()
    return out


def test_each_session_has_its_own_identity():
    """start_proxy: rank 0 draws the session's secret and epoch, every rank's engine gets them, no
    connection of the session's own ranks is refused, and the next session has another secret."""
    results = dist_util.run(3, _identity_worker, timeout=120)
    for session in range(2):
        got = {r[session][:2] for r in results}
        assert len(got) == 1, "the ranks' engines got different identities"
        (secret, epoch), = got
        assert len(secret) == 16 and secret != bytes(16) and epoch > 0
        assert all(r[session][2] == 0 and r[session][3] == ["", ""] for r in results), results
    assert results[0][0][0] != results[0][1][0] and results[0][1][1] >= results[0][0][1]


def test_default_private_capacity():
    from moe_ep.internode.spec import default_private_capacity

    # decode at EP16: a token touches a given rank with probability ~0.41 -> ~1.25 * 128 * 0.41 + 8
    assert 60 <= default_private_capacity(128, 8, 256, 16) <= 80
    assert default_private_capacity(128, 8, 256, 2) == 128  # 2 ranks: nearly every token, capped
    assert default_private_capacity(16, 1, 64, 64) == 9     # sparse: mostly headroom
