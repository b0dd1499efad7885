"""The host's waits for peers' flags between the two halves of a call under the interpreter (CPU),
which cannot spin in a kernel; on a GPU the kernels wait themselves (``kernels/common.py``)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ..core.errors import CommTimeoutError
from ..core.workspace import chunking

if TYPE_CHECKING:
    from .calls import Parts


def _flags(parts: "Parts", region: str, count: int) -> torch.Tensor:
    """The ``count`` int64 flags of ``region`` in this rank's workspace."""
    start = parts.shape.offsets[region]
    return parts.memory.workspace.local[start:start + 8 * count].view(torch.int64)


def _wait(parts: "Parts", missing, epoch: int, phase: str) -> None:
    """Polls (backoff up to 5 ms) until ``missing()``, the first peer whose flag is not there yet
    or None, names no peer; past ``parts.timeout_s`` the buffer fails with ``CommTimeoutError``.
    With other nodes the proxy's error fails it at once (a node peer killed: its connections go
    before any deadline)."""
    deadline = time.monotonic() + parts.timeout_s
    delay = 1e-4
    while True:
        peer = missing()
        if peer is None:
            return
        remote = parts.memory.remote
        if remote is not None:
            try:
                remote.check()
            except Exception as exc:  # noqa: BLE001
                parts.calls.fail(exc)
        if time.monotonic() > deadline:
            parts.calls.fail(CommTimeoutError(parts.rank, peer, phase, epoch, parts.timeout_s))
        time.sleep(delay)
        delay = min(delay * 2, 5e-3)


def wait_dispatch(parts: "Parts", epoch: int) -> None:
    """Every node source's header flag of dispatch ``epoch``, then the flag of each chunk its header
    announces; with other nodes, then every source's header through the proxy."""
    N, C, HDR = parts.shape.node_size, parts.shape.chunks, parts.shape.workspace.HDR
    hflag, dflag = _flags(parts, "hdr_flag", N), _flags(parts, "disp_flag", N * C).view(N, C)
    hoff = parts.shape.offsets["hdr"] // 4 + (epoch & 1) * N * HDR
    hdr = parts.memory.workspace.local.view(torch.int32)

    def missing():
        for s in range(N):
            if int(hflag[s]) < epoch:
                return parts.node0 + s
            nc = chunking(int(hdr[hoff + s * HDR]), C)[1]
            if nc and int(dflag[s, :nc].min()) < epoch:
                return parts.node0 + s
        return None
    _wait(parts, missing, epoch, "dispatch")
    if parts.memory.remote is not None:  # and every source's header from the proxy (the count matrix)
        parts.memory.remote.host_wait(parts.calls.fail, "dispatch", epoch)


def wait_weights(parts: "Parts", epoch: int) -> None:
    """Every node source's combine-time weight flag (combine ``epoch``) of each chunk of its latest dispatch."""
    N, C, HDR = parts.shape.node_size, parts.shape.chunks, parts.shape.workspace.HDR
    wflag = _flags(parts, "wgt_flag", N * C).view(N, C)
    hoff = parts.shape.offsets["hdr"] // 4 + (parts.calls.epochs[0] & 1) * N * HDR
    hdr = parts.memory.workspace.local.view(torch.int32)

    def missing():
        for s in range(N):
            nc = max(1, chunking(int(hdr[hoff + s * HDR]), C)[1])
            if int(wflag[s, :nc].min()) < epoch:
                return parts.node0 + s
        return None
    _wait(parts, missing, epoch, "combine")


def wait_combine(parts: "Parts", epoch: int, T: int) -> None:
    """Every node owner's flag (combine ``epoch``) of each chunk of this rank's ``T`` tokens (chunk 0
    at least); with other nodes, then every remote owner's rows through the proxy."""
    N, C = parts.shape.node_size, parts.shape.chunks
    cflag = _flags(parts, "comb_flag", N * C).view(N, C)
    nc = max(1, chunking(T, C)[1])

    def missing():
        lag = (cflag[:, :nc].min(dim=1).values < epoch).nonzero()
        return parts.node0 + int(lag[0, 0]) if lag.numel() else None
    _wait(parts, missing, epoch, "combine")
    if parts.memory.remote is not None:  # and every remote owner's rows (its combine carries the dispatch epoch)
        parts.memory.remote.host_wait(parts.calls.fail, "combine", parts.calls.epochs[0])
