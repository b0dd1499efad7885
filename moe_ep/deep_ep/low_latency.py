"""DeepEP's low-latency pair on moe_ep's masked layout.

DeepEP's ``recv_x [E_local, R*M, H]`` and ``recv_count [E_local]`` are the masked layout's
``expert_x`` and ``expert_counts`` (M = ``num_max_dispatch_tokens_per_rank``); the weights come at
combine (``EPBuffer.combine(topk_weights=)``), the dispatch sends zeros in their place. Two
EPBuffers per shape take dispatches in turn, so, as in DeepEP, the results of the last two
dispatches stay valid together (two micro-batches in flight). DeepEP's power-of-two scales
(``round_scale``, ``use_ue8m0``) are not a format of the kernels: those dispatches move bf16 and
the rows are cast on arrival, exactly as DeepEP casts them.

Across nodes (``node_size < R``) the weights cannot reach a remote owner's pre-reduction at
combine (the proxy carries them only at dispatch), so each (token, k) travels as a token of its
own, as DeepEP's low-latency kernels send it: the slot's buffer has ``max_tokens = M*K``,
``topk = 1`` and ``expert_capacity = R*M`` (the same ``[E_local, R*M, H]`` layout, since a token
lists an expert once), its dispatch sends weight 1, its combine returns each (token, k)'s expert
row in float32, and the source applies the combine weights and sums over k in float32 (one
rounding). It moves K rows per token where the node path moves one per rank.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..ops.buffer import EPBuffer
from ..ops.calls import on_device
from ..ops.replay import guard
from ..ops.result import DispatchResult


class LowLatencySlot:
    """One masked EPBuffer of a low-latency shape and what DeepEP's calls need beside it: the
    weights its dispatch sends, the power-of-two formats' fp8 tensors, the combine input buffer.

    ``M``, ``K``: DeepEP's ``num_max_dispatch_tokens_per_rank`` and top-k. ``expand``: 1 (the
    buffer's tokens are DeepEP's), or K across nodes (module docstring: the buffer's tokens are
    the (token, k) pairs, with staging tensors for them). ``scales``: None (bf16), ``"float"``
    (the buffer's fp8 scales: made with ``column_major_scales``, the kernels write DeepEP's
    layout, nothing is copied), ``"pow2"`` / ``"ue8m0"`` (DeepEP's ``round_scale`` /
    ``use_ue8m0``: the buffer moves bf16 and the rows are cast here, on arrival, into this slot's
    fp8 tensor)."""

    def __init__(self, epbuf: EPBuffer, M: int, K: int, scales: Optional[str] = None, expand: int = 1):
        self.epbuf, self.scales, self.M, self.K, self.expand = epbuf, scales, M, K, expand
        EL, H, rows = epbuf.num_local_experts, epbuf.hidden, epbuf.sizes.capacity
        dev = epbuf.device
        if expand == 1:  # the weights come at combine: the dispatch sends zeros in their place
            self.weights = torch.zeros(M, K, dtype=torch.float32, device=dev)
        else:  # weight 1 per (token, k): the owner's "pre-reduction" returns the expert row as it is
            self.weights = torch.ones(M * K, 1, dtype=torch.float32, device=dev)
            self.x_stage = torch.empty(M * K, H, dtype=torch.bfloat16, device=dev)
            self.ids_stage = torch.empty(M * K, 1, dtype=torch.int64, device=dev)
            self.rows_f32 = torch.empty(M * K, H, dtype=torch.float32, device=dev)
        # DeepEP's scales are [E_local, R*M, blocks] with the last two dims column-major (TMA-ready):
        # a [E_local, blocks, R*M] tensor, handed out transposed (the "float" format's: the buffer's own).
        self.scales_cm = None
        self.q = None
        if scales == "float":
            if not epbuf.sizes.column_major_scales:
                raise ValueError("LowLatencySlot: the float scale format needs a buffer made with "
                                 "column_major_scales=True")
        elif scales in ("pow2", "ue8m0"):
            self.q = torch.empty(EL, rows, H, dtype=torch.float8_e4m3fn, device=dev)
            self.scales_cm = (torch.empty(EL, H // 512, rows, dtype=torch.int32, device=dev) if scales == "ue8m0"
                              else torch.empty(EL, H // 128, rows, dtype=torch.float32, device=dev))
        self.combine_in: Optional[torch.Tensor] = None
        self._weights_of: dict = {}  # weights_for's views, per token count (at most M*K + 1)
        # combine's checks passed once per (token count, zero_copy, out given): a torch tensor
        # guard over the tensors they looked at, which later calls pass instead (~1.5 us a call).
        self.combine_checked: dict = {}

    def weights_for(self, tokens: int) -> torch.Tensor:
        """The weights a dispatch of ``tokens`` buffer tokens sends (a view kept per count:
        slicing a tensor costs ~0.5 us of host time per call)."""
        w = self._weights_of.get(tokens)
        if w is None:
            w = self._weights_of[tokens] = self.weights[:tokens]
        return w

    def next_combine_buffer(self) -> torch.Tensor:
        """bf16 ``[E_local, R*M, H]``: what a ``zero_copy`` combine of this slot reads."""
        if self.combine_in is None:
            self.combine_in = torch.zeros((*self.epbuf.sizes.lead, self.epbuf.hidden), dtype=torch.bfloat16, device=self.epbuf.device)
        return self.combine_in


class LowLatencyHandle:
    """What ``low_latency_dispatch`` hands to ``low_latency_combine``: the slot and its dispatch.
    (DeepEP's handle is a tuple of its source-info tensors; this one is opaque.)"""

    def __init__(self, slot: LowLatencySlot, result: DispatchResult, num_tokens: int, hidden: int, num_experts: int):
        self.slot, self.result, self.num_tokens = slot, result, num_tokens
        self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts = slot.M, hidden, num_experts


def pow2_quantize(x: torch.Tensor, q_out: torch.Tensor, scales_cm: torch.Tensor, ue8m0: bool) -> None:
    """DeepEP's ``round_scale`` cast of bf16 ``x [E_local, R*M, H]`` into ``q_out`` (float8_e4m3fn,
    same shape) and ``scales_cm``: per 128 channels the power of two ``2^ceil(log2(amax / 448))``
    (amax at least 1e-4), float32 ``[E_local, H/128, R*M]``; with ``ue8m0`` its exponent byte
    (+127), four blocks packed to an int32 (block 4j+i in byte i), ``[E_local, H/512, R*M]``."""
    EL, RM, H = x.shape
    b = x.float().view(EL, RM, H // 128, 128)
    ratio = b.abs().amax(-1).clamp_min(1e-4) / 448.0
    bits = ratio.view(torch.int32)
    # ceil(log2(ratio)) from the bits, exact (log2 in float32 may round across a power of two)
    exp = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    scale_inv = torch.ldexp(torch.ones_like(ratio), exp)
    q_out.copy_((b / scale_inv.unsqueeze(-1)).view(EL, RM, H).to(torch.float8_e4m3fn))  # exact division by 2^e
    if ue8m0:
        byte = (exp + 127).view(EL, RM, H // 512, 4)
        packed = byte[..., 0] | (byte[..., 1] << 8) | (byte[..., 2] << 16) | (byte[..., 3] << 24)
        scales_cm.copy_(packed.transpose(1, 2))
    else:
        scales_cm.copy_(scale_inv.transpose(1, 2))


def _chain(first: Callable[[], None], then: Callable[[], None]) -> Callable[[], None]:
    def hook() -> None:
        first()
        then()
    return hook


def dispatch(slot: LowLatencySlot, x: torch.Tensor, topk_idx: torch.Tensor,
             cumulative_local_expert_recv_stats: Optional[torch.Tensor], return_recv_hook: bool):
    """``(recv_x, recv_count, handle, hook)`` of DeepEP's ``low_latency_dispatch`` (hook None
    without ``return_recv_hook``)."""
    buf = slot.epbuf
    stats = cumulative_local_expert_recv_stats
    if stats is not None and (not isinstance(stats, torch.Tensor) or stats.dtype != torch.int32
                              or tuple(stats.shape) != (buf.num_local_experts,) or not on_device(stats, buf.device)):
        raise ValueError(f"cumulative_local_expert_recv_stats: expected an int32 [{buf.num_local_experts}] tensor on "
                         f"{buf.device}, got {stats.dtype if isinstance(stats, torch.Tensor) else type(stats).__name__} "
                         f"{list(stats.shape) if isinstance(stats, torch.Tensor) else ''}")
    T = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 2 else 0
    if slot.expand == 1:
        got = buf.dispatch(x, topk_idx, slot.weights_for(T), return_recv_hook=return_recv_hook)
    else:  # each (token, k) a token of its own (module docstring); the staging copies are stream-ordered
        K, H = slot.K, buf.hidden
        xs, ids = slot.x_stage[:T * K], slot.ids_stage[:T * K]
        xs.view(T, K, H).copy_(x[:, None, :].expand(T, K, H))
        ids.copy_(topk_idx.reshape(T * K, 1))
        got = buf.dispatch(xs, ids, slot.weights_for(T * K), return_recv_hook=return_recv_hook)
    d, recv_hook = got if return_recv_hook else (got, None)

    def finish() -> None:  # on the received layout, after the receive half
        if slot.q is not None:
            pow2_quantize(d.expert_x, slot.q, slot.scales_cm, slot.scales == "ue8m0")
        if stats is not None:
            stats.add_(d.expert_counts)

    hook = None
    if slot.q is None and stats is None:
        hook = recv_hook  # nothing to do on arrival: the caller's hook is the buffer's
    elif recv_hook is not None:
        hook = _chain(recv_hook, finish)
    else:
        finish()
    if slot.scales is None:
        recv_x = d.expert_x
    elif slot.q is None:  # fp8 from the buffer, its scales already DeepEP's column-major layout
        recv_x = (d.expert_x, d.expert_scales)
    else:
        recv_x = (slot.q, slot.scales_cm.transpose(1, 2))
    handle = LowLatencyHandle(slot, d, T, buf.hidden, buf.num_experts)
    return recv_x, d.expert_counts, handle, hook


def _check_combine(slot: LowLatencySlot, d: DispatchResult, T: int, x, topk_idx, zero_copy: bool, out) -> None:
    """``combine``'s checks of ``x`` (unless ``zero_copy``), ``topk_idx`` and ``out``: what they
    depend on is the slot, the token count ``T`` and those tensors' dtype, device and shape."""
    buf = slot.epbuf
    shape = tuple(d.expert_x.shape)  # (the buffer's expert layout, which the dispatch's result views)
    if not zero_copy and (not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or tuple(x.shape) != shape):
        raise ValueError(f"x: expected a bfloat16 tensor of shape {list(shape)} (num_local_experts, "
                         f"num_ranks * num_max_dispatch_tokens_per_rank, hidden), got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', []))}")
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or tuple(topk_idx.shape) != (T, slot.K):
        raise ValueError(f"topk_idx: expected the dispatch's [{T}, {slot.K}] expert ids, got "
                         f"{list(getattr(topk_idx, 'shape', []))}")
    if out is not None and (not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16
                            or tuple(out.shape) != (T, buf.hidden) or not on_device(out, buf.device)):
        raise ValueError(f"out: expected a bfloat16 [{T}, {buf.hidden}] tensor on {buf.device}, got "
                         f"{getattr(out, 'dtype', type(out).__name__)} {list(getattr(out, 'shape', []))}")


def combine(handle: LowLatencyHandle, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
            zero_copy: bool, return_recv_hook: bool, out: Optional[torch.Tensor]):
    """``(combined_x, hook)`` of DeepEP's ``low_latency_combine``."""
    slot, d = handle.slot, handle.result
    buf = slot.epbuf
    T, K = handle.num_tokens, slot.K
    looked = ((topk_idx,) if zero_copy else (x, topk_idx)) + (() if out is None else (out,))
    checked = slot.combine_checked.get((T, zero_copy, out is None))
    if checked is None or not checked.check(*looked):  # (a guard passes no non-tensor)
        _check_combine(slot, d, T, x, topk_idx, zero_copy, out)
        g = guard(looked, (None,) * len(looked))
        if g is not None:
            slot.combine_checked[(T, zero_copy, out is None)] = g
    if zero_copy and slot.combine_in is None:
        raise ValueError("zero_copy: no combine buffer was taken; fill get_next_low_latency_combine_buffer(handle) "
                         "first")
    y = slot.combine_in if zero_copy else x
    if slot.expand == 1:  # (into the caller's out where given: no copy)
        got = buf.combine(y, d, return_recv_hook=return_recv_hook, topk_weights=topk_weights, out=out)
    else:
        if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32 or \
                tuple(topk_weights.shape) != (T, K) or topk_weights.device != buf.device:
            raise ValueError(f"topk_weights: expected a float32 [{T}, {K}] tensor on {buf.device}, got "
                             f"{getattr(topk_weights, 'dtype', type(topk_weights).__name__)} "
                             f"{list(getattr(topk_weights, 'shape', []))}")
        w = topk_weights.clone()  # read after a receive hook: the caller may reuse its tensor meanwhile
        got = buf.combine(y, d, return_recv_hook=return_recv_hook, out=slot.rows_f32[:T * K])
    o, recv_hook = got if return_recv_hook else (got, None)
    if slot.expand > 1:  # a bf16 tensor to return now; the hook (or this call) fills it
        o = out if out is not None else torch.empty(T, buf.hidden, dtype=torch.bfloat16, device=buf.device)

    def finish() -> None:
        if slot.expand > 1:  # sum_k w * (the expert row of (token, k)), float32, rounded once
            rows = slot.rows_f32[:T * K].view(T, K, buf.hidden)
            o.copy_((rows * w[:, :, None]).sum(dim=1))

    hook = None
    if slot.expand == 1:
        hook = recv_hook  # nothing to do on arrival: the caller's hook is the buffer's
    elif recv_hook is not None:
        hook = _chain(recv_hook, finish)
    else:
        finish()
    return (out if out is not None else o), hook
