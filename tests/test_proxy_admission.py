"""Who gets into a TCP engine (docs/ARCHITECTURE.md §9, "Who gets in"), in one process over
loopback: every malformed or foreign hello is refused with one line naming the address and what
was wrong (never the secret), lands nothing, closes within the hello deadline and releases its
descriptor; a flood of idle connections is capped; engines of different jobs cannot connect;
and a connection that did get in (the right identity) still cannot write outside a region, and
ends at once on a header no region could take.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import proxy_wire as W
from moe_ep.native.identity import JobIdentity
from moe_ep.native.transports import CQ_PEER_LOST, TcpTransport

ID = JobIdentity(bytes(range(16, 32)), 1_700_000_000_000_000_123)
HELLO_S = 1.0  # "at once" is checked as "before this", and the reason says why it was not the deadline
SIZES = {"small": 256, "big": 4096}  # keys 1 and 2


def _listener(**kw) -> tuple:
    """Rank 0 of 2 with ID, canary-padded regions registered, never connected (its listener runs)."""
    kw.setdefault("hello_timeout_s", HELLO_S)
    e = TcpTransport(0, 2, streams=2, identity=kw.pop("identity", ID), **kw)
    mem = W.CanaryRegions(SIZES)
    for name in SIZES:
        e.register(mem.views[name])
    return e, mem


def _good(stream=0, **kw):
    """The hello rank 1 of this job sends on `stream` (kw overrides fields)."""
    f = dict(src=1, dst=0, world=2, stream=stream, session=ID.session, secret=ID.secret)
    f.update(kw)
    return W.hello(**f)


WRONG = bytes(16)
STRANGERS = {
    # name: (bytes sent, closed at once (else at the hello deadline), what the refusal says)
    "nothing": (b"", False, "no hello within 1 s"),
    "truncated hello": (_good()[:20], False, "no hello within 1 s"),
    "bad magic": (b"GET / HTTP/1.1\r\n\r\n", True, "not a moe_ep hello (magic 0x20544547)"),
    "old hello": (W.hello_v1(1, 2, 0), True, "a hello without the job identity"),
    "wrong world": (_good(world=3), True, "world size 3 (this job has 2)"),
    "own rank": (_good(src=0), True, "source rank 0 (not a peer of rank 0"),
    "rank out of range": (_good(src=2), True, "source rank 2"),
    "negative rank": (_good(src=-1), True, "source rank -1"),
    "meant for another": (_good(dst=1), True, "meant for rank 1 (this is rank 0)"),
    "other session": (_good(session=ID.session - 1), True, f"session epoch {ID.session - 1} (this session: {ID.session}"),
    "wrong secret": (_good(secret=WRONG), True, "the job secret does not match"),
    "stream out of range": (_good(stream=256), True, "stream 256"),
    "wrong secret, then writes": (_good(secret=WRONG) + W.header(1, 0, 64, imm=5) + b"\xee" * 64 +
                                  W.header(2, 0, 4096, imm=5, wr_id=2) + b"\xee" * 4096, True,
                                  "the job secret does not match"),
}


@pytest.fixture
def listener():
    e, mem = _listener()
    yield e, mem
    e.close()


@pytest.mark.parametrize("case", list(STRANGERS))
def test_stranger_refused(listener, case):
    e, mem = listener
    data, at_once, why = STRANGERS[case]
    base_fds, snap, before = W.open_fds(), mem.snapshot(), e.refused().total
    s = W.dial(e.endpoint, data)
    addr = "%s:%d" % s.getsockname()
    gone = W.wait_gone(s, HELLO_S + 2.0)
    s.close()
    assert gone < (HELLO_S if at_once else HELLO_S + 1.5), f"closed after {gone:.2f} s"
    if not at_once:
        assert gone > HELLO_S - 0.1, f"closed after {gone:.2f} s, before the hello deadline"
    ref = e.refused()
    assert ref.total == before + 1, ref
    line = ref.recent[-1]
    assert f"rank 0: refused a connection from {addr}: {why}" in line, line
    assert ID.secret.hex() not in line and repr(ID.secret) not in line
    assert mem.changed(snap) == []  # nothing landed, inside or around a region
    assert e.imm.value(5) == 0 and e.peer_error(1) == ""
    assert W.wait_fds(base_fds) == base_fds  # the listener closed its side


def test_stranger_closing_mid_hello(listener):
    e, mem = listener
    base_fds = W.open_fds()
    s = W.dial(e.endpoint, _good()[:20])
    addr = "%s:%d" % s.getsockname()
    s.close()
    deadline = time.monotonic() + 2
    while e.refused().total == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert e.refused().recent[-1].endswith(f"refused a connection from {addr}: closed after 20 of its 48 hello bytes")
    assert W.wait_fds(base_fds) == base_fds and e.peer_error(1) == ""


def test_refusals_are_logged_on_stderr(capfd):
    e, _ = _listener()
    try:
        s = W.dial(e.endpoint, _good(secret=WRONG))
        W.wait_gone(s, 2)
        s.close()
        time.sleep(0.05)
    finally:
        e.close()
    err = capfd.readouterr().err
    assert "moe_ep: rank 0: refused a connection from 127.0.0.1:" in err and "job secret does not match" in err
    assert ID.secret.hex() not in err


def test_idle_flood_is_capped():
    """More idle connections than max_pending: the oldest are closed at once, the rest at the hello
    deadline; the listener never holds more than max_pending of them; afterwards every descriptor
    is released, and a peer of the job still gets in."""
    cap, n = 4, 12
    e, mem = _listener(max_pending=cap, hello_timeout_s=2.0)
    b = TcpTransport(1, 2, streams=2, identity=ID)
    try:
        base_fds = W.open_fds()
        t0 = time.monotonic()
        flood = [W.dial(e.endpoint) for _ in range(n)]
        deadline = time.monotonic() + 3
        while e.refused().total < n - cap and time.monotonic() < deadline:
            time.sleep(0.01)
        ref = e.refused()
        assert ref.total == n - cap, ref
        assert all(f"more than {cap} connections wait for theirs" in line for line in ref.recent)
        held = W.open_fds() - base_fds - n  # the listener's side of the flood
        assert held <= cap, f"the listener holds {held} connections without a hello (cap {cap})"
        closed_at = []  # since the flood began
        for s in flood:
            W.wait_gone(s, 5.0)
            closed_at.append(time.monotonic() - t0)
        assert max(closed_at[:n - cap]) < 1.5 and 1.9 < min(closed_at[n - cap:]) and max(closed_at) < 3.5, \
            [round(t, 2) for t in closed_at]
        for s in flood:
            s.close()
        assert W.wait_fds(base_fds) == base_fds
        # the job's own peer still connects and writes
        src = np.full(64, 7, np.uint8)
        b.register(src)
        b.connect([e.endpoint, b.endpoint], timeout_s=5)
        b.post_write(0, 1, 0, 1, 0, 64, imm=9)
        b.wait_completions(1, 5)
        assert (mem.views["small"][:64] == 7).all() and e.imm.value(9) == 1 and mem.canary_damage() == []
    finally:
        b.close()
        e.close()


def test_engines_of_different_jobs_do_not_connect():
    """Two engines with different secrets: each refuses the other's connections, so each sees its
    outgoing connections closed and fails its writes as peer lost, within the deadline."""
    other = JobIdentity(bytes(range(16)), ID.session)
    a, b = TcpTransport(0, 2, streams=2, identity=ID), TcpTransport(1, 2, streams=2, identity=other)
    try:
        bufs = [np.zeros(64, np.uint8), np.zeros(64, np.uint8)]
        for eng, buf in zip((a, b), bufs):
            eng.register(buf)
        eps = [a.endpoint, b.endpoint]
        a.connect(eps, timeout_s=5)
        b.connect(eps, timeout_s=5)
        t0 = time.monotonic()
        for eng in (a, b):
            eng.post_write(1 - eng.rank, 1, 0, 1, 0, 64, imm=3)
            (c,) = eng.wait_completions(1, 5, check=False)
            assert c.status == CQ_PEER_LOST, c
        assert time.monotonic() - t0 < 3
        for eng in (a, b):
            assert any("the job secret does not match" in line for line in eng.refused().recent), eng.refused()
        assert not bufs[0].any() and not bufs[1].any()
        assert a.imm.value(3) == 0 and b.imm.value(3) == 0
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------- a connection that got in

def _as_rank1(e, stream=0):
    return W.dial(e.endpoint, _good(stream))


def test_writes_of_an_admitted_peer_stay_inside_regions(listener):
    """Rank 1's identity, then writes: a good one lands and counts; unknown keys and ranges out
    of bounds (offsets near 2^64 included) are drained and acknowledged as rejected, land nothing
    and leave the connection and the peer healthy."""
    e, mem = listener
    s = _as_rank1(e)
    try:
        payload = bytes((i * 5 + 1) % 256 for i in range(64))
        snap = mem.snapshot()
        bad = [(9, 0, 64), (1, 200, 64), (1, 256, 1), (2, 4000, 97), (1, 2**64 - 8, 16), (2, 2**63, 64)]
        for wr, (key, roff, n) in enumerate(bad, start=10):
            s.sendall(W.header(key, roff, n, wr_id=wr, imm=4) + b"\xee" * n)
        assert W.read_acks(s, len(bad)) == [(wr, 1, 0) for wr in range(10, 10 + len(bad))]
        assert mem.changed(snap) == [] and e.imm.value(4) == 0
        s.sendall(W.header(1, 8, 64, wr_id=1, imm=6) + payload)
        assert W.read_acks(s, 1) == [(1, 0, 0)]
        assert bytes(mem.views["small"][8:72]) == payload and e.imm.value(6) == 1
        assert not mem.views["small"][:8].any() and not mem.views["small"][72:].any()
        assert mem.canary_damage() == [] and e.peer_error(1) == ""
        # a second connection for the same stream is refused; the first one keeps working
        dup = _as_rank1(e, 0)
        assert W.wait_gone(dup, 2.0) < 1.0
        dup.close()
        assert "a second connection for rank 1 stream 0" in e.refused().recent[-1]
        s.sendall(W.header(2, 0, 3, wr_id=2, imm=6) + b"abc")
        assert W.read_acks(s, 1) == [(2, 0, 0)] and e.imm.value(6) == 2 and e.peer_error(1) == ""
    finally:
        s.close()


PROTOCOL_ERRORS = {
    # name: (header, what the peer error says); the connection ends on the header alone
    "bad magic": (W.header(1, 0, 64, magic=0x12345678), "bad write header magic"),
    "no shards": (W.header(1, 0, 64, nshards=0), "shard 0 of 0"),
    "shard beyond nshards": (W.header(1, 0, 64, shard=2, nshards=2), "shard 2 of 2"),
    "too many shards": (W.header(1, 0, 64, shard=3, nshards=1000), "shard 3 of 1000"),
    "length near 2^64": (W.header(1, 0, 2**64 - 1), f"a shard of {2**64 - 1} bytes, larger than any registered region (4096"),
    "length beyond every region": (W.header(2, 0, 4097), "a shard of 4097 bytes, larger than any registered region"),
}


@pytest.mark.parametrize("case", list(PROTOCOL_ERRORS))
def test_protocol_error_ends_the_connection(listener, case):
    """A header no region could take ends the connection at once (not drained: no payload is
    sent), and the peer whose identity it used is lost; nothing lands."""
    e, mem = listener
    base_fds, snap = W.open_fds(), mem.snapshot()
    hdr, why = PROTOCOL_ERRORS[case]
    s = _as_rank1(e)
    s.sendall(hdr)
    gone = W.wait_gone(s, 3.0)
    s.close()
    assert gone < 1.0, f"closed after {gone:.2f} s"  # drained, it would wait for payload forever
    assert f"protocol error: {why}" in e.peer_error(1), e.peer_error(1)
    assert mem.changed(snap) == []
    assert W.wait_fds(base_fds) == base_fds


def test_truncated_payload(listener):
    """20 of 64 payload bytes, then the connection closes: the peer is lost, no immediate is
    counted, no ack is sent, and nothing outside the write's range changed."""
    e, mem = listener
    s = _as_rank1(e)
    s.sendall(W.header(1, 100, 64, imm=8) + b"\xab" * 20)
    time.sleep(0.1)
    s.close()
    deadline = time.monotonic() + 2
    while not e.peer_error(1) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "in the middle of a write" in e.peer_error(1)
    small = mem.views["small"]
    assert not small[:100].any() and not small[164:].any() and not mem.views["big"].any()
    assert mem.canary_damage() == [] and e.imm.value(8) == 0


# ---------------------------------------------------------------- settings

def test_hello_timeout_from_the_environment(monkeypatch):
    monkeypatch.setenv("MOE_EP_TCP_HELLO_TIMEOUT", "0.3")
    monkeypatch.setenv("MOE_EP_TCP_MAX_PENDING", "3")
    e = TcpTransport(0, 2, identity=ID)
    try:
        assert (e.hello_timeout_s, e.max_pending) == (0.3, 3)
        s = W.dial(e.endpoint)
        gone = W.wait_gone(s, 2)
        s.close()
        assert 0.25 < gone < 1.5, gone
        assert "no hello within 0.3 s" in e.refused().recent[-1]
        e.set_hello_timeout(2.0)  # connections accepted from now on
        s = W.dial(e.endpoint)
        assert W.wait_gone(s, 4) > 1.9
        s.close()
    finally:
        e.close()


@pytest.mark.parametrize("kw,msg", [
    (dict(hello_timeout_s=0), "hello_timeout_s: expected a positive number, got 0"),
    (dict(hello_timeout_s=-1.0), "hello_timeout_s: expected a positive number"),
    (dict(hello_timeout_s=float("nan")), "hello_timeout_s: expected a positive number"),
    (dict(hello_timeout_s="5"), "hello_timeout_s: expected a positive number, got '5'"),
    (dict(max_pending=0), "max_pending: expected a positive integer, got 0"),
    (dict(max_pending=2.5), "max_pending: expected a positive integer"),
    (dict(identity="secret"), "identity: expected a moe_ep.native.identity.JobIdentity or None, got str"),
])
def test_bad_settings(kw, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        TcpTransport(0, 2, **kw)


@pytest.mark.parametrize("env,value", [("MOE_EP_TCP_HELLO_TIMEOUT", "soon"), ("MOE_EP_TCP_HELLO_TIMEOUT", "-2"),
                                       ("MOE_EP_TCP_MAX_PENDING", "1.5")])
def test_bad_settings_in_the_environment(monkeypatch, env, value):
    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=f"{env}='{value}': expected a positive"):
        TcpTransport(0, 2)


def test_job_identity():
    a, b = JobIdentity.new(), JobIdentity.new()
    assert a != b and len(a.secret) == 16 and a.session > 0
    assert a.secret.hex() not in repr(a) and a.secret.hex() not in str(a) and str(a.session) in repr(a)
    assert JobIdentity.none() == JobIdentity(bytes(16), 0)
    with pytest.raises(ValueError, match="secret: expected 16 bytes, got 15 bytes"):
        JobIdentity(bytes(15), 1)
    with pytest.raises(ValueError, match="secret: expected 16 bytes, got str"):
        JobIdentity("0" * 16, 1)
    with pytest.raises(ValueError, match=r"session: expected an integer in \[0, 2\*\*64\), got -1"):
        JobIdentity(bytes(16), -1)
    with pytest.raises(ValueError, match="session"):
        JobIdentity(bytes(16), 2**64)
