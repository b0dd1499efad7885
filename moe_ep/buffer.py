"""EPBuffer: the communication buffer of one MoE layer shape, and its dispatch/combine calls."""
from __future__ import annotations

import logging
import math
import os
from typing import Optional

import torch

from . import combine as _combine
from . import dispatch as _dispatch
from .agreement import collective_init
from .calls import CallState
from .errors import BufferBrokenError, CapacityError, CommTimeoutError, ErrorCode, Phase
from .group import EPGroup
from .handle import DispatchResult
from .kernels.interpret import interpreting, speed_up
from .kernels.launch import compile_options
from .memory import SymmetricWorkspace, check_device_memory
from .sizing import DEVICE, BufferShape, MemoryPlan, allocate, size_text, where_of
from .tuning import CombineShape, Tuning, combine_shape  # noqa: F401 (CombineShape, combine_shape: their old home)

_log = logging.getLogger("moe_ep")
MAX_TIMEOUT_S = 1e6  # the longest deadline accepted (about 11.6 days); there is no "no deadline"
# The Tuning fields every rank must agree on (the rest shape only a rank's own launches).
LAYOUT_KNOBS = ("max_chunks", "split")


class EPBuffer:
    """Buffers and kernels for expert-parallel dispatch and combine of one layer shape.

    Args:
        group: the ``EPGroup``; rank r owns experts ``[r*E/R, (r+1)*E/R)``.
        num_experts: E, a multiple of R.
        hidden: H, a multiple of 16.
        max_tokens: the most tokens any rank passes to one dispatch.
        topk: K, selections per token.
        dispatch_dtype: ``torch.bfloat16`` or ``torch.float8_e4m3fn`` (quantized in-kernel,
            float32 scale per 128 channels, see ``moe_ep.fp8``).
        combine_dtype: ``torch.bfloat16``.
        layout: ``"masked"`` (a block of ``R*max_tokens`` rows per local expert), ``"packed"`` (one
            row per selection, experts' rows contiguous) or ``"rows"`` (one row per (source rank,
            source token) with its local ids and weights; combine takes one row per received row).
        expert_alignment: packed only: each expert's block starts at a multiple of this (1 for rows).
        timeout_s: deadline of every wait for a peer; on expiry ``CommTimeoutError``.
        num_programs: Triton programs per launch (default: SM count on GPU, 2 on CPU); the same on
            every rank.
        private_capacity: with other nodes (``group.node_size < world_size``): rows each remote
            source may send into this rank's private slot in round 1 (default: a uniform batch plus
            headroom, ``moe_ep.internode.session.default_private_capacity``); the rest goes in round 2.
        overflow_capacity: with other nodes: round-2 rows this rank can take from all remote
            sources in one dispatch (default: all that could come, ``(R - node_size) * (M -
            private_capacity)``); a batch needing more raises ``CapacityError`` on every rank.
        expert_capacity: masked only: rows of each local expert's block (default ``R*max_tokens``,
            every row that can come when a token lists an expert at most once). Fewer rows take
            less memory; a dispatch that brings an expert more raises ``CapacityError`` naming the
            rank and the expert (nothing is dropped silently).
        column_major_scales: masked fp8 only: ``expert_scales`` ``[E_local, capacity, NB]`` is a
            view of a contiguous ``[E_local, NB, capacity]`` tensor (strides ``(NB * capacity, 1,
            capacity)``: column-major in its last two dims), the layout DeepEP's low-latency
            dispatch returns and grouped GEMMs read by TMA; written so by the kernels, no copy.
        proxy_memory: with other nodes on GPUs: where the proxy's five row regions live.
            ``"auto"`` (default): GPU memory where the transport can register it (verbs: dma-buf
            or nvidia-peermem; libfabric: FI_HMEM_CUDA), so the NIC reads and writes rows in
            place, else pinned host memory (tcp always); ``"gpu"``: GPU memory or
            ``NativeError`` saying why not; ``"host"``: pinned host memory. The headers and the
            mailbox are pinned host memory either way. ``buffer.remote.memory`` says which was
            taken (per rank: ranks may differ), the log line why.
        tuning: how the kernels are launched (warps, tiles, chunks, ...: ``moe_ep.Tuning``; its
            ``None`` fields take the measured rules). Default ``Tuning.from_env()``: the
            ``MOE_EP_*`` tuning variables, kept for one release. ``buffer.tuning`` holds the values
            taken (a ``moe_ep.tuning.ResolvedTuning``).

    All calls on one buffer must be issued on one CUDA stream (the current one), in the same
    order on every rank. Construction is collective: every rank passes the same arguments (checked,
    ``ValueError`` naming the argument and each rank's value); a rank whose arguments are refused
    makes every rank raise (naming it), and one that does not arrive within ``timeout_s`` gives
    ``CommTimeoutError`` (``moe_ep.agreement``).

    Memory: every allocation is sized by ``moe_ep.sizing.BufferShape`` (the buffer's ``sizes``);
    ``moe_ep.memory_plan`` gives its bytes per region before construction, ``memory()`` from the
    live tensors after, and rank 0's log line (logger ``moe_ep``, INFO) states the total.
    """

    @collective_init("EPBuffer")
    def __init__(self, group: EPGroup, num_experts: int, hidden: int, max_tokens: int, topk: int,
                 dispatch_dtype: torch.dtype = torch.bfloat16, combine_dtype: torch.dtype = torch.bfloat16,
                 layout: str = "masked", expert_alignment: int = 1, timeout_s: float = 30.0,
                 num_programs: Optional[int] = None, private_capacity: Optional[int] = None,
                 overflow_capacity: Optional[int] = None, expert_capacity: Optional[int] = None,
                 column_major_scales: bool = False, proxy_memory: str = "auto", tuning: Optional[Tuning] = None):
        if not isinstance(group, EPGroup):
            raise TypeError(f"group: expected moe_ep.EPGroup, got {type(group).__name__}")
        if tuning is None:
            tuning = Tuning.from_env()  # (checked here, before any memory)
        elif not isinstance(tuning, Tuning):
            raise TypeError(f"tuning: expected moe_ep.Tuning or None, got {type(tuning).__name__}")
        R, G = group.world_size, group.node_size
        sms = (torch.cuda.get_device_properties(group.device).multi_processor_count
               if group.device.type == "cuda" else 2)
        if num_programs is None:
            # Ranks sharing a GPU split its SMs: under MPS their programs run at once, and a launch
            # whose programs wait for a peer's can finish only if every rank's programs are resident
            # together; with time slicing this costs nothing (each rank has the GPU in its slice).
            num_programs = max(1, sms // group.ranks_per_device)
        # The arguments that size memory, checked; every allocation below is sized by it (moe_ep.sizing).
        self.sizes = BufferShape(world_size=R, node_size=G, num_experts=num_experts, hidden=hidden,
                                 max_tokens=max_tokens, topk=topk, num_programs=num_programs,
                                 dispatch_dtype=dispatch_dtype, combine_dtype=combine_dtype, layout=layout,
                                 expert_alignment=expert_alignment, expert_capacity=expert_capacity,
                                 column_major_scales=column_major_scales, private_capacity=private_capacity,
                                 overflow_capacity=overflow_capacity, proxy_memory=proxy_memory,
                                 device_type=group.device.type, max_chunks=tuning.max_chunks)
        if not (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool) and math.isfinite(timeout_s)
                and 0 < timeout_s <= MAX_TIMEOUT_S):
            raise ValueError(f"timeout_s: expected a finite number of seconds in (0, {MAX_TIMEOUT_S:g}] (every wait "
                             f"has a deadline), got {timeout_s!r}")
        self.group = group
        self.rank, self.world_size = group.rank, R
        self.device = group.device
        self.num_experts, self.hidden, self.max_tokens, self.topk = num_experts, hidden, max_tokens, topk
        self.num_local_experts = num_experts // R
        self.dispatch_dtype, self.combine_dtype = dispatch_dtype, combine_dtype
        self.layout, self.expert_alignment = layout, expert_alignment
        self.timeout_s = float(timeout_s)
        self.fp8 = dispatch_dtype == torch.float8_e4m3fn
        self.interp = interpreting()
        if self.interp:
            speed_up()
        if self.device.type == "cpu" and not self.interp:
            raise RuntimeError("moe_ep on CPU runs its Triton kernels in the interpreter: set TRITON_INTERPRET=1 "
                               "before importing triton")
        self.num_programs = num_programs
        # The launch shape: each knob the tuning sets, else its measured rule (moe_ep.tuning).
        self.tuning = t = tuning.resolve(self.sizes, sms)
        self.fused, self.num_warps, self.combine_warps, self.stages = t.fused, t.num_warps, t.combine_warps, t.stages
        self.dispatch_maxnreg, self.combine_maxnreg = t.dispatch_maxnreg, t.combine_maxnreg
        self.tile, self.combine_tile, self.combine_recv_tile = t.tile, t.combine_tile, t.combine_recv_tile
        self.block_ts, self.combine_recv_tokens = t.block_ts, t.combine_recv_tokens
        self.hist_warps, self.prefetch = t.hist_warps, t.prefetch

        # Every rank's arguments must agree before any memory is touched (program p serves chunks
        # p, p+P, ... on every rank, so num_programs too).
        self._agreement.agree(self._signature(private_capacity, overflow_capacity, expert_capacity, tuning),
                              self.timeout_s)

        # node_size: the ranks of this node (reached by stores); the other R - node_size through the proxy.
        dev = self.device
        self.node_size, self.node0 = G, self.rank - self.rank % G
        self.num_scale_blocks = self.sizes.num_scale_blocks
        rows = layout == "rows"
        self.ws_layout = self.sizes.workspace
        self.off = self.ws_layout.offsets()
        # Every allocation of this buffer, by attribute path (moe_ep.sizing): checked against the
        # GPU's free memory first. The proxy's row regions count there only with proxy_memory="gpu":
        # with "auto" they may go to pinned host memory (tcp), decided once the engine exists.
        self._allocs = allocs = self.sizes.allocations()
        check_device_memory(group, sum(a.nbytes for k, a in allocs.items() if a.where == DEVICE and not (
            proxy_memory == "auto" and k.startswith("remote.regions."))))
        self.workspace = SymmetricWorkspace(group, allocs["workspace.local"].nbytes)
        # Local state: [0, p] / [1, p] the dispatch / combine epoch program p has completed. Each
        # program keeps its own copy, so no launch needs a cross-program step to advance it.
        self.state = allocate(allocs["state"], dev)
        # Error record read by the host without a device sync: pinned host memory on GPU.
        self.err = allocate(allocs["err"], dev)
        self._err_host = self.err.numpy()  # same memory: reading it costs no tensor op
        self.chunks, self.block_t = self.ws_layout.CMAX, self.sizes.block_t  # the largest chunk of any source
        # Rows layout: N more rows, the tokens of each chunk with a selection on each node peer;
        # with other nodes, after N such rows, R more, the same per rank (route_hist_kernel's RANKS).
        self.hist = allocate(allocs["hist"], dev)
        self.recv_pos = allocate(allocs["recv_pos"], dev)
        # This rank's expert ids of the latest dispatch (written by its send half, -1 where none or
        # out of range): combine reads these, not the caller's topk_idx, which may be reused.
        self.route_idx = allocate(allocs["route_idx"], dev, fill=-1)
        self.block_el = self.sizes.block_el
        self.scratch = allocate(allocs["scratch"], dev)
        # Masked: rows per expert; packed: rows in all (never overflows); rows: one per (source rank, token).
        self.capacity = self.sizes.capacity
        self.expert_x = allocate(allocs["expert_x"], dev, fill=None)
        self.expert_x_words = self.expert_x.view(torch.uint8).view(torch.int32)  # row copies move 4-byte words
        self.expert_scales = allocate(allocs["expert_scales"], dev, fill=None) if "expert_scales" in allocs else None
        if column_major_scales:  # [EL, NB, capacity] in memory (moe_ep.kernels.common.scale_ptr)
            self.expert_scales = self.expert_scales.transpose(1, 2)
        # Rows of a column-major block of expert_scales (the kernels' CM_ROWS), 0: row-major.
        self.scale_column_rows = self.capacity if column_major_scales else 0
        self.expert_counts = allocate(allocs["expert_counts"], dev)
        self.expert_offsets = allocate(allocs["expert_offsets"], dev) if layout == "packed" else None
        # Rows layout: per received row its local ids, weights and source; the count of rows.
        for name in ("recv_topk_idx", "recv_topk_weights", "recv_src", "num_recv"):
            setattr(self, name, allocate(allocs[name], dev) if rows else None)
        # The fields every DispatchResult of this buffer shares (DispatchResult.issued; not the
        # buffer itself: no reference cycle, so a deleted buffer frees its memory at once).
        result_fields = dict(expert_x=self.expert_x, expert_scales=self.expert_scales,
                             expert_counts=self.expert_counts, expert_offsets=self.expert_offsets,
                             recv_topk_idx=self.recv_topk_idx, recv_topk_weights=self.recv_topk_weights,
                             recv_src=self.recv_src, num_recv=self.num_recv)
        self.remote = self._start_remote() if G < R else None
        # What dispatch and combine keep from call to call: launch plans, replays, serial, epochs,
        # a pending receive hook, whether the buffer is usable (moe_ep.calls).
        self.calls = CallState(dev, self.err, self.workspace.local, self.timeout_s, result_fields,
                               self.remote.proxy_error_address() if self.remote is not None else None)
        self._agreement.done(self.timeout_s)
        if self.rank == 0:
            mem = self.memory()
            _log.info("moe_ep buffer: %d ranks, nodes of %d, node memory %s (%s), %d programs; %s a rank (device "
                      "%s, host %s; per region: buffer.memory())", R, G, self.workspace.backend, self.workspace.why,
                      self.num_programs, size_text(mem.total_bytes), size_text(mem.device_bytes),
                      size_text(mem.host_bytes))

    # ------------------------------------------------------------------ public API
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 x_scales: Optional[torch.Tensor] = None, return_recv_hook: bool = False):
        """Sends each token to the ranks owning its top-k experts; returns the expert layout.

        Args:
            x: ``[T, H]`` bfloat16 on ``group.device`` (or float8_e4m3fn with ``x_scales``), 0 <= T <= max_tokens.
            topk_idx: ``[T, K]`` int32/int64; -1 = no expert.
            topk_weights: ``[T, K]`` float32, applied in ``combine``.
            x_scales: ``[T, ceil(H/128)]`` float32, only with pre-quantized fp8 ``x``.
            return_recv_hook: issue only the send half now and return ``(result, hook)``; ``hook()``
                issues the receive half (on the then-current stream), after which ``result`` is
                valid. Work queued in between (another buffer's dispatch, attention of another
                micro-batch) overlaps the transfer. Until the hook is called this buffer takes no
                other dispatch or combine; it may be called once.
        Returns:
            ``DispatchResult`` (views of buffer memory, valid until the next dispatch), or
            ``(DispatchResult, hook)`` with ``return_recv_hook``.
        """
        # the eager fast path: a call like the latest replayed one of its kind (dispatch.replayed)
        result = _dispatch.replayed(self, x, topk_idx, topk_weights, x_scales, return_recv_hook)
        if result is not None:
            return result
        self.check_usable()
        return _dispatch.dispatch(self, x, topk_idx, topk_weights, x_scales, return_recv_hook, True)

    def combine(self, expert_y: torch.Tensor, handle: DispatchResult, return_recv_hook: bool = False, *,
                topk_weights: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None):
        """Weighted sum of the expert outputs back on each token's rank.

        Args:
            expert_y: bfloat16, the layout and shape of ``handle.expert_x``; only the first
                ``expert_counts[e]`` rows of each expert are read (rows layout: rows ``< num_recv``,
                each already reduced over its local experts by the caller).
            handle: the latest ``DispatchResult`` of this buffer.
            return_recv_hook: issue only the send half now and return ``(out, hook)``; ``out`` is
                valid after ``hook()`` (as for ``dispatch``).
            topk_weights: masked/packed: ``[T, K]`` float32 on ``group.device`` (T of the dispatch):
                the weights to apply instead of those given to dispatch (combine-time weights, as
                DeepEP's low-latency combine takes them); each source pushes them to the expert
                owners first, so the combine waits one more flag per peer. Node peers only:
                ``ValueError`` with other nodes. Rows layout: float32 ``[R*max_tokens, K]`` per
                received row (rows ``< num_recv`` read); their sums over ranks come back with ``out``.
            out: optional ``[T, H]`` bfloat16 contiguous tensor on the buffer's device to write the
                result into (it is returned), saving an allocation per call; it must not overlap
                ``expert_y`` (``ValueError``), and it is written on the current stream when the combine runs, so it
                must stay alive (and unread by other streams) until then. A float32 ``out`` gets the
                float32 sum itself, not rounded (for a caller that adds a bias or a residual before
                the one rounding to bf16). Default: a new bfloat16 tensor.
        Returns:
            ``[T, H]`` bfloat16 (or the float32 ``out``): masked/packed
            ``out[t] = sum_k w[t,k] * y(t, topk_idx[t,k])`` (float32 sum, one rounding per owner); rows: ``out[t] = sum over the ranks that received t of
            expert_y[its row there]`` (no weights applied; summed in float32, rounded once); 0 for
            tokens sent nowhere. Rows with ``topk_weights``: ``(out, w)``, ``w`` float32 ``[T, K]`` the
            sum over ranks of the rows' ``topk_weights``. With ``return_recv_hook``: ``(that, hook)``.
        """
        # the eager fast path: a call like the latest replayed one of its kind (combine.replayed)
        result = _combine.replayed(self, expert_y, handle, out, topk_weights, return_recv_hook)
        if result is not None:
            return result
        self.check_usable()
        return _combine.combine(self, expert_y, handle, return_recv_hook, topk_weights, out, True)

    def synchronize(self) -> None:
        """Waits for this buffer's work on the device, then raises any error a kernel recorded."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.check_usable()

    def check_usable(self) -> None:
        """Raises where this buffer can take no call: closed (``RuntimeError``), broken by an
        earlier error (``BufferBrokenError``), or with an error a kernel or the proxy recorded
        since (``CommTimeoutError`` naming rank, peer and phase, ``CapacityError``, ``ValueError``
        for expert ids out of range), which then breaks it. Reads host memory only: no device sync,
        so an error of work still queued shows at a later call or at ``synchronize()``."""
        calls = self.calls
        if calls.closed:
            raise RuntimeError("EPBuffer is closed")
        if calls.broken is not None:
            raise BufferBrokenError(f"this buffer is unusable after an earlier error: {calls.broken}")
        if calls.error_code() != 0:
            calls.broken = self._error_from_record()
            raise calls.broken
        if self.remote is not None:
            try:
                self.remote.check()  # the proxy's record and the remote kernels' (host memory, no sync)
            except Exception as exc:  # noqa: BLE001
                calls.fail(exc)

    def close(self) -> None:
        """Releases the workspace and the proxy (after the device is done with them)."""
        if self.calls.closed:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.remote is not None:
            self.remote.close(self.calls.broken)  # the peers learn this rank's error, if any
        self.workspace.close()
        self.calls.closed = True

    def __enter__(self) -> "EPBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def memory(self) -> MemoryPlan:
        """What this rank's buffer holds, per region (the regions of ``moe_ep.memory_plan``): each
        allocation's live tensor, its storage's bytes and where it lives (``"device"``: the GPU;
        ``"pinned host"``; ``"host"``: CPU ranks' memory, numpy arrays). ``RuntimeError`` once closed."""
        if self.calls.closed:
            raise RuntimeError("EPBuffer is closed")
        entries = {}
        for key, a in self._allocs.items():
            t = self
            for part in key.split("."):  # an attribute path: "hist", "workspace.local", "remote.regions.round1"
                t = t[part] if isinstance(t, dict) else getattr(t, part)
            entries[key] = (a.region, t.untyped_storage().nbytes(), where_of(t))
        return MemoryPlan.of(entries)

    def launch_options(self, kernel: str) -> dict:
        """The compile options of this buffer's ``kernel`` launch ("dispatch" or "combine"):
        ``num_warps``, and ``maxnreg`` where it has a register budget (not under the interpreter)."""
        if kernel == "dispatch":
            warps, maxnreg = self.num_warps, self.dispatch_maxnreg
        elif kernel == "combine":
            warps, maxnreg = self.combine_warps or self.num_warps, self.combine_maxnreg
        else:
            raise ValueError(f"kernel: expected 'dispatch' or 'combine', got {kernel!r}")
        return compile_options(warps, "" if self.interp else maxnreg)

    # ------------------------------------------------------------------ internals
    def _signature(self, private_capacity: Optional[int], overflow_capacity: Optional[int],
                   expert_capacity: Optional[int], tuning: Tuning) -> dict:
        """What every rank must agree on, by argument name (``moe_ep.agreement``): the arguments,
        and the ``tuning`` knobs that change what peers read (``tuning.<field>``): ``max_chunks``
        sizes the workspace's chunk flags and the chunking a receiver reads a source's header by;
        ``split`` whether a call is one launch or two halves."""
        remote = self.group.node_size < self.world_size
        return dict(num_experts=self.num_experts, hidden=self.hidden, max_tokens=self.max_tokens, topk=self.topk,
                    dispatch_dtype=str(self.dispatch_dtype), combine_dtype=str(self.combine_dtype),
                    layout=self.layout, expert_alignment=self.expert_alignment, num_programs=self.num_programs,
                    node_size=self.group.node_size, device_type=self.device.type,
                    private_capacity=private_capacity, overflow_capacity=overflow_capacity,
                    expert_capacity=expert_capacity, transport=os.environ.get("MOE_EP_TRANSPORT", "auto") if remote else None,
                    **{f"tuning.{name}": getattr(tuning, name) for name in LAYOUT_KNOBS})

    def _start_remote(self):
        from .internode.path import RemotePath

        rp = RemotePath(self)
        if self.device.type == "cuda":
            mib = sum(int(r.numel()) for r in rp.regions.values()) / 2**20
            _log.log(logging.INFO if self.rank == 0 else logging.DEBUG,
                     "moe_ep rank %d proxy regions (%.1f MiB, %s transport): rows in %s memory (%s); headers and "
                     "mailbox in pinned host memory", self.rank, mib, rp.proxy.engine.transport,
                     "GPU" if rp.memory == "gpu" else "pinned host", rp.memory_why)
        return rp

    def _error_from_record(self) -> BaseException:
        code, peer, phase, epoch, detail = (int(v) for v in self._err_host[:5])
        phase_name = Phase.text_of(phase)
        if code == ErrorCode.TIMEOUT:
            return CommTimeoutError(self.rank, peer, phase_name, epoch, self.timeout_s)
        if code == ErrorCode.BAD_EXPERT:
            return ValueError(f"topk_idx: {detail} expert ids outside [-1, {self.num_experts}) in {phase_name} "
                              f"epoch {epoch} (treated as -1; nothing was written out of bounds)")
        if code == ErrorCode.CAPACITY:  # peer: the rank that overflowed (this one, or a node peer); detail: expert << 32 | rows
            where = "this rank" if peer == self.rank else f"rank {peer}"
            return CapacityError(f"rank {self.rank}: expert {detail >> 32} on {where} received {detail & 0xFFFFFFFF} "
                                 f"rows in {phase_name} epoch {epoch}, more than the masked layout holds "
                                 f"({self.capacity} per expert); with the default capacity only possible when tokens "
                                 f"list an expert more than once. Use layout='packed' or a larger expert_capacity.")
        if code == ErrorCode.PROXY and self.remote is not None:  # the wait kernel saw the proxy's error record
            try:
                self.remote.proxy.check_error()
            except Exception as exc:  # noqa: BLE001
                return exc
        return RuntimeError(f"moe_ep kernel error code {code}")
