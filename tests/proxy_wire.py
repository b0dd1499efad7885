"""The proxy engine's TCP wire format written out from docs/ARCHITECTURE.md §9 (not from
csrc/proxy), for tests that speak it as a stranger or as a hand-made peer; memory with canary
bytes around every region; the process's open descriptors.
"""
from __future__ import annotations

import os
import socket
import struct
import time
from typing import Dict, List, Optional

import numpy as np

MAGIC_HELLO = 0x3248454D     # "MEH2"
MAGIC_HELLO_V1 = 0x4850454D  # "MEPH": the hello before the job identity
MAGIC_WRITE = 0x5750454D     # "MEPW"
# magic, src_rank, dst_rank, world, lane (stream), reserved, session, secret
HELLO = struct.Struct("<IiiiiIQ16s")
# magic, flags (bit 0: immediate), wr_id, rkey, imm, roff, len, shard, nshards
HEADER = struct.Struct("<IIQIIQQII")
ACK = struct.Struct("<QII")  # wr_id, status (0 landed, 1 rejected), shard
assert HELLO.size == 48 and HEADER.size == 48 and ACK.size == 16


def hello(src: int, dst: int, world: int, stream: int, session: int, secret: bytes, magic: int = MAGIC_HELLO) -> bytes:
    return HELLO.pack(magic, src, dst, world, stream, 0, session, secret)


def hello_v1(src: int, world: int, stream: int) -> bytes:
    """The 16-byte hello of moe_ep before the job identity."""
    return struct.pack("<Iiii", MAGIC_HELLO_V1, src, world, stream)


def header(rkey: int, roff: int, nbytes: int, *, wr_id: int = 1, imm: Optional[int] = None, shard: int = 0,
           nshards: int = 1, magic: int = MAGIC_WRITE) -> bytes:
    return HEADER.pack(magic, 0 if imm is None else 1, wr_id, rkey, imm or 0, roff, nbytes, shard, nshards)


def dial(endpoint: str, data: bytes = b"") -> socket.socket:
    """A TCP connection to ``host:port`` that first sends ``data``."""
    host, port = endpoint.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    if data:
        s.sendall(data)
    return s


def read_acks(s: socket.socket, n: int, timeout_s: float = 5.0) -> List[tuple]:
    """The next ``n`` acks on ``s`` as (wr_id, status, shard)."""
    buf, deadline = b"", time.monotonic() + timeout_s
    while len(buf) < n * ACK.size:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = s.recv(n * ACK.size - len(buf))
        assert chunk, f"connection closed after {len(buf)} of {n * ACK.size} ack bytes"
        buf += chunk
    return [ACK.unpack_from(buf, i * ACK.size) for i in range(n)]


def wait_gone(s: socket.socket, timeout_s: float) -> float:
    """Seconds until the other end closes ``s`` (end of file or reset; anything it sends first is
    read and dropped); raises AssertionError if it is still open after ``timeout_s``."""
    t0 = time.monotonic()
    while True:
        left = timeout_s - (time.monotonic() - t0)
        assert left > 0, f"the connection is still open after {timeout_s} s"
        s.settimeout(left)
        try:
            if not s.recv(4096):
                return time.monotonic() - t0
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - t0
        except socket.timeout:
            continue


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def wait_fds(n: int, timeout_s: float = 3.0) -> int:
    """The open descriptor count once it is ``n`` (or at the deadline: what it is then)."""
    deadline = time.monotonic() + timeout_s
    while open_fds() != n and time.monotonic() < deadline:
        time.sleep(0.02)
    return open_fds()


class CanaryRegions:
    """Byte regions with ``pad`` canary bytes on each side: ``views[name]`` is the region (what is
    registered), ``buf[name]`` the whole allocation."""

    def __init__(self, sizes: Dict[str, int], pad: int = 4096):
        self.pad = pad
        self.buf = {}
        self.views = {}
        for i, (name, n) in enumerate(sizes.items()):
            b = ((np.arange(n + 2 * pad, dtype=np.int64) * 37 + 11 + i) % 251 + 1).astype(np.uint8)
            b[pad:pad + n] = 0
            self.buf[name], self.views[name] = b, b[pad:pad + n]
        self._canary = {k: (b[:pad].copy(), b[len(b) - pad:].copy()) for k, b in self.buf.items()}

    def canary_damage(self) -> List[str]:
        """Where a canary byte changed: a write outside a region."""
        bad = []
        for k, b in self.buf.items():
            lo, hi = self._canary[k]
            if not np.array_equal(b[:self.pad], lo):
                bad.append(f"{k}: {int((b[:self.pad] != lo).sum())} canary bytes before the region changed")
            if not np.array_equal(b[len(b) - self.pad:], hi):
                bad.append(f"{k}: {int((b[len(b) - self.pad:] != hi).sum())} canary bytes after the region changed")
        return bad

    def snapshot(self) -> Dict[str, np.ndarray]:
        return {k: b.copy() for k, b in self.buf.items()}

    def changed(self, snap: Dict[str, np.ndarray]) -> List[str]:
        """Regions (or canaries) whose bytes differ from ``snap``, with the first offsets that do."""
        out = []
        for k, b in self.buf.items():
            d = np.nonzero(b != snap[k])[0]
            if d.size:
                out.append(f"{k}: {d.size} bytes changed, first at region offsets {(d[:4] - self.pad).tolist()}")
        return out
