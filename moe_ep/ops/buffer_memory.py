"""BufferMemory: every tensor one rank's EPBuffer holds (node workspace, launch state, error record,
expert layout; across nodes the proxy and its regions), allocated as its ``BufferShape`` sizes them."""
from __future__ import annotations

import logging
from typing import Optional

import torch

from ..core.group import EPGroup
from ..internode.path import RemotePath
from ..core.node_memory import SymmetricWorkspace, check_device_memory
from .sizing import DEVICE, RECV_ROW_ALLOCS, BufferShape, MemoryPlan, allocate, where_of

_log = logging.getLogger("moe_ep")


class BufferMemory:
    """The memory of one rank's ``EPBuffer`` of ``shape`` (``moe_ep.ops.sizing.BufferShape``), allocated
    at construction (collective: the node memory's rendezvous, the proxy's endpoint exchange).

    Attributes (on ``device``, the rank's, unless said; shapes are ``BufferShape.allocations``'):
        device: the rank's device.
        workspace: the node workspace (``moe_ep.core.node_memory.SymmetricWorkspace``): uint8
            ``[shape.offsets["total"]]`` a rank, every node peer's addresses in ``peer_ptrs``.
        state: int64 ``[2, P]``: ``[0, p]`` / ``[1, p]`` the dispatch / combine epoch program p
            has completed (each program its own copy: no launch needs a cross-program step).
        err: int64 ``[8]`` error record (``moe_ep.core.errors.ErrorCode``), pinned host memory on GPU
            (read by the host without a device sync).
        hist: int32 ``[E (+N, +R), CMAX]`` routing histogram (rows layout: N more rows, the
            tokens of each chunk with a selection on each node peer; across nodes then R more).
        recv_pos: int32 ``[N, M, K]``; route_idx: int32 ``[M, K]``: this rank's expert ids of the
            latest dispatch (-1 where none or out of range), which combine reads, not the caller's
            ``topk_idx``; scratch: int32 ``[P, block_el]``.
        expert_x: the expert layout (``DispatchResult.expert_x``), dispatch dtype; expert_x_words:
            the same bytes as int32 (row copies move 4-byte words). Packed or rows sized per call:
            at least the rows of the latest dispatch (``fit_rows``), of which ``rows`` are its result.
        recv_need: sized per call only: int64 ``[1]``, pinned host memory on GPU: the rows the
            dispatch being received brings (``moe_ep.kernels.recv_total``), else None.
        rows: sized per call (``per_call``): the rows of the latest dispatch, which its
            ``DispatchResult`` shows.
        expert_scales: fp8 only: float32 ``[..., NB]`` (column-major in its last two dims with
            ``column_major_scales``), else None.
        expert_counts: int32 ``[EL]``; expert_offsets: packed only, int32 ``[EL + 1]``, else None.
        recv_topk_idx, recv_topk_weights, recv_src, num_recv: rows layout only (per received row
            its local ids, weights and source; the count of rows), else None.
        remote: the inter-node path (``moe_ep.internode.path.RemotePath``: the proxy, its regions
            and device state) where ``node_size < world_size``, else None.
    """

    def __init__(self, group: EPGroup, shape: BufferShape, timeout_s: float):
        """Checks the device's free memory against every allocation (the proxy's row regions only
        with ``proxy_memory="gpu"``: with ``"auto"`` they may go to pinned host memory, decided once
        the engine exists), then allocates them; ``timeout_s``: the proxy's deadline."""
        dev = self.device = group.device
        self._allocs = allocs = shape.allocations()
        check_device_memory(group, sum(a.nbytes for k, a in allocs.items() if a.where == DEVICE and not (
            shape.proxy_memory == "auto" and k.startswith("remote.regions."))))
        self.workspace = SymmetricWorkspace(group, allocs["workspace.local"].nbytes)
        self.state = allocate(allocs["state"], dev)
        self.err = allocate(allocs["err"], dev)
        self._err_host = self.err.numpy()  # same memory: reading it costs no tensor op
        self.hist = allocate(allocs["hist"], dev)
        self.recv_pos = allocate(allocs["recv_pos"], dev)
        self.route_idx = allocate(allocs["route_idx"], dev, fill=-1)
        self.scratch = allocate(allocs["scratch"], dev)
        self.expert_x = allocate(allocs["expert_x"], dev, fill=None)
        self.expert_x_words = self.expert_x.view(torch.uint8).view(torch.int32)
        self.expert_scales = allocate(allocs["expert_scales"], dev, fill=None) if "expert_scales" in allocs else None
        self.rows = shape.allocated_rows
        self.per_call = shape.recv_rows_mode == "per_call"
        self.recv_need = allocate(allocs["recv_need"], dev) if "recv_need" in allocs else None
        if shape.column_major_scales:  # [EL, NB, capacity] in memory (moe_ep.kernels.common.scale_ptr)
            self.expert_scales = self.expert_scales.transpose(1, 2)
        self.expert_counts = allocate(allocs["expert_counts"], dev)
        self.expert_offsets = allocate(allocs["expert_offsets"], dev) if "expert_offsets" in allocs else None
        rows = shape.layout == "rows"
        self.recv_topk_idx, self.recv_topk_weights, self.recv_src, self.num_recv = (
            allocate(allocs[name], dev) if rows else None
            for name in ("recv_topk_idx", "recv_topk_weights", "recv_src", "num_recv"))
        self.remote = self._start_remote(group, shape, timeout_s) if shape.node_size < shape.world_size else None
        if dev.type == "cuda":  # zeroed before a kernel on another stream than this one reads it
            torch.cuda.current_stream(dev).synchronize()

    @staticmethod
    def _start_remote(group: EPGroup, shape: BufferShape, timeout_s: float) -> RemotePath:
        rp = RemotePath(group, shape.remote_spec(group.rank), shape.num_programs, shape.proxy_memory, timeout_s)
        if group.device.type == "cuda":
            mib = sum(int(r.numel()) for r in rp.regions.values()) / 2**20
            _log.log(logging.INFO if group.rank == 0 else logging.DEBUG,
                     "moe_ep rank %d proxy regions (%.1f MiB, %s transport): rows in %s memory (%s); headers and "
                     "mailbox in pinned host memory", group.rank, mib, rp.proxy.engine.transport,
                     "GPU" if rp.memory == "gpu" else "pinned host", rp.memory_why)
        return rp

    def fit_rows(self, rows: int) -> None:
        """Sized per call: the received tensors (``RECV_ROW_ALLOCS``: ``expert_x``, fp8
        ``expert_scales``, the rows layout's ids, weights and sources) hold at least ``rows`` rows,
        reallocated with exactly that many (uninitialised) when they hold fewer (the previous
        dispatch's result, valid until this dispatch, is released); ``self.rows = rows``."""
        if rows > self.expert_x.shape[0]:
            for key in RECV_ROW_ALLOCS:
                if key in self._allocs:
                    a = self._allocs[key]
                    setattr(self, key, torch.empty((rows, *a.shape[1:]), dtype=a.dtype, device=self.device))
            self.expert_x_words = self.expert_x.view(torch.uint8).view(torch.int32)
        self.rows = rows

    def recv_row_ptrs(self) -> tuple:
        """The addresses of the received tensors (a launch plan holds them: one plan per allocation)."""
        return tuple(getattr(self, key).data_ptr() for key in RECV_ROW_ALLOCS if key in self._allocs)

    def result_fields(self) -> dict:
        """The fields every ``DispatchResult`` of this memory shares (``DispatchResult.issued``): the
        expert layout's tensors, by field name (sized per call: the latest dispatch's ``rows``)."""
        fields = self._result_fields()
        if self.per_call and self.rows != self.expert_x.shape[0]:
            for key in RECV_ROW_ALLOCS:
                if fields[key] is not None:
                    fields[key] = fields[key][:self.rows]
        return fields

    def _result_fields(self) -> dict:
        return dict(expert_x=self.expert_x, expert_scales=self.expert_scales, expert_counts=self.expert_counts,
                    expert_offsets=self.expert_offsets, recv_topk_idx=self.recv_topk_idx,
                    recv_topk_weights=self.recv_topk_weights, recv_src=self.recv_src, num_recv=self.num_recv)

    def error_record(self) -> tuple:
        """``(code, peer, phase, epoch, detail)`` of the error record, read from host memory (no device sync)."""
        return tuple(int(v) for v in self._err_host[:5])

    def plan(self) -> MemoryPlan:
        """What this memory holds, per region (``moe_ep.ops.sizing.PLAN_REGIONS``), from the live tensors:
        each allocation's storage bytes and where it lives."""
        entries = {}
        for key, a in self._allocs.items():
            t = self
            for part in key.split("."):  # an attribute path: "hist", "workspace.local", "remote.regions.round1"
                t = t[part] if isinstance(t, dict) else getattr(t, part)
            entries[key] = (a.region, t.untyped_storage().nbytes(), where_of(t))
        return MemoryPlan.of(entries)

    def close(self, cause: Optional[BaseException] = None) -> None:
        """Stops the proxy (its goodbye tells the peers ``cause``, the error the buffer broke with)
        and releases the workspace; the device must be done with them."""
        if self.remote is not None:
            self.remote.close(cause)
        self.workspace.close()
