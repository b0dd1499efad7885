"""The host proxy's bindings (csrc/proxy/proxy.h, docs/ARCHITECTURE.md §10): ``Proxy``, one
rank's protocol thread on an ``Engine``, driven by the mailbox words (``moe_ep.native.protocol``);
its configuration (``ProxyConfig``) and the regions it needs (``proxy_region_bytes``); what it
records (``PhaseRecord``, ``TraceEvent``); ``Proxy.check_error`` turns its error record into
``CommTimeoutError`` / ``PeerLostError`` / ``moe_ep.CapacityError``.
"""
from __future__ import annotations

import ctypes
import time
from typing import Sequence

from ..core.errors import CapacityError, CommTimeoutError
from .library import (CP, ERR_INVALID, ERR_PEER, I32, I64, SZ, U32, U64, VP, Closable, Functions, NativeError,
                      PeerLostError, address, check, fail, ns, text)
from .protocol import (MAILBOX, MAILBOX_ARRAYS, PHASE_NAMES, PROXY_CAPACITY, PROXY_OK, PROXY_PEER_LOST,
                       PROXY_TIMEOUT, REGION_NAMES, hdr_bytes, mailbox_word, mailbox_words)
from .transports import Engine

class ProxyConfig(ctypes.Structure):
    """csrc/proxy/proxy.h ProxyConfig (all int64)."""
    _fields_ = [(n, ctypes.c_int64) for n in (
        "rank", "world_size", "node_size", "num_local_experts", "row_bytes", "comb_row_bytes", "private_capacity",
        "overflow_capacity", "max_send_rows", "timeout_ns", "spin_ns", "sleep_ns", "trace_level")]


# ProxyConfig.trace_level by name (csrc/proxy/proxy.h kTrace*): what the proxy's trace records.
TRACE_LEVELS = {"off": 0, "phases": 1, "peers": 2}


class PhaseRecord(ctypes.Structure):
    """csrc/proxy/proxy.h PhaseRecord: one served phase (steady-clock ns)."""
    _fields_ = [(n, ctypes.c_int64) for n in ("kind", "epoch", "seen_ns", "mid_ns", "ready_ns", "cpu_ns", "posts",
                                              "bells")]


class TraceEvent(ctypes.Structure):
    """csrc/proxy/proxy.h TraceEvent: one thing the proxy saw or did."""
    _fields_ = [("ns", ctypes.c_int64), ("epoch", ctypes.c_int64), ("kind", ctypes.c_int32), ("peer", ctypes.c_int32)]


# TraceEvent kinds (csrc/proxy/proxy.h kTr*), by value.
TRACE_KINDS = ("hdr_bell", "rows_bell", "post_d0", "post_d1", "post_d2", "got_d0", "got_d1", "got_d2", "hdr_ready",
               "disp_ready", "comb_bell", "post_c", "got_c", "comb_ready", "post_credit", "got_credit", "ov_ready")


_native = Functions(
    moe_ep_proxy_mailbox_layout=(I32, I64, ctypes.POINTER(I64), I32), moe_ep_proxy_region_bytes=(I32, ctypes.POINTER(ProxyConfig), ctypes.POINTER(U64)),
    moe_ep_proxy_create=(VP, VP, ctypes.POINTER(ProxyConfig), ctypes.POINTER(VP), ctypes.POINTER(U64),
                         ctypes.POINTER(I64), U64),
    moe_ep_proxy_keys=(I32, VP, ctypes.POINTER(U32)), moe_ep_proxy_start=(I32, VP), moe_ep_proxy_destroy=(None, VP),
    moe_ep_proxy_error_message=(I32, VP, CP, SZ), moe_ep_proxy_phases_done=(I64, VP),
    moe_ep_proxy_phase_records=(I32, VP, ctypes.POINTER(PhaseRecord), I32),
    moe_ep_proxy_trace=(I32, VP, ctypes.POINTER(TraceEvent), I32))


def native_mailbox_layout(world: int) -> dict[str, int]:
    """The word indices as the native library defines them for ``world`` ranks: the fixed words,
    ``"n_fixed"``, the first word of each per-rank array, and ``"n_words"``."""
    out = (ctypes.c_int64 * 32)()
    n = _native().moe_ep_proxy_mailbox_layout(world, out, 32)
    return dict(zip([*MAILBOX, "n_fixed", *MAILBOX_ARRAYS, "n_words"], out[:n]))


def proxy_region_bytes(world_size: int, *, node_size: int, num_local_experts: int, row_bytes: int,
                       comb_row_bytes: int, private_capacity: int, overflow_capacity: int,
                       max_send_rows: int) -> dict[str, int]:
    """The minimum byte size of each region (``REGION_NAMES``) of a ``Proxy`` with these arguments
    (the native ``moe_ep_proxy_region_bytes``), for a caller that passes its own ``regions``."""
    cfg = ProxyConfig(0, world_size, node_size, num_local_experts, row_bytes, comb_row_bytes, private_capacity,
                      overflow_capacity, max_send_rows, 0, 0, 0, 0)
    need = (ctypes.c_uint64 * len(REGION_NAMES))()
    _native().moe_ep_proxy_region_bytes(ctypes.byref(cfg), need)
    return dict(zip(REGION_NAMES, (int(n) for n in need)))


class Proxy(Closable):
    """One rank's §10 proxy on a (not yet or already connected) ``Engine``.

    The seven regions (``REGION_NAMES``: ``disp_send``, ``round1``, ``overflow``, ``comb_send``,
    ``comb_recv`` hold rows; ``hdr_send``, ``hdr_recv`` the headers; uint8 arrays or tensors,
    numpy arrays allocated here unless given) and the int64 ``mailbox`` are owned by this object;
    they are registered with the engine at construction, in that order, so the engine must see
    the same registrations in the same order on every rank. Then ``engine.connect``, then
    ``start()``. The kernel side writes the headers (``header(p)``) and packs the send buffer
    (``disp_offsets``), calls ``ring("dispatch", e)``, polls ``wait_ready("dispatch", e,
    timeout_s)``, and the same for ``"combine"``. Any error stops the proxy; ``wait_ready`` then
    raises. ``close()`` before the engine is closed.

    The regions peers write into hold two copies, picked by the epoch's parity (§10): epoch ``e``
    finds source ``s``'s header at ``received_header(e, s)``, its round-1 rows at
    ``round1_offset(e, s)``, its overflow rows from
    ``overflow_offset(e)`` and its combine rows from ``comb_recv_offset(e)``.
    """

    def __init__(self, engine: Engine, *, node_size: int, num_local_experts: int, row_bytes: int,
                 comb_row_bytes: int, private_capacity: int, overflow_capacity: int, max_send_rows: int,
                 timeout_s: float = 30.0, spin_us: float = 50.0, sleep_us: float = 20.0, trace: str = "phases",
                 regions: dict | None = None, mailbox=None):
        import numpy as np

        if trace not in TRACE_LEVELS:
            raise ValueError(f"trace must be one of {sorted(TRACE_LEVELS)}, got {trace!r}")
        self._lib = _native()
        self.engine = engine
        self.rank, self.world = engine.rank, engine.world
        self.node_size, self.timeout_s = node_size, timeout_s
        self.cfg = ProxyConfig(self.rank, self.world, node_size, num_local_experts, row_bytes, comb_row_bytes,
                               private_capacity, overflow_capacity, max_send_rows, ns(timeout_s),
                               int(spin_us * 1e3), int(sleep_us * 1e3), TRACE_LEVELS[trace])
        self.hdr_bytes = hdr_bytes(self.world, num_local_experts)
        self.row_bytes, self.comb_row_bytes = row_bytes, comb_row_bytes
        self.private_capacity, self.overflow_capacity = private_capacity, overflow_capacity
        self.max_send_rows = max_send_rows
        self.slot_bytes = private_capacity * row_bytes  # one round-1 slot
        self.region_bytes = proxy_region_bytes(self.world, node_size=node_size, num_local_experts=num_local_experts,
                                               row_bytes=row_bytes, comb_row_bytes=comb_row_bytes,
                                               private_capacity=private_capacity,
                                               overflow_capacity=overflow_capacity, max_send_rows=max_send_rows)
        regions = dict(regions or {})
        for name in REGION_NAMES:
            if name not in regions:
                regions[name] = np.zeros(max(int(self.region_bytes[name]), 16), np.uint8)
            setattr(self, name, regions[name])
        self.mailbox = np.zeros(mailbox_words(self.world), np.int64) if mailbox is None else mailbox
        addrs = [address(regions[n]) for n in REGION_NAMES]
        ptrs = (ctypes.c_void_p * len(addrs))(*[a[0] for a in addrs])
        lens = (ctypes.c_uint64 * len(addrs))(*[a[1] for a in addrs])
        mb_ptr, mb_len = address(self.mailbox)
        self._h = self._lib.moe_ep_proxy_create(engine.handle, ctypes.byref(self.cfg), ptrs, lens,
                                                ctypes.cast(mb_ptr, ctypes.POINTER(ctypes.c_int64)), mb_len // 8)
        if not self._h:
            fail(ERR_INVALID, f"rank {self.rank}: creating the proxy failed")
        keys = (ctypes.c_uint32 * len(REGION_NAMES))()
        self._lib.moe_ep_proxy_keys(self._h, keys)
        self.keys = dict(zip(REGION_NAMES, keys))

    def remote(self, p: int) -> bool:
        return p // self.node_size != self.rank // self.node_size

    def round1_offset(self, epoch: int, s: int) -> int:
        """Byte offset of source s's round-1 slot (its first ``min(c, cap)`` rows) for ``epoch``."""
        return ((epoch & 1) * self.world + s) * self.slot_bytes

    def header(self, p: int):
        """The int32 view of this rank's header for peer ``p`` in ``hdr_send`` (``[R]`` count
        vector, then ``[EL]`` selections of p's experts); slot ``rank``: its own count vector."""
        return self.hdr_send[p * self.hdr_bytes:(p + 1) * self.hdr_bytes].view("int32")

    def received_header(self, epoch: int, s: int):
        """The int32 view of source ``s``'s header for ``epoch`` in ``hdr_recv``."""
        o = ((epoch & 1) * self.world + s) * self.hdr_bytes
        return self.hdr_recv[o:o + self.hdr_bytes].view("int32")

    def overflow_offset(self, epoch: int) -> int:
        """Byte offset of ``epoch``'s overflow copy (rows at sum of o_{s'p} over remote s' < s)."""
        return (epoch & 1) * self.overflow_capacity * self.row_bytes

    def comb_recv_offset(self, epoch: int) -> int:
        """Byte offset of ``epoch``'s combine receive copy (rows at sum of c_{rank,p'}, remote p' < p)."""
        return (epoch & 1) * self.max_send_rows * self.comb_row_bytes

    def disp_offsets(self, counts: Sequence[int]) -> dict[int, int]:
        """Byte offset of ``rows_p`` in the send buffer for each remote peer p (rank order), from
        this rank's count vector."""
        out, o = {}, 0
        for p in range(self.world):
            if self.remote(p):
                out[p] = o
                o += counts[p] * self.row_bytes
        return out

    def start(self) -> None:
        """Starts the proxy thread (after ``engine.connect``)."""
        check(self._lib.moe_ep_proxy_start(self._h))

    def ring(self, phase: str, epoch: int) -> None:
        """Kernel stand-in: rings every bell of ``phase``: dispatch, each peer's rows bell and the
        header bell (``hdr_send`` holds every header, the send buffer every row); combine, each
        source's bell."""
        W = self.world
        if phase == "dispatch":
            self.mailbox[mailbox_word("disp_bell", W, 0):mailbox_word("disp_bell", W, W)] = epoch
            self.mailbox[MAILBOX["hdr_bell"]] = epoch
        else:
            self.mailbox[mailbox_word("comb_bell", W, 0):mailbox_word("comb_bell", W, W)] = epoch

    def error_record(self) -> tuple[int, int, int, int]:
        """(code, peer, phase, epoch); code 0 while healthy."""
        code = int(self.mailbox[MAILBOX["err_code"]])  # read first: the proxy writes it last
        return (code, int(self.mailbox[MAILBOX["err_peer"]]), int(self.mailbox[MAILBOX["err_phase"]]),
                int(self.mailbox[MAILBOX["err_epoch"]]))

    @property
    def error_message(self) -> str:
        return text(self._lib.moe_ep_proxy_error_message, self._h) if self._h else ""

    @property
    def phases_done(self) -> int:
        return self._lib.moe_ep_proxy_phases_done(self._h)

    def phase_records(self, max_n: int = 8192) -> list[tuple[str, int, int, int, int, int, int, int]]:
        """The most recent served phases, oldest first: (``"dispatch"``/``"combine"``, epoch,
        bell seen, every header in (dispatch; = ready for combine), ready written: steady-clock
        ns; the proxy thread's CPU ns in the phase; writes it posted; doorbells it saw)."""
        buf = (PhaseRecord * max(1, max_n))()
        n = self._lib.moe_ep_proxy_phase_records(self._h, buf, max(1, max_n))
        return [("dispatch" if r.kind == 0 else "combine", r.epoch, r.seen_ns, r.mid_ns, r.ready_ns, r.cpu_ns,
                 r.posts, r.bells) for r in buf[:n]]

    def trace(self, max_n: int = 1 << 16) -> list[tuple[int, str, int, int]]:
        """The most recent trace events, oldest first: (steady-clock ns, kind (``TRACE_KINDS``),
        peer (-1: none), epoch); the last 65536 kept. ``trace="phases"`` (the default) records the
        header bell, hdr_ready and the ready words; ``"peers"`` also every bell seen, write posted
        and immediate counted, per peer; ``"off"`` nothing."""
        buf = (TraceEvent * max(1, max_n))()
        n = self._lib.moe_ep_proxy_trace(self._h, buf, max(1, max_n))
        return [(e.ns, TRACE_KINDS[e.kind], e.peer, e.epoch) for e in buf[:n]]

    def error(self) -> BaseException | None:
        """The exception of the error record (what ``check_error`` raises), or None while healthy."""
        try:
            self.check_error()
        except Exception as exc:  # noqa: BLE001 - returned, not raised
            return exc
        return None

    def check_error(self) -> None:
        """Raises the exception of the error record, if there is one."""
        code, peer, phase, epoch = self.error_record()
        if code == PROXY_OK:
            return
        msg = self.error_message or f"rank {self.rank}: proxy error {code}"
        name = PHASE_NAMES.get(phase, "proxy")
        if code == PROXY_TIMEOUT:
            err = CommTimeoutError(self.rank, peer, name, epoch, self.timeout_s)
            err.args = (f"{err.args[0]} [{msg}]",)
            raise err
        if code == PROXY_PEER_LOST:
            err = PeerLostError(msg, ERR_PEER, peer)
            err.rank, err.phase, err.epoch = self.rank, name, epoch
            raise err
        if code == PROXY_CAPACITY:  # (a peer's goodbye after a CapacityError: peer is the rank over its cap)
            raise CapacityError(msg, rank=self.rank, peer=peer, phase=name, epoch=epoch)
        raise NativeError(msg, ERR_INVALID, peer)

    def wait_ready(self, phase: str, epoch: int, timeout_s: float) -> None:
        """Kernel stand-in: polls the ready word of ``phase`` until it reaches ``epoch``; raises
        the error record's exception as soon as there is one, CommTimeoutError at the deadline."""
        self.wait_word(MAILBOX["disp_ready" if phase == "dispatch" else "comb_ready"], epoch, timeout_s,
                       phase=phase, epoch=epoch)

    def wait_word(self, word: int, value: int, timeout_s: float, *, phase: str = "dispatch", epoch: int = 0) -> None:
        """Kernel stand-in: polls mailbox ``word`` until it reaches ``value`` (a ready word, or an
        overflow window's ``ov_window(epoch, w)``); the error record's exception as soon as there
        is one, CommTimeoutError (``phase``, ``epoch``) at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_error()
            if self.mailbox[word] >= value:
                return
            if time.monotonic() >= deadline:
                raise CommTimeoutError(self.rank, -1, phase, epoch, timeout_s)
            time.sleep(0.0002)

    def close(self) -> None:
        """Stops and joins the proxy thread. Call before closing the engine."""
        if getattr(self, "_h", None):
            self._lib.moe_ep_proxy_destroy(self._h)
            self._h = None
