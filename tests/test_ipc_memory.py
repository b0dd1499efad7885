"""The CUDA-IPC node memory's protocol on CPU ranks, with a stand-in for cupy's runtime: a failing
CUDA call is named with its rank and call on every rank (nobody waits), and a rank's allocation
is freed only once no live peer maps it, whatever order the ranks close in. The real calls run
in tests/test_shared_gpu.py (GPU-marked)."""
from __future__ import annotations

import contextlib
import time

import dist_util


class FakeRuntime:
    """What ``IpcMemory`` calls of ``cupy.cuda.runtime``, on host bytes: ``fail`` names a call that
    raises (as cupy's CUDARuntimeError would); ``freed`` and ``closed`` record the releases."""

    cudaIpcMemLazyEnablePeerAccess = 1

    def __init__(self, fail=None):
        self.fail, self.freed, self.closed, self.mem = fail, [], [], {}
        self.log = []  # (call, args) of the stream and zeroing calls, in order
        self.streams = {}  # stream -> memsets queued on it and not yet waited for

    def _maybe_fail(self, name):
        if self.fail == name:
            raise RuntimeError(f"cudaErrorInvalidValue: invalid argument (stand-in for {name})")

    def setDevice(self, index):
        pass

    def malloc(self, n):
        self._maybe_fail("malloc")
        buf = bytearray(b"\xff" * n)  # (cudaMalloc's memory holds whatever was there)
        ptr = id(buf)
        self.mem[ptr] = buf
        return ptr

    def memset(self, ptr, value, n):  # the legacy default stream: queued behind the caller's work
        self.log.append(("memset", ptr))

    def streamCreateWithFlags(self, flags):
        stream = 1000 + len(self.streams)
        self.streams[stream] = []
        self.log.append(("streamCreateWithFlags", flags))
        return stream

    def memsetAsync(self, ptr, value, n, stream):
        self._maybe_fail("memsetAsync")
        self.streams[stream].append((ptr, value, n))
        self.log.append(("memsetAsync", ptr))

    def streamSynchronize(self, stream):
        for ptr, value, n in self.streams[stream]:
            self.mem[ptr][:n] = bytes([value]) * n
        self.streams[stream].clear()
        self.log.append(("streamSynchronize", stream))

    def streamDestroy(self, stream):
        self.log.append(("streamDestroy", stream))

    def ipcGetMemHandle(self, ptr):
        self.log.append(("ipcGetMemHandle", ptr, bytes(self.mem[ptr]) == bytes(len(self.mem[ptr]))))
        return ptr.to_bytes(64, "little")

    def ipcOpenMemHandle(self, handle, flags):
        self._maybe_fail("ipcOpenMemHandle")
        return int.from_bytes(handle, "little") + 1  # any address but the exporter's

    def ipcCloseMemHandle(self, ptr):
        self.closed.append(ptr)

    def free(self, ptr):
        self.freed.append(ptr)


@contextlib.contextmanager
def fake_runtime(fail=None):
    """``moe_ep.core.node_memory`` calls a FakeRuntime (and makes no CUDA tensor) inside the block."""
    import moe_ep.core.node_memory as mem

    fake = FakeRuntime(fail)
    saved = mem._runtime, mem._device_bytes
    mem._runtime = lambda rank: fake
    mem._device_bytes = lambda ptr, n, dev: None
    try:
        yield fake
    finally:
        mem._runtime, mem._device_bytes = saved


def _fail_worker(rank, world_size, fail_rank, fail_call):
    import moe_ep
    from moe_ep.core.node_memory import IpcMemory

    group = moe_ep.EPGroup()
    with fake_runtime(fail_call if rank == fail_rank else None):
        t0 = time.monotonic()
        try:
            IpcMemory(group, 4096)
            return "no error", time.monotonic() - t0
        except RuntimeError as exc:
            return str(exc), time.monotonic() - t0


def test_a_failing_call_is_named_on_every_rank():
    for call, step, name in (("malloc", "export", "cudaMalloc"), ("memsetAsync", "export", "cudaMemsetAsync"),
                             ("ipcOpenMemHandle", "open", "cudaIpcOpenMemHandle")):
        for r, (msg, took) in enumerate(dist_util.run(3, _fail_worker, 1, call, timeout=120)):
            assert f"({step}) failed on rank(s) [1]: rank 1: {name} failed" in msg, (r, msg)
            assert took < 30, (r, took)


def _close_worker(rank, world_size):
    import moe_ep

    group = moe_ep.EPGroup()
    with fake_runtime() as fake:
        return _close_in_order(rank, group, fake)


def _close_in_order(rank, group, fake):
    from moe_ep.core.node_memory import IpcMemory, release_deferred

    m = IpcMemory(group, 4096)
    own = m.ptr
    out = {}
    if rank == 0:  # closes first: its peer still maps its memory
        m.close()
        out["freed_at_close"] = own in fake.freed
        out["pending"] = release_deferred()
        group.barrier()
        group.barrier()
    else:
        group.barrier()
        m.close()  # rank 0 has unmapped this rank's memory already
        out["freed_at_close"] = own in fake.freed
        out["pending"] = release_deferred()
        group.barrier()
    out["pending_after"] = release_deferred()
    out["freed"] = own in fake.freed
    out["unmapped"] = len(fake.closed)
    return out


def test_freed_once_no_peer_maps_it():
    first, second = dist_util.run(2, _close_worker, timeout=120)
    assert first == {"freed_at_close": False, "pending": 1, "pending_after": 0, "freed": True, "unmapped": 1}, first
    assert second == {"freed_at_close": True, "pending": 0, "pending_after": 0, "freed": True, "unmapped": 1}, second


def _zeroing_worker(rank, world_size):
    import moe_ep
    from moe_ep.core.node_memory import IpcMemory

    with fake_runtime() as fake:
        m = IpcMemory(moe_ep.EPGroup(), 4096)
        m.close()
        return fake.log


def test_zeroed_before_the_handle_is_exported():
    """The allocation is zeroed on a non-blocking stream of its own, and that zeroing is complete
    when its handle leaves the rank: a peer may write into it from then on. (A plain cudaMemset
    would queue on the legacy default stream, behind the caller's work there: found on a GPU, where
    a buffer made while the caller's stream slept had a peer's combine flags wiped.)"""
    for log in dist_util.run(2, _zeroing_worker, timeout=120):
        calls = [c[0] for c in log]
        assert "memset" not in calls, log
        i = calls.index("ipcGetMemHandle")
        assert calls[:i] == ["streamCreateWithFlags", "memsetAsync", "streamSynchronize", "streamDestroy"], log
        assert log[0][1] & 1, log  # cudaStreamNonBlocking
        assert log[i][2], "exported before its memory read as zeros"
