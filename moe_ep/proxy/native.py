"""ctypes loader and Python wrapper for the native proxy engine (csrc/proxy).

``ImmCounter``: a signed counter per 32-bit immediate; ``wait`` subtracts what it expects.
``Engine`` (``TcpTransport``, ``VerbsTransport``, ``FabricTransport``: libfabric, which is also how
EFA is reached, through its ``efa`` provider): registered memory, one-sided writes with immediates
to peers, completions by ``poll``, the receiver's immediates counted in ``engine.imm``.
``Proxy``: the host side of the inter-node protocol (docs/ARCHITECTURE.md §10) on an engine,
driven by the mailbox words (``MAILBOX``); ``Proxy.wait_ready`` turns its error record into
``CommTimeoutError`` / ``PeerLostError`` / ``moe_ep.CapacityError``.

Native calls release the GIL (ctypes.CDLL), so a blocking ``wait`` or ``poll`` does not stop
other Python threads. Timeouts raise ``moe_ep.CommTimeoutError``; a lost peer raises
``PeerLostError``; other failures raise ``NativeError``; all are ``RuntimeError``s carrying the
native message (rank, peer, what failed).
"""
from __future__ import annotations

import ctypes
import glob
import json
import math
import os
import re
import subprocess
import sysconfig
import threading
from typing import NamedTuple, Sequence

from ..core import settings
from ..core.errors import CapacityError, CommTimeoutError, ErrorCode
from .identity import JobIdentity

# Return codes (csrc/proxy/imm_counter.h) and completion status (csrc/proxy/transport.h).
OK, ERR_TIMEOUT, ERR_PEER, ERR_INVALID, ERR_SYSTEM = 0, 1, 2, -1, -2
CQ_OK, CQ_TIMEOUT, CQ_PEER_LOST, CQ_REMOTE_ACCESS = 0, 1, 2, 3
CQ_STATUS_NAMES = {CQ_OK: "ok", CQ_TIMEOUT: "timeout", CQ_PEER_LOST: "peer lost", CQ_REMOTE_ACCESS: "remote access error"}


class NativeError(RuntimeError):
    """A native call failed; ``code`` is its return code, the message is the native one."""

    def __init__(self, msg: str, code: int = ERR_SYSTEM, peer: int = -1):
        super().__init__(msg)
        self.code, self.peer = code, peer


class PeerLostError(NativeError):
    """A peer's connection was lost (cut, closed, dead); ``peer`` names it (-1 if unknown)."""


ABI_VERSION = 15  # moe_ep_abi_version() of the library this module drives (csrc/proxy/capi.cc)
_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_SRC_DIR = os.path.normpath(os.path.join(_PKG_DIR, "..", "..", "csrc", "proxy"))
_SRC_DIRS = (_SRC_DIR, os.path.join(os.path.dirname(_SRC_DIR), "launch"))  # the proxy engine; the kernel launcher
_lib = None
_lib_lock = threading.Lock()


def _sources() -> list[str]:
    return sorted(f for d in _SRC_DIRS for f in glob.glob(os.path.join(d, "*.cc")) + glob.glob(os.path.join(d, "*.h")))


def _build_from_source() -> str:
    """Source checkout without a (fresh) built library: compile csrc/proxy and csrc/launch with the system c++."""
    out_dir = os.path.normpath(os.path.join(_SRC_DIR, "..", "..", "build", "moe_ep_native"))
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, "_native.so")
    srcs = [s for s in _sources() if s.endswith(".cc")]
    if os.path.exists(out) and os.path.getmtime(out) >= max(os.path.getmtime(s) for s in _sources()):
        return out
    tmp = f"{out}.{os.getpid()}.tmp"
    cxx = os.environ.get("CXX", "c++")
    flags = ["-O2", "-std=c++17", "-pthread", "-fPIC", "-shared", "-fvisibility=hidden"]
    # The flags, recorded in the library for build_info() (csrc/proxy/capi.cc: moe_ep_build_info).
    record = "-DMOE_EP_BUILD_FLAGS=" + json.dumps(f"{' '.join(flags)} (in-tree build by moe_ep.proxy.native, {cxx})")
    # Python's headers for csrc/launch/launch.cc's `launch` function (stable ABI: no libpython linked)
    cmd = [cxx, *flags, record, "-I" + sysconfig.get_paths()["include"], *srcs, "-o", tmp, "-ldl"]
    newest = max(os.path.getmtime(s) for s in _sources())  # before compiling: see below
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise NativeError(f"building the native proxy library failed ({' '.join(cmd)}):\n{r.stderr[-4000:]}")
    # The library is as new as the sources it was built from, not as the end of the build: a source
    # edited while compiling (or a slower concurrent build finishing last) then still looks newer.
    os.utime(tmp, (newest, newest))
    os.replace(tmp, out)
    return out


def _find_library() -> str:
    named = settings.native_lib()
    if named:
        return named
    built = sorted(glob.glob(os.path.join(_PKG_DIR, "_native*.so")))
    srcs = _sources()
    if built:
        # In a source checkout, a library older than its sources is stale: rebuild next to it.
        if srcs and max(os.path.getmtime(s) for s in srcs) > os.path.getmtime(built[0]):
            return _build_from_source()
        return built[0]
    if srcs:
        return _build_from_source()
    raise NativeError(f"native proxy library not found in {_PKG_DIR}; reinstall moe_ep (pip install -e .)")


def _c(lib, name, restype, *argtypes):
    f = getattr(lib, name)
    f.restype, f.argtypes = restype, list(argtypes)


def lib() -> ctypes.CDLL:
    """The loaded native library (loaded, and in a source checkout built, on first use)."""
    global _lib
    with _lib_lock:
        if _lib is None:
            L = ctypes.CDLL(_find_library())
            vp, i32, u32, i64, u64, cp, sz = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_int64,
                                              ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t)
            _c(L, "moe_ep_abi_version", i32)
            _c(L, "moe_ep_build_info", cp)
            _c(L, "moe_ep_last_error", i32, cp, sz)
            _c(L, "moe_ep_imm_create", vp)
            _c(L, "moe_ep_imm_destroy", None, vp)
            _c(L, "moe_ep_imm_add", i32, vp, u32, i64)
            _c(L, "moe_ep_imm_wait", i32, vp, u32, i64, i64)
            _c(L, "moe_ep_imm_value", i64, vp, u32)
            _c(L, "moe_ep_imm_stress", i32, vp, u32, i32, i64)
            _c(L, "moe_ep_engine_create", vp, cp, i32, i32, i32, cp, cp, u64)
            _c(L, "moe_ep_engine_create_verbs", vp, i32, i32, cp, i32, i32, i32, cp, u64)
            _c(L, "moe_ep_engine_imm_per_write", i32, vp)
            _c(L, "moe_ep_shard_bounds", i32, u64, i32, u64, u64, ctypes.POINTER(u64))
            _c(L, "moe_ep_verbs_probe", i32, cp, sz)
            _c(L, "moe_ep_verbs_destroy_qp", i32, vp, i32)
            _c(L, "moe_ep_verbs_region_how", i32, vp, u32, cp, sz)
            _c(L, "moe_ep_engine_try_register", i32, vp, vp, u64, cp, sz)
            _c(L, "moe_ep_test_memory_type", i32, i32)
            _c(L, "moe_ep_memory_type", i32, vp)
            _c(L, "moe_ep_cuda_dmabuf_fd", i32, vp, u64, ctypes.POINTER(i32), ctypes.POINTER(u64))
            _c(L, "moe_ep_verbs_probe_device", i32, cp, i32, cp, sz)
            _c(L, "moe_ep_rdma_devices", i32, cp, sz)
            _c(L, "moe_ep_engine_create_fabric", vp, i32, i32, cp, cp, i32, i32, cp, u64)
            _c(L, "moe_ep_fabric_probe", i32, cp, cp, cp, sz)
            _c(L, "moe_ep_fabric_providers", i32, cp, cp, sz)
            _c(L, "moe_ep_fabric_describe", i32, vp, cp, sz)
            _c(L, "moe_ep_engine_destroy", None, vp)
            _c(L, "moe_ep_engine_goodbye", i32, vp, i32, i32, i32, i64, i32)
            _c(L, "moe_ep_engine_imm", vp, vp)
            _c(L, "moe_ep_register", i32, vp, vp, u64, ctypes.POINTER(u32))
            _c(L, "moe_ep_endpoint", i32, vp, cp, sz)
            _c(L, "moe_ep_connect", i32, vp, ctypes.POINTER(cp), i32, i64)
            _c(L, "moe_ep_post_write", i32, vp, i32, u32, u64, u32, u64, u64, i32, u32, ctypes.POINTER(u64))
            _c(L, "moe_ep_poll", i32, vp, ctypes.POINTER(_CCompletion), i32, i64)
            _c(L, "moe_ep_set_fault", i32, vp, i64, i32, i32, i64)
            _c(L, "moe_ep_set_op_timeout", i32, vp, i64)
            _c(L, "moe_ep_set_min_shard_bytes", i32, vp, u64)
            _c(L, "moe_ep_set_hello_timeout", i32, vp, i64)
            _c(L, "moe_ep_set_max_pending", i32, vp, i32)
            _c(L, "moe_ep_engine_refused", i32, vp, cp, sz, ctypes.POINTER(i64))
            _c(L, "moe_ep_peer_error", i32, vp, i32, cp, sz)
            _c(L, "moe_ep_engine_cpu_ns", i64, vp)
            _c(L, "moe_ep_rank", i32, vp)
            _c(L, "moe_ep_world", i32, vp)
            _c(L, "moe_ep_proxy_mailbox_layout", i32, i64, ctypes.POINTER(i64), i32)
            _c(L, "moe_ep_proxy_hdr_bytes", i64, i64, i64)
            _c(L, "moe_ep_proxy_region_bytes", i32, ctypes.POINTER(ProxyConfig), ctypes.POINTER(u64))
            _c(L, "moe_ep_proxy_create", vp, vp, ctypes.POINTER(ProxyConfig), ctypes.POINTER(vp),
               ctypes.POINTER(u64), ctypes.POINTER(i64), u64)
            _c(L, "moe_ep_proxy_keys", i32, vp, ctypes.POINTER(u32))
            _c(L, "moe_ep_proxy_start", i32, vp)
            _c(L, "moe_ep_proxy_destroy", None, vp)
            _c(L, "moe_ep_proxy_error_message", i32, vp, cp, sz)
            _c(L, "moe_ep_proxy_phases_done", i64, vp)
            _c(L, "moe_ep_proxy_phase_records", i32, vp, ctypes.POINTER(PhaseRecord), i32)
            _c(L, "moe_ep_proxy_trace", i32, vp, ctypes.POINTER(TraceEvent), i32)
            _c(L, "moe_ep_bench_post", i32, vp, i32, u32, u64, u32, u64, u64, u32, i64, i64, i64,
               ctypes.POINTER(i64))
            _c(L, "moe_ep_engine_create_null", vp, i32, i32)
            _c(L, "moe_ep_null_stats", i32, vp, ctypes.POINTER(i64))
            _c(L, "moe_ep_sim_drive", i32, vp, ctypes.POINTER(i64), ctypes.POINTER(SimConfig), ctypes.POINTER(ctypes.c_int32),
               i64, i64, ctypes.POINTER(i64))
            _c(L, "moe_ep_sim_floor", i32, i64, i64, i64, i64, ctypes.POINTER(i64))
            _c(L, "moe_ep_bench_drive", i32, ctypes.POINTER(i64), i64, i64, i64, i32, i64, i64, i64, ctypes.POINTER(i64))
            _c(L, "moe_ep_launch_plan_create", i32, u64, u32, u32, u32, i32, ctypes.POINTER(u32),
               ctypes.POINTER(u64), i32, ctypes.POINTER(i32))
            _c(L, "moe_ep_launch_plan_destroy", None, i32)
            _c(L, "moe_ep_launch_plan_stage", u64, i32)
            _c(L, "moe_ep_launch_plan_params", i64, i32, ctypes.c_char_p, sz)
            if L.moe_ep_abi_version() != ABI_VERSION:
                raise NativeError("native proxy library has an unexpected ABI version; rebuild moe_ep")
            _lib = L
        return _lib


class _CCompletion(ctypes.Structure):
    _fields_ = [("wr_id", ctypes.c_uint64), ("peer", ctypes.c_int32), ("status", ctypes.c_int32)]


class Completion(NamedTuple):
    wr_id: int
    peer: int
    status: int

    @property
    def ok(self) -> bool:
        return self.status == CQ_OK


def _str(fn, *args) -> str:
    buf = ctypes.create_string_buffer(1024)
    n = fn(*args, buf, len(buf))
    if n >= len(buf):
        buf = ctypes.create_string_buffer(n + 1)
        fn(*args, buf, len(buf))
    return buf.value.decode(errors="replace")


def build_info() -> str:
    """How the loaded native library was built: compiler, C++ standard and compile flags."""
    return lib().moe_ep_build_info().decode(errors="replace")


def last_error() -> str:
    """The native message of the last failed call on this thread."""
    return _str(lib().moe_ep_last_error)


_PEER_RE = re.compile(r"peer (\d+)")


def _raise(code: int, what: str = "") -> None:
    msg = last_error() or what
    m = _PEER_RE.search(msg)
    peer = int(m.group(1)) if m else -1
    if code == ERR_PEER:
        raise PeerLostError(msg, code, peer)
    raise NativeError(msg, code, peer)


def _ns(timeout_s: float) -> int:
    return max(0, int(timeout_s * 1e9))


class ImmCounter:
    """Signed counter per 32-bit immediate. ``wait(imm, expected, timeout_s)`` blocks until the
    count reaches ``expected`` and subtracts it; counts may run ahead of their waiter."""

    def __init__(self, _handle: int | None = None, _owner: object = None, rank: int = -1):
        self._lib = lib()
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
        rc = self._lib.moe_ep_imm_add(self._h, imm, n)
        if rc != OK:
            _raise(rc)

    def value(self, imm: int) -> int:
        return self._lib.moe_ep_imm_value(self._h, imm)

    def wait(self, imm: int, expected: int, timeout_s: float, *, peer: int = -1, phase: str = "proxy",
             epoch: int = 0) -> None:
        """Raises CommTimeoutError(rank, peer, phase, epoch, timeout_s) when the deadline passes
        (the counter is then unchanged), PeerLostError when a peer's connection was lost."""
        rc = self._lib.moe_ep_imm_wait(self._h, imm, expected, _ns(timeout_s))
        if rc == ERR_TIMEOUT:
            raise CommTimeoutError(self.rank, peer, phase, epoch, timeout_s)
        if rc != OK:
            _raise(rc)

    def close(self) -> None:
        if self._owned and self._h:
            self._lib.moe_ep_imm_destroy(self._h)
        self._h = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _address(obj) -> tuple[int, int]:
    """(pointer, nbytes) of a writable contiguous buffer: torch tensor, numpy array, bytearray."""
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):
        if not obj.is_contiguous():
            raise ValueError("register: tensor must be contiguous")
        return obj.data_ptr(), obj.numel() * obj.element_size()
    if hasattr(obj, "__array_interface__"):
        ai = obj.__array_interface__
        if ai.get("strides") is not None:
            raise ValueError("register: array must be C-contiguous")
        return ai["data"][0], obj.nbytes
    mv = memoryview(obj)
    if mv.readonly or not mv.c_contiguous:
        raise ValueError("register: buffer must be writable and contiguous")
    n = mv.nbytes
    return (ctypes.addressof((ctypes.c_char * n).from_buffer(obj)) if n else 0), n


class _Closable:
    """Context manager and finalizer around ``close()``."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

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
        raise ValueError(f"identity: expected a moe_ep.proxy.JobIdentity or None, got {type(identity).__name__}")
    return identity


class Engine(_Closable):
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
        self._lib = lib()
        ident = _identity(identity)
        self._adopt(self._lib.moe_ep_engine_create(transport.encode(), rank, world, streams, bind_host.encode(),
                                                   ident.secret, ident.session),
                    rank, world, transport, ident)
        self.streams = streams

    def _adopt(self, handle, rank: int, world: int, transport: str, identity: JobIdentity) -> None:
        self._h = handle
        if not self._h:
            _raise(ERR_SYSTEM, f"rank {rank}: creating the {transport} engine failed")
        self.rank, self.world, self.transport, self.identity = rank, world, transport, identity
        self._keep: list = []  # registered objects stay alive as long as the engine
        self.imm = ImmCounter(self._lib.moe_ep_engine_imm(self._h), _owner=self, rank=rank)

    @property
    def handle(self) -> int:
        """The native engine's handle (for a ``Proxy`` built on this engine); None once closed."""
        return self._h

    @property
    def endpoint(self) -> str:
        return _str(self._lib.moe_ep_endpoint, self._h)

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
        if rc != OK:
            _raise(rc)
        return key.value

    def try_register(self, obj) -> tuple[bool, str]:
        """Whether ``register(obj)`` would succeed (tried and released at once; no key is used):
        ``(True, how)`` (``"host"``; GPU memory: ``"dma-buf"`` / ``"gpu address"`` per NIC for
        verbs, ``"FI_HMEM_CUDA"`` for libfabric), else ``(False, why)``. ``obj``: a contiguous
        numpy array or tensor (host or CUDA)."""
        ptr, n = _address(obj)
        buf = ctypes.create_string_buffer(1024)
        ok = self._lib.moe_ep_engine_try_register(self._h, ptr, n, buf, len(buf))
        return bool(ok), buf.value.decode(errors="replace")

    def register(self, obj) -> int:
        """Registers a writable contiguous buffer (kept alive by the engine); returns its key."""
        ptr, n = _address(obj)
        key = self.register_ptr(ptr, n)
        self._keep.append(obj)
        return key

    def connect(self, endpoints: Sequence[str], timeout_s: float = 30.0) -> None:
        arr = (ctypes.c_char_p * len(endpoints))(*[e.encode() for e in endpoints])
        rc = self._lib.moe_ep_connect(self._h, arr, len(endpoints), _ns(timeout_s))
        if rc == ERR_TIMEOUT:
            msg = last_error()
            m = _PEER_RE.search(msg)
            err = CommTimeoutError(self.rank, int(m.group(1)) if m else -1, "connect", 0, timeout_s)
            err.args = (f"{err.args[0]} [{msg}]",)
            raise err
        if rc != OK:
            _raise(rc)

    def post_write(self, peer: int, local_key: int, local_off: int, remote_key: int, remote_off: int,
                   nbytes: int, imm: int | None = None) -> int:
        """One-sided write into the peer's registered memory; returns the write id."""
        wr = ctypes.c_uint64()
        rc = self._lib.moe_ep_post_write(self._h, peer, local_key, local_off, remote_key, remote_off, nbytes,
                                         0 if imm is None else 1, 0 if imm is None else imm, ctypes.byref(wr))
        if rc != OK:
            _raise(rc)
        return wr.value

    def poll(self, max_n: int = 256, timeout_s: float = 0.0) -> list[Completion]:
        """Up to max_n completions, waiting up to timeout_s for the first one."""
        cq = (_CCompletion * max(1, max_n))()
        n = self._lib.moe_ep_poll(self._h, cq, max(1, max_n), _ns(timeout_s))
        if n < 0:
            _raise(n)
        return [Completion(c.wr_id, c.peer, c.status) for c in cq[:n]]

    def wait_completions(self, n: int, timeout_s: float, *, phase: str = "proxy", epoch: int = 0,
                         check: bool = True) -> list[Completion]:
        """Polls until n completions arrived. Raises CommTimeoutError at the deadline; with check,
        PeerLostError / NativeError for the first failed completion."""
        import time

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

    def bench_post(self, peer: int, local_key: int, remote_key: int, nbytes: int, *, n: int, n_serial: int,
                   imm: int = 0x3000, timeout_s: float = 60.0) -> dict:
        """Measurement loop in native code (moe_ep/bench/proxy_cost.py): ``n`` writes of ``nbytes`` posted
        back to back, then ``n_serial`` posted one at a time, each waited for. Nanoseconds."""
        out = (ctypes.c_int64 * 8)()
        rc = self._lib.moe_ep_bench_post(self._h, peer, local_key, 0, remote_key, 0, nbytes, imm, n, n_serial,
                                         _ns(timeout_s), out)
        if rc != OK:
            _raise(rc)
        return dict(post_total_ns=out[0], complete_total_ns=out[1], serial_post_p50_ns=out[2],
                    serial_post_p99_ns=out[3], serial_latency_p50_ns=out[4], serial_latency_p99_ns=out[5],
                    failed=out[6])

    def set_fault(self, delay_us: int = 0, reorder: bool = False, cut_peer: int = -1, cut_after: int = 0) -> None:
        """Fault injection (off by default): random per-shard delay up to delay_us; reorder (random
        stream, random pick from the stream's queue); cut every connection with cut_peer when
        write number cut_after+1 to it is posted."""
        self._lib.moe_ep_set_fault(self._h, delay_us, int(reorder), cut_peer, cut_after)

    def set_op_timeout(self, timeout_s: float) -> None:
        """A write not acknowledged within this time completes with CQ_TIMEOUT and its peer is lost."""
        self._lib.moe_ep_set_op_timeout(self._h, _ns(timeout_s))

    def cpu_ns(self) -> int:
        """CPU ns used so far by the transport's own threads (-1 when unknown)."""
        return self._lib.moe_ep_engine_cpu_ns(self._h)

    def set_min_shard_bytes(self, nbytes: int) -> None:
        """Shards of a write are at least this large (default 16 KiB; 1: every write of at least
        ``streams`` bytes is spread over all streams)."""
        self._lib.moe_ep_set_min_shard_bytes(self._h, nbytes)

    def peer_error(self, peer: int) -> str:
        """Why the peer was lost ('' while it is healthy)."""
        return _str(self._lib.moe_ep_peer_error, self._h, peer)

    def refused(self) -> Refused:
        """The connections (tcp) and hellos (verbs, libfabric) this engine refused: a wrong job secret,
        session, world, rank or format, a second connection for a stream, no hello in time, too
        many waiting. Each was also one line on stderr (at most 20 a second)."""
        total = ctypes.c_int64()
        text = _str(lambda buf, n: self._lib.moe_ep_engine_refused(self._h, buf, n, ctypes.byref(total)))
        return Refused(total.value, text.splitlines())

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
        self._lib.moe_ep_set_hello_timeout(self._h, _ns(timeout_s))

    def set_max_pending(self, n: int) -> None:
        """At most ``n`` accepted connections wait for their hello; one more closes the oldest."""
        self.max_pending = n = _positive(n, int, "max_pending")
        self._lib.moe_ep_set_max_pending(self._h, min(n, 2**31 - 1))


def verbs_probe(device: str | None = None, port: int = 0) -> tuple[bool, str]:
    """(True, "device rxe0 port 1 GID index 1 (RoCE)") when a verbs engine can be created here
    (on ``device`` and ``port``, default the transport's own choice), else (False, why not:
    libibverbs missing, no device, no active port, no usable GID)."""
    buf = ctypes.create_string_buffer(2048)
    ok = (lib().moe_ep_verbs_probe_device(device.encode(), port, buf, len(buf)) if device or port
          else lib().moe_ep_verbs_probe(buf, len(buf)))
    return ok == 1, buf.value.decode(errors="replace")


def memory_type(ptr: int) -> str:
    """``"device"`` when registration treats ``ptr`` as GPU memory (the CUDA driver, if this process
    has loaded it, says ``CU_MEMORYTYPE_DEVICE``), else ``"host"``."""
    return "device" if lib().moe_ep_memory_type(ptr) == 1 else "host"


def set_test_memory_type(kind: str | None) -> None:
    """Test hook: registration takes every pointer for ``"device"`` or ``"host"`` memory (None:
    asks the CUDA driver again, the default)."""
    lib().moe_ep_test_memory_type({None: -1, "host": 0, "device": 1}[kind])


def cuda_dmabuf_fd(ptr: int, nbytes: int) -> tuple[int, int]:
    """(fd, offset of ptr in it): the dma-buf the verbs transport would register for GPU memory
    at ``[ptr, ptr + nbytes)`` (the caller closes the fd). Raises ``NativeError`` naming what is
    missing (the CUDA driver, its dma-buf export, the driver's error)."""
    fd, off = ctypes.c_int32(-1), ctypes.c_uint64()
    rc = lib().moe_ep_cuda_dmabuf_fd(ptr, nbytes, ctypes.byref(fd), ctypes.byref(off))
    if rc != OK:
        _raise(rc)
    return fd.value, off.value


SHARD_ALIGN = 64  # the verbs transport's shard alignment (kShardAlign, verbs_transport.cc)
DEFAULT_MIN_SHARD = 16384  # kDefaultMinShardBytes (transport.h)


def shard_bounds(nbytes: int, k: int, min_shard: int = DEFAULT_MIN_SHARD, align: int = SHARD_ALIGN) -> list[int]:
    """The byte shards of a write of ``nbytes`` over ``k`` NICs as the verbs transport cuts it
    (the native ``shard_bounds``): ``k + 1`` bounds, shard i = ``[b[i], b[i + 1])``, contiguous;
    all ``chunk = roundup(max(ceil(nbytes / k), min_shard), align)`` bytes but the last non-empty
    one and the empty ones after it."""
    out = (ctypes.c_uint64 * (k + 1))()
    rc = lib().moe_ep_shard_bounds(nbytes, k, min_shard, align, out)
    if rc != OK:
        _raise(rc)
    return list(out)


def rdma_devices() -> dict:
    """What libibverbs reports of every RDMA device, EFA devices included (device and port
    attributes, GIDs): ``{"devices": [...]}``, or ``{"error": why}``."""
    import json

    return json.loads(_str(lib().moe_ep_rdma_devices))


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
    reading ``endpoint``. No delay/reorder injection (the NIC's queue pair decides);
    ``set_fault(cut_peer=...)`` works. Creating one where there is no usable device raises
    ``NativeError`` naming what is missing."""

    def __init__(self, rank: int, world: int, device: str | Sequence[str] | None = None, port: int = 0,
                 gid_index: int = -1, nics: int = 0, *, identity: JobIdentity | None = None):
        self._lib = lib()
        if device is not None and not isinstance(device, str):
            device = ",".join(device)
        ident = _identity(identity)
        self._adopt(self._lib.moe_ep_engine_create_verbs(rank, world, (device or "").encode(), port, gid_index, nics,
                                                         ident.secret, ident.session),
                    rank, world, "verbs", ident)
        self.streams = 1
        self.nics = self.imm_per_write

    def region_how(self, key: int) -> str:
        """How region ``key`` was registered on each NIC: ``"host"`` (``ibv_reg_mr``),
        ``"dma-buf"`` (GPU memory, ``ibv_reg_dmabuf_mr``) or ``"gpu address"`` (GPU memory,
        ``ibv_reg_mr`` on its address: nvidia-peermem); ``/``-joined per NIC."""
        return _str(self._lib.moe_ep_verbs_region_how, self._h, key)

    def destroy_qp(self, peer: int) -> None:
        """Test hook: destroys the queue pairs to ``peer`` (as a crashed process would)."""
        rc = self._lib.moe_ep_verbs_destroy_qp(self._h, peer)
        if rc != OK:
            _raise(rc)


# FI_MR_* bits (csrc/proxy/fabric_abi.h; fi_mr(3)) for FabricTransport's force_mr_mode.
FI_MR = {"local": 1 << 2, "virt_addr": 1 << 4, "allocated": 1 << 5, "prov_key": 1 << 6, "endpoint": 1 << 9,
         "hmem": 1 << 10}


def fabric_probe(provider: str | None = None, domain: str | None = None) -> tuple[bool, str]:
    """(True, "provider tcp;ofi_rxm domain lo (mr_mode ..., cq_data_size 8)") when a libfabric
    engine can be created here (``provider`` / ``domain``, default the transport's own choice;
    ``domain`` may list several, ``"a,b"``: each must fit),
    else (False, why not: libfabric missing, no provider with FI_EP_RDM + FI_RMA + remote CQ data)."""
    buf = ctypes.create_string_buffer(4096)
    ok = lib().moe_ep_fabric_probe((provider or "").encode(), (domain or "").encode(), buf, len(buf))
    return ok == 1, buf.value.decode(errors="replace")


def fabric_providers(provider: str | None = None) -> dict:
    """What libfabric offers (every fi_info entry of ``provider``, default all): provider, fabric,
    domain, endpoint type, RMA / MSG / HMEM caps, mr_mode, cq_data_size, progress, max message size
    and whether the libfabric transport can use it: ``{"library_version", "api_version",
    "entries": [...]}``, or ``{"error": why}``."""
    return json.loads(_str(lambda buf, n: lib().moe_ep_fabric_providers((provider or "").encode(), buf, n)))


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
    every region before reading ``endpoint``. ``set_fault(cut_peer=...)`` works; delay and reorder
    do not (udp;ofi_rxd reorders on its own). Creating one where this cannot work raises
    ``NativeError`` naming what is missing."""

    def __init__(self, rank: int, world: int, provider: str | None = None,
                 domain: str | Sequence[str] | None = None, endpoints: int = 0, force_mr_mode: int = 0, *,
                 identity: JobIdentity | None = None):
        self._lib = lib()
        if domain is not None and not isinstance(domain, str):
            domain = ",".join(domain)
        ident = _identity(identity)
        self._adopt(self._lib.moe_ep_engine_create_fabric(rank, world, (provider or "").encode(),
                                                          (domain or "").encode(), endpoints, force_mr_mode,
                                                          ident.secret, ident.session), rank, world, "libfabric", ident)
        self.streams = 1
        self.endpoints = self.imm_per_write

    def describe(self) -> dict:
        """The provider, domains and mr_mode in use: ``{"provider", "domain" (``,``-joined),
        "domains" (endpoint i on ``domains[i % n]``), "mr_mode" (in use), "provider_mr_mode",
        "forced_mr_mode", "mr_mode_names", "endpoints", "max_msg_size"}``."""
        return json.loads(_str(self._lib.moe_ep_fabric_describe, self._h))


# ---------------------------------------------------------------- Proxy (§10)

# Mailbox word indices (int64 words), mirrored from csrc/proxy/proxy.h (kMb*, mb_*); the kernel
# side writes the bells, the proxy the ready words and the error record. Twelve fixed words, then
# four arrays of one word per rank (``mailbox_words(world)`` in all): the rows bell of each peer,
# each source's round-1 and overflow ready words, each source's combine bell.
MAILBOX = {
    "hdr_bell": 0,
    "disp_ready": 1,
    "hdr_ready": 2,
    "comb_ready": 3,
    "err_code": 4,
    "err_peer": 5,
    "err_phase": 6,
    "err_epoch": 7,
    "ov_ready": 8,  # proxy: overflow window w >= 1 of epoch e landed -> ov_window(e, w)
    "ov_done": 9,   # kernel: windows 0..w-1 of epoch e unpacked -> ov_window(e, w)
    "comb_win_done": 10,  # proxy: combine writes of windows 0..w-1 of epoch e completed -> ov_window(e, w)
    "comb_win_bell": 11,  # kernel: combine window w >= 1 of epoch e packed -> ov_window(e, w)
}
MAILBOX_WORDS = 12  # the fixed words
MAILBOX_ARRAYS = ("disp_bell", "ready1", "ready2", "comb_bell")  # after them, one word per rank each


def mailbox_words(world: int) -> int:
    """Words of a mailbox for ``world`` ranks."""
    return MAILBOX_WORDS + len(MAILBOX_ARRAYS) * world


def ov_window(epoch: int, window: int) -> int:
    """The value of the ``ov_ready`` / ``ov_done`` words for ``window`` of ``epoch`` (grows with both)."""
    return (epoch << 32) | window


def mailbox_word(name: str, world: int, rank: int) -> int:
    """Index of the word of ``rank`` in the per-rank array ``name`` (``MAILBOX_ARRAYS``)."""
    return MAILBOX_WORDS + MAILBOX_ARRAYS.index(name) * world + rank


# Error codes (mailbox["err_code"]) and phases (immediate bits 31..29, mailbox["err_phase"]).
PROXY_OK, PROXY_TIMEOUT, PROXY_PEER_LOST, PROXY_CAPACITY, PROXY_INVALID, PROXY_TRANSPORT = 0, 1, 2, 3, 4, 5
# D0: the headers (reported as round 1); CREDIT: a receiver's zero-byte "your part of overflow
# window w may come" (reported as round 2)
PHASE_D1, PHASE_D2, PHASE_C, PHASE_D0, PHASE_CREDIT = 0, 1, 2, 3, 4
PHASE_NAMES = {PHASE_D1: "dispatch", PHASE_D2: "dispatch", PHASE_C: "combine", PHASE_D0: "dispatch",
               PHASE_CREDIT: "dispatch"}
# Registration order. The first five hold rows only (GPU memory where the transport can register
# it); the proxy reads counts from the two header regions, which stay in host memory.
REGION_NAMES = ("disp_send", "round1", "overflow", "comb_send", "comb_recv", "hdr_send", "hdr_recv")
HEADER_REGIONS = ("hdr_send", "hdr_recv")


# Immediate fields (csrc/proxy/proxy.h make_imm, §10): phase in bits 31..29, the source rank in
# bits 28..16 (so at most IMM_MAX_RANKS ranks), the epoch mod 2^16 in bits 15..0.
IMM_SRC_SHIFT, IMM_SRC_BITS = 16, 13
IMM_PHASE_SHIFT = IMM_SRC_SHIFT + IMM_SRC_BITS
IMM_MAX_RANKS = 1 << IMM_SRC_BITS


def make_imm(phase: int, epoch: int, src: int = 0) -> int:
    """The 32-bit immediate a write of (phase, epoch) from rank ``src`` carries: phase in bits
    31..29, ``src`` in bits 28..16, epoch mod 2^16 in bits 15..0."""
    return (phase << IMM_PHASE_SHIFT) | ((src & (IMM_MAX_RANKS - 1)) << IMM_SRC_SHIFT) | (epoch & ((1 << IMM_SRC_SHIFT) - 1))


def native_mailbox_layout(world: int) -> dict[str, int]:
    """The word indices as the native library defines them for ``world`` ranks: the fixed words,
    ``"n_fixed"``, the first word of each per-rank array, and ``"n_words"``."""
    out = (ctypes.c_int64 * 32)()
    n = lib().moe_ep_proxy_mailbox_layout(world, out, 32)
    return dict(zip([*MAILBOX, "n_fixed", *MAILBOX_ARRAYS, "n_words"], out[:n]))


def hdr_bytes(world: int, num_local_experts: int) -> int:
    """HDR: int32[world] counts + int32[EL] local-expert counts, padded to 16 bytes."""
    return (4 * (world + num_local_experts) + 15) // 16 * 16


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


def proxy_region_bytes(world_size: int, *, node_size: int, num_local_experts: int, row_bytes: int,
                       comb_row_bytes: int, private_capacity: int, overflow_capacity: int,
                       max_send_rows: int) -> dict[str, int]:
    """The minimum byte size of each region (``REGION_NAMES``) of a ``Proxy`` with these arguments
    (the native ``moe_ep_proxy_region_bytes``), for a caller that passes its own ``regions``."""
    cfg = ProxyConfig(0, world_size, node_size, num_local_experts, row_bytes, comb_row_bytes, private_capacity,
                      overflow_capacity, max_send_rows, 0, 0, 0, 0)
    need = (ctypes.c_uint64 * len(REGION_NAMES))()
    lib().moe_ep_proxy_region_bytes(ctypes.byref(cfg), need)
    return dict(zip(REGION_NAMES, (int(n) for n in need)))


class NullTransport(Engine):
    """Bench tool (csrc/proxy/null_transport.cc): posts complete at once and move nothing; peers'
    writes are injected by ``moe_ep_sim_drive`` (moe_ep/bench/proxy_scale.py). Never connected to
    anything: one proxy's own cost."""

    def __init__(self, rank: int, world: int):
        self._lib = lib()
        self._adopt(self._lib.moe_ep_engine_create_null(rank, world), rank, world, "null", _identity(None))
        self.streams = 0

    def stats(self) -> dict[str, int]:
        """Writes posted so far by phase (``D1``, ``D2``, ``C``, ``D0``, ``plain``) and ``bytes``."""
        out = (ctypes.c_int64 * 6)()
        if self._lib.moe_ep_null_stats(self._h, out) != OK:
            _raise(ERR_INVALID)
        return dict(zip(("D1", "D2", "C", "D0", "plain", "bytes"), out))


class SimConfig(ctypes.Structure):
    """``moe_ep::SimConfig`` (csrc/proxy/null_transport.cc): the simulated peers of a null-transport run."""
    _fields_ = [(n, ctypes.c_int64) for n in ("rank", "world", "node_size", "private_capacity", "hdr_bytes",
                                              "hdr_send_key", "hdr_recv_key", "n_draws", "arrival", "gap_ns",
                                              "timeout_ns", "spin_ns", "sleep_ns")]


class Proxy(_Closable):
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
        self._lib = lib()
        self.engine = engine
        self.rank, self.world = engine.rank, engine.world
        self.node_size, self.timeout_s = node_size, timeout_s
        self.cfg = ProxyConfig(self.rank, self.world, node_size, num_local_experts, row_bytes, comb_row_bytes,
                               private_capacity, overflow_capacity, max_send_rows, _ns(timeout_s),
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
        addrs = [_address(regions[n]) for n in REGION_NAMES]
        ptrs = (ctypes.c_void_p * len(addrs))(*[a[0] for a in addrs])
        lens = (ctypes.c_uint64 * len(addrs))(*[a[1] for a in addrs])
        mb_ptr, mb_len = _address(self.mailbox)
        self._h = self._lib.moe_ep_proxy_create(engine.handle, ctypes.byref(self.cfg), ptrs, lens,
                                                ctypes.cast(mb_ptr, ctypes.POINTER(ctypes.c_int64)), mb_len // 8)
        if not self._h:
            _raise(ERR_INVALID, f"rank {self.rank}: creating the proxy failed")
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
        rc = self._lib.moe_ep_proxy_start(self._h)
        if rc != OK:
            _raise(rc)

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
        return _str(self._lib.moe_ep_proxy_error_message, self._h) if self._h else ""

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

    def bench_drive(self, first: int, n: int, *, combine: bool = True, timeout_s: float = 30.0,
                    spin_us: float = 20.0, sleep_us: float = 5.0) -> tuple[list[int], list[int]]:
        """Kernel stand-in in native code (moe_ep/bench/proxy_cost.py): rings dispatch (and combine) for
        epochs first .. first+n-1, each after the previous ready; returns the ns bells -> ready
        of every dispatch and every combine. The send buffers are used as they are."""
        out = (ctypes.c_int64 * (2 * max(1, n)))()
        mb = ctypes.cast(_address(self.mailbox)[0], ctypes.POINTER(ctypes.c_int64))
        rc = self._lib.moe_ep_bench_drive(mb, self.world, first, n, int(combine), _ns(timeout_s), int(spin_us * 1e3),
                                          int(sleep_us * 1e3), out)
        if rc != 0:
            self.check_error()
            raise CommTimeoutError(self.rank, -1, "bench", first, timeout_s)
        return list(out[0:2 * n:2]), list(out[1:2 * n:2])

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
        import time

        self.wait_word(MAILBOX["disp_ready" if phase == "dispatch" else "comb_ready"], epoch, timeout_s,
                       phase=phase, epoch=epoch)

    def wait_word(self, word: int, value: int, timeout_s: float, *, phase: str = "dispatch", epoch: int = 0) -> None:
        """Kernel stand-in: polls mailbox ``word`` until it reaches ``value`` (a ready word, or an
        overflow window's ``ov_window(epoch, w)``); the error record's exception as soon as there
        is one, CommTimeoutError (``phase``, ``epoch``) at the deadline."""
        import time

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
