"""DeepEP's normal-mode dispatch and combine on moe_ep's rows layout.

A rows dispatch delivers one row per (source token, this rank) in ascending (source rank, source
token) order, with the token's top-k ids mapped to local ones (-1 elsewhere) and its weights: that
is DeepEP's ``recv_x`` / ``recv_topk_idx`` / ``recv_topk_weights``. DeepEP returns tensors of the
received size, so without ``num_worst_tokens`` the rows buffer sizes its received tensors per call
(the count read on the host: one sync, as DeepEP does); with it, the buffer's received tensors are
capped at ``num_worst_tokens`` rows (``EPBuffer(max_recv_rows=num_worst_tokens)``) and that many
rows come back with no sync, the rows past the count with top-k ids -1 and weights 0; a dispatch
bringing more raises ``CapacityError`` (nothing written past the cap). Returned tensors are copies
(DeepEP's outlive later dispatches; the rows layout's views do not).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ..ops.buffer import EPBuffer
from ..ops.result import DispatchResult


class RowsSlot:
    """One rows EPBuffer and its staging tensors: the combine input where the buffer's received
    tensors have more rows than the caller got (``max_recv_rows="worst"``, DeepEP V2 without a CPU
    sync; sized per call or capped, DeepEP's ``x`` is the combine's input as it is) and the zero
    weights a dispatch without top-k sends. ``latest``: the handle whose dispatch the buffer holds now;
    ``waiting``: that handle's combine is still due, so no other dispatch may take this slot
    (DeepEP's handles stay valid across later dispatches: two micro-batches dispatched before
    either is combined each keep a slot)."""

    def __init__(self, epbuf: EPBuffer):
        self.epbuf = epbuf
        self.latest: Optional["NormalHandle"] = None
        self.waiting = False
        self._stage_y: Optional[torch.Tensor] = None
        self._stage_w: Optional[torch.Tensor] = None
        self.zero_weights = torch.zeros(epbuf.max_tokens, epbuf.topk, dtype=torch.float32, device=epbuf.device)

    @property
    def capacity(self) -> int:
        return self.epbuf.world_size * self.epbuf.max_tokens

    def hold(self, handle: "NormalHandle") -> None:
        """``handle``'s dispatch was just issued on this slot: it holds the slot until its combine.
        A handle moving here from another slot (a cached dispatch) frees that one."""
        old = handle.slot
        if old is not self and old.latest is handle:
            old.waiting = False
        handle.slot = self
        self.latest, self.waiting = handle, True

    def combined(self, handle: "NormalHandle") -> None:
        """``handle``'s combine was issued: the slot takes other dispatches again."""
        if self.latest is handle:
            self.waiting = False

    def stage_y(self) -> torch.Tensor:
        if self._stage_y is None:
            self._stage_y = torch.zeros(self.capacity, self.epbuf.hidden, dtype=torch.bfloat16, device=self.epbuf.device)
        return self._stage_y

    def stage_w(self) -> torch.Tensor:
        if self._stage_w is None:
            self._stage_w = torch.zeros(self.capacity, self.epbuf.topk, dtype=torch.float32, device=self.epbuf.device)
        return self._stage_w


class NormalHandle:
    """What ``dispatch`` hands to ``combine`` and to a cached ``dispatch``: the routing (a copy of
    the ids and weights dispatched, so a cached dispatch repeats it), the rows slot of the latest
    dispatch with this routing, and how many rows the caller got. (DeepEP's handle is a tuple of
    prefix matrices; this one is opaque.)"""

    def __init__(self, slot: RowsSlot, result: DispatchResult, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 num_rows: int, with_topk: bool):
        self.slot, self.result = slot, result
        self.topk_idx, self.topk_weights = topk_idx, topk_weights
        self.num_rows, self.with_topk = num_rows, with_topk

    @property
    def num_tokens(self) -> int:
        return self.result.num_tokens

    @property
    def max_tokens(self) -> int:
        return self.slot.epbuf.max_tokens


def routing_from_ranks(is_token_in_rank: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """int64 ``[T, R]``: a dispatch without top-k sends token t to rank r when
    ``is_token_in_rank[t, r]``; as top-k ids: rank r's first expert there, -1 elsewhere."""
    R = is_token_in_rank.shape[1]
    first = torch.arange(R, device=is_token_in_rank.device, dtype=torch.int64) * num_local_experts
    return torch.where(is_token_in_rank, first, -1)


def aligned(counts: List[int], alignment: int) -> List[int]:
    """Each count rounded up to a multiple of ``alignment`` (DeepEP's ``expert_alignment``)."""
    return [-(-c // alignment) * alignment for c in counts]


def received(slot: RowsSlot, d: DispatchResult, fp8: bool, num_worst_tokens: int, with_topk: bool,
             layout_check: Optional[torch.Tensor]) -> Tuple[object, Optional[torch.Tensor], Optional[torch.Tensor],
                                                             List[int], int]:
    """``(recv_x, recv_topk_idx, recv_topk_weights, local expert counts (host, None with
    num_worst_tokens), rows)`` of a rows dispatch. Without ``num_worst_tokens``: one host read of
    the count, the expert counts and ``layout_check`` (nonzero: the caller's layout tensors do not
    match its ``topk_idx``)."""
    counts = None
    if num_worst_tokens == 0:
        parts = [d.num_recv.long().view(1), d.expert_counts.long()]
        if layout_check is not None:
            parts.append(layout_check.long().view(1))
        host = torch.cat(parts).tolist()  # the one host sync of DeepEP's normal dispatch
        if layout_check is not None and host[-1] != 0:
            raise ValueError("is_token_in_rank / num_tokens_per_rank / num_tokens_per_expert: expected what "
                             "get_dispatch_layout(topk_idx) gives for the topk_idx passed (moe_ep routes by topk_idx)")
        rows, counts = host[0], host[1:1 + d.expert_counts.numel()]
    else:  # the buffer's cap: more rows raise CapacityError (none written past it), no host sync
        rows = num_worst_tokens
    x = d.expert_x[:rows].clone()
    recv_x = (x, d.expert_scales[:rows].clone()) if fp8 else x
    if not with_topk:
        return recv_x, None, None, counts, rows
    idx, w = d.recv_topk_idx[:rows].long(), d.recv_topk_weights[:rows].clone()
    if num_worst_tokens:
        live = (torch.arange(rows, device=idx.device) < d.num_recv)[:, None]
        idx = torch.where(live, idx, -1)
        w = torch.where(live, w, 0.0)
    return recv_x, idx, w, counts, rows


def combine(handle: NormalHandle, x: torch.Tensor, topk_weights: Optional[torch.Tensor], bias) -> Tuple[
        torch.Tensor, Optional[torch.Tensor]]:
    """``(combined_x, combined_topk_weights)`` of DeepEP's normal ``combine``."""
    slot, d = handle.slot, handle.result
    buf, n = slot.epbuf, handle.num_rows
    if slot.latest is not handle:
        raise ValueError("handle: a later dispatch took its buffer after this handle's combine; repeat its routing "
                         "with dispatch(x, handle=handle) before combining it again")
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or tuple(x.shape) != (n, buf.hidden):
        raise ValueError(f"x: expected a bfloat16 [{n}, {buf.hidden}] tensor (one row per received row), got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', []))}")
    if x.device != buf.device:
        raise ValueError(f"x: expected a tensor on {buf.device}, got {x.device}")
    T = handle.num_tokens
    biases = _biases(bias, T, buf.hidden, buf.device)
    if topk_weights is not None:
        if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32 or \
                tuple(topk_weights.shape) != (n, buf.topk) or topk_weights.device != buf.device:
            raise ValueError(f"topk_weights: expected a float32 [{n}, {buf.topk}] tensor on {buf.device}, got "
                             f"{getattr(topk_weights, 'dtype', type(topk_weights).__name__)} "
                             f"{list(getattr(topk_weights, 'shape', []))}")
    staged = d.expert_x.shape[0] != n  # (the buffer's rows as the caller got them: x itself)
    y = slot.stage_y() if staged else x.contiguous()
    if staged:
        y[:n].copy_(x)
    # With a bias the float32 sum comes back unrounded and is rounded once, after the bias is added
    # (DeepEP's one rounding).
    out32 = torch.empty(T, buf.hidden, dtype=torch.float32, device=buf.device) if biases else None
    if topk_weights is not None:
        w = slot.stage_w() if staged else topk_weights.contiguous()
        if staged:
            w[:n].copy_(topk_weights)
        out, combined_w = buf.combine(y, d, topk_weights=w, out=out32)
    else:
        out, combined_w = buf.combine(y, d, out=out32), None
    if biases:
        for b in biases:
            out += b.float()
        out = out.to(torch.bfloat16)
    return out, combined_w


def _biases(bias, T: int, H: int, device: torch.device) -> List[torch.Tensor]:
    """DeepEP's ``bias``: None, one tensor or a pair, each bfloat16 ``[T, H]``."""
    if bias is None:
        return []
    parts = list(bias) if isinstance(bias, tuple) else [bias]
    if len(parts) > 2:
        raise ValueError(f"bias: expected a tensor or a tuple of two, got a tuple of {len(parts)}")
    for b in parts:
        if b is None:
            continue
        if not isinstance(b, torch.Tensor) or b.dtype != torch.bfloat16 or tuple(b.shape) != (T, H) or b.device != device:
            raise ValueError(f"bias: expected bfloat16 [{T}, {H}] tensors on {device}, got "
                             f"{getattr(b, 'dtype', type(b).__name__)} {list(getattr(b, 'shape', []))}")
    return [b for b in parts if b is not None]
