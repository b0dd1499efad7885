"""The native library itself: where it is (or, in a source checkout, building it), loading it,
its ABI check, its errors, and the ctypes helpers every binding module shares.

One library (csrc/proxy and csrc/launch, C++17, ``moe_ep/native/_native*.so``) holds the proxy
engine, its transports and the kernel launcher; each binding module of this folder declares the
functions it calls (``Functions``). Native calls release the GIL (``ctypes.CDLL``), so a blocking
call does not stop other Python threads. A failed call raises ``NativeError`` (``PeerLostError``
for a lost peer), a ``RuntimeError`` carrying the native message (rank, peer, what failed).
"""
from __future__ import annotations

import ctypes
import glob
import json
import os
import re
import subprocess
import sysconfig
import threading
from typing import Sequence

from ..core import settings

# Return codes (csrc/proxy/imm_counter.h).
OK, ERR_TIMEOUT, ERR_PEER, ERR_INVALID, ERR_SYSTEM = 0, 1, 2, -1, -2
# The C types the signatures use.
VP, I32, U32, I64, U64, CP, SZ = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_int64, ctypes.c_uint64,
                                  ctypes.c_char_p, ctypes.c_size_t)


class NativeError(RuntimeError):
    """A native call failed; ``code`` is its return code, the message is the native one."""

    def __init__(self, msg: str, code: int = ERR_SYSTEM, peer: int = -1):
        super().__init__(msg)
        self.code, self.peer = code, peer


class PeerLostError(NativeError):
    """A peer's connection was lost (cut, closed, dead); ``peer`` names it (-1 if unknown)."""


ABI_VERSION = 20  # moe_ep_abi_version() of the library this package drives (csrc/proxy/capi.cc)
_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.normpath(os.path.join(_PKG_DIR, "..", "..", "csrc"))  # in a source checkout
SRC_DIRS = (os.path.join(CSRC, "proxy"), os.path.join(CSRC, "launch"))  # the proxy engine; the kernel launcher
_IN_TREE = os.path.normpath(os.path.join(CSRC, "..", "build", "moe_ep_native"))
_lib = None
_lib_lock = threading.Lock()


def _sources(src_dirs: Sequence[str]) -> list[str]:
    return sorted(f for d in src_dirs for f in glob.glob(os.path.join(d, "*.cc")) + glob.glob(os.path.join(d, "*.h")))


def build(out_dir: str = _IN_TREE, src_dirs: Sequence[str] = SRC_DIRS, defines: Sequence[str] = ()) -> str:
    """The library compiled from the C++ of ``src_dirs`` (default csrc/proxy and csrc/launch of this
    source checkout) with the system c++ (``CXX``) and ``defines`` (``-D`` macros) into
    ``out_dir/_native.so``; one there as new as every source is kept. Returns its path."""
    srcs = _sources(src_dirs)
    if not srcs:
        raise NativeError(f"build: no C++ sources in {', '.join(src_dirs)}")
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, "_native.so")
    newest = max(os.path.getmtime(s) for s in srcs)  # before compiling: see below
    if os.path.exists(out) and os.path.getmtime(out) >= newest:
        return out
    tmp = f"{out}.{os.getpid()}.tmp"
    cxx = os.environ.get("CXX", "c++")
    flags = ["-O2", "-std=c++17", "-pthread", "-fPIC", "-shared", "-fvisibility=hidden",
             *(f"-D{d}" for d in defines)]
    # The flags, recorded in the library for build_info() (csrc/proxy/capi.cc: moe_ep_build_info).
    record = "-DMOE_EP_BUILD_FLAGS=" + json.dumps(f"{' '.join(flags)} (in-tree build by moe_ep.native.library, {cxx})")
    # Python's headers for csrc/launch/launch.cc's `launch` function (stable ABI: no libpython linked)
    cmd = [cxx, *flags, record, "-I" + sysconfig.get_paths()["include"], *(s for s in srcs if s.endswith(".cc")),
           "-o", tmp, "-ldl"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise NativeError(f"building the native library failed ({' '.join(cmd)}):\n{r.stderr[-4000:]}")
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
    srcs = _sources(SRC_DIRS)
    if built:
        # In a source checkout, a library older than its sources is stale: rebuild it in the tree.
        if srcs and max(os.path.getmtime(s) for s in srcs) > os.path.getmtime(built[0]):
            return build()
        return built[0]
    if srcs:
        return build()
    raise NativeError(f"native library not found in {_PKG_DIR}; reinstall moe_ep (pip install -e .)")


def lib() -> ctypes.CDLL:
    """The loaded native library (loaded, and in a source checkout built, on first use), its ABI
    checked; the functions of this module declared (the others: ``Functions``)."""
    global _lib
    with _lib_lock:
        if _lib is None:
            L = ctypes.CDLL(_find_library())
            _declare(L, {"moe_ep_abi_version": (I32,), "moe_ep_build_info": (CP,),
                         "moe_ep_last_error": (I32, CP, SZ)})
            if L.moe_ep_abi_version() != ABI_VERSION:
                raise NativeError("native library has an unexpected ABI version; rebuild moe_ep")
            _lib = L
        return _lib


def path() -> str:
    """The file of the loaded native library (loaded on first use)."""
    return lib()._name


def _declare(L: ctypes.CDLL, signatures: dict) -> None:
    for name, (restype, *argtypes) in signatures.items():
        f = getattr(L, name)
        f.restype, f.argtypes = restype, list(argtypes)


class Functions:
    """The native functions a binding module calls, with their C types:
    ``Functions(moe_ep_x=(restype, *argtypes), ...)``. Calling it gives the loaded library with
    them declared (declared once, at the first call)."""

    def __init__(self, **signatures: tuple):
        self._signatures = signatures
        self._declared = None

    def __call__(self) -> ctypes.CDLL:
        L = lib()
        if self._declared is not L:
            _declare(L, self._signatures)
            self._declared = L
        return L


def text(fn, *args) -> str:
    """The string a native ``fn(*args, buf, len)`` writes (it returns the full length: a longer
    one is read again into a buffer that fits)."""
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
    return text(lib().moe_ep_last_error)


PEER_RE = re.compile(r"peer (\d+)")  # the peer a native message names


def fail(code: int, what: str = "") -> None:
    """Raises the error of return code ``code``: ``PeerLostError`` for a lost peer, else
    ``NativeError``; the message is the thread's native one (``what`` when there is none)."""
    msg = last_error() or what
    m = PEER_RE.search(msg)
    peer = int(m.group(1)) if m else -1
    if code == ERR_PEER:
        raise PeerLostError(msg, code, peer)
    raise NativeError(msg, code, peer)


def check(code: int) -> None:
    """``fail(code)`` unless ``code`` is ``OK``."""
    if code != OK:
        fail(code)


def ns(timeout_s: float) -> int:
    """Seconds as the native calls' nanoseconds (>= 0)."""
    return max(0, int(timeout_s * 1e9))


def address(obj) -> tuple[int, int]:
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


class Closable:
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
