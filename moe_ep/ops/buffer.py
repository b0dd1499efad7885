"""EPBuffer: the communication buffer of one MoE layer shape, and its dispatch/combine calls;
BufferSet: the buffers of one owner, each made on first use, closed together."""
from __future__ import annotations

import logging
import math
from operator import attrgetter
from typing import Callable, Dict, Hashable, Optional

import torch

from . import combine as _combine
from ..core import settings
from . import dispatch as _dispatch
from ..core.agreement import collective_init
from .buffer_memory import BufferMemory
from .calls import CallState, Parts
from ..core.group import EPGroup
from .result import DispatchResult
from ..core.interpret import interpreting, speed_up
from .sizing import BufferShape, MemoryPlan, size_text
from ..core.tuning import CombineShape, Tuning, combine_shape  # noqa: F401 (CombineShape, combine_shape: their old home)

_log = logging.getLogger("moe_ep")
MAX_TIMEOUT_S = 1e6  # the longest deadline accepted (about 11.6 days); there is no "no deadline"
# The Tuning fields every rank must agree on (the rest shape only a rank's own launches).
LAYOUT_KNOBS = ("max_chunks", "split")


def _part(path: str) -> property:
    """A read-only ``EPBuffer`` attribute that is one of its parts' (``EPBuffer.parts``):
    ``_part("shape.hidden")`` reads ``buffer.parts.shape.hidden`` (a C getter: as cheap as a plain
    attribute read, which the per-call wrappers of ``moe_ep.deep_ep`` rely on)."""
    return property(attrgetter("parts." + path), doc=f"``parts.{path}`` (read-only)")


class EPBuffer:
    """Buffers and kernels for expert-parallel dispatch and combine of one layer shape.

    Args:
        group: the ``EPGroup``; rank r owns experts ``[r*E/R, (r+1)*E/R)``.
        num_experts: E, a multiple of R.
        hidden: H, a multiple of 16.
        max_tokens: the most tokens any rank passes to one dispatch.
        topk: K, selections per token.
        dispatch_dtype: ``torch.bfloat16`` or ``torch.float8_e4m3fn`` (quantized in-kernel,
            float32 scale per 128 channels, see ``moe_ep.core.fp8``).
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
            headroom, ``moe_ep.internode.spec.default_private_capacity``); the rest goes in round 2.
        overflow_capacity: with other nodes: rows of this rank's overflow region, one window of
            the round-2 rows it takes from all remote sources; a dispatch bringing more crosses
            in as many windows as it needs (one credit round trip each), so no batch is refused
            (default: what ``overflow_budget_bytes`` holds; 0 refuses every overflowing batch
            with ``CapacityError`` on every rank).
        overflow_budget_bytes: with other nodes: bytes of the overflow region (two parity copies)
            when ``overflow_capacity`` is not given (default 128 MiB,
            ``moe_ep.internode.spec.DEFAULT_OVERFLOW_BUDGET``; at most what could ever overflow).
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
        max_recv_rows: packed and rows layouts: how ``expert_x`` (and fp8 ``expert_scales``; rows
            layout also ``recv_topk_idx``, ``recv_topk_weights``, ``recv_src``) is sized.
            ``None`` (default): per call, to exactly the rows the dispatch brings (packed
            ``offsets[-1]``, rows ``num_recv``),
            read on the host between its send and receive halves (one host sync a dispatch, as
            DeepEP's normal mode without ``num_worst_tokens``; a cached tensor grown when a call
            needs more); under CUDA graph capture, where no host read may happen, the worst case
            instead. An int: a cap, allocated once, no host sync (CUDA-graph safe); a dispatch
            needing more rows writes none past it and raises ``CapacityError`` naming the rank,
            the rows needed (packed: and the expert) (the buffer is then broken, like any kernel
            error). ``"worst"``: allocated once for every row that can come, packed
            ``R*max_tokens*topk + E_local*(expert_alignment - 1)`` (a token may list one expert
            several times), rows ``R*max_tokens``, no sync, never over.
        tuning: how the kernels are launched (warps, tiles, chunks, ...: ``moe_ep.Tuning``; its
            ``None`` fields take the measured rules). Default ``Tuning.from_env()``: the
            ``MOE_EP_*`` tuning variables, kept for one release. ``buffer.tuning`` holds the values
            taken (a ``moe_ep.core.tuning.ResolvedTuning``).

    All calls on one buffer must be issued on one CUDA stream (the current one), in the same
    order on every rank. Construction is collective: every rank passes the same arguments (checked,
    ``ValueError`` naming the argument and each rank's value); a rank whose arguments are refused
    makes every rank raise (naming it), and one that does not arrive within ``timeout_s`` gives
    ``CommTimeoutError`` (``moe_ep.core.agreement``).

    Memory: every allocation is sized by ``moe_ep.ops.sizing.BufferShape`` (the buffer's ``sizes``);
    ``moe_ep.memory_plan`` gives its bytes per region before construction, ``memory()`` from the
    live tensors after, and rank 0's log line (logger ``moe_ep``, INFO) states the total.

    Attributes: ``group``; the arguments as taken (``num_experts``, ``hidden``, ``max_tokens``,
    ``topk``, ``dispatch_dtype``, ``combine_dtype``, ``layout``, ``expert_alignment``,
    ``num_programs``, ``timeout_s``) and ``rank``, ``world_size``, ``node_size``, ``device``,
    ``num_local_experts``; ``sizes`` (the ``BufferShape``), ``tuning`` (the ``ResolvedTuning``),
    ``workspace`` (the node memory), ``remote`` (the inter-node path, or None) and ``calls``
    (``moe_ep.ops.calls.CallState``). They are read from ``parts`` (``moe_ep.ops.calls.Parts``: shape,
    launch shape, memory, call state), which ``moe_ep.ops.dispatch`` and ``moe_ep.ops.combine`` take.
    """

    group: EPGroup
    parts: Parts
    sizes = _part("shape")
    rank = _part("rank")
    timeout_s = _part("timeout_s")
    tuning = _part("tuning")
    calls = _part("calls")
    device = _part("memory.device")
    workspace = _part("memory.workspace")
    remote = _part("memory.remote")
    world_size = _part("shape.world_size")
    node_size = _part("shape.node_size")
    num_experts = _part("shape.num_experts")
    num_local_experts = _part("shape.num_local_experts")
    hidden = _part("shape.hidden")
    max_tokens = _part("shape.max_tokens")
    topk = _part("shape.topk")
    dispatch_dtype = _part("shape.dispatch_dtype")
    combine_dtype = _part("shape.combine_dtype")
    layout = _part("shape.layout")
    expert_alignment = _part("shape.expert_alignment")
    num_programs = _part("shape.num_programs")

    @collective_init("EPBuffer")
    def __init__(self, group: EPGroup, num_experts: int, hidden: int, max_tokens: int, topk: int,
                 dispatch_dtype: torch.dtype = torch.bfloat16, combine_dtype: torch.dtype = torch.bfloat16,
                 layout: str = "masked", expert_alignment: int = 1, timeout_s: float = 30.0,
                 num_programs: Optional[int] = None, private_capacity: Optional[int] = None,
                 overflow_capacity: Optional[int] = None, expert_capacity: Optional[int] = None,
                 column_major_scales: bool = False, proxy_memory: str = "auto", tuning: Optional[Tuning] = None,
                 max_recv_rows=None, overflow_budget_bytes: Optional[int] = None):
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
        # The arguments that size memory, checked; every allocation is sized by it (moe_ep.ops.sizing).
        shape = BufferShape(world_size=R, node_size=G, num_experts=num_experts, hidden=hidden,
                            max_tokens=max_tokens, topk=topk, num_programs=num_programs,
                            dispatch_dtype=dispatch_dtype, combine_dtype=combine_dtype, layout=layout,
                            expert_alignment=expert_alignment, expert_capacity=expert_capacity,
                            column_major_scales=column_major_scales, private_capacity=private_capacity,
                            overflow_capacity=overflow_capacity, overflow_budget_bytes=overflow_budget_bytes,
                            proxy_memory=proxy_memory, device_type=group.device.type, max_chunks=tuning.max_chunks,
                            max_recv_rows=max_recv_rows)
        if not (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool) and math.isfinite(timeout_s)
                and 0 < timeout_s <= MAX_TIMEOUT_S):
            raise ValueError(f"timeout_s: expected a finite number of seconds in (0, {MAX_TIMEOUT_S:g}] (every wait "
                             f"has a deadline), got {timeout_s!r}")
        timeout_s = float(timeout_s)
        interp = interpreting()
        if interp:
            speed_up()
        if group.device.type == "cpu" and not interp:
            raise RuntimeError("moe_ep on CPU runs its Triton kernels in the interpreter: set TRITON_INTERPRET=1 "
                               "before importing triton")
        # The launch shape: each knob the tuning sets, else its measured rule (moe_ep.core.tuning).
        launch_shape = tuning.resolve(shape, sms)
        # Every rank's arguments must agree before any memory is touched (program p serves chunks
        # p, p+P, ... on every rank, so num_programs too).
        self._agreement.agree(self._signature(shape, tuning), timeout_s)
        self.group = group
        memory = BufferMemory(group, shape, timeout_s)
        # What dispatch and combine keep from call to call: launch plans, replays, serial, epochs,
        # a pending receive hook, whether the buffer is usable (moe_ep.ops.calls). The fields every
        # DispatchResult of this buffer shares are its memory's (DispatchResult.issued; not the
        # buffer itself: no reference cycle, so a deleted buffer frees its memory at once).
        calls = CallState(group.device, memory.err, memory.workspace.local, timeout_s, memory.result_fields(),
                          memory.remote.proxy_error_address() if memory.remote is not None else None,
                          graph_launch=self._graph_launch(tuning, memory, interp))
        self.parts = Parts(shape=shape, tuning=launch_shape, memory=memory, calls=calls,
                           rank=group.rank, timeout_s=timeout_s, interp=interp)
        self._agreement.done(timeout_s)
        if self.rank == 0:
            mem = self.memory()
            _log.info("moe_ep buffer: %d ranks, nodes of %d, node memory %s (%s), %d programs; %s a rank (device "
                      "%s, host %s; per region: buffer.memory())", R, G, memory.workspace.backend, memory.workspace.why,
                      num_programs, size_text(mem.total_bytes), size_text(mem.device_bytes),
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
        parts = self.parts
        result = _dispatch.replayed(parts, self, x, topk_idx, topk_weights, x_scales, return_recv_hook)
        if result is not None:
            return result
        return _dispatch.dispatch(parts, self, x, topk_idx, topk_weights, x_scales, return_recv_hook, True)

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
                ``ValueError`` with other nodes. Rows layout: float32 ``[rows of expert_x, K]`` per
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
        parts = self.parts
        result = _combine.replayed(parts, self, expert_y, handle, out, topk_weights, return_recv_hook)
        if result is not None:
            return result
        return _combine.combine(parts, self, expert_y, handle, return_recv_hook, topk_weights, out, True)

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
        self.parts.check_usable()

    def close(self) -> None:
        """Releases the workspace and the proxy (after the device is done with them)."""
        calls = self.parts.calls
        if calls.closed:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.parts.memory.close(calls.broken)  # the peers learn this rank's error, if any
        calls.closed = True

    def __enter__(self) -> "EPBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def memory(self) -> MemoryPlan:
        """What this rank's buffer holds, per region (the regions of ``moe_ep.memory_plan``): each
        allocation's live tensor, its storage's bytes and where it lives (``"device"``: the GPU;
        ``"pinned host"``; ``"host"``: CPU ranks' memory, numpy arrays). ``RuntimeError`` once closed."""
        if self.parts.calls.closed:
            raise RuntimeError("EPBuffer is closed")
        return self.parts.memory.plan()

    def launch_options(self, kernel: str) -> dict:
        """The compile options of this buffer's ``kernel`` launch ("dispatch" or "combine"):
        ``num_warps``, and ``maxnreg`` where it has a register budget (not under the interpreter)."""
        return self.parts.launch_options(kernel)

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _graph_launch(tuning: Tuning, memory: BufferMemory, interp: bool) -> bool:
        """Whether replays of two launches or more go as one CUDA graph launch: ``tuning.graph_launch``,
        where None means across nodes (docs/ARCHITECTURE.md, *Launch graphs*); GPUs only, never
        under the interpreter (its host waits sit between the halves)."""
        on = tuning.graph_launch if tuning.graph_launch is not None else memory.remote is not None
        return on and memory.device.type == "cuda" and not interp

    @staticmethod
    def _signature(shape: BufferShape, tuning: Tuning) -> dict:
        """What every rank must agree on, by argument name (``moe_ep.core.agreement``): the arguments as
        given (``num_programs`` resolved), and the ``tuning`` knobs that change what peers read
        (``tuning.<field>``): ``max_chunks`` sizes the workspace's chunk flags and the chunking a
        receiver reads a source's header by; ``split`` whether a call is one launch or two halves."""
        remote = shape.node_size < shape.world_size
        return dict(num_experts=shape.num_experts, hidden=shape.hidden, max_tokens=shape.max_tokens, topk=shape.topk,
                    dispatch_dtype=str(shape.dispatch_dtype), combine_dtype=str(shape.combine_dtype),
                    layout=shape.layout, expert_alignment=shape.expert_alignment, num_programs=shape.num_programs,
                    node_size=shape.node_size, device_type=shape.device_type,
                    private_capacity=shape.private_capacity, overflow_capacity=shape.overflow_capacity,
                    overflow_budget_bytes=shape.overflow_budget_bytes, expert_capacity=shape.expert_capacity,
                    max_recv_rows=shape.max_recv_rows,
                    transport=(settings.value("MOE_EP_TRANSPORT") or "auto") if remote else None,
                    **{f"tuning.{name}": getattr(tuning, name) for name in LAYOUT_KNOBS})


class BufferSet:
    """``EPBuffer``s by key, each made on first use (``get``; making one is collective, so every
    rank asks for the same keys in the same order) and closed together (``close``)."""

    def __init__(self):
        self._made: Dict[Hashable, EPBuffer] = {}

    def get(self, key: Hashable, make: Callable[[], EPBuffer]) -> EPBuffer:
        """The buffer of ``key``, made by ``make()`` on the first call with it."""
        buf = self._made.get(key)
        if buf is None:
            buf = self._made[key] = make()
        return buf

    def close(self) -> None:
        """Closes every buffer made so far; later ``get`` calls make new ones."""
        for buf in self._made.values():
            buf.close()
        self._made.clear()
