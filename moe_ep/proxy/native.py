"""ctypes loader and Python wrapper for the native proxy engine (csrc/proxy).

``ImmCounter``: a signed counter per 32-bit immediate; ``wait`` subtracts what it expects.
``Engine`` (``TcpTransport``): registered memory, one-sided writes with immediates to peers,
completions by ``poll``, the receiver's immediates counted in ``engine.imm``.

Native calls release the GIL (ctypes.CDLL), so a blocking ``wait`` or ``poll`` does not stop
other Python threads. Timeouts raise ``moe_ep.CommTimeoutError``; a lost peer raises
``PeerLostError``; other failures raise ``NativeError``; all are ``RuntimeError``s carrying the
native message (rank, peer, what failed).
"""
from __future__ import annotations

import ctypes
import glob
import os
import re
import subprocess
import threading
from typing import NamedTuple, Sequence

from ..errors import CommTimeoutError

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


_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_SRC_DIR = os.path.normpath(os.path.join(_PKG_DIR, "..", "..", "csrc", "proxy"))
_lib = None
_lib_lock = threading.Lock()


def _sources() -> list[str]:
    return sorted(glob.glob(os.path.join(_SRC_DIR, "*.cc")) + glob.glob(os.path.join(_SRC_DIR, "*.h")))


def _build_from_source() -> str:
    """Source checkout without a (fresh) built library: compile csrc/proxy with the system c++."""
    out_dir = os.path.normpath(os.path.join(_SRC_DIR, "..", "..", "build", "moe_ep_native"))
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, "_native.so")
    srcs = [s for s in _sources() if s.endswith(".cc")]
    if os.path.exists(out) and os.path.getmtime(out) >= max(os.path.getmtime(s) for s in _sources()):
        return out
    tmp = f"{out}.{os.getpid()}.tmp"
    cxx = os.environ.get("CXX", "c++")
    cmd = [cxx, "-O2", "-std=c++17", "-pthread", "-fPIC", "-shared", "-fvisibility=hidden", *srcs, "-o", tmp]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise NativeError(f"building the native proxy library failed ({' '.join(cmd)}):\n{r.stderr[-4000:]}")
    os.replace(tmp, out)
    return out


def _find_library() -> str:
    env = os.environ.get("MOE_EP_NATIVE_LIB")
    if env:
        return env
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
            _c(L, "moe_ep_last_error", i32, cp, sz)
            _c(L, "moe_ep_imm_create", vp)
            _c(L, "moe_ep_imm_destroy", None, vp)
            _c(L, "moe_ep_imm_add", i32, vp, u32, i64)
            _c(L, "moe_ep_imm_wait", i32, vp, u32, i64, i64)
            _c(L, "moe_ep_imm_value", i64, vp, u32)
            _c(L, "moe_ep_imm_stress", i32, vp, u32, i32, i64)
            _c(L, "moe_ep_engine_create", vp, cp, i32, i32, i32, cp)
            _c(L, "moe_ep_engine_destroy", None, vp)
            _c(L, "moe_ep_engine_imm", vp, vp)
            _c(L, "moe_ep_register", i32, vp, vp, u64, ctypes.POINTER(u32))
            _c(L, "moe_ep_endpoint", i32, vp, cp, sz)
            _c(L, "moe_ep_connect", i32, vp, ctypes.POINTER(cp), i32, i64)
            _c(L, "moe_ep_post_write", i32, vp, i32, u32, u64, u32, u64, u64, i32, u32, ctypes.POINTER(u64))
            _c(L, "moe_ep_poll", i32, vp, ctypes.POINTER(_CCompletion), i32, i64)
            _c(L, "moe_ep_set_fault", i32, vp, i64, i32, i32, i64)
            _c(L, "moe_ep_set_op_timeout", i32, vp, i64)
            _c(L, "moe_ep_peer_error", i32, vp, i32, cp, sz)
            _c(L, "moe_ep_rank", i32, vp)
            _c(L, "moe_ep_world", i32, vp)
            if L.moe_ep_abi_version() != 1:
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

    def stress(self, imm: int, threads: int, adds_per_thread: int) -> None:
        """Test helper: `threads` native threads each add 1 to `imm` `adds_per_thread` times."""
        rc = self._lib.moe_ep_imm_stress(self._h, imm, threads, adds_per_thread)
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


class Engine:
    """One rank's proxy engine: a transport (``"tcp"``) plus the ImmCounter its receives feed.

    Usage: ``key = e.register(buf)`` (every rank registers its regions in the same order, so keys
    agree), exchange ``e.endpoint`` strings, ``e.connect(endpoints)``, then ``post_write`` /
    ``poll`` on the sender and ``e.imm.wait`` on the receiver. ``connect`` once; ``close`` only
    after every call on the engine (and its ``imm``) has returned.
    """

    def __init__(self, rank: int, world: int, streams: int = 4, bind_host: str = "127.0.0.1",
                 transport: str = "tcp"):
        self._lib = lib()
        self._h = self._lib.moe_ep_engine_create(transport.encode(), rank, world, streams, bind_host.encode())
        if not self._h:
            _raise(ERR_SYSTEM, f"rank {rank}: creating the {transport} engine failed")
        self.rank, self.world, self.streams = rank, world, streams
        self._keep: list = []  # registered objects stay alive as long as the engine
        self.imm = ImmCounter(self._lib.moe_ep_engine_imm(self._h), _owner=self, rank=rank)

    @property
    def endpoint(self) -> str:
        return _str(self._lib.moe_ep_endpoint, self._h)

    def register_ptr(self, ptr: int, nbytes: int) -> int:
        key = ctypes.c_uint32()
        rc = self._lib.moe_ep_register(self._h, ptr, nbytes, ctypes.byref(key))
        if rc != OK:
            _raise(rc)
        return key.value

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
            m = _PEER_RE.search(last_error())
            raise CommTimeoutError(self.rank, int(m.group(1)) if m else -1, "connect", 0, timeout_s)
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

    def set_fault(self, delay_us: int = 0, reorder: bool = False, cut_peer: int = -1, cut_after: int = 0) -> None:
        """Fault injection (off by default): random per-shard delay up to delay_us; reorder (random
        stream, random pick from the stream's queue); cut every connection with cut_peer when
        write number cut_after+1 to it is posted."""
        self._lib.moe_ep_set_fault(self._h, delay_us, int(reorder), cut_peer, cut_after)

    def set_op_timeout(self, timeout_s: float) -> None:
        """A write not acknowledged within this time completes with CQ_TIMEOUT and its peer is lost."""
        self._lib.moe_ep_set_op_timeout(self._h, _ns(timeout_s))

    def peer_error(self, peer: int) -> str:
        """Why the peer was lost ('' while it is healthy)."""
        return _str(self._lib.moe_ep_peer_error, self._h, peer)

    def close(self) -> None:
        if getattr(self, "_h", None):
            self._lib.moe_ep_engine_destroy(self._h)
            self._h = None
            self.imm._h = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class TcpTransport(Engine):
    """Engine over TCP: ``streams`` sockets per peer and direction, each write sharded across them."""

    def __init__(self, rank: int, world: int, streams: int = 4, bind_host: str = "127.0.0.1"):
        super().__init__(rank, world, streams, bind_host, transport="tcp")
