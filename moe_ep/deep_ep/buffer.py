"""``Buffer``: DeepEP V1's ``deep_ep.Buffer`` (``deep_ep/buffers/legacy.py``) on moe_ep.

Names, arguments, defaults, return tuples, shapes and dtypes are DeepEP's. Underneath, one
``moe_ep.EPGroup`` over the given process group and EPBuffers created on first use per call shape
(DeepEP's Buffer is sized in bytes, moe_ep's by shape): normal mode on the ``rows`` layout, the
low-latency pair on the ``masked`` layout. Creating an EPBuffer is collective, which is safe here
because every rank makes the same calls in the same order (as DeepEP requires too).
"""
from __future__ import annotations

import os
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..ops.buffer import EPBuffer
from ..ops.replay import guard
from ..core.interpret import interpreting
from ..core.group import EPGroup
from ..core.workspace import WorkspaceLayout, pow2
from ..core.tuning import Tuning
from . import forks as _forks
from . import low_latency as _ll
from . import normal as _normal
from .config import Config
from .event import EventHandle, EventOverlap, record_event, stream_wait
from .routing import check_topk_idx, dispatch_layout

FP8 = torch.float8_e4m3fn
_MIN_ROWS_TOKENS = 64  # the smallest max_tokens of a normal-mode buffer (so a few sizes serve every batch)
# Normal-mode dispatches of one shape that may wait for their combine at once (each holds a rows
# buffer: two micro-batches in flight need two; a training step's cached dispatch and its combine
# come in pairs, so one layer at a time)
MAX_WAITING = 4


def rows_buffer_tokens(tokens: int) -> int:
    """``max_tokens`` of the rows buffer made for calls of up to ``tokens`` tokens per rank (the next
    power of two, at least ``_MIN_ROWS_TOKENS``)."""
    return max(_MIN_ROWS_TOKENS, pow2(tokens))


def cuda_tensors(obj) -> List[torch.Tensor]:
    """The CUDA tensors in ``obj`` and in the tuples, lists and dicts it nests (other objects, such
    as handles, are not looked into)."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_cuda else []
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    return [t for o in items for t in cuda_tensors(o)]


def _refuse(name: str, value, why: str) -> None:
    raise NotImplementedError(f"{name}={value!r}: not implemented by moe_ep.deep_ep ({why})")


class Buffer:
    """DeepEP's expert-parallel communication buffer, on moe_ep.

    Args (DeepEP's; those marked "tuning" only tune DeepEP's own buffers and are accepted, kept as
    attributes and otherwise unused: moe_ep sizes its buffers per call shape, picks its program
    count, and reaches node peers by stores and other nodes through its proxy):
        group: the torch ``ProcessGroup`` of the EP ranks (required; ``comm`` is not supported).
        num_nvl_bytes, num_rdma_bytes: tuning (byte sizes of DeepEP's buffers; no call fails for
            being "too small").
        low_latency_mode: tuning (both modes work on every Buffer).
        num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl: tuning.
        explicitly_destroy: as DeepEP: ``destroy()`` is allowed only when set.
        enable_shrink: rank masking is not implemented: True raises ``NotImplementedError``.
        comm: an ``mpi4py`` communicator instead of ``group``: not implemented (raises).
        timeout_s: moe_ep's deadline for every wait on a peer (``CommTimeoutError`` instead of a
            hang); not a DeepEP argument.
        tuning: the ``moe_ep.Tuning`` of every EPBuffer this Buffer makes (default
            ``Tuning.from_env()``); not a DeepEP argument (DeepEP's ``Config`` objects stay tuning
            of DeepEP's own kernels, accepted and unused).

    Calls are issued on a communication stream of the Buffer (as DeepEP's): it waits for the
    current stream (or ``previous_event``); unless ``async_finish``, the current stream then waits
    for it. Calls with ``return_recv_hook`` run on the current stream. On CPU every call has
    finished when it returns.
    """

    num_sms: int = 20

    def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm=None,
                 timeout_s: float = 30.0, tuning: Optional[Tuning] = None) -> None:
        if comm is not None:
            _refuse("comm", comm, "pass the torch ProcessGroup as group")
        if group is None:
            raise ValueError("group: expected a torch.distributed ProcessGroup, got None")
        if enable_shrink:
            _refuse("enable_shrink", enable_shrink, "moe_ep has no rank masking; a stuck peer gives CommTimeoutError")
        for name, v in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes),
                        ("num_qps_per_rank", num_qps_per_rank)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {v!r}")
        if tuning is not None and not isinstance(tuning, Tuning):  # (the EPBuffers come at first use)
            raise TypeError(f"tuning: expected moe_ep.Tuning or None, got {type(tuning).__name__}")
        self.group = group
        self.ep_group = EPGroup(group)
        self.rank, self.group_size = self.ep_group.rank, self.ep_group.world_size
        self.device = self.ep_group.device
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = bool(low_latency_mode)
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode, self.allow_mnnvl = allow_nvlink_for_low_latency_mode, allow_mnnvl
        self.explicitly_destroy, self.enable_shrink = explicitly_destroy, enable_shrink
        self.timeout_s, self.tuning = timeout_s, tuning
        self._rows: Dict[tuple, List[_normal.RowsSlot]] = {}
        self._ll: Dict[tuple, List[_ll.LowLatencySlot]] = {}
        self._ll_turn: Dict[tuple, int] = {}
        # low_latency_dispatch's arguments checked in full once per signature (the scalars and
        # the token count; x and topk_idx as tensors): a later call that torch's tensor guard passes
        # with the same scalars and count skips the checks (~2 us of Python a call). Keyed by count,
        # so an eager loop whose batch changes builds each count's guard once (~3 us each).
        self._ll_checked: Dict[tuple, object] = {}
        self._comm_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._destroyed = False

    # ------------------------------------------------------------------ DeepEP's static API
    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: moe_ep's fp8 paths need no special build."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Sets ``Buffer.num_sms`` (tuning: the SM count of DeepEP's normal kernels; DeepEP's rule,
        an even count, is kept)."""
        if not isinstance(new_num_sms, int) or new_num_sms < 2 or new_num_sms % 2 != 0:
            raise ValueError(f"new_num_sms: expected an even positive int, got {new_num_sms!r}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream (a complete one on CPU)."""
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and not interpreting() \
            else torch.device("cpu")
        return EventOverlap(record_event(dev))

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of the node workspaces of the two bf16 low-latency buffers of this shape with all
        ranks on one node, top-8 (informational: the byte count passed to Buffer is not used)."""
        lay = WorkspaceLayout(N=num_ranks, M=num_max_dispatch_tokens_per_rank, K=8, EL=max(1, num_experts // num_ranks),
                              H=hidden, payload_bytes=2 * hidden)
        return 2 * lay.offsets()["total"]

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """A Config (tuning only)."""
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """A Config (tuning only)."""
        return Config(Buffer.num_sms, 4, 256, 6, 128)

    # ------------------------------------------------------------------ lifetime
    def destroy(self) -> None:
        """Releases every buffer (only with ``explicitly_destroy=True``, as in DeepEP)."""
        if not self.explicitly_destroy:
            raise RuntimeError("destroy: the Buffer was made with explicitly_destroy=False (as in DeepEP, destroy() "
                               "needs explicitly_destroy=True)")
        for slots in list(self._rows.values()) + list(self._ll.values()):
            for s in slots:
                s.epbuf.close()
        self._rows.clear()
        self._ll.clear()
        self._destroyed = True

    def get_comm_stream(self):
        """The stream this Buffer's calls run on (None on CPU)."""
        return self._comm_stream

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """Not available: moe_ep has no single raw buffer (one per call shape, made on first use)."""
        _refuse("get_local_buffer_tensor", dtype, "moe_ep's buffers are per call shape; use "
                "get_next_low_latency_combine_buffer for zero-copy combine input")

    # ------------------------------------------------------------------ normal mode
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False
                            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        """DeepEP's layout: ``(num_tokens_per_rank int32 [R], num_tokens_per_rdma_rank int32 [nodes]
        or None on one node, num_tokens_per_expert int32 [E], is_token_in_rank bool [T, R], event)``
        for ``topk_idx`` int64 ``[T, K]`` (-1: none). Plain torch, no communication."""
        self._check_alive()
        self._check_experts(num_experts)
        check_topk_idx("topk_idx", topk_idx, num_experts, self.device)
        return self._issue(lambda: dispatch_layout(topk_idx, num_experts, self.group_size, self.ep_group.node_size),
                           previous_event, async_finish, unpack=True, reads=(topk_idx,))

    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], handle=None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """DeepEP's normal dispatch: ``(recv_x, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, event)``.

        ``x``: bfloat16 ``[T, H]``, or ``(float8_e4m3fn [T, H], float32 [T, H/128])``. Received rows
        come in ascending (source rank, source token) order, one per token that selected an expert
        of this rank; ``recv_topk_idx`` int64 ``[n, K]`` holds local expert ids (-1 elsewhere),
        ``recv_topk_weights`` float32 ``[n, K]`` (0 where the id is -1). The list holds each local
        expert's selections rounded up to ``expert_alignment``; empty with ``num_worst_tokens``,
        where ``n = num_worst_tokens`` and nothing waits on the host: the rows buffer's received
        tensors are capped at ``num_worst_tokens`` rows (``EPBuffer(max_recv_rows=)``), and a
        dispatch bringing more writes none past it and raises ``CapacityError`` naming the rank
        and the rows it needs (on a GPU at the next call or ``synchronize``). Without top-k (then
        ``is_token_in_rank`` and ``num_tokens_per_expert`` route) ``recv_topk_*`` are None. With a
        ``handle`` (cached mode: no top-k) the handle's routing is sent again and
        ``(recv_x, None, None, None, None, event)`` comes back.
        """
        self._check_alive()
        self._check_config(config)
        for name, v in (("expert_alignment", expert_alignment),):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if not isinstance(num_worst_tokens, int) or isinstance(num_worst_tokens, bool) or num_worst_tokens < 0:
            raise ValueError(f"num_worst_tokens: expected an int >= 0, got {num_worst_tokens!r}")
        x, x_scales = self._unpack_x(x)
        if handle is not None:
            return self._cached_dispatch(x, x_scales, handle, topk_idx, topk_weights, previous_event, async_finish)
        return self._dispatch(x, x_scales, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                              topk_weights, expert_alignment, num_worst_tokens, previous_event, async_finish)

    def combine(self, x: torch.Tensor, handle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """DeepEP's normal combine: ``(combined_x bf16 [T, H], combined_topk_weights float32 [T, K]
        or None, event)``: per source token the sum over the ranks that received it of their row of
        ``x`` (bf16 ``[n, H]``, no weights applied) plus ``bias`` (one or two bf16 ``[T, H]``), and of
        their ``topk_weights`` rows (float32 ``[n, K]``)."""
        self._check_alive()
        self._check_config(config)
        self._check_handle(handle)
        out, ev = self._issue(lambda: _normal.combine(handle, x, topk_weights, bias), previous_event, async_finish,
                              reads=(x, topk_weights, bias))
        handle.slot.combined(handle)
        return out[0], out[1], ev

    # ------------------------------------------------------------------ low-latency mode
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Nothing to clean: moe_ep's flags carry epochs, so no buffer needs zeroing between calls
        or after normal-mode calls."""
        self._check_alive()

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False, **branch_options):
        """DeepEP's low-latency dispatch: ``(recv_x, recv_count, handle, event, hook)``.

        ``x`` bfloat16 ``[T, H]`` (T <= num_max_dispatch_tokens_per_rank), ``topk_idx`` int64 ``[T, K]``.
        ``recv_x``: bf16 ``[E_local, R*M, H]``, or with ``use_fp8`` ``(float8_e4m3fn [E_local, R*M, H],
        float32 [E_local, R*M, H/128])``, the scales column-major in the last two dims; rows of an
        expert in ascending (source rank, token) order; ``recv_count`` int32 ``[E_local]`` on the
        device. ``round_scale``: power-of-two scales ``2^ceil(log2(amax / 448))``; with ``use_ue8m0``
        their biased exponents, four to an int32, ``[E_local, R*M, H/512]`` (H a multiple of 512);
        these two move bf16 and cast on arrival (DeepEP's values exactly, twice the bytes of fp8).
        Results stay valid until the dispatch after next (two buffers take turns). Across nodes
        each (token, k) travels on its own, as in DeepEP (``moe_ep/deep_ep/low_latency.py``).
        ``branch_options``: DeepEP hybrid-ep's ``use_nvfp4`` / ``x_global_scale``, accepted at their
        defaults (``moe_ep/deep_ep/forks.py``).
        """
        if branch_options:
            _forks.check_dispatch(branch_options)
        self._check_alive()
        if dispatch_wait_recv_cost_stats is not None:
            _refuse("dispatch_wait_recv_cost_stats", "<tensor>", "no per-peer wait timing")
        try:
            scalars = (type(num_max_dispatch_tokens_per_rank), num_max_dispatch_tokens_per_rank, type(num_experts),
                       num_experts, bool(use_fp8), bool(round_scale), bool(use_ue8m0), x.shape[0])
        except (AttributeError, IndexError):  # (not a tensor of tokens: the checks say what is wrong)
            scalars = None
        checked = self._ll_checked.get(scalars)
        if checked is None or not checked.check(x, topk_idx):
            self._check_ll_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale,
                                    use_ue8m0)
            if len(self._ll_checked) >= 1024:
                self._ll_checked.clear()
            g = guard((x, topk_idx), (None, None))
            if g is not None:
                self._ll_checked[scalars] = g
        scales = None if not use_fp8 else "ue8m0" if use_ue8m0 else "pow2" if round_scale else "float"
        slot = self._ll_slot(num_experts, x.shape[1], num_max_dispatch_tokens_per_rank, topk_idx.shape[1], scales)
        (recv_x, count, handle, hook), ev = self._issue(
            lambda: _ll.dispatch(slot, x, topk_idx, cumulative_local_expert_recv_stats, return_recv_hook),
            None, async_finish, on_current=return_recv_hook, reads=(x, topk_idx, cumulative_local_expert_recv_stats))
        return recv_x, count, handle, ev, hook

    def _check_ll_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale,
                           use_ue8m0) -> None:
        """``low_latency_dispatch``'s argument checks (what they depend on: the scalars, and the
        dtype, device and shape of ``x`` and ``topk_idx``)."""
        if use_ue8m0 and not round_scale:
            raise ValueError("use_ue8m0: needs round_scale=True (as in DeepEP)")
        if round_scale and not use_fp8:
            raise ValueError("round_scale: needs use_fp8=True")
        self._check_experts(num_experts)
        if not isinstance(num_max_dispatch_tokens_per_rank, int) or num_max_dispatch_tokens_per_rank < 1:
            raise ValueError(f"num_max_dispatch_tokens_per_rank: expected a positive int, got "
                             f"{num_max_dispatch_tokens_per_rank!r}")
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16:
            raise ValueError(f"x: expected a bfloat16 [num_tokens, hidden] tensor, got "
                             f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', []))}")
        if x.shape[0] > num_max_dispatch_tokens_per_rank:
            raise ValueError(f"x: expected at most num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank} "
                             f"tokens, got {x.shape[0]}")
        if use_fp8 and x.shape[1] % (512 if use_ue8m0 else 128) != 0:
            raise ValueError(f"x: fp8 dispatch needs hidden divisible by {512 if use_ue8m0 else 128} (DeepEP's scale "
                             f"layout{', four UE8M0 scales per int32' if use_ue8m0 else ''}), got {x.shape[1]}")
        check_topk_idx("topk_idx", topk_idx, num_experts, self.device, num_tokens=x.shape[0])

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None, **fork_options):
        """DeepEP's low-latency combine: ``(combined_x bf16 [T, H], event, hook)``,
        ``combined_x[t] = sum_k topk_weights[t, k] * x[expert, row of (t, k)]`` (float32 sums).

        ``x`` bf16 ``[E_local, R*M, H]`` (ignored with ``zero_copy``: the buffer from
        ``get_next_low_latency_combine_buffer`` is read); ``topk_weights`` float32 ``[T, K]``; the
        experts are the dispatch's (``topk_idx`` is checked for shape, the dispatch's ids are used);
        ``out``: written in place and returned. ``fork_options``: the single-batch-overlap options of
        DeepEP's forks SGLang calls (``overlap``, ``src_signals``, ``comp_signal``, ...), accepted
        where they ask for nothing (``moe_ep/deep_ep/forks.py``).
        """
        if fork_options:
            _forks.check_combine(fork_options)
        self._check_alive()
        if use_logfmt:
            _refuse("use_logfmt", use_logfmt, "combine sends bfloat16")
        if combine_wait_recv_cost_stats is not None:
            _refuse("combine_wait_recv_cost_stats", "<tensor>", "no per-peer wait timing")
        if not isinstance(handle, _ll.LowLatencyHandle):
            raise TypeError(f"handle: expected the handle of this Buffer's low_latency_dispatch, got "
                            f"{type(handle).__name__}")
        (res, hook), ev = self._issue(
            lambda: _ll.combine(handle, x, topk_idx, topk_weights, zero_copy, return_recv_hook, out),
            None, async_finish, on_current=return_recv_hook, reads=(x, topk_idx, topk_weights, out))
        return res, ev, hook

    def get_next_low_latency_combine_buffer(self, handle) -> torch.Tensor:
        """bf16 ``[E_local, R*M, H]`` to fill with expert outputs for ``low_latency_combine(...,
        zero_copy=True)`` of ``handle``."""
        if not isinstance(handle, _ll.LowLatencyHandle):
            raise TypeError(f"handle: expected the handle of this Buffer's low_latency_dispatch, got "
                            f"{type(handle).__name__}")
        return handle.slot.next_combine_buffer()

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False):
        _refuse("low_latency_update_mask_buffer", rank_to_mask, "no rank masking (enable_shrink)")

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor):
        _refuse("low_latency_query_mask_buffer", "<tensor>", "no rank masking (enable_shrink)")

    def low_latency_clean_mask_buffer(self):
        _refuse("low_latency_clean_mask_buffer", None, "no rank masking (enable_shrink)")

    # ------------------------------------------------------------------ internals
    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("Buffer: destroyed")

    def _check_experts(self, num_experts) -> None:
        if not isinstance(num_experts, int) or num_experts < 1 or num_experts % self.group_size != 0:
            raise ValueError(f"num_experts: expected a positive multiple of the group size {self.group_size}, "
                             f"got {num_experts!r}")

    @staticmethod
    def _check_config(config) -> None:
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config: expected moe_ep.deep_ep.Config, got {type(config).__name__}")

    def _unpack_x(self, x):
        if isinstance(x, tuple):
            if len(x) != 2:
                raise ValueError(f"x: expected a tensor or a (float8_e4m3fn x, float32 scales) pair, got a tuple of {len(x)}")
            q, s = x
            if not isinstance(q, torch.Tensor) or q.dtype != FP8:
                raise TypeError(f"x: the first of the pair must be float8_e4m3fn, got {getattr(q, 'dtype', type(q))}")
            if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.dim() != 2 or q.dim() != 2 or \
                    q.shape[1] % 128 != 0 or tuple(s.shape) != (q.shape[0], q.shape[1] // 128):
                raise ValueError(f"x: the scales must be float32 [num_tokens, hidden // 128] (hidden a multiple of 128), "
                                 f"got {getattr(s, 'dtype', type(s))} {list(getattr(s, 'shape', []))} for x "
                                 f"{list(q.shape)}")
            return q, s  # DeepEP takes column-major scales too (made contiguous in the call, on its stream)
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2:
            raise ValueError(f"x: expected a bfloat16 [num_tokens, hidden] tensor or an fp8 pair, got "
                             f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', []))}")
        return x, None

    def _issue(self, fn: Callable, previous_event: Optional[EventOverlap], async_finish: bool,
               on_current: bool = False, unpack: bool = False, reads: tuple = ()):
        """Runs ``fn`` with DeepEP's stream semantics; returns ``(fn(), event)`` (or ``(*fn(),
        event)`` with ``unpack``).

        ``fn`` holds every tensor operation of the call (copies of inputs and buffers made on first
        use included): on a GPU it runs on the communication stream after that stream waited for
        ``previous_event`` (else the current stream), so work the caller queued after
        ``previous_event`` is never waited for and nothing of the call runs before the wait. Its
        tensors are allocated on the communication stream and recorded on the caller's
        (``record_stream``), so the caller may free them whenever its stream is done with them;
        with ``async_finish`` the caller's tensors in ``reads`` are recorded on the communication
        stream (the caller may free them before that stream has read them)."""
        if previous_event is not None and not isinstance(previous_event, (EventOverlap, EventHandle)):
            raise TypeError(f"previous_event: expected an EventOverlap (or EventHandle), got "
                            f"{type(previous_event).__name__}")
        waits = previous_event is not None and previous_event.event is not None
        if self._comm_stream is None or on_current:
            if waits:
                stream_wait(None, previous_event)
            res = fn()
            ev = EventOverlap(record_event(self.device)) if async_finish else EventOverlap(None)
        else:
            cur = torch.cuda.current_stream(self.device)
            comm = self._comm_stream
            if waits:
                stream_wait(comm, previous_event)
            else:
                comm.wait_stream(cur)
            with torch.cuda.stream(comm):
                res = fn()
            for t in cuda_tensors(res):
                t.record_stream(cur)
            if async_finish:
                ev = EventOverlap(record_event(self.device, comm))
                for t in cuda_tensors(reads):
                    t.record_stream(comm)
            else:
                cur.wait_stream(comm)
                ev = EventOverlap(None)
        return (*res, ev) if unpack else (res, ev)

    def _ll_slot(self, num_experts: int, hidden: int, M: int, K: int, scales: Optional[str]) -> _ll.LowLatencySlot:
        """The next of the two low-latency buffers of this shape and scale format (made on first use;
        ``LowLatencySlot``: only the ``"float"`` format moves fp8, the power-of-two ones move bf16)."""
        key = (num_experts, hidden, M, K, scales)
        slots = self._ll.get(key)
        if slots is None:
            slots = self._ll[key] = []
        turn = self._ll_turn.get(key, 0)
        self._ll_turn[key] = turn + 1
        if len(slots) < 2:
            dtype = FP8 if scales == "float" else torch.bfloat16
            cm = scales == "float"  # the kernels write DeepEP's column-major scales themselves
            if self.ep_group.node_size < self.group_size:  # each (token, k) a token (low_latency.py)
                epbuf = self._epbuffer(num_experts, hidden, M * K, 1, dtype, "masked",
                                       expert_capacity=self.group_size * M, column_major_scales=cm)
                slots.append(_ll.LowLatencySlot(epbuf, M, K, scales, expand=K))
            else:
                epbuf = self._epbuffer(num_experts, hidden, M, K, dtype, "masked", column_major_scales=cm)
                slots.append(_ll.LowLatencySlot(epbuf, M, K, scales))
            return slots[-1]
        return slots[turn % 2]

    def _check_handle(self, handle) -> None:
        """``handle`` must be a normal-mode handle of this Buffer (its rows buffer is one of ours)."""
        if not isinstance(handle, _normal.NormalHandle):
            raise TypeError(f"handle: expected the handle of this Buffer's dispatch, got {type(handle).__name__}")
        if not any(handle.slot in slots for slots in self._rows.values()):
            raise ValueError("handle: expected the handle of this Buffer's dispatch, got one of another Buffer "
                             "(or of this one before destroy())")

    def _rows_slot(self, num_experts: int, hidden: int, tokens: int, K: int, dtype: torch.dtype,
                   prefer: Optional[_normal.RowsSlot] = None, max_recv_rows=None) -> _normal.RowsSlot:
        """A rows buffer of this shape and ``max_recv_rows`` (None: sized per call; a cap; "worst")
        holding at least ``tokens`` per rank whose latest dispatch is
        not waiting for its combine (``prefer`` if it qualifies or already holds the caller's
        handle; else the latest made that is free; else a new one of the next power of two, at
        most ``MAX_WAITING`` waiting at once). Every rank makes the same calls in the same order
        (DeepEP's rule), so every rank picks the same slot."""
        key = (num_experts, hidden, K, dtype, max_recv_rows)
        slots = self._rows.setdefault(key, [])
        if prefer is not None and prefer in slots and prefer.epbuf.max_tokens >= tokens:
            return prefer
        free = [s for s in slots if not s.waiting and s.epbuf.max_tokens >= tokens]
        if free:
            return free[-1]
        waiting = sum(s.waiting for s in slots)
        if waiting >= MAX_WAITING:
            raise ValueError(f"dispatch: {waiting} normal-mode dispatches of this shape are waiting for their combine "
                             f"(moe_ep keeps one buffer for each, at most MAX_WAITING={MAX_WAITING}); combine one first")
        slots.append(_normal.RowsSlot(self._epbuffer(num_experts, hidden, rows_buffer_tokens(tokens), K, dtype, "rows",
                                                     max_recv_rows=max_recv_rows)))
        return slots[-1]

    def _epbuffer(self, num_experts: int, hidden: int, M: int, K: int, dtype: torch.dtype, layout: str,
                  expert_capacity: Optional[int] = None, column_major_scales: bool = False,
                  max_recv_rows=None) -> EPBuffer:
        return EPBuffer(self.ep_group, num_experts, hidden, M, K, dispatch_dtype=dtype, layout=layout,
                        timeout_s=self.timeout_s, expert_capacity=expert_capacity,
                        column_major_scales=column_major_scales, tuning=self.tuning,
                        **({"max_recv_rows": max_recv_rows} if layout == "rows" else {}))

    def _dispatch(self, x, x_scales, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                  topk_weights, expert_alignment, num_worst_tokens, previous_event, async_finish):
        R, dev, T, H = self.group_size, self.device, x.shape[0], x.shape[1]
        with_topk = topk_idx is not None
        if with_topk != (topk_weights is not None):
            raise ValueError("topk_idx / topk_weights: expected both or neither")
        if num_tokens_per_expert is None or not isinstance(num_tokens_per_expert, torch.Tensor) or \
                num_tokens_per_expert.dim() != 1:
            raise ValueError("num_tokens_per_expert: expected the int32 [num_experts] tensor of get_dispatch_layout")
        E = int(num_tokens_per_expert.shape[0])
        self._check_experts(E)
        EL = E // R
        if not isinstance(is_token_in_rank, torch.Tensor) or is_token_in_rank.dtype != torch.bool or \
                tuple(is_token_in_rank.shape) != (T, R):
            raise ValueError(f"is_token_in_rank: expected the bool [{T}, {R}] tensor of get_dispatch_layout, got "
                             f"{getattr(is_token_in_rank, 'dtype', type(is_token_in_rank).__name__)} "
                             f"{list(getattr(is_token_in_rank, 'shape', []))}")
        if not isinstance(num_tokens_per_rank, torch.Tensor) or tuple(num_tokens_per_rank.shape) != (R,):
            raise ValueError(f"num_tokens_per_rank: expected the int32 [{R}] tensor of get_dispatch_layout")
        if with_topk:
            check_topk_idx("topk_idx", topk_idx, E, dev, num_tokens=T)
            K = topk_idx.shape[1]
            if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32 or \
                    tuple(topk_weights.shape) != (T, K):
                raise ValueError(f"topk_weights: expected a float32 [{T}, {K}] tensor, got "
                                 f"{getattr(topk_weights, 'dtype', type(topk_weights).__name__)} "
                                 f"{list(getattr(topk_weights, 'shape', []))}")
        else:
            K = R
        dtype = FP8 if x_scales is not None else torch.bfloat16
        gathered = None
        if num_worst_tokens == 0:
            # Every rank's token count fixes the buffer's max_tokens (same on all ranks); without
            # top-k the expert counts travel along (the rows layout counts only its own ids).
            mine = (T, None if with_topk else num_tokens_per_expert.view(R, EL).cpu().tolist())
            gathered = self.ep_group.all_gather_object(mine)
            tokens = max(g[0] for g in gathered)
        else:
            if T > num_worst_tokens:
                raise ValueError(f"x: {T} tokens, more than num_worst_tokens={num_worst_tokens}, which sizes the buffer "
                                 f"(the other ranks then time out)")
            tokens = num_worst_tokens

        def run():
            # num_worst_tokens: the received tensors capped at that many rows, no host read (graph-safe);
            # else sized per call (the count is read on the host anyway, as DeepEP's normal mode does)
            slot = self._rows_slot(E, H, tokens, K, dtype, max_recv_rows=num_worst_tokens or None)
            if with_topk:
                ids, w = topk_idx.contiguous().clone(), topk_weights.contiguous().clone()
            else:
                ids = _normal.routing_from_ranks(is_token_in_rank.to(dev), EL)
                w = torch.zeros(T, K, dtype=torch.float32, device=dev)
            check = None
            if num_worst_tokens == 0:
                ntr, _, nte, itr = dispatch_layout(ids, E, R, self.ep_group.node_size)
                check = ((itr != is_token_in_rank.to(dev)).any() | (ntr != num_tokens_per_rank.to(dev)).any())
                if with_topk:
                    check = check | (nte != num_tokens_per_expert.to(dev)).any()
            d = slot.epbuf.dispatch(x, ids, w, x_scales=None if x_scales is None else x_scales.contiguous())
            recv_x, r_idx, r_w, counts, rows = _normal.received(slot, d, x_scales is not None, num_worst_tokens,
                                                                with_topk, check)
            if not with_topk and counts is not None:
                counts = [sum(g[1][self.rank][e] for g in gathered) for e in range(EL)]
            lst = _normal.aligned(counts, expert_alignment) if counts is not None else []
            handle = _normal.NormalHandle(slot, d, ids, w, rows, with_topk)
            slot.hold(handle)
            return recv_x, r_idx, r_w, lst, handle

        (recv_x, r_idx, r_w, lst, handle), ev = self._issue(
            run, previous_event, async_finish,
            reads=(x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert))
        return recv_x, r_idx, r_w, lst, handle, ev

    def _cached_dispatch(self, x, x_scales, handle, topk_idx, topk_weights, previous_event, async_finish):
        self._check_handle(handle)
        if topk_idx is not None or topk_weights is not None:
            raise ValueError("topk_idx / topk_weights: a cached dispatch (handle given) takes neither; it repeats "
                             "the handle's routing")
        if x.shape[0] != handle.num_tokens:
            raise ValueError(f"x: expected the {handle.num_tokens} tokens of the handle's dispatch, got {x.shape[0]}")
        E, K = handle.slot.epbuf.num_experts, handle.slot.epbuf.topk
        dtype = FP8 if x_scales is not None else torch.bfloat16
        # Its own slot again while it still holds it (a second cached dispatch before the combine).
        mine = handle.slot if handle.slot.latest is handle else None

        def run():
            slot = self._rows_slot(E, x.shape[1], handle.max_tokens, K, dtype, prefer=mine,
                                   max_recv_rows=handle.slot.epbuf.sizes.max_recv_rows)
            d = slot.epbuf.dispatch(x, handle.topk_idx, handle.topk_weights,
                                    x_scales=None if x_scales is None else x_scales.contiguous())
            handle.result = d
            slot.hold(handle)
            rows = handle.num_rows
            xr = d.expert_x[:rows].clone()
            return (xr, d.expert_scales[:rows].clone()) if x_scales is not None else xr

        recv_x, ev = self._issue(run, previous_event, async_finish, reads=(x, x_scales))
        return recv_x, None, None, None, None, ev
