"""§10 inter-node protocol, proxy side (csrc/proxy/proxy.cc), on CPU over TCP loopback.

Every rank is a process with a TcpTransport and a Proxy; the kernels are stood in for by numpy:
they pack the send buffers, ring the mailbox doorbells and poll the ready words (and, where a
receiver's overflow needs several windows of the region, unpack each and raise ``ov_done``).
Every row is checked byte for byte where §10 puts it (round-1 slot, overflow offset in its
window, combine offset), with delay and reorder injection on, over several epochs; plus the
capacity decision, a rank killed mid-dispatch, silent ranks (alive, never ringing): the others'
timeouts name them, and a receiver killed or silent in its fourth overflow window.
"""
import multiprocessing as mp
import os
import re
import signal
import time
import traceback

import numpy as np
import pytest

from moe_ep import CapacityError, CommTimeoutError
import native_hooks as hooks
from moe_ep.native import protocol, proxy
from moe_ep.native.library import NativeError, PeerLostError
from moe_ep.native.protocol import MAILBOX, MAILBOX_WORDS, make_imm
from moe_ep.native.proxy import Proxy
from moe_ep.native.transports import TcpTransport

RB, CRB, EL = 40, 24, 3  # dispatch row bytes, combine row bytes, local experts per rank
MAXC = 9                 # per-destination counts are drawn from 0..MAXC-1


def _counts(seed, epoch, R, maxc=MAXC):
    """The count matrix C[s][p] of an epoch (every rank derives the same one)."""
    rng = np.random.default_rng([seed, epoch])
    C = rng.integers(0, maxc, (R, R))
    C[rng.random((R, R)) < 0.25] = 0    # zero-row peers
    if epoch % 3 == 2:
        C[rng.integers(R)] = 0           # a rank sending nothing at all
    return C.astype(np.int32)


def _rows(seed, epoch, s, p, n):
    return np.random.default_rng([seed, epoch, s, p, 7]).integers(0, 256, (n, RB), dtype=np.uint8)


def _el(epoch, s, p):
    return (np.arange(EL) + 1000 * s + 100 * p + epoch).astype(np.int32)


def _comb(owner, rows):
    """The owner's combine row for each received row (order-dependent content)."""
    return rows[:, :CRB] ^ np.uint8(16 * owner + 3)


def _remote_before(px, C, p, upto, axis):
    """Sum over remote ranks q < upto (relative to p's node) of C[q][p] (axis 0) or C[p][q] (axis 1)."""
    tot = 0
    for q in range(upto):
        if q != p and q // px.node_size != p // px.node_size:
            tot += C[q, p] if axis == 0 else C[p, q]
    return int(tot)


def _combine_epochs(plan, epochs):
    """The epochs followed by a combine: every one, or with plan["runs"] = [n1, n2, ...] the last
    of each run of n dispatches in a row (dispatch 1..n1, combine n1, ...)."""
    if not plan or "runs" not in plan:
        return set(range(1, epochs + 1))
    ends = np.cumsum(plan["runs"])
    assert ends[-1] == epochs
    return {int(x) for x in ends}


def _overflow_windows(px, e, C, cap, timeout_s, stop_at=None):
    """Dispatch receive "kernel" for an overflow stream of several windows (§10 "Round 2 in
    windows"): window 0 once every source's ready2 is up, then each window w >= 1 after raising
    ``ov_done`` for w (the region is free) and seeing ``ov_ready`` for w. Returns the whole stream
    (bytes), None when it fits one window (read from the region), or "stopped" at window
    ``stop_at`` (before its ``ov_done``)."""
    R, rank, B = px.world, px.rank, px.overflow_capacity
    O = sum(max(0, int(C[s, rank]) - cap) for s in range(R) if s != rank and px.remote(s))
    n_win = -(-O // B) if B else 0
    if n_win <= 1:
        return None
    for s in range(R):
        if s != rank and px.remote(s):
            px.wait_word(protocol.mailbox_word("ready2", R, s), e, timeout_s, epoch=e)
    base = px.overflow_offset(e)
    parts = [px.overflow[base:base + B * RB].copy()]
    for w in range(1, n_win):
        if w == stop_at:
            return "stopped"
        px.mailbox[MAILBOX["ov_done"]] = protocol.ov_window(e, w)
        px.wait_word(MAILBOX["ov_ready"], protocol.ov_window(e, w), timeout_s, epoch=e)
        parts.append(px.overflow[base:base + min(B, O - w * B) * RB].copy())
    return np.concatenate(parts)


def _check_dispatch(px, seed, e, R, maxc, cap, plan, stats=None, stream=None):
    """Dispatch receive "kernel": every header and row of epoch e where §10 puts it (in the
    epoch's parity copy; the overflow from ``stream`` where it came in several windows); returns
    the rows received from each remote source."""
    rank = px.rank
    C = _epoch_counts(seed, e, R, maxc, plan)
    received = {}
    ov_base = px.overflow_offset(e)
    region = px.overflow if stream is None else stream
    if stream is not None:
        ov_base = 0
    for s in range(R):
        if s == rank:
            continue
        base = px.round1_offset(e, s)
        hdr = px.received_header(e, s)
        np.testing.assert_array_equal(hdr[:R], C[s], err_msg=f"epoch {e}: header counts from {s}")
        np.testing.assert_array_equal(hdr[R:R + EL], _el(e, s, rank))
        if not px.remote(s):
            continue
        c = int(C[s, rank])
        n1, ov = min(c, cap), max(0, c - cap)
        want = _rows(seed, e, s, rank, c)
        got1 = px.round1[base:base + n1 * RB].reshape(n1, RB)
        np.testing.assert_array_equal(got1, want[:n1], err_msg=f"epoch {e}: round-1 rows from {s}")
        o = ov_base + RB * sum(max(0, int(C[q, rank]) - cap) for q in range(s) if q != rank and px.remote(q))
        got2 = region[o:o + ov * RB].reshape(ov, RB)
        np.testing.assert_array_equal(got2, want[n1:], err_msg=f"epoch {e}: overflow rows from {s}")
        received[s] = np.concatenate([got1, got2])
        if stats is not None:
            stats["round1_rows"] += n1
            stats["overflow_rows"] += ov
    return received


def _wait_headers(px, e, timeout_s):
    """Waits until every peer's header of epoch e has landed (its EL part is unique per epoch)."""
    deadline = time.monotonic() + timeout_s
    R = px.world
    for s in range(R):
        while s != px.rank and not np.array_equal(px.received_header(e, s)[R:R + EL], _el(e, s, px.rank)):
            if time.monotonic() > deadline:
                raise CommTimeoutError(px.rank, s, "run-ahead header", e, timeout_s)
            time.sleep(0.001)


def _epoch_counts(seed, e, R, maxc, plan):
    C = _counts(seed, e, R, maxc)
    if plan and plan.get("big_epoch") == e:
        C[:, plan["big_dst"]] = maxc + 5
        np.fill_diagonal(C, 0)
    if plan and plan.get("all_to") is not None:  # every epoch: every rank sends maxc + 5 rows to one
        C[:, plan["all_to"]] = maxc + 5
        np.fill_diagonal(C, 0)
    if plan and plan.get("victim") is not None and plan.get("epoch") == e:
        # every survivor sends the victim rows, so it waits for the victim in combine too and cannot
        # finish the victim's epoch
        C[:, plan["victim"]] = np.maximum(C[:, plan["victim"]], 1)
        np.fill_diagonal(C, 0)
    return C


def _rank_main(rank, R, node_size, cap, ovcap, epochs, seed, fault, maxc, plan, timeout_s, conn):
    try:
        eng = TcpTransport(rank, R, streams=2)
        if fault:
            hooks.set_fault(eng, delay_us=200, reorder=True)
        px = Proxy(eng, node_size=node_size, num_local_experts=EL, row_bytes=RB, comb_row_bytes=CRB,
                   private_capacity=cap, overflow_capacity=ovcap, max_send_rows=R * (maxc + 5), timeout_s=timeout_s,
                   spin_us=20, sleep_us=200)
        assert list(px.keys.values()) == [1, 2, 3, 4, 5, 6, 7]
        conn.send(eng.endpoint)
        eng.connect(conn.recv(), timeout_s=10)
        px.start()
        log = []
        stats = {"round1_rows": 0, "overflow_rows": 0, "combine_rows": 0, "ran_ahead": 0, "stale_count": 0}
        served = 0  # phases this rank's proxy has made ready: its count must include each at once
        combine_at = _combine_epochs(plan, epochs)
        for e in range(1, epochs + 1):
            C = _epoch_counts(seed, e, R, maxc, plan)
            # ---- dispatch send "kernel": a header per peer (own slot: the count vector), rows_p per
            # remote peer p, rank order
            for p in range(R):
                hdr = px.header(p)
                hdr[:R] = C[rank]
                hdr[R:R + EL] = _el(e, rank, p)
            for p, off in px.disp_offsets(C[rank]).items():
                n = int(C[rank, p])
                px.disp_send[off:off + n * RB] = _rows(seed, e, rank, p, n).reshape(-1)
            victim = plan and plan.get("victim") == rank and plan.get("epoch") == e
            silent = plan and rank in plan.get("silent", ()) and plan.get("epoch") == e
            if silent and plan["phase"] == "dispatch":  # alive, but never rings: the others time out
                log.append(("silent", e))
                break
            if victim:  # every survivor has finished epoch e - 1 (its epoch-e header landed here), so
                _wait_headers(px, e, timeout_s)  # the kill can only break epoch e, not a slow survivor's e - 1
            if victim and plan["when"] == "before_ring":
                conn.send(("dying", e, time.monotonic()))
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.monotonic()
            px.ring("dispatch", e)
            if victim:  # after the doorbell: its proxy may have posted some round-1 writes
                conn.send(("dying", e, time.monotonic()))
                os.kill(os.getpid(), signal.SIGKILL)
            stop_at = plan.get("stop_window") if plan and plan.get("win_victim") == rank and plan["epoch"] == e else None
            try:
                stream = _overflow_windows(px, e, C, cap, timeout_s + 5, stop_at)
                if isinstance(stream, str):  # the victim of a later window: killed, or silent (alive)
                    if plan["how"] == "kill":
                        conn.send(("dying", e, time.monotonic()))
                        os.kill(os.getpid(), signal.SIGKILL)
                    log.append(("silent", e))
                    break
                px.wait_ready("dispatch", e, timeout_s + 5)
            except Exception as ex:  # noqa: BLE001 - reported to the parent
                log.append(("error", e, type(ex).__name__, str(ex), time.monotonic() - t0, px.error_record()))
                break
            served += 1
            stats["stale_count"] += px.phases_done != served
            if plan and plan.get("lag") == rank and e not in combine_at and e < epochs:
                # dispatches in a row: the others run ahead into dispatch e+1 and write its headers
                # into the other parity copy while this rank has not read epoch e yet
                _wait_headers(px, e + 1, timeout_s)
                stats["ran_ahead"] += 1
            received = _check_dispatch(px, seed, e, R, maxc, cap, plan, stats, stream)
            stats["windows"] = max(stats.get("windows", 0), 0 if stream is None else -(-len(stream) // (RB * ovcap)))
            if e not in combine_at:
                log.append(("ok", e))
                continue
            if silent:  # dispatched, but never rings the combine
                log.append(("silent", e))
                break
            # ---- combine send "kernel": per remote source, one row per received row of round 1 and
            # overflow window 0, in order; then each later window's rows from row 0, once the proxy
            # sent the window before (comb_win_done)
            rows = {s: _comb(rank, received[s]) for s in sorted(received)}
            o_s = {s: max(0, len(rows[s]) - cap) for s in rows}
            st = dict(zip(rows, np.cumsum([0] + [o_s[s] for s in rows])))
            o = 0
            for s in rows:
                c0 = len(rows[s]) - o_s[s] + min(o_s[s], max(0, ovcap - st[s]))
                px.comb_send[o:o + c0 * CRB] = rows[s][:c0].reshape(-1)
                o += c0 * CRB
            px.ring("combine", e)
            try:
                n_win = -(-sum(o_s.values()) // ovcap) if ovcap else 0
                for w in range(1, n_win):
                    px.wait_word(MAILBOX["comb_win_done"], protocol.ov_window(e, w), timeout_s + 5, phase="combine",
                                 epoch=e)
                    for s in rows:
                        lo, hi = max(st[s], w * ovcap), min(st[s] + o_s[s], (w + 1) * ovcap)
                        if hi > lo:
                            part = rows[s][cap + lo - st[s]:cap + hi - st[s]]
                            px.comb_send[(lo - w * ovcap) * CRB:(hi - w * ovcap) * CRB] = part.reshape(-1)
                    px.mailbox[MAILBOX["comb_win_bell"]] = protocol.ov_window(e, w)
                px.wait_ready("combine", e, timeout_s + 5)
            except Exception as ex:  # noqa: BLE001
                log.append(("error", e, type(ex).__name__, str(ex), time.monotonic() - t0, px.error_record()))
                break
            served += 1
            stats["stale_count"] += px.phases_done != served
            # ---- combine receive "kernel": owner p's rows at sum of c_{rank,p'} over remote p' < p
            cbase = px.comb_recv_offset(e)
            for p in range(R):
                if p == rank or not px.remote(p):
                    continue
                o = cbase + CRB * _remote_before(px, C, rank, p, axis=1)
                n = int(C[rank, p])
                got = px.comb_recv[o:o + n * CRB].reshape(n, CRB)
                np.testing.assert_array_equal(got, _comb(p, _rows(seed, e, rank, p, n)),
                                              err_msg=f"epoch {e}: combine rows from owner {p}")
                stats["combine_rows"] += n
            log.append(("ok", e))
        log.append(stats)
        conn.send(("done", log))
        conn.recv()  # every rank finished before any closes
        px.close()
        eng.close()
    except BaseException:  # noqa: BLE001
        conn.send(("exception", traceback.format_exc()))
        raise


def _run(R, node_size, cap, *, epochs=3, seed=0, ovcap=None, fault=True, maxc=MAXC, plan=None, timeout_s=10.0,
         wall_s=60.0):
    ctx = mp.get_context("fork")
    if ovcap is None:
        ovcap = R * (maxc + 6)
    procs = []
    for r in range(R):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_rank_main, daemon=True,
                        args=(r, R, node_size, cap, ovcap, epochs, seed, fault, maxc, plan, timeout_s, child))
        p.start()
        procs.append((p, parent))
    try:
        eps = []
        for p, c in procs:
            assert c.poll(30), "rank did not start"
            msg = c.recv()
            assert isinstance(msg, str), msg
            eps.append(msg)
        for _, c in procs:
            c.send(eps)
        deadline = time.monotonic() + wall_s
        out = {}
        for r, (p, c) in enumerate(procs):
            assert c.poll(max(0.0, deadline - time.monotonic())), f"rank {r} hung"
            msg = c.recv()
            if msg[0] == "dying":  # the victim: it sends nothing more
                out["dying"] = msg
                continue
            assert msg[0] != "exception", f"rank {r}:\n{msg[1]}"
            out[r] = msg[1]
        for r, (p, c) in enumerate(procs):
            if r in out:
                c.send("close")
        for r, (p, _) in enumerate(procs):
            if r in out:
                p.join(20)
                assert p.exitcode == 0, f"rank {r} exit code {p.exitcode}"
        return out
    finally:
        for p, _ in procs:
            if p.is_alive():
                p.kill()


# ---------------------------------------------------------------- in one process

def test_mailbox_layout_and_imm():
    for W in (2, 5):
        want = {**MAILBOX, "n_fixed": MAILBOX_WORDS,
                **{a: protocol.mailbox_word(a, W, 0) for a in protocol.MAILBOX_ARRAYS}, "n_words": protocol.mailbox_words(W)}
        assert proxy.native_mailbox_layout(W) == want
    assert protocol.mailbox_words(3) == 12 + 4 * 3 and protocol.mailbox_word("ready2", 3, 1) == 12 + 2 * 3 + 1
    # phase in bits 31..29, source rank in bits 28..16, epoch mod 2^16 in bits 15..0
    assert make_imm(0, 5) == 5 and make_imm(1, 5) == (1 << 29) | 5 and make_imm(2, 5) == (2 << 29) | 5
    assert make_imm(2, 5, src=3) == (2 << 29) | (3 << 16) | 5
    assert make_imm(protocol.PHASE_CREDIT, 5, src=3) == (4 << 29) | (3 << 16) | 5
    assert make_imm(1, (1 << 16) + 7, src=protocol.IMM_MAX_RANKS - 1) == (1 << 29) | (0x1FFF << 16) | 7
    assert protocol.IMM_MAX_RANKS == 1 << 13
    assert protocol.ov_window(3, 2) == (3 << 32) | 2 and protocol.ov_window(2, 1 << 20) < protocol.ov_window(3, 0)
    assert protocol.hdr_bytes(4, 3) == 32 and protocol.hdr_bytes(3, 1) == 16 and protocol.hdr_bytes(4, 4) == 32


def test_imm_names_source_and_epoch():
    """A peer's write counts only with its own rank, phase and epoch in the immediate: rank 0 is
    a bare engine posting round-1 writes by hand (so Python's make_imm is checked against the
    proxy's), rank 1 a proxy. Writes from another source, of another phase or of the next epoch
    do not complete round 1 of epoch 1; the next epoch's write, early, completes epoch 2 (run
    ahead); epoch 3 with no write times out naming peer 0."""
    a, b = TcpTransport(0, 2, streams=1), TcpTransport(1, 2, streams=1)
    try:
        pb = Proxy(b, node_size=1, num_local_experts=1, row_bytes=RB, comb_row_bytes=CRB, private_capacity=1,
                   overflow_capacity=2, max_send_rows=4, timeout_s=1.0)
        regs = {n: np.zeros(max(int(nb), 16), np.uint8) for n, nb in pb.region_bytes.items()}
        keys = [a.register(regs[n]) for n in protocol.REGION_NAMES]  # same order: the keys agree
        a.connect([a.endpoint, b.endpoint], 10)
        b.connect([a.endpoint, b.endpoint], 10)
        pb.start()
        hs, hr = (keys[protocol.REGION_NAMES.index(n)] for n in protocol.HEADER_REGIONS)

        def header(epoch, imm):  # rank 0's (all-zero) header into its header slot of `epoch`
            a.post_write(1, hs, 0, hr, ((epoch & 1) * 2 + 0) * pb.hdr_bytes, pb.hdr_bytes, imm=imm)

        pb.ring("dispatch", 1)
        stray = [make_imm(protocol.PHASE_D0, 1, src=1), make_imm(protocol.PHASE_D2, 1, src=0),
                 make_imm(protocol.PHASE_D1, 1, src=0)]
        for imm in stray:
            header(1, imm)
        header(2, make_imm(protocol.PHASE_D0, 2, src=0))
        time.sleep(0.3)
        assert pb.mailbox[MAILBOX["disp_ready"]] == 0 and pb.error_record()[0] == 0
        assert pb.mailbox[MAILBOX["hdr_ready"]] == 0
        header(1, make_imm(protocol.PHASE_D0, 1, src=0))
        pb.wait_ready("dispatch", 1, 5)
        assert pb.mailbox[MAILBOX["hdr_ready"]] == 1
        assert b.imm.value(make_imm(protocol.PHASE_D0, 2, src=0)) == 1
        pb.ring("dispatch", 2)
        pb.wait_ready("dispatch", 2, 5)
        assert b.imm.value(make_imm(protocol.PHASE_D0, 2, src=0)) == 0
        assert [b.imm.value(i) for i in stray] == [1, 1, 1]  # counted apart, never consumed
        t0 = time.monotonic()
        pb.ring("dispatch", 3)
        with pytest.raises(CommTimeoutError) as ei:
            pb.wait_ready("dispatch", 3, 10)
        assert 0.9 <= time.monotonic() - t0 < 3
        exc = ei.value
        assert (exc.rank, exc.peer, exc.phase, exc.epoch) == (1, 0, "dispatch", 3), str(exc)
        assert "no immediate from peer 0" in str(exc) and "1 of 1 peers missing: 0" in str(exc), str(exc)
        assert pb.error_record() == (protocol.PROXY_TIMEOUT, 0, protocol.PHASE_D1, 3)
        pb.close()
    finally:
        a.close()
        b.close()


def test_rows_immediate_after_a_header_of_no_rows_stays_a_stray():
    """A source's round-1 immediate logged right after its header is taken in the same look of the
    arrival log; when that header says no rows come, the immediate is a stray: it goes back to
    the counter (still counted, never consumed) and the dispatch completes."""
    a, b = TcpTransport(0, 2, streams=1), TcpTransport(1, 2, streams=1)
    try:
        pb = Proxy(b, node_size=1, num_local_experts=1, row_bytes=RB, comb_row_bytes=CRB, private_capacity=1,
                   overflow_capacity=2, max_send_rows=4, timeout_s=2.0)
        regs = {n: np.zeros(max(int(nb), 16), np.uint8) for n, nb in pb.region_bytes.items()}
        keys = [a.register(regs[n]) for n in protocol.REGION_NAMES]
        a.connect([a.endpoint, b.endpoint], 10)
        b.connect([a.endpoint, b.endpoint], 10)
        pb.start()
        hs, hr = (keys[protocol.REGION_NAMES.index(n)] for n in protocol.HEADER_REGIONS)
        hdr, d1 = make_imm(protocol.PHASE_D0, 1, src=0), make_imm(protocol.PHASE_D1, 1, src=0)
        a.post_write(1, hs, 0, hr, 0, pb.hdr_bytes, imm=hdr)  # rank 0's all-zero header of epoch 1
        deadline = time.monotonic() + 5
        while b.imm.value(hdr) < 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        a.post_write(1, hs, 0, hr, 0, 0, imm=d1)  # then a round-1 immediate, logged after it
        while b.imm.value(d1) < 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        pb.ring("dispatch", 1)
        pb.wait_ready("dispatch", 1, 5)
        assert pb.mailbox[MAILBOX["hdr_ready"]] == 1 and pb.error_record()[0] == 0
        assert b.imm.value(hdr) == 0 and b.imm.value(d1) == 1  # the header taken, the stray counted again
        pb.close()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("spin_us", [10.0, 1e6], ids=["asleep", "spinning"])
def test_rows_before_their_header(spin_us):
    """Writes are unordered: a source's round-1 rows may land before its header. Here they land,
    then the header a while later, while the proxy (rank 1; its own bells rung, so only headers are
    left) sleeps in one wait for the headers (asleep) or still looks pass by pass (spinning): once
    the header says the rows are expected, the rows already counted complete round 1 at once (they
    are not waited for until the deadline)."""
    a, b = TcpTransport(0, 2, streams=1), TcpTransport(1, 2, streams=1)
    try:
        pb = Proxy(b, node_size=1, num_local_experts=1, row_bytes=RB, comb_row_bytes=CRB, private_capacity=1,
                   overflow_capacity=2, max_send_rows=4, timeout_s=2.0, spin_us=spin_us)
        regs = {n: np.zeros(max(int(nb), 16), np.uint8) for n, nb in pb.region_bytes.items()}
        keys = dict(zip(protocol.REGION_NAMES, (a.register(regs[n]) for n in protocol.REGION_NAMES)))
        a.connect([a.endpoint, b.endpoint], 10)
        b.connect([a.endpoint, b.endpoint], 10)
        pb.start()
        regs["hdr_send"][:12].view(np.int32)[:] = [0, 1, 1]  # rank 0's counts: one row for rank 1 (its expert)
        regs["disp_send"][:RB] = 7
        pb.ring("dispatch", 1)
        # round-1 rows first, into rank 0's slot of copy 1
        a.post_write(1, keys["disp_send"], 0, keys["round1"], (1 * 2 + 0) * pb.slot_bytes, RB,
                     imm=make_imm(protocol.PHASE_D1, 1, src=0))
        time.sleep(0.3)  # the proxy has taken everything else and sleeps until a header lands
        assert pb.mailbox[MAILBOX["hdr_ready"]] == 0 and pb.error_record()[0] == 0
        a.post_write(1, keys["hdr_send"], 0, keys["hdr_recv"], (1 * 2 + 0) * pb.hdr_bytes, pb.hdr_bytes,
                     imm=make_imm(protocol.PHASE_D0, 1, src=0))
        t0 = time.monotonic()
        pb.wait_ready("dispatch", 1, 5)
        assert time.monotonic() - t0 < 1.0  # not at the 2 s deadline
        assert pb.mailbox[protocol.mailbox_word("ready1", 2, 0)] == 1
        assert bytes(pb.round1[(1 * 2 + 0) * pb.slot_bytes:][:RB]) == bytes([7]) * RB
        assert b.imm.value(make_imm(protocol.PHASE_D1, 1, src=0)) == 0  # taken once
        pb.close()
    finally:
        a.close()
        b.close()


def test_world_beyond_the_immediate_is_refused():
    n = protocol.IMM_MAX_RANKS + 1
    e = TcpTransport(0, n, streams=1)
    try:
        with pytest.raises(NativeError, match=f"world_size {n} exceeds {n - 1}, the most ranks the 13 source bits"):
            Proxy(e, node_size=1, num_local_experts=1, row_bytes=RB, comb_row_bytes=CRB, private_capacity=0,
                  overflow_capacity=0, max_send_rows=0, regions={k: np.zeros(16, np.uint8) for k in protocol.REGION_NAMES})
    finally:
        e.close()


def test_config_errors_and_combine_misuse():
    a, b = TcpTransport(0, 2, streams=1), TcpTransport(1, 2, streams=1)
    kw = dict(node_size=1, num_local_experts=2, row_bytes=RB, comb_row_bytes=CRB, private_capacity=2,
              overflow_capacity=4, max_send_rows=8, timeout_s=2.0)
    try:
        with pytest.raises(NativeError, match="round-1 region has 16 bytes"):
            Proxy(a, **kw, regions={"round1": np.zeros(16, np.uint8)})
        with pytest.raises(NativeError, match="bad config"):
            Proxy(a, **{**kw, "node_size": 3})
        pa, pb = Proxy(a, **kw), Proxy(b, **kw)
        a.connect([a.endpoint, b.endpoint], 10)
        b.connect([a.endpoint, b.endpoint], 10)
        pa.start()
        pb.start()
        # two dispatches in a row, 3 rows each way (2 in round 1, 1 overflow); each epoch's headers
        # and rows land in its own parity copy, and epoch 1's copy survives epoch 2
        for e in (1, 2):
            for px, me in ((pa, 0), (pb, 1)):
                for p in range(2):
                    hdr = px.header(p)
                    hdr[:2] = [0, 3] if me == 0 else [3, 0]
                    hdr[2:4] = [me, 10 * e]
                px.disp_send[:3 * RB] = 10 * e + me
                px.ring("dispatch", e)
            for px, me in ((pa, 0), (pb, 1)):
                px.wait_ready("dispatch", e, 10)
        for e in (1, 2):
            for px, me in ((pa, 0), (pb, 1)):
                s = 1 - me
                o = px.round1_offset(e, s)
                slot = px.round1[o:o + px.slot_bytes]
                assert list(px.received_header(e, s)[:4]) == ([0, 3] if s == 0 else [3, 0]) + [s, 10 * e]
                assert (slot[:2 * RB] == 10 * e + s).all()
                ov = px.overflow[px.overflow_offset(e):px.overflow_offset(e) + 4 * RB]
                assert (ov[:RB] == 10 * e + s).all() and not ov[RB:].any()
        assert px.round1_offset(1, 0) == 2 * px.slot_bytes and px.overflow_offset(2) == 0
        assert dict(px.region_bytes) == {"disp_send": 8 * RB, "round1": 2 * 2 * px.slot_bytes,
                                         "overflow": 2 * 4 * RB, "comb_send": (2 + 4) * CRB, "comb_recv": 2 * 8 * CRB,
                                         "hdr_send": 2 * px.hdr_bytes, "hdr_recv": 2 * 2 * px.hdr_bytes}
        # a combine doorbell for an older dispatch than the last one: refused as stale
        pa.ring("combine", 1)
        with pytest.raises(NativeError, match="combine doorbell for epoch 1 but the last dispatch was epoch 2"):
            pa.wait_ready("combine", 1, 5)
        assert pa.error_record()[0] == protocol.PROXY_INVALID
        # pb now waits for an immediate pa will never send: a timeout within the deadline
        pb.ring("combine", 2)
        t0 = time.monotonic()
        with pytest.raises((CommTimeoutError, PeerLostError)):
            pb.wait_ready("combine", 2, 10)
        assert time.monotonic() - t0 < 5
        pa.close()
        pb.close()
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------- multi-process

CASES = [(4, 2), (4, 1), (3, 1)]  # (ranks, node_size): 2 nodes x 2, 4 nodes x 1, 3 nodes x 1


@pytest.mark.parametrize("cap", [0, 1, 64], ids=["cap0", "cap1", "cap_large"])
@pytest.mark.parametrize("R,node_size", CASES, ids=["2x2", "4x1", "3x1"])
def test_dispatch_combine_rows(R, node_size, cap):
    epochs = 6
    out = _run(R, node_size, cap, epochs=epochs, seed=100 * R + 10 * node_size + cap)
    for r in range(R):
        assert out[r][:-1] == [("ok", e) for e in range(1, epochs + 1)], out[r]
    stats = [out[r][-1] for r in range(R)]
    # round 1 carries rows exactly when each source has a private slot (cap 0: headers only)
    assert (sum(st["round1_rows"] for st in stats) > 0) == (cap > 0), (cap, stats)
    # round 2 carries rows when cap is small, and has no writes at all when it is large
    assert (sum(st["overflow_rows"] for st in stats) > 0) == (cap < MAXC)
    assert sum(st["combine_rows"] for st in stats) == sum(st["round1_rows"] + st["overflow_rows"] for st in stats)
    # a phase is counted before its ready word is written: right after ready, the count is exact
    assert all(st["stale_count"] == 0 for st in stats), stats


@pytest.mark.parametrize("R,node_size,cap", [(4, 1, 1), (4, 2, 0)], ids=["4x1", "2x2"])
def test_dispatches_in_a_row(R, node_size, cap):
    # dispatch 1, 2, 3, combine 3; dispatch 4, combine 4; dispatch 5, 6, combine 6. Rank 0 lags
    # after each dispatch followed by another, so the others post the next epoch's rows meanwhile;
    # it checks epoch e byte for byte only once every peer's epoch e+1 header has landed.
    runs = [3, 1, 2]
    out = _run(R, node_size, cap, epochs=6, seed=31 + R + node_size, plan={"runs": runs, "lag": 0})
    for r in range(R):
        assert out[r][:-1] == [("ok", e) for e in range(1, 7)], out[r]
        assert out[r][-1]["overflow_rows"] > 0, out[r][-1]
    assert out[0][-1]["ran_ahead"] == 3  # after dispatches 1, 2 and 5
    stats = [out[r][-1] for r in range(R)]
    # a combine returns exactly the rows of its own dispatch (epochs 3, 4 and 6)
    rows_at = {e: sum(int(_counts(31 + R + node_size, e, R)[s, p]) for s in range(R) for p in range(R)
                      if s // node_size != p // node_size) for e in (3, 4, 6)}
    assert sum(st["combine_rows"] for st in stats) == sum(rows_at.values()) > 0


@pytest.mark.parametrize("R,node_size", [(4, 1), (4, 2)], ids=["4x1", "2x2"])
def test_overflow_in_windows(R, node_size):
    # every epoch every rank sends maxc + 5 = 9 rows to rank 1 (cap 1: 8 overflow rows a remote
    # source), the rest random: rank 1's stream of 24 (4x1) or 16 (2x2) rows crosses a region of 4
    # rows in 6 or 4 windows, each after the previous one was unpacked; every row checked in place
    out = _run(R, node_size, 1, epochs=3, seed=5, ovcap=4, maxc=4, plan={"all_to": 1})
    for r in range(R):
        assert out[r][:-1] == [("ok", e) for e in range(1, 4)], out[r]
    assert out[1][-1]["windows"] == (6 if node_size == 1 else 4), out[1][-1]
    assert sum(out[r][-1]["combine_rows"] for r in range(R)) > 0


@pytest.mark.parametrize("R,node_size", [(4, 1), (4, 2)], ids=["4x1", "2x2"])
def test_no_overflow_region_refuses_overflow_every_rank(R, node_size):
    # overflow_capacity 0: epochs 1-2 fit the private slots (cap 3, counts < 4); epoch 3 sends
    # maxc+5 rows from every rank to rank 1: every rank raises CapacityError for epoch 3.
    out = _run(R, node_size, 3, epochs=4, seed=5, ovcap=0, maxc=4, plan={"big_epoch": 3, "big_dst": 1})
    for r in range(R):
        log = out[r]
        assert log[:2] == [("ok", 1), ("ok", 2)], log
        kind, e, name, msg, dt, rec = log[2]
        assert (kind, e, name) == ("error", 3, "CapacityError"), log
        assert rec == (protocol.PROXY_CAPACITY, 1, protocol.PHASE_D2, 3), rec
        assert "overflow_capacity is 0" in msg and len(log) == 4


@pytest.mark.parametrize("how", ["kill", "silent"])
def test_receiver_lost_in_a_later_window(how):
    """Rank 1 receives 8 overflow rows from each of 3 sources through a region of 2 rows (12
    windows) and stops before unpacking window 3 of epoch 2: killed, or alive and silent. Every
    source still has a window to post then, waits for its credit, and names rank 1 within the
    deadline: PeerLostError (killed) or CommTimeoutError (silent), phase dispatch round 2."""
    R, timeout_s = 4, 3.0
    plan = {"all_to": 1, "win_victim": 1, "epoch": 2, "stop_window": 3, "how": how}
    out = _run(R, 1, 1, epochs=3, seed=13, ovcap=2, maxc=4, plan=plan, timeout_s=timeout_s, wall_s=40)
    if how == "kill":
        assert out["dying"][1] == 2
    else:
        assert out[1][:2] == [("ok", 1), ("silent", 2)], out[1]
    for r in (0, 2, 3):
        log = out[r]
        assert log[0] == ("ok", 1), log
        kind, e, name, msg, dt, rec = log[1]
        want = "PeerLostError" if how == "kill" else "CommTimeoutError"
        assert (kind, e, name) == ("error", 2, want), log
        code = protocol.PROXY_PEER_LOST if how == "kill" else protocol.PROXY_TIMEOUT
        assert rec == (code, 1, protocol.PHASE_D2, 2), (rec, msg)
        assert "peer 1" in msg and "dispatch round 2" in msg, msg
        if how == "silent":
            assert "credit for an overflow window" in msg, msg
        assert dt < timeout_s + 2, (dt, msg)


@pytest.mark.parametrize("when", ["before_ring", "after_ring"])
def test_rank_killed_mid_dispatch(when):
    R, timeout_s = 4, 6.0
    t0 = time.monotonic()
    out = _run(R, 1, 1, epochs=3, seed=9, plan={"victim": 3, "epoch": 2, "when": when}, timeout_s=timeout_s,
               wall_s=40)
    assert out["dying"][1] == 2
    for r in range(3):
        log = out[r]
        assert log[0] == ("ok", 1), log
        kind, e, name, msg, dt, rec = log[1]
        # epoch 2 fails on every survivor (in dispatch, or in combine if the victim's round-1 and
        # round-2 writes all landed before it died), within the deadline: no hang
        assert (kind, e) == ("error", 2) and name in ("PeerLostError", "CommTimeoutError"), log
        assert dt < timeout_s + 1, log
        assert rec[0] in (protocol.PROXY_PEER_LOST, protocol.PROXY_TIMEOUT) and rec[3] == 2, rec
        if rec[0] == protocol.PROXY_PEER_LOST:
            assert rec[1] == 3 and "peer 3" in msg, (rec, msg)
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("phase,silent", [("dispatch", [3]), ("combine", [3]), ("dispatch", [1, 3])],
                         ids=["dispatch", "combine", "dispatch-two-silent"])
def test_silent_rank_named(phase, silent):
    """Ranks that stay alive but never ring epoch 2's doorbell (dispatch, or combine after a good
    dispatch): every other rank times out within the deadline, naming the first silent peer, the
    phase, and how many peers are missing. In the combine case every rank sends rows to rank 3,
    so each waits for its combine write."""
    R, timeout_s = 4, 2.0
    plan = {"silent": silent, "epoch": 2, "phase": phase, "big_epoch": 2, "big_dst": 3}
    out = _run(R, 1, 1, epochs=3, seed=11, plan=plan, timeout_s=timeout_s, wall_s=40)
    want_phase = protocol.PHASE_D1 if phase == "dispatch" else protocol.PHASE_C
    for r in range(R):
        if r in silent:
            assert out[r][:2] == [("ok", 1), ("silent", 2)], out[r]
            continue
        assert out[r][0] == ("ok", 1), out[r]
        kind, e, name, msg, dt, rec = out[r][1]
        assert (kind, e, name) == ("error", 2, "CommTimeoutError"), out[r]
        assert rec == (protocol.PROXY_TIMEOUT, silent[0], want_phase, 2), (rec, msg)
        assert f"rank {r}: peer {silent[0]} did not signal {'dispatch' if phase == 'dispatch' else 'combine'}" in msg
        missing = ", ".join(map(str, silent))
        if phase == "dispatch":
            assert f"no immediate from peer {silent[0]}" in msg and f"{len(silent)} of 3 peers missing: {missing})" in msg
        else:
            assert re.search(rf"1 of \d peers missing: {missing}\)", msg), msg
        assert timeout_s * 0.9 <= dt < timeout_s + 1.5, (dt, msg)
