"""The proxy engine's transports (csrc/proxy): ``Engine``, one rank's registered memory, one-sided
writes with immediates to peers and their completions (``poll``), over TCP (``TcpTransport``),
libibverbs (``VerbsTransport``) or libfabric (``FabricTransport``, which is also how EFA is
reached, through its ``efa`` provider); the ``ImmCounter`` its receives feed (``engine.imm``);
the goodbye a closing engine sends; how a write is cut into shards (``shard_bounds``).

Timeouts raise ``moe_ep.CommTimeoutError``; a lost peer raises ``PeerLostError``; other failures
raise ``NativeError`` (``moe_ep.native.library``).
"""
from __future__ import annotations

import ctypes
import json
import math
import time
from typing import NamedTuple, Sequence

from ..core import settings
from ..core.errors import CapacityError, CommTimeoutError, ErrorCode
from .identity import JobIdentity
from .library import (CP, ERR_INVALID, ERR_PEER, ERR_SYSTEM, ERR_TIMEOUT, I32, I64, PEER_RE, SZ, U32, U64, VP,
                      Closable, Functions, NativeError, PeerLostError, address, check, fail, last_error, ns, text)
from .protocol import PHASE_C, PHASE_D1

# Completion status (csrc/proxy/transport.h).
CQ_OK, CQ_TIMEOUT, CQ_PEER_LOST, CQ_REMOTE_ACCESS = 0, 1, 2, 3
CQ_STATUS_NAMES = {CQ_OK: "ok", CQ_TIMEOUT: "timeout", CQ_PEER_LOST: "peer lost", CQ_REMOTE_ACCESS: "remote access error"}

class _CCompletion(ctypes.Structure):
    _fields_ = [("wr_id", ctypes.c_uint64), ("peer", ctypes.c_int32), ("status", ctypes.c_int32)]


class Completion(NamedTuple):
    wr_id: int
    peer: int
    status: int

    @property
    def ok(self) -> bool:
        return self.status == CQ_OK


_native = Functions(
    moe_ep_imm_create=(VP,), moe_ep_imm_destroy=(None, VP), moe_ep_imm_add=(I32, VP, U32, I64),
    moe_ep_imm_wait=(I32, VP, U32, I64, I64), moe_ep_imm_value=(I64, VP, U32),
    moe_ep_engine_create=(VP, CP, I32, I32, I32, CP, CP, U64),
    moe_ep_engine_create_verbs=(VP, I32, I32, CP, I32, I32, I32, CP, U64),
    moe_ep_engine_create_fabric=(VP, I32, I32, CP, CP, I32, I32, CP, U64),
    moe_ep_engine_imm_per_write=(I32, VP), moe_ep_shard_bounds=(I32, U64, I32, U64, U64, ctypes.POINTER(U64)),
    moe_ep_verbs_region_how=(I32, VP, U32, CP, SZ), moe_ep_engine_try_register=(I32, VP, VP, U64, CP, SZ),
    moe_ep_fabric_describe=(I32, VP, CP, SZ), moe_ep_engine_destroy=(None, VP),
    moe_ep_engine_goodbye=(I32, VP, I32, I32, I32, I64, I32), moe_ep_engine_imm=(VP, VP),
    moe_ep_register=(I32, VP, VP, U64, ctypes.POINTER(U32)), moe_ep_endpoint=(I32, VP, CP, SZ),
    moe_ep_connect=(I32, VP, ctypes.POINTER(CP), I32, I64),
    moe_ep_post_write=(I32, VP, I32, U32, U64, U32, U64, U64, I32, U32, ctypes.POINTER(U64)),
    moe_ep_poll=(I32, VP, ctypes.POINTER(_CCompletion), I32, I64), moe_ep_set_op_timeout=(I32, VP, I64),
    moe_ep_set_min_shard_bytes=(I32, VP, U64), moe_ep_set_hello_timeout=(I32, VP, I64),
    moe_ep_set_max_pending=(I32, VP, I32), moe_ep_engine_refused=(I32, VP, CP, SZ, ctypes.POINTER(I64)),
    moe_ep_peer_error=(I32, VP, I32, CP, SZ), moe_ep_engine_cpu_ns=(I64, VP), moe_ep_rank=(I32, VP),
    moe_ep_world=(I32, VP))


class ImmCounter:
    """Signed counter per 32-bit immediate. ``wait(imm, expected, timeout_s)`` blocks until the
    count reaches ``expected`` and subtracts it; counts may run ahead of their waiter."""

    def __init__(self, _handle: int | None = None, _owner: object = None, rank: int = -1):
        self._lib = _native()
        self._owned = _handle is None
        self._h = self._lib.moe_ep_imm_create() if _handle is None else _handle
        if not self._h:
            raise NativeError("creating an ImmCounter failed")
        self._owner = _owner  # keeps an engine alive while its counter is in use
        self.rank = rank

    @property
    def handle(self) -> int:
        """The native counter's handle (what the library's ``moe_ep_imm_*`` functions take); None once closed."""
        return self._h

    def add(self, imm: int, n: int = 1) -> None:
        check(self._lib.moe_ep_imm_add(self._h, imm, n))

    def value(self, imm: int) -> int:
        return self._lib.moe_ep_imm_value(self._h, imm)

    def wait(self, imm: int, expected: int, timeout_s: float, *, peer: int = -1, phase: str = "proxy",
             epoch: int = 0) -> None:
        """Raises CommTimeoutError(rank, peer, phase, epoch, timeout_s) when the deadline passes
        (the counter is then unchanged), PeerLostError when a peer's connection was lost."""
        rc = self._lib.moe_ep_imm_wait(self._h, imm, expected, ns(timeout_s))
        if rc == ERR_TIMEOUT:
            raise CommTimeoutError(self.rank, peer, phase, epoch, timeout_s)
        check(rc)

    def close(self) -> None:
        if self._owned and self._h:
            self._lib.moe_ep_imm_destroy(self._h)
        self._h = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Refused(NamedTuple):
    """Connections and hellos an engine refused: how many in all, and the last 64 lines (oldest
    first; each names the address and what was wrong)."""
    total: int
    recent: list


def _identity(identity: JobIdentity | None) -> JobIdentity:
    if identity is None:
        return JobIdentity.none()
    if not isinstance(identity, JobIdentity):
        raise ValueError(f"identity: expected a moe_ep.native.identity.JobIdentity or None, got {type(identity).__name__}")
    return identity


class Engine(Closable):
    """One rank's proxy engine: a transport (``"tcp"``; ``"verbs"``, ``"libfabric"`` and ``"efa"``
    (libfabric, provider efa) with their defaults) plus the ImmCounter its receives feed.

    Usage: ``key = e.register(buf)`` (every rank registers its regions in the same order, so keys
    agree), exchange ``e.endpoint`` strings, ``e.connect(endpoints)``, then ``post_write`` /
    ``poll`` on the sender and ``e.imm.wait`` on the receiver. ``connect`` once; ``close`` only
    after every call on the engine (and its ``imm``) has returned.

    ``identity``: the ``JobIdentity`` every hello of this engine carries and every peer's hello
    must carry (``start_proxy`` gives each session a new one, drawn by rank 0); the engines of one
    job need the same. None: the all-zero identity, for engines connected by hand.
    """

    def __init__(self, rank: int, world: int, streams: int = 4, bind_host: str = "127.0.0.1",
                 transport: str = "tcp", *, identity: JobIdentity | None = None):
        self._lib = _native()
        ident = _identity(identity)
        self.adopt(self._lib.moe_ep_engine_create(transport.encode(), rank, world, streams, bind_host.encode(),
                                                   ident.secret, ident.session),
                    rank, world, transport, ident)
        self.streams = streams

    def adopt(self, handle, rank: int, world: int, transport: str, identity: JobIdentity) -> None:
        """For the constructors: takes the native engine ``handle`` (raising the native error when
        it is null) and its counter."""
        self._lib = _native()  # (this module's functions declared: a subclass may have declared only its own)
        self._h = handle
        if not self._h:
            fail(ERR_SYSTEM, f"rank {rank}: creating the {transport} engine failed")
        self.rank, self.world, self.transport, self.identity = rank, world, transport, identity
        self._keep: list = []  # registered objects stay alive as long as the engine
        self.imm = ImmCounter(self._lib.moe_ep_engine_imm(self._h), _owner=self, rank=rank)

    @property
    def handle(self) -> int:
        """The native engine's handle (for a ``Proxy`` built on this engine); None once closed."""
        return self._h

    @property
    def endpoint(self) -> str:
        return text(self._lib.moe_ep_endpoint, self._h)

    @property
    def imm_per_write(self) -> int:
        """What one write with an immediate adds to the receiver's count: 1 (tcp), the NIC
        count for verbs and the endpoint count for libfabric (one immediate per byte shard, empty
        shards included). A receiver that
        waits for n writes waits for ``n * imm_per_write``."""
        return self._lib.moe_ep_engine_imm_per_write(self._h)

    def register_ptr(self, ptr: int, nbytes: int) -> int:
        key = ctypes.c_uint32()
        rc = self._lib.moe_ep_register(self._h, ptr, nbytes, ctypes.byref(key))
        check(rc)
        return key.value

    def try_register(self, obj) -> tuple[bool, str]:
        """Whether ``register(obj)`` would succeed (tried and released at once; no key is used):
        ``(True, how)`` (``"host"``; GPU memory: ``"dma-buf"`` / ``"gpu address"`` per NIC for
        verbs, ``"FI_HMEM_CUDA"`` for libfabric), else ``(False, why)``. ``obj``: a contiguous
        numpy array or tensor (host or CUDA)."""
        ptr, n = address(obj)
        buf = ctypes.create_string_buffer(1024)
        ok = self._lib.moe_ep_engine_try_register(self._h, ptr, n, buf, len(buf))
        return bool(ok), buf.value.decode(errors="replace")

    def register(self, obj) -> int:
        """Registers a writable contiguous buffer (kept alive by the engine); returns its key."""
        ptr, n = address(obj)
        key = self.register_ptr(ptr, n)
        self._keep.append(obj)
        return key

    def connect(self, endpoints: Sequence[str], timeout_s: float = 30.0) -> None:
        arr = (ctypes.c_char_p * len(endpoints))(*[e.encode() for e in endpoints])
        rc = self._lib.moe_ep_connect(self._h, arr, len(endpoints), ns(timeout_s))
        if rc == ERR_TIMEOUT:
            msg = last_error()
            m = PEER_RE.search(msg)
            err = CommTimeoutError(self.rank, int(m.group(1)) if m else -1, "connect", 0, timeout_s)
            err.args = (f"{err.args[0]} [{msg}]",)
            raise err
        check(rc)

    def post_write(self, peer: int, local_key: int, local_off: int, remote_key: int, remote_off: int,
                   nbytes: int, imm: int | None = None) -> int:
        """One-sided write into the peer's registered memory; returns the write id."""
        wr = ctypes.c_uint64()
        rc = self._lib.moe_ep_post_write(self._h, peer, local_key, local_off, remote_key, remote_off, nbytes,
                                         0 if imm is None else 1, 0 if imm is None else imm, ctypes.byref(wr))
        check(rc)
        return wr.value

    def poll(self, max_n: int = 256, timeout_s: float = 0.0) -> list[Completion]:
        """Up to max_n completions, waiting up to timeout_s for the first one."""
        cq = (_CCompletion * max(1, max_n))()
        n = self._lib.moe_ep_poll(self._h, cq, max(1, max_n), ns(timeout_s))
        if n < 0:
            fail(n)
        return [Completion(c.wr_id, c.peer, c.status) for c in cq[:n]]

    def wait_completions(self, n: int, timeout_s: float, *, phase: str = "proxy", epoch: int = 0,
                         check: bool = True) -> list[Completion]:
        """Polls until n completions arrived. Raises CommTimeoutError at the deadline; with check,
        PeerLostError / NativeError for the first failed completion."""
        deadline = time.monotonic() + timeout_s
        out: list[Completion] = []
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommTimeoutError(self.rank, -1, phase, epoch, timeout_s)
            out += self.poll(n - len(out), min(left, 0.1))
        if check:
            for c in out:
                if not c.ok:
                    msg = self.peer_error(c.peer) or f"rank {self.rank}: write {c.wr_id} to peer {c.peer} failed"
                    lost = c.status in (CQ_PEER_LOST, CQ_TIMEOUT)
                    cls = PeerLostError if lost else NativeError
                    raise cls(f"{msg} (completion status: {CQ_STATUS_NAMES.get(c.status, c.status)})",
                              ERR_PEER if lost else ERR_INVALID, c.peer)
        return out

    def set_op_timeout(self, timeout_s: float) -> None:
        """A write not acknowledged within this time completes with CQ_TIMEOUT and its peer is lost."""
        self._lib.moe_ep_set_op_timeout(self._h, ns(timeout_s))

    def cpu_ns(self) -> int:
        """CPU ns used so far by the transport's own threads (-1 when unknown)."""
        return self._lib.moe_ep_engine_cpu_ns(self._h)

    def set_min_shard_bytes(self, nbytes: int) -> None:
        """Shards of a write are at least this large (default 16 KiB; 1: every write of at least
        ``streams`` bytes is spread over all streams)."""
        self._lib.moe_ep_set_min_shard_bytes(self._h, nbytes)

    def peer_error(self, peer: int) -> str:
        """Why the peer was lost ('' while it is healthy)."""
        return text(self._lib.moe_ep_peer_error, self._h, peer)

    def refused(self) -> Refused:
        """The connections (tcp) and hellos (verbs, libfabric) this engine refused: a wrong job secret,
        session, world, rank or format, a second connection for a stream, no hello in time, too
        many waiting. Each was also one line on stderr (at most 20 a second)."""
        total = ctypes.c_int64()
        listing = text(lambda buf, n: self._lib.moe_ep_engine_refused(self._h, buf, n, ctypes.byref(total)))
        return Refused(total.value, listing.splitlines())

    def close(self, error: BaseException | None = None) -> None:
        """Closes the engine. Every connected peer first gets its goodbye (waited for at most 1 s):
        ``error``, the exception this rank failed with, names its cause (``goodbye_cause``), so a
        peer that sees this close reports that peer rather than this rank; None: a clean close."""
        if getattr(self, "_h", None):
            self._lib.moe_ep_engine_goodbye(self._h, *goodbye_cause(error))
            self._lib.moe_ep_engine_destroy(self._h)
            self._h = None
            self.imm.close()  # (the engine's counter: forgets its handle, destroys nothing)


def goodbye_cause(error: BaseException | None) -> tuple[int, int, int, int, int]:
    """What a closing engine's goodbye says of ``error`` (csrc/proxy/transport.h ``Goodbye``):
    ``(error, peer, phase, epoch, code)``. None: ``(0, -1, -1, 0, 0)``, a clean close. A
    ``CommTimeoutError`` / ``PeerLostError`` of a dispatch or a combine (its ``peer``, ``phase``,
    ``epoch``): ``(1, peer, PHASE_D1 or PHASE_C, epoch, 0)``, so the peers name that peer. A
    ``CapacityError`` naming the rank over its cap (``peer``; the closer's own: -1) in a dispatch
    or a combine: ``(1, peer, phase, epoch, ErrorCode.CAPACITY)``, so the peers raise a capacity
    error naming that rank; without those attributes ``(1, -1, -1, 0, ErrorCode.CAPACITY)``. Any
    other error (none of these, or one naming no peer or phase): ``(1, -1, -1, 0, 0)``, so they
    name this rank."""
    if error is None:
        return 0, -1, -1, 0, 0
    peer, phase, epoch, rank = (getattr(error, k, None) for k in ("peer", "phase", "epoch", "rank"))
    codes = {"dispatch": PHASE_D1, "combine": PHASE_C}
    named = isinstance(peer, int) and peer >= 0 and phase in codes and isinstance(epoch, int)
    if isinstance(error, CapacityError):
        if not named:
            return 1, -1, -1, 0, int(ErrorCode.CAPACITY)
        return 1, -1 if peer == rank else peer, codes[phase], epoch, int(ErrorCode.CAPACITY)
    if isinstance(error, (CommTimeoutError, PeerLostError)) and named:
        return 1, peer, codes[phase], epoch, 0
    return 1, -1, -1, 0, 0


HELLO_TIMEOUT_S, MAX_PENDING = settings.TCP_HELLO_TIMEOUT_S, settings.TCP_MAX_PENDING  # the tcp defaults


def _positive(value, kind: type, what: str):
    """``value`` as a positive ``kind`` (``float``: finite; ``int``: whole), else ``ValueError``
    naming ``what``."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0
          and (kind is float or int(value) == value))
    if not ok:
        raise ValueError(f"{what}: expected a positive {'number' if kind is float else 'integer'}, got {value!r}")
    return kind(value)


def _setting(value, what: str, kind: type, from_env):
    """The argument ``value`` (named ``what``) as a positive ``kind``, else ``from_env()`` (its
    variable's value, or the default: ``moe_ep.core.settings``)."""
    return from_env() if value is None else _positive(value, kind, what)


class TcpTransport(Engine):
    """Engine over TCP: ``streams`` sockets per peer and direction; successive writes go to
    successive streams and a large one is sharded across them (shards of at least 16 KiB,
    ``set_min_shard_bytes``), so delivery is unordered. One epoll I/O thread per engine.

    The listener takes a connection as a peer's only after its hello (``identity``, see
    ``Engine``): an accepted connection without a valid hello within ``hello_timeout_s`` (default
    ``MOE_EP_TCP_HELLO_TIMEOUT``, else 10 s) is closed, and at most ``max_pending`` (default
    ``MOE_EP_TCP_MAX_PENDING``, else 256) wait for theirs; one more closes the oldest."""

    def __init__(self, rank: int, world: int, streams: int = 4, bind_host: str = "127.0.0.1", *,
                 identity: JobIdentity | None = None, hello_timeout_s: float | None = None,
                 max_pending: int | None = None):
        hello_timeout_s = _setting(hello_timeout_s, "hello_timeout_s", float, settings.tcp_hello_timeout)
        max_pending = _setting(max_pending, "max_pending", int, settings.tcp_max_pending)
        super().__init__(rank, world, streams, bind_host, transport="tcp", identity=identity)
        self.set_hello_timeout(hello_timeout_s)
        self.set_max_pending(max_pending)

    def set_hello_timeout(self, timeout_s: float) -> None:
        """Accepted connections without a valid hello after ``timeout_s`` seconds are closed
        (applies to connections accepted from now on)."""
        self.hello_timeout_s = timeout_s = _positive(timeout_s, float, "timeout_s")
        self._lib.moe_ep_set_hello_timeout(self._h, ns(timeout_s))

    def set_max_pending(self, n: int) -> None:
        """At most ``n`` accepted connections wait for their hello; one more closes the oldest."""
        self.max_pending = n = _positive(n, int, "max_pending")
        self._lib.moe_ep_set_max_pending(self._h, min(n, 2**31 - 1))


SHARD_ALIGN = 64  # the verbs transport's shard alignment (kShardAlign, verbs_transport.cc)
DEFAULT_MIN_SHARD = 16384  # kDefaultMinShardBytes (transport.h)


def shard_bounds(nbytes: int, k: int, min_shard: int = DEFAULT_MIN_SHARD, align: int = SHARD_ALIGN) -> list[int]:
    """The byte shards of a write of ``nbytes`` over ``k`` NICs as the verbs transport cuts it
    (the native ``shard_bounds``): ``k + 1`` bounds, shard i = ``[b[i], b[i + 1])``, contiguous;
    all ``chunk = roundup(max(ceil(nbytes / k), min_shard), align)`` bytes but the last non-empty
    one and the empty ones after it."""
    out = (ctypes.c_uint64 * (k + 1))()
    rc = _native().moe_ep_shard_bounds(nbytes, k, min_shard, align, out)
    check(rc)
    return list(out)


class VerbsTransport(Engine):
    """Engine over libibverbs (loaded at run time): one RC queue pair per peer and NIC,
    ``RDMA_WRITE_WITH_IMM`` (plain ``RDMA_WRITE`` without an immediate), a completion thread per
    NIC.

    ``device``: the NICs, ``"mlx5_0"``, ``"mlx5_0,mlx5_1"``, ``"mlx5_0:1,mlx5_1:2"`` or a list
    (a name listed twice is opened twice); default ``MOE_EP_IB_DEVICE``, else the first ``nics``
    devices with an active port. ``nics`` (default ``MOE_EP_IB_NICS``, else as many as listed,
    else 1); every rank must open as many (``connect`` refuses a peer that opened another
    number). ``port`` (default ``MOE_EP_IB_PORT``, else 1), ``gid_index`` (default
    ``MOE_EP_IB_GID_INDEX``, else the first RoCE v2 IPv4-mapped GID). A write is split into
    contiguous byte shards, one per NIC (``shard_bounds``; ``set_min_shard_bytes``, default
    16 KiB), each with the write's immediate, so a receiver counts ``imm_per_write`` (= ``nics``)
    per write. The endpoint carries the regions registered so far: register every region before
    reading ``endpoint``. Of the fault injection (``FaultConfig``, set by the tests) only
    the cut works: the NIC's queue pair decides delays and order. Creating one where there is no usable device raises
    ``NativeError`` naming what is missing."""

    def __init__(self, rank: int, world: int, device: str | Sequence[str] | None = None, port: int = 0,
                 gid_index: int = -1, nics: int = 0, *, identity: JobIdentity | None = None):
        self._lib = _native()
        if device is not None and not isinstance(device, str):
            device = ",".join(device)
        ident = _identity(identity)
        self.adopt(self._lib.moe_ep_engine_create_verbs(rank, world, (device or "").encode(), port, gid_index, nics,
                                                         ident.secret, ident.session),
                    rank, world, "verbs", ident)
        self.streams = 1
        self.nics = self.imm_per_write

    def region_how(self, key: int) -> str:
        """How region ``key`` was registered on each NIC: ``"host"`` (``ibv_reg_mr``),
        ``"dma-buf"`` (GPU memory, ``ibv_reg_dmabuf_mr``) or ``"gpu address"`` (GPU memory,
        ``ibv_reg_mr`` on its address: nvidia-peermem); ``/``-joined per NIC."""
        return text(self._lib.moe_ep_verbs_region_how, self._h, key)

# FI_MR_* bits (csrc/proxy/fabric_abi.h; fi_mr(3)) for FabricTransport's force_mr_mode.
FI_MR = {"local": 1 << 2, "virt_addr": 1 << 4, "allocated": 1 << 5, "prov_key": 1 << 6, "endpoint": 1 << 9,
         "hmem": 1 << 10}


class FabricTransport(Engine):
    """Engine over libfabric (loaded at run time): ``endpoints`` ``FI_EP_RDM`` endpoints of one
    provider, ``fi_writedata`` carrying the immediate as remote CQ data (``fi_write`` without
    one), hellos and goodbyes as messages, a completion thread per endpoint (which is what
    progresses tcp and udp).

    ``provider``: ``"efa"``, ``"tcp;ofi_rxm"``, ``"udp;ofi_rxd"``, ``"shm"``, ...; default
    ``MOE_EP_FI_PROVIDER``, else ``FI_PROVIDER``, else efa where it fits, else libfabric's first
    that reaches other hosts (never shm, which reaches one host only).
    ``domain``: the fi_info domain (interface) name, e.g. ``"lo"`` or ``"rdmap16s27-rdm"`` (the
    efa provider names a domain after its EFA device: ``nic.efa_domain``), or several
    (``"a,b"`` or a list: endpoint i opens domain ``i % n``, e.g. one per EFA device near the
    GPU); default ``MOE_EP_FI_DOMAIN``, else the provider's first. ``endpoints`` (default 0: one
    per listed domain, so 1 for one domain; else a multiple of their number): a write is split
    into contiguous byte shards, one per endpoint (``shard_bounds``; ``set_min_shard_bytes``, default 16 KiB), each
    with the write's immediate, so a receiver counts ``imm_per_write`` (= ``endpoints``) per
    write; every rank must open as many (``connect`` refuses a peer that opened another number or
    another provider). ``force_mr_mode``: ``FI_MR`` bits used as if the provider had asked for
    them (descriptors, virtual addresses, keys, endpoint binding: EFA's paths on tcp). Register
    every region before reading ``endpoint``. Of the fault injection (set by the tests) only the cut
    works (udp;ofi_rxd reorders on its own). Creating one where this cannot work raises
    ``NativeError`` naming what is missing."""

    def __init__(self, rank: int, world: int, provider: str | None = None,
                 domain: str | Sequence[str] | None = None, endpoints: int = 0, force_mr_mode: int = 0, *,
                 identity: JobIdentity | None = None):
        self._lib = _native()
        if domain is not None and not isinstance(domain, str):
            domain = ",".join(domain)
        ident = _identity(identity)
        self.adopt(self._lib.moe_ep_engine_create_fabric(rank, world, (provider or "").encode(),
                                                          (domain or "").encode(), endpoints, force_mr_mode,
                                                          ident.secret, ident.session), rank, world, "libfabric", ident)
        self.streams = 1
        self.endpoints = self.imm_per_write

    def describe(self) -> dict:
        """The provider, domains and mr_mode in use: ``{"provider", "domain" (``,``-joined),
        "domains" (endpoint i on ``domains[i % n]``), "mr_mode" (in use), "provider_mr_mode",
        "forced_mr_mode", "mr_mode_names", "endpoints", "max_msg_size"}``."""
        return json.loads(text(self._lib.moe_ep_fabric_describe, self._h))

