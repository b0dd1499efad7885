"""The host's waits for peers' flags between the two halves of a call under the interpreter (CPU),
which cannot spin in a kernel; on a GPU the kernels wait themselves (``kernels/common.py``)."""
from __future__ import annotations

import time

import torch

from .errors import CommTimeoutError
from .layout import chunking


def _flags(buf, region: str, count: int) -> torch.Tensor:
    """The ``count`` int64 flags of ``region`` in this rank's workspace."""
    start = buf.off[region]
    return buf.workspace.local[start:start + 8 * count].view(torch.int64)


def _wait(buf, missing, epoch: int, phase: str) -> None:
    """Polls (backoff up to 5 ms) until ``missing()``, the first peer whose flag is not there yet
    or None, names no peer; past ``buf.timeout_s`` the buffer fails with ``CommTimeoutError``.
    With other nodes the proxy's error fails it at once (a node peer killed: its connections go
    before any deadline)."""
    deadline = time.monotonic() + buf.timeout_s
    delay = 1e-4
    while True:
        peer = missing()
        if peer is None:
            return
        if buf.remote is not None:
            try:
                buf.remote.check()
            except Exception as exc:  # noqa: BLE001
                buf.calls.fail(exc)
        if time.monotonic() > deadline:
            buf.calls.fail(CommTimeoutError(buf.rank, peer, phase, epoch, buf.timeout_s))
        time.sleep(delay)
        delay = min(delay * 2, 5e-3)


def wait_dispatch(buf, epoch: int) -> None:
    """Every node source's header flag of dispatch ``epoch``, then the flag of each chunk its header
    announces; with other nodes, then every source's header through the proxy."""
    N, C, HDR = buf.node_size, buf.chunks, buf.ws_layout.HDR
    hflag, dflag = _flags(buf, "hdr_flag", N), _flags(buf, "disp_flag", N * C).view(N, C)
    hoff = buf.off["hdr"] // 4 + (epoch & 1) * N * HDR
    hdr = buf.workspace.local.view(torch.int32)

    def missing():
        for s in range(N):
            if int(hflag[s]) < epoch:
                return buf.node0 + s
            nc = chunking(int(hdr[hoff + s * HDR]), C)[1]
            if nc and int(dflag[s, :nc].min()) < epoch:
                return buf.node0 + s
        return None
    _wait(buf, missing, epoch, "dispatch")
    if buf.remote is not None:  # and every source's header from the proxy (the count matrix)
        buf.remote.host_wait(buf, "dispatch", epoch)


def wait_weights(buf, epoch: int) -> None:
    """Every node source's combine-time weight flag (combine ``epoch``) of each chunk of its latest dispatch."""
    N, C, HDR = buf.node_size, buf.chunks, buf.ws_layout.HDR
    wflag = _flags(buf, "wgt_flag", N * C).view(N, C)
    hoff = buf.off["hdr"] // 4 + (buf.calls.epochs[0] & 1) * N * HDR
    hdr = buf.workspace.local.view(torch.int32)

    def missing():
        for s in range(N):
            nc = max(1, chunking(int(hdr[hoff + s * HDR]), C)[1])
            if int(wflag[s, :nc].min()) < epoch:
                return buf.node0 + s
        return None
    _wait(buf, missing, epoch, "combine")


def wait_combine(buf, epoch: int, T: int) -> None:
    """Every node owner's flag (combine ``epoch``) of each chunk of this rank's ``T`` tokens (chunk 0
    at least); with other nodes, then every remote owner's rows through the proxy."""
    N, C = buf.node_size, buf.chunks
    cflag = _flags(buf, "comb_flag", N * C).view(N, C)
    nc = max(1, chunking(T, C)[1])

    def missing():
        lag = (cflag[:, :nc].min(dim=1).values < epoch).nonzero()
        return buf.node0 + int(lag[0, 0]) if lag.numel() else None
    _wait(buf, missing, epoch, "combine")
    if buf.remote is not None:  # and every remote owner's rows from the proxy (its combine carries the dispatch epoch)
        buf.remote.host_wait(buf, "combine", buf.calls.epochs[0])
