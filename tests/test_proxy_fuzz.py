"""Wire fuzz against a live pair (docs/ARCHITECTURE.md §9, "Who gets in"): two CPU rank processes
as two nodes, an ``EPBuffer`` each over the TCP proxy, checked against the oracle; then, while
they idle, strangers connect to rank 0's listener over loopback and send no hello, truncated
hellos, wrong magic / world / ranks / session / secret, a hello of another job followed by write
headers of every bad kind (each region key, offsets and lengths out of bounds, lengths that
overflow 64-bit arithmetic, bad shard numbers, truncated payloads), a second connection for a
stream the live peer holds, and a flood of idle connections beyond the pending cap. After each:
the connection is gone within the hello deadline with one refusal naming it, its descriptor is
released, no byte of any region (or of the canaries around them) changed, and the live peer is
not marked lost. Then both ranks run again against the oracle, and the canaries are intact.
Bounded: about 10 s of fuzzing.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import dist_util
import proxy_wire as W
from ep_cases import Case

CASE = Case(R=2, E=4, K=2, M=4, H=128, calls=("uniform",), seed=3)
AFTER = dataclasses.replace(CASE, calls=("skewed",), seed=4)
HELLO_S = 1.0
PENDING, FLOOD = 16, 64


def _canary_proxy(real, mems):
    """``start_proxy`` with every region inside canary bytes (``proxy_wire.CanaryRegions``)."""
    from moe_ep.native.proxy import proxy_region_bytes

    def start(g, *, regions=None, **kw):
        assert regions is None, "CPU ranks: the proxy allocates its regions"
        sizes = proxy_region_bytes(g.world_size, node_size=g.node_size,
                                   **{k: v for k, v in kw.items() if k not in ("timeout_s", "mailbox")})
        mem = W.CanaryRegions({k: max(n, 16) for k, n in sizes.items()})
        mems.append(mem)
        return real(g, regions=dict(mem.views), **kw)

    return start


def _stranger_cases(ident, keys, region_len):
    """(name, bytes, close after sending, what the refusal says). Strangers name streams the
    live peer does not use, so only the check that fails for each stands in its way."""
    free = iter(range(16, 256))

    def hello(**kw):
        f = dict(src=1, dst=0, world=2, stream=next(free), session=ident.session, secret=bytes(16))
        f.update(kw)
        return W.hello(**f)

    good = hello(secret=ident.secret, stream=0)
    cases = [
        ("no hello", b"", False, f"no hello within {HELLO_S:g} s"),
        ("truncated hello", hello()[:20], False, f"no hello within {HELLO_S:g} s"),
        ("truncated hello, closed", hello()[:30], True, "closed after 30 of its 48 hello bytes"),
        ("wrong magic", b"\x00" * 48, False, "not a moe_ep hello (magic 0x00000000)"),
        ("old hello", W.hello_v1(1, 2, 0), False, "a hello without the job identity"),
        ("wrong world", hello(world=64), False, "world size 64"),
        ("own rank", hello(src=0), False, "source rank 0"),
        ("rank out of range", hello(src=7), False, "source rank 7"),
        ("meant for rank 1", hello(dst=1), False, "meant for rank 1"),
        ("other session", hello(session=ident.session ^ 1), False, "session epoch"),
        ("wrong secret", hello(), False, "the job secret does not match"),
        ("live stream taken", good + W.header(1, 0, 64, imm=1) + b"\xee" * 64, False,
         "a second connection for rank 1 stream 0"),
    ]
    bad_writes = [(f"key {k}", W.header(k, 0, 64, imm=0x10000 | k) + b"\xee" * 64) for k in range(8)]
    bad_writes += [
        ("offset at the end", W.header(keys[0], region_len, 64, imm=1) + b"\xee" * 64),
        ("offset near 2^64", W.header(keys[0], 2**64 - 16, 64, imm=1) + b"\xee" * 64),
        ("length near 2^64", W.header(keys[0], 64, 2**64 - 32, imm=1) + b"\xee" * 256),
        ("bad write magic", W.header(keys[0], 0, 64, magic=0xDEADBEEF) + b"\xee" * 64),
        ("shard >= nshards", W.header(keys[0], 0, 64, shard=4, nshards=4) + b"\xee" * 64),
        ("no shards", W.header(keys[0], 0, 64, nshards=0) + b"\xee" * 64),
        ("truncated payload", W.header(keys[0], 0, 64, imm=1) + b"\xee" * 20),
    ]
    for name, tail in bad_writes:
        cases.append((f"wrong secret + {name}", hello() + tail, name == "truncated payload",
                      "the job secret does not match"))
    return cases


def _fuzz(engine, mem, peer: int) -> list:
    """Rank 0: every stranger case, then the idle flood, against its own listener."""
    fails = []
    engine.set_hello_timeout(HELLO_S)
    engine.set_max_pending(PENDING)
    ep = engine.endpoint
    snap, base_fds = mem.snapshot(), W.open_fds()
    keys = list(range(1, len(mem.views) + 1))
    for name, data, close, why in _stranger_cases(engine.identity, keys, len(next(iter(mem.views.values())))):
        before = engine.refused().total
        s = W.dial(ep, data)
        addr = "%s:%d" % s.getsockname()
        t0 = time.monotonic()
        try:
            if close:
                s.close()
                while engine.refused().total == before and time.monotonic() - t0 < HELLO_S + 2:
                    time.sleep(0.01)
            else:
                W.wait_gone(s, HELLO_S + 2)
        except AssertionError as exc:
            fails.append(f"{name}: {exc}")
        finally:
            s.close()
        gone = time.monotonic() - t0
        ref = engine.refused()
        if gone > HELLO_S + 1.5:
            fails.append(f"{name}: the connection lasted {gone:.2f} s (hello deadline {HELLO_S} s)")
        if ref.total != before + 1 or f"refused a connection from {addr}: {why}" not in ref.recent[-1]:
            fails.append(f"{name}: expected one refusal of {addr} saying {why!r}, got {ref.recent[-3:]}")
        fails += [f"{name}: {c}" for c in mem.changed(snap)]
        if engine.peer_error(peer):
            fails.append(f"{name}: the live peer was marked lost: {engine.peer_error(peer)}")
            break
        if W.wait_fds(base_fds) != base_fds:
            fails.append(f"{name}: {W.open_fds() - base_fds} descriptors more than before")
    # a flood of idle connections: the oldest beyond the cap go at once, the rest at the deadline
    before = engine.refused().total
    t0 = time.monotonic()
    flood = [W.dial(ep) for _ in range(FLOOD)]
    while engine.refused().total < before + FLOOD - PENDING and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    held = W.open_fds() - base_fds - FLOOD
    if held > PENDING:
        fails.append(f"flood: the listener holds {held} connections without a hello (cap {PENDING})")
    for s in flood:
        try:
            W.wait_gone(s, HELLO_S + 3)
        except AssertionError as exc:
            fails.append(f"flood: {exc}")
        s.close()
    if time.monotonic() - t0 > HELLO_S + 3:
        fails.append(f"flood: the connections lasted {time.monotonic() - t0:.2f} s")
    if engine.refused().total != before + FLOOD:
        fails.append(f"flood: {engine.refused().total - before} refusals for {FLOOD} connections")
    if W.wait_fds(base_fds) != base_fds:
        fails.append(f"flood: {W.open_fds() - base_fds} descriptors more than before")
    fails += [f"flood: {c}" for c in mem.changed(snap)]
    if engine.peer_error(peer):
        fails.append(f"flood: the live peer was marked lost: {engine.peer_error(peer)}")
    return fails


def _worker(rank, world_size):
    import moe_ep
    import moe_ep.internode.path as internode
    from ep_cases import make_buffer, run_calls

    group = moe_ep.EPGroup(node_size=1)
    mems, real = [], internode.start_proxy
    internode.start_proxy = _canary_proxy(real, mems)
    try:
        buf = make_buffer(group, CASE, timeout_s=60.0)
    finally:
        internode.start_proxy = real
    with buf:
        assert buf.remote is not None, "two ranks with node_size 1 take the inter-node path"
        (mem,) = mems
        engine = buf.remote.proxy.engine
        fails = [f"before: {f}" for f in run_calls(group, buf, CASE)]
        group.barrier()
        if rank == 0:
            log = tempfile.TemporaryFile()
            saved = os.dup(2)
            os.dup2(log.fileno(), 2)  # the refusal lines the engine writes to stderr
            try:
                fails += _fuzz(engine, mem, peer=1)
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            log.seek(0)
            text = log.read()
            if engine.identity.secret in text or engine.identity.secret.hex().encode() in text:
                fails.append("the secret appears on stderr")
            if text.count(b"moe_ep: rank 0: refused a connection from 127.0.0.1:") < 20:
                fails.append(f"too few refusal lines on stderr: {text[-2000:]!r}")
        group.barrier()
        fails += [f"after: {f}" for f in run_calls(group, buf, AFTER)]
        fails += [f"canaries: {c}" for c in mem.canary_damage()]
        fails += [f"peer: {engine.peer_error(1 - rank)}"] if engine.peer_error(1 - rank) else []
        group.barrier()  # neither closes its buffer (and connections) before both have looked
    return fails


def test_wire_fuzz_against_a_live_pair():
    fails = [f for r in dist_util.run(2, _worker, timeout=300) for f in r]
    assert not fails, f"{len(fails)} failed checks:\n" + "\n".join(fails[:40])
