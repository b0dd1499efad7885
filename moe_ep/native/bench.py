"""The native bench tools' bindings (csrc/proxy/bench.cc, csrc/proxy/null_transport.cc), which
``moe-ep-bench proxy`` runs: measurement loops in native code (``bench_post``: the cost of a post;
``bench_drive``: a kernel stand-in ringing a proxy's bells), the null transport (``NullTransport``:
posts that move nothing) and the peer simulator (``sim_drive``, ``sim_floor``) that measure one
proxy's own cost to EP128.
"""
from __future__ import annotations

import ctypes

from ..core.errors import CommTimeoutError
from .identity import JobIdentity
from .library import ERR_INVALID, I32, I64, OK, U32, U64, VP, Functions, address, check, fail, ns
from .proxy import Proxy
from .transports import Engine

_I64P = ctypes.POINTER(I64)


class SimConfig(ctypes.Structure):
    """``moe_ep::SimConfig`` (csrc/proxy/null_transport.cc): the simulated peers of a null-transport run."""
    _fields_ = [(n, ctypes.c_int64) for n in ("rank", "world", "node_size", "private_capacity", "hdr_bytes",
                                              "hdr_send_key", "hdr_recv_key", "n_draws", "arrival", "gap_ns",
                                              "timeout_ns", "spin_ns", "sleep_ns")]


_native = Functions(
    moe_ep_bench_post=(I32, VP, I32, U32, U64, U32, U64, U64, U32, I64, I64, I64, _I64P),
    moe_ep_bench_drive=(I32, _I64P, I64, I64, I64, I32, I64, I64, I64, _I64P),
    moe_ep_engine_create_null=(VP, I32, I32), moe_ep_null_stats=(I32, VP, _I64P), moe_ep_null_post_calls=(I64, VP),
    moe_ep_sim_drive=(I32, VP, _I64P, ctypes.POINTER(SimConfig), ctypes.POINTER(ctypes.c_int32), I64, I64, _I64P),
    moe_ep_sim_floor=(I32, I64, I64, I64, I64, I32, I64, _I64P))


def bench_post(engine: Engine, peer: int, local_key: int, remote_key: int, nbytes: int, *, n: int, n_serial: int,
               imm: int = 0x3000, timeout_s: float = 60.0) -> dict:
    """Measurement loop in native code (moe_ep/bench/proxy_cost.py) on a connected ``engine``:
    ``n`` writes of ``nbytes`` to ``peer`` posted back to back, then ``n_serial`` posted one at a
    time, each waited for. Nanoseconds."""
    out = (ctypes.c_int64 * 8)()
    check(_native().moe_ep_bench_post(engine.handle, peer, local_key, 0, remote_key, 0, nbytes, imm, n, n_serial,
                                      ns(timeout_s), out))
    return dict(post_total_ns=out[0], complete_total_ns=out[1], serial_post_p50_ns=out[2],
                serial_post_p99_ns=out[3], serial_latency_p50_ns=out[4], serial_latency_p99_ns=out[5],
                failed=out[6])


def _mailbox(proxy: Proxy):
    return ctypes.cast(address(proxy.mailbox)[0], _I64P)


def bench_drive(proxy: Proxy, first: int, n: int, *, combine: bool = True, timeout_s: float = 30.0,
                spin_us: float = 20.0, sleep_us: float = 5.0) -> tuple[list[int], list[int]]:
    """Kernel stand-in in native code (moe_ep/bench/proxy_cost.py): rings ``proxy``'s dispatch (and
    combine) bells for epochs first .. first+n-1, each after the previous ready; returns the ns
    bells -> ready of every dispatch and every combine. The send buffers are used as they are."""
    out = (ctypes.c_int64 * (2 * max(1, n)))()
    rc = _native().moe_ep_bench_drive(_mailbox(proxy), proxy.world, first, n, int(combine), ns(timeout_s),
                                      int(spin_us * 1e3), int(sleep_us * 1e3), out)
    if rc != OK:
        proxy.check_error()
        raise CommTimeoutError(proxy.rank, -1, "bench", first, timeout_s)
    return list(out[0:2 * n:2]), list(out[1:2 * n:2])


class NullTransport(Engine):
    """Bench tool (csrc/proxy/null_transport.cc): posts complete at once and move nothing; peers'
    writes are injected by ``sim_drive`` (moe_ep/bench/proxy_scale.py). Never connected to
    anything: one proxy's own cost."""

    def __init__(self, rank: int, world: int):
        self.adopt(_native().moe_ep_engine_create_null(rank, world), rank, world, "null", JobIdentity.none())
        self.streams = 0

    def stats(self) -> dict[str, int]:
        """Writes posted so far by phase (``D1``, ``D2``, ``C``, ``D0``, ``plain``) and ``bytes``."""
        out = (ctypes.c_int64 * 6)()
        if _native().moe_ep_null_stats(self.handle, out) != OK:
            fail(ERR_INVALID)
        return dict(zip(("D1", "D2", "C", "D0", "plain", "bytes"), out))

    def post_calls(self) -> int:
        """Post calls served so far (``post_write``, or ``post_writes`` with a batch of writes: one)."""
        n = _native().moe_ep_null_post_calls(self.handle)
        if n < 0:
            fail(int(n))
        return int(n)


def sim_drive(engine: NullTransport, proxy: Proxy, cfg: SimConfig, counts, first: int, n: int) -> list[int]:
    """The simulated peers and kernels of ``proxy`` (started, on ``engine``) for epochs first ..
    first+n-1: each epoch's headers and rows injected from the int32 count matrices ``counts``
    (``[cfg.n_draws, R, R]``, C-contiguous), its bells rung and its ready words awaited. Returns
    two ns per epoch (dispatch, combine); raises the proxy's error, else ``RuntimeError``."""
    out = (ctypes.c_int64 * (2 * max(1, n)))()
    rc = _native().moe_ep_sim_drive(engine.handle, _mailbox(proxy), ctypes.byref(cfg),
                                    counts.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), first, n, out)
    if rc != OK:
        proxy.check_error()
        raise RuntimeError(f"R={cfg.world}: simulated run failed ({rc})")
    return list(out)


def sim_floor(ranks: int, node_size: int, iters: int, reps: int, writer_cpu: int = -1,
              shards: int = 1) -> tuple[int, ...]:
    """The floor of one decode dispatch at ``ranks`` ranks (``moe_ep_sim_floor``): ns per dispatch
    of the posts and their completions, the immediates taken, the headers copied and scanned, each
    timed alone on one thread (best of ``reps``); then the headers and the immediates again, as
    another thread (on CPU ``writer_cpu``; -1: the scheduler's choice) wrote them. ``shards`` > 1:
    one thread's share of a proxy whose peers are dealt out over that many threads."""
    out = (ctypes.c_int64 * 5)()
    if _native().moe_ep_sim_floor(ranks, node_size, iters, reps, writer_cpu, shards, out) != OK:
        raise RuntimeError(f"R={ranks}: moe_ep_sim_floor failed")
    return tuple(out)
