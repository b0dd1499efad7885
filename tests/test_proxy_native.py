"""Native proxy engine (csrc/proxy): ImmCounter and the TCP transport, on CPU.

Integrity runs with delay and reorder injection on; cut and dead peers must give errors within
the deadline on both sides, never a hang.
"""
import multiprocessing as mp
import os
import signal
import socket
import threading
import time

import numpy as np
import pytest

from moe_ep import CommTimeoutError
from moe_ep.proxy import native
from moe_ep.proxy import (CQ_OK, CQ_PEER_LOST, CQ_REMOTE_ACCESS, CQ_TIMEOUT, Engine, ImmCounter, NativeError,
                          PeerLostError, TcpTransport)


# ---------------------------------------------------------------- ImmCounter

def test_imm_run_ahead():
    c = ImmCounter()
    for _ in range(5):
        c.add(7)
    c.add(7, 3)
    assert c.value(7) == 8
    t0 = time.monotonic()
    c.wait(7, 8, timeout_s=5.0)  # everything arrived before the wait: returns at once
    assert time.monotonic() - t0 < 1.0
    assert c.value(7) == 0
    assert c.value(8) == 0  # other immediates untouched


def test_imm_exact_counts_and_timeout():
    c = ImmCounter()
    c.add(1, 3)
    c.add(2, 1)
    c.wait(1, 2, timeout_s=1.0)
    assert c.value(1) == 1  # the wait subtracted exactly what it expected
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError) as ei:
        c.wait(1, 2, timeout_s=0.2, peer=3, phase="dispatch", epoch=9)
    dt = time.monotonic() - t0
    assert 0.15 < dt < 2.0
    assert (ei.value.peer, ei.value.phase, ei.value.epoch) == (3, "dispatch", 9)
    assert c.value(1) == 1  # a timed-out wait leaves the count alone
    c.add(1)
    c.wait(1, 2, timeout_s=1.0)
    assert c.value(1) == 0 and c.value(2) == 1
    # signed: a waiter may expect 0, and negative adds are allowed
    c.wait(3, 0, timeout_s=0.0)
    c.add(4, -2)
    assert c.value(4) == -2


def test_imm_waiter_wakes_without_gil():
    c = ImmCounter()
    done = []

    def waiter():
        c.wait(5, 10, timeout_s=10.0)
        done.append(time.monotonic())

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    for _ in range(10):
        c.add(5)  # the waiter blocks in native code without holding the GIL
    t.join(5.0)
    assert done and not t.is_alive()
    assert c.value(5) == 0


def test_imm_waiters_woken_only_when_reachable_still_all_return():
    """add() wakes waiters only when one can return: several waiters on one immediate with
    different expectations, and one on another immediate, all return with exact counts."""
    c = ImmCounter()
    done = {}

    def waiter(name, imm, n):
        c.wait(imm, n, timeout_s=10.0)
        done[name] = time.monotonic()

    ts = [threading.Thread(target=waiter, args=a) for a in (("one", 9, 1), ("three", 9, 3), ("other", 10, 2))]
    for t in ts:
        t.start()
    time.sleep(0.05)
    for i in range(4):
        c.add(9)
        c.add(10, 1 if i < 2 else 0)
        time.sleep(0.01)
    for t in ts:
        t.join(10.0)
    assert sorted(done) == ["one", "other", "three"] and not any(t.is_alive() for t in ts)
    assert c.value(9) == 0 and c.value(10) == 0


def test_imm_concurrent_producers():
    c = ImmCounter()
    n_threads, per = 4, 2000

    def producer(i):
        for _ in range(per):
            c.add(11)
            c.add(12 + i % 2)

    ts = [threading.Thread(target=producer, args=(i,)) for i in range(n_threads)]
    got = []
    w = threading.Thread(target=lambda: (c.wait(11, n_threads * per, timeout_s=20.0), got.append(1)))
    w.start()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    w.join(20.0)
    assert got == [1]
    assert c.value(11) == 0 and c.value(12) == 2 * per and c.value(13) == 2 * per
    # native producers, no GIL between the adds: 8 threads of the library each add 1 50,000 times
    assert native.lib().moe_ep_imm_stress(c.handle, 20, 8, 50_000) == native.OK
    assert c.value(20) == 400_000
    c.wait(20, 400_000, timeout_s=1.0)
    assert c.value(20) == 0


# ---------------------------------------------------------------- TCP transport helpers

REGION = 1 << 20


def _plan(seed, n_writes, region=REGION):
    """Deterministic writes: (offset, size, imm), disjoint ranges, many 0-byte writes."""
    rng = np.random.default_rng(seed)
    sizes = rng.choice([0, 1, 3, 7, 64, 1000, 4093, 20000], size=n_writes, p=[.2, .1, .1, .1, .1, .2, .1, .1])
    offs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    assert offs[-1] + sizes[-1] <= region
    imms = (0x1000 + rng.integers(0, 3, size=n_writes)).astype(np.int64)
    payload = rng.integers(0, 256, size=region, dtype=np.uint8)
    return [(int(o), int(s), int(i)) for o, s, i in zip(offs, sizes, imms)], payload


def _send_all(eng, peer, src_key, dst_key, plan, timeout_s=20.0, expect_unordered=False):
    wrs = [eng.post_write(peer, src_key, o, dst_key, o, s, imm=i) for o, s, i in plan]
    comps = eng.wait_completions(len(wrs), timeout_s)
    assert sorted(c.wr_id for c in comps) == sorted(wrs)
    assert all(c.status == CQ_OK and c.peer == peer for c in comps)
    if expect_unordered:  # writes really complete out of posting order
        assert [c.wr_id for c in comps] != wrs


def _recv_all(eng, dst, plan, payload, timeout_s=20.0):
    for imm in sorted({i for _, _, i in plan}):
        eng.imm.wait(imm, sum(1 for *_, i in plan if i == imm), timeout_s)
        assert eng.imm.value(imm) == 0  # exact: nothing extra arrived
    end = max(o + s for o, s, _ in plan)
    np.testing.assert_array_equal(dst[:end], payload[:end])
    assert not dst[end:].any()


def _pair(streams=4, min_shard=1, **fault):
    """Two connected engines; min_shard=1 spreads every write of >= streams bytes over all streams
    (None: the default 16 KiB shards)."""
    a, b = TcpTransport(0, 2, streams=streams), TcpTransport(1, 2, streams=streams)
    bufs = {}
    for e in (a, b):
        if min_shard is not None:
            e.set_min_shard_bytes(min_shard)
        src, dst = np.zeros(REGION, np.uint8), np.zeros(REGION, np.uint8)
        bufs[e.rank] = (src, dst, e.register(src), e.register(dst))
        if fault:
            e.set_fault(**fault)
    eps = [a.endpoint, b.endpoint]
    a.connect(eps, timeout_s=10)
    b.connect(eps, timeout_s=10)
    return a, b, bufs


# ---------------------------------------------------------------- TCP: in one process

@pytest.mark.parametrize("streams,fault,min_shard", [(1, {}, 1), (4, {}, 1), (4, dict(delay_us=300, reorder=True), 1),
                                                     (3, dict(reorder=True), 1), (4, dict(reorder=True), None)])
def test_tcp_integrity_in_process(streams, fault, min_shard):
    a, b, bufs = _pair(streams, min_shard, **fault)
    try:
        plans = {0: _plan(1, 300), 1: _plan(2, 300)}
        for r in (0, 1):  # sources
            bufs[r][0][:] = plans[r][1]
        ths = [threading.Thread(target=_send_all, args=(e, 1 - e.rank, bufs[e.rank][2], bufs[1 - e.rank][3],
                                                       plans[e.rank][0], 20.0, "reorder" in fault)) for e in (a, b)]
        errs = []
        for t in ths:
            t.run = (lambda f: (lambda: _catch(f, errs)))(t.run)
            t.start()
        _recv_all(b, bufs[1][1], *plans[0])
        _recv_all(a, bufs[0][1], *plans[1])
        for t in ths:
            t.join(30)
        assert not errs, errs
        assert a.peer_error(1) == "" and b.peer_error(0) == ""
    finally:
        a.close()
        b.close()


def _catch(f, errs):
    try:
        f()
    except BaseException as e:  # noqa: BLE001 - reported by the test
        errs.append(e)


def test_tcp_zero_byte_writes_and_remote_errors():
    a, b, bufs = _pair(4)
    try:
        src_key, dst_key = bufs[0][2], bufs[1][3]
        wrs = [a.post_write(1, src_key, 0, dst_key, REGION, 0, imm=42) for _ in range(10)]  # 0 bytes at the end
        assert len(a.wait_completions(10, 10)) == len(wrs)
        b.imm.wait(42, 10, 10)
        assert b.imm.value(42) == 0
        # no immediate: lands but is not counted
        a.post_write(1, src_key, 0, dst_key, 0, 100)
        a.wait_completions(1, 10)
        assert b.imm.value(0) == 0
        # remote key unknown / out of bounds: an error completion, no immediate, peer stays healthy
        a.post_write(1, src_key, 0, 99, 0, 100, imm=43)
        a.post_write(1, src_key, 0, dst_key, REGION - 10, 100, imm=43)
        comps = a.wait_completions(2, 10, check=False)
        assert [c.status for c in comps] == [CQ_REMOTE_ACCESS] * 2
        assert b.imm.value(43) == 0 and a.peer_error(1) == ""
        # local errors are reported at once
        with pytest.raises(NativeError, match="rank 0.*peer 1.*local key"):
            a.post_write(1, 77, 0, dst_key, 0, 10)
        with pytest.raises(NativeError, match="bad peer"):
            a.post_write(0, src_key, 0, dst_key, 0, 10)
        # still works afterwards
        _send_all(a, 1, src_key, dst_key, [(0, 5000, 44)])
        b.imm.wait(44, 1, 10)
    finally:
        a.close()
        b.close()


def test_tcp_cut_connection_errors_both_sides():
    a, b, bufs = _pair(4, delay_us=100, reorder=True)
    try:
        a.set_fault(delay_us=100, reorder=True, cut_peer=1, cut_after=5)
        _send_all(a, 1, bufs[0][2], bufs[1][3], [(i * 10, 10, 7) for i in range(5)])
        b.imm.wait(7, 5, 10)
        t0 = time.monotonic()
        a.post_write(1, bufs[0][2], 0, bufs[1][3], 0, 10, imm=7)  # the 6th write cuts the connection
        with pytest.raises(PeerLostError, match="rank 0.*peer 1.*cut") as ei:
            a.wait_completions(1, 10)
        assert ei.value.peer == 1
        # waiters on both sides fail naming the peer, well before their deadline
        with pytest.raises(PeerLostError, match="rank 1: connection with peer 0 lost"):
            b.imm.wait(7, 1, 10)
        with pytest.raises(PeerLostError, match="rank 0: connection with peer 1 lost"):
            a.imm.wait(8, 1, 10)
        # the other direction fails too, as an error completion
        b.post_write(0, bufs[1][2], 0, bufs[0][3], 0, 10, imm=8)
        (c,) = b.wait_completions(1, 10, check=False)
        assert c.status == CQ_PEER_LOST and c.peer == 0
        assert time.monotonic() - t0 < 5.0
        assert "peer 0" in b.peer_error(0) and "cut" in a.peer_error(1)
    finally:
        a.close()
        b.close()


def test_tcp_stuck_peer_op_timeout():
    """A peer that accepts but never acknowledges: the write completes with a timeout."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    a = TcpTransport(0, 2, streams=2)
    try:
        a.set_op_timeout(0.3)
        key = a.register(np.zeros(64, np.uint8))
        a.connect([a.endpoint, "127.0.0.1:%d" % srv.getsockname()[1]], timeout_s=5)
        a.post_write(1, key, 0, 1, 0, 64, imm=1)
        t0 = time.monotonic()
        (c,) = a.wait_completions(1, 10, check=False)
        assert c.status == CQ_TIMEOUT and 0.2 < time.monotonic() - t0 < 3.0
        assert "not acknowledged" in a.peer_error(1)
    finally:
        a.close()
        srv.close()


def test_tcp_connect_deadline():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nobody listens there
    a = Engine(0, 2, streams=2)
    try:
        t0 = time.monotonic()
        with pytest.raises(CommTimeoutError) as ei:
            a.connect([a.endpoint, f"127.0.0.1:{port}"], timeout_s=0.3)
        assert ei.value.peer == 1 and ei.value.phase == "connect"
        assert time.monotonic() - t0 < 3.0
    finally:
        a.close()


# ---------------------------------------------------------------- TCP: two processes

def _proc_main(rank, conn, n_writes, fault, die_after_connect):
    try:
        e = TcpTransport(rank, 2, streams=4)
        e.set_min_shard_bytes(1)
        src, dst = np.zeros(REGION, np.uint8), np.zeros(REGION, np.uint8)
        ks, kd = e.register(src), e.register(dst)
        e.set_fault(**fault)
        conn.send(e.endpoint)
        e.connect(conn.recv(), timeout_s=10)
        if die_after_connect:
            conn.send("connected")
            time.sleep(60)  # killed by the parent
        plan, payload = _plan(10 + rank, n_writes)
        src[:] = payload
        _send_all(e, 1 - rank, ks, kd, plan, expect_unordered=True)
        other_plan, other_payload = _plan(10 + 1 - rank, n_writes)
        _recv_all(e, dst, other_plan, other_payload)
        conn.send("ok")
        conn.recv()  # both done before either closes
        e.close()
    except BaseException as ex:  # noqa: BLE001
        conn.send(f"error: {type(ex).__name__}: {ex}")
        raise


def _spawn(rank, n_writes, fault, die=False):
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_proc_main, args=(rank, child, n_writes, fault, die), daemon=True)
    p.start()
    return p, parent


def test_tcp_two_processes_integrity():
    fault = dict(delay_us=200, reorder=True)
    procs = [_spawn(r, 400, fault) for r in (0, 1)]
    try:
        eps = [c.recv() for _, c in procs]
        for _, c in procs:
            c.send(eps)
        for _, c in procs:
            assert c.poll(60), "peer process did not finish"
            assert c.recv() == "ok"
        for _, c in procs:
            c.send("close")
        for p, _ in procs:
            p.join(20)
            assert p.exitcode == 0
    finally:
        for p, _ in procs:
            if p.is_alive():
                p.kill()


def test_tcp_dead_peer_process():
    """The peer process is killed: this side's waiter and writes fail naming it, no hang."""
    p, conn = _spawn(1, 0, {}, die=True)
    a = TcpTransport(0, 2, streams=4)
    try:
        src, dst = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
        ks, _ = a.register(src), a.register(dst)
        ep1 = conn.recv()
        conn.send([a.endpoint, ep1])
        a.connect([a.endpoint, ep1], timeout_s=10)
        assert conn.recv() == "connected"
        errs = []
        w = threading.Thread(target=_catch, args=(lambda: a.imm.wait(3, 1, 20), errs))
        w.start()
        time.sleep(0.1)
        t0 = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        w.join(20)
        assert not w.is_alive() and len(errs) == 1
        assert isinstance(errs[0], PeerLostError) and errs[0].peer == 1
        assert "rank 0: connection with peer 1 lost" in str(errs[0])
        a.post_write(1, ks, 0, 2, 0, 100, imm=3)
        (c,) = a.wait_completions(1, 10, check=False)
        assert c.status == CQ_PEER_LOST
        assert time.monotonic() - t0 < 10.0
    finally:
        a.close()
        p.kill()
        p.join(10)
