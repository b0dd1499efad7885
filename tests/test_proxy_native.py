"""Native proxy engine (csrc/proxy): ImmCounter and the TCP transport, on CPU.

Integrity runs with delay and reorder injection on; cut and dead peers must give errors within
the deadline on both sides, never a hang. The goodbye a closing engine sends: a proxy that loses
a peer by it names the cause it gives, where that cause can be trusted; on the wire it is taken
only from a connection that passed its hello and only with the job's identity.
"""
import multiprocessing as mp
import os
import signal
import socket
import struct
import threading
import time

import numpy as np
import pytest

import proxy_wire as W
from engine_cases import catch, wait_lost
from moe_ep import CapacityError, CommTimeoutError
from moe_ep.core.errors import ErrorCode
import native_hooks as hooks
from moe_ep.native import library, protocol, transports
from moe_ep.native.identity import JobIdentity
from moe_ep.native.library import NativeError, PeerLostError
from moe_ep.native.proxy import Proxy
from moe_ep.native.transports import (CQ_OK, CQ_PEER_LOST, CQ_REMOTE_ACCESS, CQ_TIMEOUT, Engine, ImmCounter,
                                      TcpTransport)


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


def test_imm_counts_match_a_dict_under_random_adds_and_takes():
    """The counter's table (open addressing, deletion by backward shift) against a dict: random
    adds (negative ones too) and exact takes over keys shaped like immediates (the same epoch
    bits, sources and phases packed above them), growing the table and emptying it again."""
    rng = np.random.default_rng(5)
    keys = [int(protocol.make_imm(ph, e, src=s)) for ph in range(4) for s in range(0, 4096, 7) for e in (1, 2)]
    c, want = ImmCounter(), {}
    for step in range(20000):
        k = keys[int(rng.integers(len(keys)))] if step < 14000 else list(want)[0] if want else keys[0]
        have = want.get(k, 0)
        if step >= 14000 and have > 0:  # drain: take what each key holds
            c.wait(k, have, timeout_s=0.0)
            want.pop(k)
        elif have > 0 and rng.random() < 0.4:
            n = int(rng.integers(1, have + 1))
            c.wait(k, n, timeout_s=0.0)
            want[k] = have - n
        else:
            n = int(rng.choice([-2, -1, 1, 2, 3])) if step < 14000 else -have
            if n:
                c.add(k, n)
                want[k] = have + n
        if not want.get(k):
            want.pop(k, None)
        if step % 97 == 0:
            probe = keys[int(rng.integers(len(keys)))]
            assert c.value(probe) == want.get(probe, 0), (step, probe)
        assert c.value(k) == want.get(k, 0), (step, k)
    assert all(c.value(k) == want.get(k, 0) for k in keys)


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
    hooks.imm_stress(c, 20, 8, 50_000)
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
            hooks.set_fault(e, **fault)
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
            t.run = (lambda f: (lambda: catch(f, errs)))(t.run)
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
        hooks.set_fault(a, delay_us=100, reorder=True, cut_peer=1, cut_after=5)
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
        hooks.set_fault(e, **fault)
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
        w = threading.Thread(target=catch, args=(lambda: a.imm.wait(3, 1, 20), errs))
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


# ---------------------------------------------------------------- the goodbye

def _three_waiting(timeout_s=5.0):
    """Rank 0 of 3 with a Proxy (every rank a node) in dispatch epoch 1, waiting for ranks 1 and 2:
    bare engines with the same regions (so rank 0's writes land), all connected."""
    es = [TcpTransport(r, 3, streams=2) for r in range(3)]
    px = Proxy(es[0], node_size=1, num_local_experts=1, row_bytes=16, comb_row_bytes=16, private_capacity=1,
               overflow_capacity=2, max_send_rows=4, timeout_s=timeout_s)
    for e in es[1:]:
        for name in protocol.REGION_NAMES:
            e.register(np.zeros(max(int(px.region_bytes[name]), 16), np.uint8))
    eps = [e.endpoint for e in es]
    for e in es:
        e.connect(eps, timeout_s=10)
    px.start()
    px.ring("dispatch", 1)
    return es, px


def _lost(peer, phase, epoch):
    err = PeerLostError(f"rank 1: connection with peer {peer} lost", library.ERR_PEER, peer)
    err.rank, err.phase, err.epoch = 1, phase, epoch
    return err


# name: (what rank 1 says as it closes: the error it closes with, or the raw goodbye fields
# (error, peer, phase, epoch, code)), the peer rank 0's error names, what its message says of rank 1.
GOODBYES = {
    "cause": (CommTimeoutError(1, 2, "dispatch", 1, 3.0), 2,
              "rank 1 closed after its own error naming peer 2 (dispatch epoch 1)"),
    "cause in combine": (_lost(2, "combine", 9), 2, "rank 1 closed after its own error naming peer 2 (combine epoch 9)"),
    "clean": (None, 1, "rank 1 closed without an error of its own (a clean close)"),
    "error naming no peer": (RuntimeError("expert ids out of range"), 1, "rank 1 closed after its own error, naming no peer"),
    "peer outside the world": (CommTimeoutError(1, 99, "dispatch", 1, 3.0), 1,
                               "naming peer 99 in phase 0 (not trusted: not another rank of a world of 3)"),
    "the closer itself": (CommTimeoutError(1, 1, "dispatch", 1, 3.0), 1,
                          "naming peer 1 in phase 0 (not trusted: not another rank of a world of 3)"),
    "unknown phase": ((1, 2, 7, 1, 0), 1, "naming peer 2 in phase 7 (not trusted: an unknown phase)"),
    "an unknown kind": ((1, 2, protocol.PHASE_D1, 1, 77), 2,
                        "rank 1 closed after its own error naming peer 2 (dispatch epoch 1)"),
    # trusted, but rank 0 is alive: a peer that gave up on it is the one it names
    "this rank": (CommTimeoutError(1, 0, "dispatch", 1, 3.0), 1,
                  "rank 1 closed after its own error naming peer 0 (dispatch epoch 1)"),
}


@pytest.mark.parametrize("case", list(GOODBYES))
def test_goodbye_names_the_cause(case):
    """Rank 1 closes while rank 0's proxy waits for it: rank 0 raises at once (not at its 5 s
    deadline), naming the peer rank 1's error named where the goodbye may be trusted with it (a
    rank of this job other than the two of them, in a known phase), else rank 1."""
    said, named, text = GOODBYES[case]
    es, px = _three_waiting()
    try:
        t0 = time.monotonic()
        if isinstance(said, tuple):
            library.lib().moe_ep_engine_goodbye(es[1].handle, *said)  # the first goodbye counts
            said = None
        es[1].close(said)
        with pytest.raises(PeerLostError) as ei:
            px.wait_ready("dispatch", 1, 10)
        assert time.monotonic() - t0 < 2.5
        exc = ei.value
        assert (exc.rank, exc.peer, exc.phase, exc.epoch) == (0, named, "dispatch", 1), str(exc)
        assert text in str(exc), str(exc)
        assert es[0].peer_error(1).endswith(text) and es[0].peer_error(2) == ""
        assert wait_lost(es[2], 1, 3.0).endswith(text)  # rank 2 heard it too
    finally:
        px.close()
        for e in es:
            e.close()


@pytest.mark.parametrize("over", [1, 2], ids=["the closer", "its node peer"])
def test_goodbye_after_a_capacity_error(over):
    """Rank 1 closes after a ``CapacityError`` (its own rows over its cap, or a node peer's it
    learned): rank 0's proxy raises a ``CapacityError`` at once, not a ``PeerLostError``, naming
    the rank over its cap (attributes and message), the phase and epoch; rank 2 hears the same."""
    es, px = _three_waiting()
    try:
        t0 = time.monotonic()
        es[1].close(CapacityError("over", rank=1, peer=over, phase="dispatch", epoch=1))
        with pytest.raises(CapacityError) as ei:
            px.wait_ready("dispatch", 1, 10)
        assert time.monotonic() - t0 < 2.5
        exc = ei.value
        assert (exc.rank, exc.peer, exc.phase, exc.epoch) == (0, over, "dispatch", 1), str(exc)
        text = f"rank 1 closed after a CapacityError: rank {over} received more rows than its max_recv_rows " \
               f"(dispatch epoch 1)"
        assert text in str(exc), str(exc)
        assert wait_lost(es[2], 1, 3.0).endswith(text)
    finally:
        px.close()
        for e in es:
            e.close()


@pytest.mark.parametrize("error", [False, True], ids=["clean", "after an error"])
def test_goodbye_heard_after_the_loss(error):
    """A goodbye read after its link's loss was noticed (a keepalive that failed first; providers
    order the two as they like) still counts: the loss's text ends with what it said, and an
    error goodbye gives its cause (peer 2), which the proxy then names (Proxy::cause_of)."""
    text, counted = hooks.late_goodbye(error)
    assert text.startswith("rank 0: connection with peer 1 lost (test): a keepalive failed"), text
    said = ("rank 1 closed after its own error naming peer 2 (combine epoch 6)" if error
            else "rank 1 closed without an error of its own (a clean close)")
    assert text.endswith("; its goodbye said: " + said), text
    assert counted == (1 + 2 if error else 1 + -1), counted


def test_goodbye_cause_of_an_error():
    assert transports.goodbye_cause(None) == (0, -1, -1, 0, 0)
    assert transports.goodbye_cause(CommTimeoutError(0, 3, "dispatch", 4, 1.0)) == (1, 3, protocol.PHASE_D1, 4, 0)
    assert transports.goodbye_cause(_lost(2, "combine", 5)) == (1, 2, protocol.PHASE_C, 5, 0)
    for other in (CommTimeoutError(0, 3, "connect", 0, 1.0), CommTimeoutError(0, -1, "dispatch", 4, 1.0),
                  PeerLostError("no phase", library.ERR_PEER, 3), ValueError("bad ids")):
        assert transports.goodbye_cause(other) == (1, -1, -1, 0, 0), other
    # a CapacityError: its kind, and the rank over its cap where it is another (a node peer)
    cap = int(ErrorCode.CAPACITY)
    assert transports.goodbye_cause(CapacityError("over", rank=1, peer=1, phase="dispatch", epoch=4)) == \
        (1, -1, protocol.PHASE_D1, 4, cap)
    assert transports.goodbye_cause(CapacityError("over", rank=1, peer=0, phase="dispatch", epoch=4)) == \
        (1, 0, protocol.PHASE_D1, 4, cap)
    assert transports.goodbye_cause(CapacityError("over")) == (1, -1, -1, 0, cap)


# The goodbye written out from docs/ARCHITECTURE.md §10: magic "MEGB", src, dst, world, error,
# cause peer, cause phase, cause code, cause epoch, session, secret; on an ack stream after an ack
# (wr_id 0, status 2, shard 0).
GOODBYE = struct.Struct("<IiiiiiiiqQ16s")
MAGIC_GOODBYE = 0x4247454D
assert GOODBYE.size == 64
ID = JobIdentity(bytes(range(40, 56)), 1_700_000_000_000_000_777)


def _goodbye(cause=2, secret=ID.secret, src=1, world=3, code=0):
    return GOODBYE.pack(MAGIC_GOODBYE, src, 0, world, 1, cause, protocol.PHASE_D1, code, 4, ID.session, secret)


def _fake_rank1(e, stream):
    """A connection of a hand-made rank 1 to engine `e` (rank 0 of 3, identity ID) that passed its
    hello: on its data stream (rank 1 dialled e's listener) or on an ack stream (e dialled it)."""
    if stream == "data":
        return W.dial(e.endpoint, W.hello(1, 0, 3, 0, ID.session, ID.secret)), []
    srvs = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    e.connect([e.endpoint] + ["127.0.0.1:%d" % s.getsockname()[1] for s in srvs], timeout_s=5)
    s, _ = srvs[0].accept()
    s.settimeout(5)
    assert W.HELLO.unpack(s.recv(W.HELLO.size, socket.MSG_WAITALL))[1:3] == (0, 1)
    return s, srvs


# name: (the frame rank 1 sends, why rank 0 then says it lost rank 1)
WIRE_GOODBYES = {
    "trusted": (_goodbye(), "rank 1 closed after its own error naming peer 2 (dispatch epoch 4)"),
    "outside the world": (_goodbye(cause=3), "rank 1 closed after its own error, naming peer 3 in phase 0 "
                                             "(not trusted: not another rank of a world of 3)"),
    "wrong secret": (_goodbye(secret=bytes(16)), "protocol error: a goodbye whose job secret does not match"),
    "another rank's": (_goodbye(src=2), "protocol error: a goodbye saying rank 2, from peer 1"),
    "another world": (_goodbye(world=4), "protocol error: a goodbye for world size 4 (this job has 3)"),
    "capacity": (_goodbye(cause=-1, code=3), "rank 1 closed after a CapacityError: rank 1 received more rows than "
                                             "its max_recv_rows (dispatch epoch 4)"),
    "capacity of a node peer": (_goodbye(code=3), "rank 1 closed after a CapacityError: rank 2 received more rows "
                                                  "than its max_recv_rows (dispatch epoch 4)"),
    "a stranger's capacity": (_goodbye(cause=-1, code=3, secret=bytes(16)),
                              "protocol error: a goodbye whose job secret does not match"),
}


@pytest.mark.parametrize("stream", ["data", "acks"])
@pytest.mark.parametrize("case", list(WIRE_GOODBYES))
def test_goodbye_on_the_wire(stream, case):
    """A goodbye on a connection of rank 1 that passed its hello (sent in two pieces: it is taken
    whole) loses rank 1 by what it says; one that fails the hello's checks is a protocol error."""
    frame, says = WIRE_GOODBYES[case]
    e = TcpTransport(0, 3, streams=1, identity=ID)
    s, srvs = _fake_rank1(e, stream)
    try:
        data = (W.ACK.pack(0, 2, 0) if stream == "acks" else b"") + frame
        s.sendall(data[:10])
        time.sleep(0.05)
        assert e.peer_error(1) == ""
        s.sendall(data[10:])
        assert wait_lost(e, 1, 3.0) == f"rank 0: connection with peer 1 lost: {says}"
        with pytest.raises(PeerLostError, match="peer 1 lost"):
            e.imm.wait(5, 1, 5)
        assert e.peer_error(2) == ""
    finally:
        s.close()
        for srv in srvs:
            srv.close()
        e.close()


def test_goodbye_without_a_hello_is_refused():
    """A stranger's goodbye (no hello first) is refused like any connection without a hello: rank 1,
    whom it names, stays healthy."""
    e = TcpTransport(0, 3, streams=1, identity=ID)
    try:
        s = W.dial(e.endpoint, _goodbye())
        assert W.wait_gone(s, 2.0) < 2.0
        s.close()
        assert "not a moe_ep hello (magic 0x4247454d)" in e.refused().recent[-1]
        assert e.peer_error(1) == ""
    finally:
        e.close()
