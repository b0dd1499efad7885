"""What the engine tests of the transports share (tcp, verbs, libfabric): connecting engines of
one process, the §10 proxy exchange between two one-rank nodes checked row by row, the goodbye
that names its cause, a wait for a peer's loss, a stand-in process group, the collection of a
thread's exception. Imports nothing of moe_ep (the tests pass in the classes it needs), so the
tests that run without torch (``light_import``) can use it.
"""
from __future__ import annotations

import os
import subprocess
import threading
import time

import numpy as np


def assert_compiles(tmp_path, name: str, text: str, include: str) -> None:
    """C++17 ``text`` (written to ``tmp_path / name``, ``include`` on the include path) passes the
    compiler's syntax check (``$CXX``, else c++): how the ABI declarations are checked against the
    system's headers."""
    src = tmp_path / name
    src.write_text(text)
    r = subprocess.run([os.environ.get("CXX", "c++"), "-std=c++17", "-fsyntax-only", f"-I{include}", str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def catch(f, errs: list) -> None:
    """Runs ``f``, appending what it raises to ``errs`` (a thread's failure, reported by the test)."""
    try:
        f()
    except BaseException as e:  # noqa: BLE001 - reported by the test
        errs.append(e)


def connect_all(engines, timeout_s=30.0, delays=None):
    """Connects every engine from its own thread (connect waits for the peers' hellos)."""
    eps = [e.endpoint for e in engines]
    errs: list = []

    def run(i, e):
        if delays:
            time.sleep(delays[i])
        e.connect(eps, timeout_s)

    ts = [threading.Thread(target=catch, args=(lambda i=i, e=e: run(i, e), errs)) for i, e in enumerate(engines)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout_s + 30)
    assert not errs, errs
    assert not any(t.is_alive() for t in ts)


def registered_pair(a, b, region: int, connect: bool = True):
    """Engines ``a`` (rank 0) and ``b`` (rank 1) of a world of two, each with a source and a
    destination of ``region`` bytes registered, connected unless ``connect`` is false: (a, b,
    bufs), bufs[rank] = (src, dst, src key, dst key)."""
    bufs = {}
    for e in (a, b):
        src, dst = np.zeros(region, np.uint8), np.zeros(region, np.uint8)
        bufs[e.rank] = (src, dst, e.register(src), e.register(dst))
    if connect:
        connect_all([a, b])
    return a, b, bufs


def wait_lost(e, peer: int, timeout_s: float = 30.0) -> str:
    """``e.peer_error(peer)`` once it is set, or at the deadline ("" if the peer is still healthy)."""
    deadline = time.monotonic() + timeout_s
    while not e.peer_error(peer) and time.monotonic() < deadline:
        time.sleep(0.01)
    return e.peer_error(peer)


class GroupStandIn:
    """A stand-in EPGroup whose other ranks answer every all_gather_object from a queue."""

    def __init__(self, rank, answers):
        self.rank, self.device = rank, None
        self._answers = list(answers)  # per gather: the other ranks' objects
        self.world_size = len(self._answers[0]) + 1

    def all_gather_object(self, obj):
        out = list(self._answers.pop(0))
        out.insert(self.rank, obj)
        return out


def rows(e: int, s: int, p: int, n: int, rb: int = 32) -> np.ndarray:
    """The ``n`` rows of ``rb`` bytes rank ``s`` sends rank ``p`` in epoch ``e``."""
    v = (np.arange(n * rb, dtype=np.int64) * 7 + 1000 * e + 100 * s + 10 * p) % 251
    return v.astype(np.uint8).reshape(n, rb)


CLEAN_GOODBYE = "; its goodbye said: rank 2 closed without an error of its own (a clean close)"


def goodbye_names_the_cause(timeout_error: type, es, where: str) -> None:
    """Three connected engines ``es``: rank 1 closes after an error naming rank 2, and both others
    lose it at once, by its goodbye, hearing the cause (their loss names the link: ``where``). Then
    rank 2 closes cleanly: rank 0 only remembers that (the loss that follows ends with
    ``CLEAN_GOODBYE``). ``timeout_error``: ``moe_ep.CommTimeoutError``."""
    es[1].close(timeout_error(1, 2, "combine", 6, 3.0))
    said = "rank 1 closed after its own error naming peer 2 (combine epoch 6)"
    for r in (0, 2):
        assert wait_lost(es[r], 1, 5.0).endswith(said), es[r].peer_error(1)
        assert f"rank {r}: connection with peer 1 lost ({where}" in es[r].peer_error(1)
    es[2].close()
    time.sleep(0.5)
    # A clean goodbye alone loses no peer; the loss that follows (a keepalive, or the link's own
    # close, which can come within this half second on a loaded machine) names it.
    lost = es[0].peer_error(2)
    assert lost == "" or lost.endswith(CLEAN_GOODBYE), lost


def proxy_two_nodes(proxy_class: type, engines, cap: int, rb: int = 32, crb: int = 16, el: int = 2) -> None:
    """Two engines (not connected yet) as two nodes, each with its §10 proxy: connected, started,
    ``proxy_dispatch_combine``, then everything closed. ``proxy_class``: ``moe_ep.native.proxy.Proxy``."""
    R = len(engines)
    pxs = [proxy_class(e, node_size=1, num_local_experts=el, row_bytes=rb, comb_row_bytes=crb, private_capacity=cap,
                       overflow_capacity=R * 8, max_send_rows=R * 8, timeout_s=60) for e in engines]
    try:
        connect_all(engines)
        for px in pxs:
            px.start()
        proxy_dispatch_combine(pxs, cap, rb, crb, el)
    finally:
        for px in pxs:
            px.close()
        for e in engines:
            e.close()


def proxy_dispatch_combine(pxs, cap: int, rb: int = 32, crb: int = 16, el: int = 2, epochs: int = 3) -> None:
    """Two ranks as two nodes, each with its started §10 proxy (``pxs``, ``row_bytes=rb``,
    ``comb_row_bytes=crb``, ``num_local_experts=el``, ``private_capacity=cap``): ``epochs`` epochs
    of dispatch (round 1, and round 2 for rows over the private capacity) and combine, every header
    and row checked where §10 puts it, then the phases each proxy counted."""
    R = len(pxs)
    rng = np.random.default_rng(3)
    for e in range(1, epochs + 1):
        C = rng.integers(0, 6, size=(R, R))
        np.fill_diagonal(C, 0)
        for r, px in enumerate(pxs):
            for p in range(R):
                hdr = px.header(p)
                hdr[:R], hdr[R:R + el] = C[r], e
            for p, off in px.disp_offsets(C[r]).items():
                n = int(C[r, p])
                px.disp_send[off:off + n * rb] = rows(e, r, p, n, rb).reshape(-1)
            px.ring("dispatch", e)
        for px in pxs:
            px.wait_ready("dispatch", e, 60)
        for r, px in enumerate(pxs):
            s = 1 - r
            base = px.round1_offset(e, s)
            hdr = px.received_header(e, s)
            assert hdr[:R].tolist() == C[s].tolist() and hdr[R:R + el].tolist() == [e] * el
            c = int(C[s, r])
            n1 = min(c, cap)
            o = px.overflow_offset(e)  # the only remote source: overflow rows from offset 0
            got = np.concatenate([px.round1[base:base + n1 * rb].reshape(n1, rb),
                                  px.overflow[o:o + (c - n1) * rb].reshape(c - n1, rb)])
            assert np.array_equal(got, rows(e, s, r, c, rb)), (e, s, r)
            px.comb_send[:c * crb] = got[:, :crb].reshape(-1)
            px.ring("combine", e)
        for r, px in enumerate(pxs):
            px.wait_ready("combine", e, 60)
            c, o = int(C[r, 1 - r]), px.comb_recv_offset(e)
            got = px.comb_recv[o:o + c * crb].reshape(c, crb)
            assert np.array_equal(got, rows(e, r, 1 - r, c, rb)[:, :crb]), (e, r)
    # The proxy counts a phase before it writes the ready word: seen ready, counted.
    assert [px.phases_done for px in pxs] == [2 * epochs] * R
