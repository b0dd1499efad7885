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

    def _maybe_fail(self, name):
        if self.fail == name:
            raise RuntimeError(f"cudaErrorInvalidValue: invalid argument (stand-in for {name})")

    def setDevice(self, index):
        pass

    def malloc(self, n):
        self._maybe_fail("malloc")
        buf = bytearray(n)
        ptr = id(buf)
        self.mem[ptr] = buf
        return ptr

    def memset(self, ptr, value, n):
        pass

    def ipcGetMemHandle(self, ptr):
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
    for call, step, name in (("malloc", "export", "cudaMalloc"), ("ipcOpenMemHandle", "open", "cudaIpcOpenMemHandle")):
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
