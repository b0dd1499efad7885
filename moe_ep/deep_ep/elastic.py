"""``ElasticBuffer``: DeepEP V2's expert-parallel buffer (``deep_ep.ElasticBuffer``) on moe_ep's rows
layout, with its ``EPHandle``.

Both of DeepEP V2's layouts come from one rows dispatch (one row per (source token, this rank), in
ascending (source rank, source token) order, with the token's local top-k ids and weights):
``do_expand=False`` returns those rows; ``do_expand=True`` copies each (row, k) with a local expert
into that expert's block (blocks start at multiples of ``expert_alignment``; within a block rows
keep the ascending source order), as DeepEP's receiver expands them (one row per rank on the wire
either way). Combine folds an expanded input back to one row per received row (float32 sum over
k, rounded to bf16), then the rows combine sums over ranks in float32 and rounds once: two
roundings, what DeepEP calls ``allow_multiple_reduction``. Neither combine multiplies by weights
(as DeepEP's): ``topk_weights`` only come back summed, as ``combined_topk_weights``.

One rows EPBuffer per (experts, hidden, top-k, dtype) serves every ``num_max_tokens_per_rank`` up
to the constructor's (the token count is a runtime value of moe_ep's kernels: nothing is compiled
per token cap). ``do_cpu_sync=False`` returns worst-case shapes (``R * num_max_tokens_per_rank``
rows; expanded: ``R * num_max_tokens_per_rank * K + E_local * (expert_alignment - 1)``) with no host
step: rows past the received count have ids -1 and weights 0.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..core import settings
from ..core.interpret import interpreting
from ..ops.sizing import memory_plan
from ..core.tuning import Tuning
from . import normal as _normal
from .buffer import FP8, Buffer, rows_buffer_tokens
from .event import EventHandle, EventOverlap, stream_wait
from .routing import check_topk_idx

_ALIGN_BYTES = 2 << 20  # DeepEP's buffer sizes are multiples of 2 MiB


def _align(v: int, a: int) -> int:
    return -(-v // a) * a


def _int(name: str, v: Any, lo: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")
    return v


def _planned_bytes(R: int, G: int, device: torch.device, ranks_per_device: int, M: int, H: int, K: int, fp8: bool,
                   tuning: Optional[Tuning]) -> int:
    """Bytes (2 MiB-aligned, DeepEP's unit) of the rows buffer a dispatch of ``M`` tokens per rank,
    hidden ``H`` and top-``K`` makes for ``R`` ranks in nodes of ``G`` (``ranks_per_device`` sharing
    a GPU): ``moe_ep.memory_plan``'s total, which across nodes holds the proxy's regions. ``K`` 0
    plans for 32 (as DeepEP); ``M`` or ``H`` 0: the 2 MiB minimum (sizes come with the dispatch)."""
    if M < 1 or H < 1:
        return _ALIGN_BYTES
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    plan = memory_plan(world_size=R, node_size=G, num_experts=R, hidden=_align(H, 16), max_tokens=rows_buffer_tokens(M),
                       topk=K or 32, dispatch_dtype=FP8 if fp8 else torch.bfloat16, layout="rows",
                       num_programs=max(1, sms // ranks_per_device), device=device.type, tuning=tuning,
                       max_recv_rows="worst")  # as the dispatch's buffer (no CPU sync: R * M rows)
    return _align(plan.total_bytes, _ALIGN_BYTES)


class EPHandle:
    """What ``ElasticBuffer.dispatch`` returns and ``combine`` (or a cached ``dispatch``) takes.

    DeepEP's fields (on the buffer's device unless said):
        do_expand, num_experts, expert_alignment, num_max_tokens_per_rank, num_sms.
        topk_idx: int64 ``[T, K]``, the dispatch's ids (a copy with ``do_handle_copy``).
        num_recv_tokens: received rows (host int; ``R * num_max_tokens_per_rank`` without CPU sync).
        num_expanded_tokens: rows of an expanded ``recv_x`` (host int; 0 when not expanded).
        num_recv_tokens_per_expert_list: per local expert its selections rounded up to
            ``expert_alignment`` (host list; empty without CPU sync).
        psum_num_recv_tokens_per_scaleup_rank: int32 ``[S]`` (S = ``num_scaleup_ranks``: ranks per
            node, or every rank without hybrid mode): inclusive prefix sum of the rows received from
            source ranks ``s`` with ``s % S == i`` (DeepEP's hybrid mode forwards them through that
            peer of this node); the last element is the received row count.
        psum_num_recv_tokens_per_expert: int32 ``[E_local]``: not expanded, the inclusive prefix sum
            of the aligned counts; expanded, expert ``i``'s block start plus its count.
        num_unaligned_recv_tokens_per_expert: int32 ``[E_local]``, expanded only (else None).
        recv_src_metadata: int32 ``[rows, 2 + K]``: column 0 ``source rank * num_max_tokens_per_rank
            + source token`` (-1 past the received count), 1 the row, ``2 + k`` the expanded row of
            the row's k-th selection (-1: none, or not expanded).
        dst_buffer_slot_idx, token_metadata_at_forward, channel_linked_list: None (moe_ep keeps
            its routing state in its buffer).
    """

    def __init__(self, **fields: Any) -> None:
        self.dst_buffer_slot_idx = self.token_metadata_at_forward = self.channel_linked_list = None
        self.num_unaligned_recv_tokens_per_expert = None
        self.__dict__.update(fields)


class ElasticBuffer:
    """DeepEP V2's ``ElasticBuffer`` for expert-parallel dispatch and combine, on moe_ep.

    Args (DeepEP's; "tuning" ones are accepted, kept and change nothing):
        group: the torch ``ProcessGroup`` of the EP ranks.
        num_bytes: accepted (moe_ep sizes its buffer per call shape); None: set to the bytes of the
            rows buffer the first dispatch of these sizes makes (``moe_ep.memory_plan``, 2 MiB-aligned;
            across nodes with the proxy's regions).
        num_allocated_qps, sl_idx, prefer_overlap_with_compute, use_fp8_dispatch,
            allow_multiple_reduction: tuning (combine always reduces in the rank, then across ranks).
        allow_hybrid_mode: DeepEP's logical domains (``get_logical_domain_size``,
            ``scaleup_rank_idx``, the handle's ``psum_num_recv_tokens_per_scaleup_rank``): True,
            one scale-up domain per node (moe_ep's nodes); False, one of every rank (DeepEP's direct
            mode). The path is moe_ep's either way (node peers by stores, other nodes through the
            proxy); it also picks DeepEP's QP rule (``get_theoretical_num_qps``).
        num_max_tokens_per_rank: the most tokens a rank passes to one dispatch (0: given per call).
        hidden, num_topk: sizes of the calls (used for ``num_bytes`` when it is None).
        deterministic: accepted (moe_ep's received order is always the ascending source order).
        num_cpu_bytes: Engram's host storage: not implemented (> 0 raises ``NotImplementedError``).
        num_gpu_timeout_secs: moe_ep's deadline for every wait on a peer (``CommTimeoutError``).
        num_cpu_timeout_secs: kept (the host waits on nothing longer than the device waits).
        explicitly_destroy: as DeepEP: ``destroy()`` is allowed only when set.
        tuning: the ``moe_ep.Tuning`` of the EPBuffers underneath (default ``Tuning.from_env()``);
            not a DeepEP argument.
    """

    def __init__(self, group: dist.ProcessGroup, num_bytes: Optional[int] = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True, sl_idx: int = 3,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False, tuning: Optional[Tuning] = None) -> None:
        if num_cpu_bytes:
            raise NotImplementedError(f"num_cpu_bytes={num_cpu_bytes!r}: not implemented by moe_ep.deep_ep (Engram's "
                                      f"host storage)")
        for name, v in (("num_max_tokens_per_rank", num_max_tokens_per_rank), ("hidden", hidden),
                        ("num_topk", num_topk), ("num_allocated_qps", num_allocated_qps), ("sl_idx", sl_idx)):
            _int(name, v)
        if num_bytes is not None:
            _int("num_bytes", num_bytes)
        if not isinstance(num_gpu_timeout_secs, (int, float)) or num_gpu_timeout_secs <= 0:
            raise ValueError(f"num_gpu_timeout_secs: expected a positive number of seconds, got "
                             f"{num_gpu_timeout_secs!r}")
        self._v1 = Buffer(group, explicitly_destroy=True, timeout_s=float(num_gpu_timeout_secs), tuning=tuning)
        self.group, self.ep_group = group, self._v1.ep_group
        self.rank_idx, self.num_ranks = self._v1.rank, self._v1.group_size
        self.device = self._v1.device
        node = self.ep_group.node_size
        # DeepEP's domains: physical (nodes, ranks per node); logical the same in hybrid mode, else
        # one scale-up domain of every rank (its direct mode)
        self.num_rdma_ranks, self.num_nvlink_ranks = self.num_ranks // node, node
        up = node if allow_hybrid_mode else self.num_ranks
        self.num_scaleout_ranks, self.num_scaleup_ranks = self.num_ranks // up, up
        self.scaleout_rank_idx, self.scaleup_rank_idx = self.rank_idx // up, self.rank_idx % up
        self.num_max_tokens_per_rank, self.hidden, self.num_topk = num_max_tokens_per_rank, hidden, num_topk
        self.use_fp8_dispatch, self.deterministic = use_fp8_dispatch, deterministic
        self.allow_hybrid_mode, self.allow_multiple_reduction = allow_hybrid_mode, allow_multiple_reduction
        self.prefer_overlap_with_compute, self.sl_idx = prefer_overlap_with_compute, sl_idx
        self.num_allocated_qps = num_allocated_qps or (65 if allow_hybrid_mode else 17)
        self.num_cpu_timeout_secs, self.num_gpu_timeout_secs = num_cpu_timeout_secs, num_gpu_timeout_secs
        self.explicitly_destroy = explicitly_destroy
        g = self.ep_group
        self.num_bytes = num_bytes if num_bytes is not None else _planned_bytes(
            g.world_size, g.node_size, g.device, g.ranks_per_device, num_max_tokens_per_rank, hidden, num_topk,
            use_fp8_dispatch, self._v1.tuning)
        self.runtime = self  # DeepEP's C++ runtime handle: not None until destroy()

    # ------------------------------------------------------------------ DeepEP's static API
    @staticmethod
    def get_buffer_size_hint(group: dist.ProcessGroup, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """The bytes (2 MiB-aligned) of the rows buffer a dispatch of these sizes makes, for nodes of
        ``MOE_EP_NODE_SIZE`` ranks (one node when unset; an ``ElasticBuffer``'s ``num_bytes`` knows
        its group's nodes). Informational: moe_ep sizes its own buffers."""
        R = group.size()
        dev = torch.device("cuda" if torch.cuda.is_available() and not interpreting() else "cpu")
        return _planned_bytes(R, settings.node_size() or R, dev, 1, num_max_tokens_per_rank, hidden, num_topk,
                              use_fp8_dispatch, None)

    @staticmethod
    def capture() -> EventHandle:
        """An ``EventHandle`` on the current stream (complete on CPU)."""
        return EventHandle()

    def get_comm_stream(self):
        """The stream calls run on (None on CPU)."""
        return self._v1.get_comm_stream()

    def get_logical_domain_size(self) -> Tuple[int, int]:
        """``(nodes, ranks per node)``: moe_ep's nodes are DeepEP's scale-out and scale-up domains."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_physical_domain_size(self) -> Tuple[int, int]:
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """Tuning: the programs moe_ep's kernels launch (the SM count on a GPU, 4 on CPU ranks)."""
        if self.device.type == "cuda":
            return torch.cuda.get_device_properties(self.device).multi_processor_count
        return 4

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """Tuning: DeepEP's rule (``num_sms * 16 + 1`` hybrid, else at most 9), capped by
        ``num_allocated_qps``."""
        return min(num_sms * 16 + 1 if self.allow_hybrid_mode else min(num_sms, 9), self.num_allocated_qps)

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """Every rank's work queued so far on its device (every stream) is done before any rank's
        later work starts: a device sync, then a process-group barrier. DeepEP's barrier orders the
        streams with a GPU kernel; moe_ep's waits on the host (as DeepEP's ``with_cpu_sync=True``),
        whatever the arguments say."""
        self._check_alive()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.ep_group.barrier()

    def destroy(self) -> None:
        """Releases the buffers (only with ``explicitly_destroy=True``, as in DeepEP)."""
        if not self.explicitly_destroy:
            raise RuntimeError("destroy: the ElasticBuffer was made with explicitly_destroy=False (as in DeepEP, "
                               "destroy() needs explicitly_destroy=True)")
        if self.runtime is not None:
            self._v1.destroy()
            self.runtime = None

    def __getattr__(self, name: str):
        if name.startswith(("engram_", "pp_", "agrs_")) or name in ("all_gather", "create_agrs_session",
                                                                  "destroy_agrs_session"):
            raise NotImplementedError(f"ElasticBuffer.{name}: not implemented by moe_ep.deep_ep (DeepEP V2's "
                                      f"experimental Engram / pipeline-parallel / all-gather-reduce-scatter calls)")
        raise AttributeError(name)

    # ------------------------------------------------------------------ dispatch / combine
    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                 num_experts: Optional[int] = None, num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event: Optional[EventHandle] = None,
                 previous_event_before_epilogue: Optional[EventHandle] = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None, do_handle_copy: bool = True, do_cpu_sync: Optional[bool] = None,
                 do_expand: bool = False, do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False):
        """DeepEP V2's dispatch: ``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``.

        ``x``: bfloat16 ``[T, H]``, or ``(float8_e4m3fn [T, H], scales [T, H/128])`` with float32
        scales or int32 packs (four UE8M0 bytes, MXFP8 as vLLM packs them): the scales travel bit
        for bit. ``topk_idx`` int64 ``[T, K]`` (-1: none; a token may list an expert twice: it gets
        two selections), ``topk_weights`` float32 ``[T, K]`` or None. Not expanded: ``recv_x
        [rows, H]`` one row per (source token, this rank) in ascending source order,
        ``recv_topk_idx`` int64 ``[rows, K]`` local ids (-1 elsewhere), ``recv_topk_weights``
        float32 ``[rows, K]``. Expanded: ``recv_x [N, H]`` grouped per local expert,
        ``recv_topk_idx`` None, ``recv_topk_weights`` float32 ``[N]``; scales ``[N, H/128]``
        (column-major with ``use_tma_aligned_col_major_sf``). With ``handle`` (cached): the
        handle's routing again (``topk_idx`` None; ``topk_weights`` optional, else the handle's).
        ``do_cpu_sync`` (default True, False with a handle): read the counts on the host once for
        exact shapes; False: worst-case shapes, nothing waits on the host (module docstring).
        ``num_sms``, ``num_qps``, ``allocate_on_comm_stream``: tuning. ``event``: holds an event
        only with ``async_with_compute_stream``.
        """
        self._check_alive()
        _int("num_sms", num_sms)
        _int("num_qps", num_qps)
        x, sf, sf_int = self._unpack_x(x)
        if handle is not None:
            if not isinstance(handle, EPHandle):
                raise TypeError(f"handle: expected an EPHandle of ElasticBuffer.dispatch, got {type(handle).__name__}")
            if topk_idx is not None:
                raise ValueError("topk_idx: a cached dispatch (handle given) takes none; it repeats the handle's")
            if do_cpu_sync:
                raise ValueError("do_cpu_sync: a cached dispatch (handle given) does not sync (as in DeepEP)")
            for name, v, h in (("num_experts", num_experts, handle.num_experts),
                               ("expert_alignment", expert_alignment, handle.expert_alignment),
                               ("num_max_tokens_per_rank", num_max_tokens_per_rank, handle.num_max_tokens_per_rank),
                               ("do_expand", do_expand, handle.do_expand)):
                if v is not None and v != h and not (name == "do_expand" and v is False and h is False):
                    raise ValueError(f"{name}: {v!r} differs from the handle's {h!r}")
            num_experts, expert_alignment = handle.num_experts, handle.expert_alignment
            num_max_tokens_per_rank, do_expand = handle.num_max_tokens_per_rank, handle.do_expand
            topk_idx = handle.topk_idx
            if topk_weights is None:
                topk_weights = handle._weights
            if x.shape[0] != topk_idx.shape[0]:
                raise ValueError(f"x: expected the {topk_idx.shape[0]} tokens of the handle's dispatch, got "
                                 f"{x.shape[0]}")
            do_cpu_sync = False
        M = self._tokens_cap(num_max_tokens_per_rank)
        align = _int("expert_alignment", 1 if expert_alignment is None else expert_alignment, 1)
        sync = True if do_cpu_sync is None else bool(do_cpu_sync)
        if not isinstance(num_experts, int) or isinstance(num_experts, bool):
            raise ValueError(f"num_experts: expected an int (the number of all experts), got {num_experts!r}")
        self._v1._check_experts(num_experts)
        T, H = x.shape
        if T > M:
            raise ValueError(f"x: {T} tokens, more than num_max_tokens_per_rank={M}")
        check_topk_idx("topk_idx", topk_idx, num_experts, self.device, num_tokens=T)
        K = topk_idx.shape[1]
        with_w = topk_weights is not None
        if with_w and (not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32
                       or tuple(topk_weights.shape) != (T, K) or topk_weights.device != x.device):
            raise ValueError(f"topk_weights: expected None or a float32 [{T}, {K}] tensor on {x.device}, got "
                             f"{getattr(topk_weights, 'dtype', type(topk_weights).__name__)} "
                             f"{list(getattr(topk_weights, 'shape', []))}")
        EL, R = num_experts // self.num_ranks, self.num_ranks
        stats = cumulative_local_expert_recv_stats
        if stats is not None and (not isinstance(stats, torch.Tensor) or stats.dtype != torch.int32
                                  or tuple(stats.shape) != (EL,) or stats.device != x.device):
            raise ValueError(f"cumulative_local_expert_recv_stats: expected an int32 [{EL}] tensor on {x.device}")
        dtype = FP8 if sf is not None else torch.bfloat16
        cap = self.num_max_tokens_per_rank or M  # one buffer for every call's cap (no new one per cap)
        prefer = handle._v1.slot if handle is not None and handle._v1.slot.latest is handle._v1 else None

        def run():
            # "worst": without a CPU sync DeepEP V2 returns R * num_max_tokens_per_rank rows
            slot = self._v1._rows_slot(num_experts, H, cap, K, dtype, prefer=prefer, max_recv_rows="worst")
            if handle is None:
                ids = topk_idx.clone() if do_handle_copy else topk_idx
                w_keep = topk_weights.clone() if with_w else None
            else:
                ids, w_keep = topk_idx, handle._weights
            w = topk_weights if with_w else slot.zero_weights[:T]
            d = slot.epbuf.dispatch(x, ids, w, x_scales=None if sf is None else sf.contiguous())
            counts = d.expert_counts
            cached = None
            if sync:  # the one host read (as DeepEP's CPU sync)
                host = torch.cat([d.num_recv.long().view(1), counts.long()]).tolist()
                rows, host_counts = host[0], host[1:]
            elif handle is not None:  # the handle's shapes (the same routing)
                rows, host_counts = handle.num_recv_tokens, None
                cached = (handle.num_expanded_tokens, handle.num_recv_tokens_per_expert_list)
            else:
                rows, host_counts = R * M, None
            out = self._received(slot, d, rows, M, K, EL, align, with_w, do_expand, sync, host_counts, sf_int,
                                 do_zero_padding, use_tma_aligned_col_major_sf, previous_event_before_epilogue,
                                 cached)
            if stats is not None:
                stats.add_(counts)
            nh = _normal.NormalHandle(slot, d, ids, w_keep if with_w else slot.zero_weights[:T], rows, True)
            slot.hold(nh)
            return out, (ids, w_keep), nh

        (out, (ids, w_keep), nh), ev = self._v1._issue(run, previous_event, async_with_compute_stream,
                                                       reads=(x, sf, topk_idx, topk_weights, stats))
        recv_x, r_idx, r_w, fields = out
        if handle is None:
            handle = EPHandle(do_expand=do_expand, num_experts=num_experts, expert_alignment=align,
                              num_max_tokens_per_rank=M, num_sms=num_sms, topk_idx=ids, **fields)
        else:
            handle.__dict__.update(fields)
        handle._v1, handle._weights = nh, w_keep
        return recv_x, r_idx, r_w if with_w else None, handle, ev

    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None, num_sms: int = 0,
                num_qps: int = 0, previous_event: Optional[EventHandle] = None,
                previous_event_before_epilogue: Optional[EventHandle] = None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """DeepEP V2's combine: ``(combined_x bf16 [T, H], combined_topk_weights float32 [T, K] or
        None, event)``: per source token the sum over its received rows of ``x`` (no weights
        applied) plus ``bias`` (one or two bf16 ``[T, H]``). ``x``: bf16 with the rows of the
        dispatch's ``recv_x`` (expanded: its ``[N, H]``); ``topk_weights``: float32 ``[rows, K]``
        (expanded ``[N]``), summed back per token."""
        self._check_alive()
        _int("num_sms", num_sms)
        _int("num_qps", num_qps)
        if not isinstance(handle, EPHandle) or not hasattr(handle, "_v1"):
            raise TypeError(f"handle: expected the EPHandle of ElasticBuffer.dispatch, got {type(handle).__name__}")
        self._v1._check_handle(handle._v1)
        rows, H = handle._v1.num_rows, handle._v1.slot.epbuf.hidden
        dev = self.device

        def run():
            if previous_event_before_epilogue is not None:
                stream_wait(None, previous_event_before_epilogue)
            y, w = x, topk_weights
            if handle.do_expand:
                N = handle.num_expanded_tokens
                if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or tuple(x.shape) != (N, H) \
                        or x.device != dev:
                    raise ValueError(f"x: expected a bfloat16 [{N}, {H}] tensor on {dev} (the expanded rows), got "
                                     f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', []))}")
                pos = handle._pos  # [rows, K], N where none
                y = torch.cat([x, x.new_zeros(1, H)])[pos].float().sum(dim=1).to(torch.bfloat16)
                if topk_weights is not None:
                    if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32 or \
                            tuple(topk_weights.shape) != (N,) or topk_weights.device != dev:
                        raise ValueError(f"topk_weights: expected a float32 [{N}] tensor on {dev} (expanded), got "
                                         f"{getattr(topk_weights, 'dtype', type(topk_weights).__name__)} "
                                         f"{list(getattr(topk_weights, 'shape', []))}")
                    w = torch.cat([topk_weights, topk_weights.new_zeros(1)])[pos]
            out, cw = _normal.combine(handle._v1, y, w, bias)
            handle._v1.slot.combined(handle._v1)
            return out, cw

        (out, cw), ev = self._v1._issue(run, previous_event, async_with_compute_stream,
                                        reads=(x, topk_weights, bias))
        return out, cw, ev

    # ------------------------------------------------------------------ internals
    def _check_alive(self) -> None:
        if self.runtime is None:
            raise RuntimeError("ElasticBuffer: destroyed")

    def _tokens_cap(self, n: Optional[int]) -> int:
        M = self.num_max_tokens_per_rank if n is None else _int("num_max_tokens_per_rank", n, 1)
        if M < 1:
            raise ValueError("num_max_tokens_per_rank: expected it here or at construction (both are 0)")
        if self.num_max_tokens_per_rank and M > self.num_max_tokens_per_rank:
            raise ValueError(f"num_max_tokens_per_rank: {M} exceeds the buffer's {self.num_max_tokens_per_rank}")
        return M

    def _unpack_x(self, x) -> Tuple[torch.Tensor, Optional[torch.Tensor], bool]:
        """``(x, float32 scales or None, the scales were int32 packs)``."""
        if isinstance(x, tuple):
            if len(x) != 2:
                raise ValueError(f"x: expected a tensor or an (fp8 x, scales) pair, got a tuple of {len(x)}")
            q, s = x
            if not isinstance(q, torch.Tensor) or q.dtype != FP8 or q.dim() != 2:
                raise TypeError(f"x: the first of the pair must be float8_e4m3fn [T, H], got "
                                f"{getattr(q, 'dtype', type(q))}")
            nb = _align(q.shape[1], 128) // 128
            if not isinstance(s, torch.Tensor) or s.dtype not in (torch.float32, torch.int32) or \
                    tuple(s.shape) != (q.shape[0], nb):
                raise ValueError(f"x: the scales must be float32 or int32 (UE8M0 packs) [{q.shape[0]}, {nb}], got "
                                 f"{getattr(s, 'dtype', type(s))} {list(getattr(s, 'shape', []))}")
            return q, s.view(torch.float32), s.dtype == torch.int32  # (made contiguous in the call, on its stream)
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2:
            raise ValueError(f"x: expected a bfloat16 [num_tokens, hidden] tensor or an fp8 pair, got "
                             f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', []))}")
        return x, None, False

    def _received(self, slot, d, rows: int, M: int, K: int, EL: int, align: int, with_w: bool, expand: bool,
                  sync: bool, host_counts: Optional[List[int]], sf_int: bool, zero_pad: bool, tma_sf: bool,
                  before_epilogue, cached: Optional[Tuple[int, List[int]]] = None):
        """``(recv_x, recv_topk_idx, recv_topk_weights, handle fields)`` from rows dispatch ``d``
        (``rows`` returned; past ``d.num_recv`` ids -1, weights 0, sources -1). ``cached``: a
        cached dispatch's ``(num_expanded_tokens, list)`` from its handle."""
        dev, Mb, S = self.device, slot.epbuf.max_tokens, self.num_scaleup_ranks
        live = torch.arange(rows, device=dev) < d.num_recv  # [rows]
        idx = torch.where(live[:, None], d.recv_topk_idx[:rows].long(), -1)
        w = torch.where(live[:, None], d.recv_topk_weights[:rows], 0.0)
        src = d.recv_src[:rows].long()
        src_rank = src // Mb
        gsrc = torch.where(live, src_rank * M + src % Mb, -1)
        per_s = torch.zeros(S, dtype=torch.int64, device=dev).scatter_add_(0, src_rank.clamp(0, self.num_ranks - 1) % S,
                                                                        live.long())
        counts = d.expert_counts.long()
        aligned = -(-counts // align) * align
        meta = torch.full((rows, 2 + K), -1, dtype=torch.int32, device=dev)
        meta[:, 0] = gsrc.int()
        meta[:, 1] = torch.arange(rows, device=dev, dtype=torch.int32)
        fields = dict(num_recv_tokens=rows, num_expanded_tokens=0,
                      num_recv_tokens_per_expert_list=([-(-c // align) * align for c in host_counts] if sync
                                                       else cached[1] if cached else []),
                      psum_num_recv_tokens_per_scaleup_rank=per_s.cumsum(0).int(), recv_src_metadata=meta)
        x_rows = d.expert_x[:rows]
        sc_rows = d.expert_scales[:rows] if d.expert_scales is not None else None
        if before_epilogue is not None:  # DeepEP's copy epilogue: what writes recv_x (either layout)
            stream_wait(None, before_epilogue)
        if not expand:
            recv_x = x_rows.clone()
            if sc_rows is not None:
                sc = sc_rows.clone()
                recv_x = (recv_x, sc.view(torch.int32) if sf_int else sc)
            fields["psum_num_recv_tokens_per_expert"] = aligned.cumsum(0).int()
            return recv_x, idx, w, fields
        # Expanded: selection (r, k) of local expert e goes to start[e] + its place among e's
        # selections in (row, k) order; N is a dummy row for the others (dropped).
        N = (sum(-(-c // align) * align for c in host_counts) if sync else cached[0] if cached
             else rows * K + EL * (align - 1))
        start = aligned.cumsum(0) - aligned  # [EL]
        flat = idx.view(-1)
        ok = flat >= 0
        RK = flat.numel()
        key = torch.where(ok, flat * RK, EL * RK) + torch.arange(RK, device=dev)
        order = torch.argsort(key)
        place = torch.empty_like(order)
        place[order] = torch.arange(RK, device=dev)
        e = flat.clamp(min=0)
        before = counts.cumsum(0) - counts  # selections of lower experts
        pos = torch.where(ok, start[e] + place - before[e], N).view(rows, K)
        meta[:, 2:] = torch.where(pos < N, pos, -1).int()
        fields.update(num_expanded_tokens=N, psum_num_recv_tokens_per_expert=(start + counts).int(),
                      num_unaligned_recv_tokens_per_expert=counts.int())
        src_row = torch.arange(rows, device=dev).repeat_interleave(K)
        ex = (torch.zeros if zero_pad else torch.empty)(N + 1, x_rows.shape[1], dtype=x_rows.dtype, device=dev)
        ex.index_copy_(0, pos.view(-1), x_rows[src_row])
        ew = torch.zeros(N + 1, dtype=torch.float32, device=dev)
        ew.index_copy_(0, pos.view(-1), w.view(-1))
        recv_x: Any = ex[:N]
        if sc_rows is not None:
            es = torch.zeros(N + 1, sc_rows.shape[1], dtype=torch.float32, device=dev)
            es.index_copy_(0, pos.view(-1), sc_rows[src_row])
            es = es[:N]
            if tma_sf:  # [N, NB] with strides (1, N rounded up to 4): TMA-aligned column-major
                cm = torch.empty(es.shape[1], _align(max(N, 1), 4), dtype=torch.float32, device=dev).t()[:N]
                cm.copy_(es)
                es = cm
            recv_x = (recv_x, es.view(torch.int32) if sf_int else es)
        fields["_pos"] = pos
        return recv_x, None, ew[:N], fields
