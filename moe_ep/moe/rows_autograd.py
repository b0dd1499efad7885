"""Differentiable dispatch and combine in the rows layout, and the buffers they share (``RowsExchange``).

The rows layout delivers one row per (source rank, source token) in ascending (source rank, source
token) order, whatever the buffer (README: API). So the backward pairs its rows with the
forward's by position: the gradient of a rows dispatch is a rows combine of the row gradients
(with the weights' gradients riding along as combine weights), and the gradient of a rows combine
is a rows dispatch of the output gradient with the same routing. No tags, no sorting.

``RowsExchange`` keeps the ``EPBuffer``s of one EP group, one per (experts, topk, hidden, dtype,
max_tokens), made on first use (collective) and reused across layers and steps. ``plan(T)`` is
called once per layer call on every rank: it agrees on ``max_tokens`` (growing it when a rank
brings more tokens, never truncating) and says how many leading rows can be defined. It reads
nothing back from the device: the agreement is a host all-gather of one integer per rank over a
gloo group (none at R = 1, with a fixed ``max_tokens``, or under CUDA graph capture).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from ..ops.buffer import BufferSet, EPBuffer
from ..core.capture import capturing
from ..core.group import EPGroup
from .rows import delivered
from ..core.tuning import Tuning

FP8 = torch.float8_e4m3fn


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class RowsExchange:
    """The rows-layout ``EPBuffer``s of one EP group and the agreement on their ``max_tokens``.

    Args:
        group: the ``EPGroup``.
        max_tokens: ``None``: grows to the largest batch any rank brings (a power of two, at least
            ``min_tokens``), agreed with a host all-gather per ``plan``; an int: fixed, no
            agreement (a batch over it raises ``ValueError`` naming ``max_tokens``).
        timeout_s: the buffers' deadline.
        tuning: how the buffers launch their kernels (``moe_ep.Tuning``); ``None``: each buffer takes
            ``Tuning.from_env()`` when it is made, as ``EPBuffer`` does.
    """

    def __init__(self, group: EPGroup, max_tokens: Optional[int] = None, timeout_s: float = 30.0,
                 min_tokens: int = 16, tuning: Optional[Tuning] = None):
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens < 1):
            raise ValueError(f"max_tokens: expected None (grow as needed) or a positive int, got {max_tokens!r}")
        if tuning is not None and not isinstance(tuning, Tuning):
            raise TypeError(f"tuning: expected moe_ep.Tuning or None, got {type(tuning).__name__}")
        self.group, self.timeout_s, self.tuning = group, timeout_s, tuning
        self.fixed = max_tokens is not None
        self.max_tokens = max_tokens if self.fixed else 0
        self.min_tokens = min_tokens
        self._buffers = BufferSet()
        self._agree_pg = None
        self.agreements = 0  # host all-gathers so far (for tests and measurements)

    # ------------------------------------------------------------------ agreement
    def _agreement_group(self):
        """gloo: the group itself; else (NCCL) a gloo group of the same ranks, made once (only its
        members take part), so the agreement never touches the device."""
        if self._agree_pg is None:
            pg = self.group.pg
            if "gloo" in self.group.backend:
                self._agree_pg = pg
            else:
                ranks = dist.get_process_group_ranks(pg)
                self._agree_pg = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        return self._agree_pg

    def plan(self, num_tokens: int) -> int:
        """Called by every rank for every layer call with its token count T; returns how many
        leading rows of a dispatch can be defined (an upper bound of ``num_recv`` known on the host:
        the sum of every rank's T, or ``R * max_tokens`` where that sum is not gathered)."""
        R = self.group.world_size
        if self.fixed or capturing(self.group.device):
            if num_tokens > self.max_tokens:
                why = ("fixed max_tokens" if self.fixed else
                       "under CUDA graph capture the ranks cannot agree on a larger one: run a batch this size "
                       "eagerly first")
                raise ValueError(f"max_tokens: this rank has {num_tokens} tokens, more than max_tokens="
                                 f"{self.max_tokens} ({why})")
            return num_tokens if R == 1 else R * self.max_tokens
        if R == 1:
            if num_tokens > self.max_tokens or self.max_tokens == 0:
                self._grow(num_tokens)
            return num_tokens
        t = torch.tensor([num_tokens], dtype=torch.int64)
        every = torch.empty(R, dtype=torch.int64)
        dist.all_gather_into_tensor(every, t, group=self._agreement_group())
        self.agreements += 1
        counts = every.tolist()  # a host tensor: no device involved
        most, total = max(counts), sum(counts)
        if most > self.max_tokens or self.max_tokens == 0:
            self._grow(most)
        return total

    def _grow(self, tokens: int) -> None:
        """Every rank calls this with the same ``tokens``: the old buffers go (their memory too)."""
        self.close()
        self.max_tokens = max(self.min_tokens, _pow2(tokens))

    # ------------------------------------------------------------------ buffers
    def buffer(self, num_experts: int, topk: int, hidden: int, dtype: torch.dtype) -> EPBuffer:
        """The rows buffer of that shape at the agreed ``max_tokens`` (made collectively on first use)."""
        # "worst": the layer reads an upper bound of the rows without a host sync (``plan``), and
        # captures in CUDA graphs
        return self._buffers.get((num_experts, topk, hidden, dtype, self.max_tokens), lambda: EPBuffer(
            self.group, num_experts, hidden, self.max_tokens, topk, dispatch_dtype=dtype, layout="rows",
            timeout_s=self.timeout_s, tuning=self.tuning, max_recv_rows="worst"))

    def close(self) -> None:
        self._buffers.close()


@dataclass
class RowsLink:
    """What one layer call's dispatch and combine share: the exchange, the layer's shape, the number
    of rows handed to the experts (``num_rows``), the forward's handle and, in the backward, the
    handle of the output gradient's dispatch (which the dispatch's backward combines with)."""

    exchange: RowsExchange
    num_experts: int
    topk: int
    dispatch_dtype: torch.dtype
    num_rows: int
    handle: object = None
    grad_handle: object = field(default=None, repr=False)

    def buffer(self, hidden: int, dtype: torch.dtype) -> EPBuffer:
        return self.exchange.buffer(self.num_experts, self.topk, hidden, dtype)


def _received(d, n: int, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` rows of a rows dispatch as ``dtype`` with rows past ``num_recv`` zeroed (they
    hold whatever an earlier call left), and the validity mask ``[n]``; no host sync."""
    x = delivered(d, n, slice(0, d.expert_x.shape[1]), dtype)  # fp8: dequantized with its scales
    valid = torch.arange(n, device=x.device) < d.num_recv
    return torch.where(valid.unsqueeze(1), x, torch.zeros((), dtype=dtype, device=x.device)), valid


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t [n, W]`` as ``[rows, W]``, contiguous. Rows past n are left unset: a rows combine reads only
    rows below ``num_recv`` <= n (no fill of the whole capacity)."""
    if t.shape[0] == rows:
        return t.contiguous()
    out = t.new_empty(rows, t.shape[1])
    out[:t.shape[0]] = t
    return out


class DispatchRows(torch.autograd.Function):
    """x ``[T, H]`` bf16, weights ``[T, K]`` float32, ids ``[T, K]`` (global, -1 none) ->
    rows ``[n, H]`` bf16, their local ids ``[n, K]`` int64 (-1 where not here) and weights
    ``[n, K]`` float32 (0 there), n = ``link.num_rows``; rows past the received count are 0 with
    ids -1. Backward: a rows combine of the row and weight gradients on the handle of the output
    gradient's dispatch (:class:`CombineRows`' backward runs first)."""

    @staticmethod
    def forward(ctx, link: RowsLink, x: torch.Tensor, weights: torch.Tensor, topk_idx: torch.Tensor):
        buf = link.buffer(x.shape[1], link.dispatch_dtype)
        d = buf.dispatch(x, topk_idx, weights)
        link.handle = d
        n = link.num_rows
        rows, valid = _received(d, n, torch.bfloat16)
        ids = d.recv_topk_idx[:n].long()
        here = valid.unsqueeze(1) & (ids >= 0)
        ids = torch.where(here, ids, torch.full_like(ids, -1))
        w = torch.where(here, d.recv_topk_weights[:n], torch.zeros((), device=ids.device))
        ctx.link = link
        ctx.save_for_backward(here)
        ctx.mark_non_differentiable(ids)
        return rows, ids, w

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_rows, _g_ids, g_w):
        link = ctx.link
        (here,) = ctx.saved_tensors
        d = link.grad_handle
        if d is None:
            raise RuntimeError("moe_ep rows dispatch backward: the combine's backward did not run first")
        cap = d.expert_x.shape[0]
        g_w = torch.where(here, g_w.float(), torch.zeros((), device=g_w.device))
        gx, gw = d.buffer.combine(_padded(g_rows.to(torch.bfloat16), cap), d,
                                  topk_weights=_padded(g_w, cap))
        link.grad_handle = None
        return None, gx, gw, None


class CombineRows(torch.autograd.Function):
    """y ``[n, H]`` bf16 (each row already reduced over this rank's experts) -> ``[T, H]`` bf16, the
    sum over the ranks that received each token. Backward: a rows dispatch of the output gradient
    with the forward's ids (so its rows are the forward's, in the same order), bf16."""

    @staticmethod
    def forward(ctx, link: RowsLink, y: torch.Tensor, weights: torch.Tensor, topk_idx: torch.Tensor):
        d = link.handle
        out = d.buffer.combine(_padded(y.to(torch.bfloat16), d.expert_x.shape[0]), d)
        ctx.link = link
        ctx.save_for_backward(weights, topk_idx)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_out):
        link = ctx.link
        weights, topk_idx = ctx.saved_tensors
        buf = link.buffer(g_out.shape[1], torch.bfloat16)
        d = buf.dispatch(g_out.to(torch.bfloat16).contiguous(), topk_idx, weights)
        link.grad_handle = d
        g_rows, _ = _received(d, link.num_rows, torch.bfloat16)
        return None, g_rows, None, None


def rows_moe(exchange: RowsExchange, experts, x: torch.Tensor, topk_idx: torch.Tensor,
             topk_weights: torch.Tensor, num_experts: int, dispatch_dtype: torch.dtype = torch.bfloat16,
             sentinel: Optional[int] = None, distinct_ids: bool = True) -> torch.Tensor:
    """Dispatch -> ``experts(rows, local_ids, weights)`` -> combine, differentiable in ``x``,
    ``topk_weights`` and whatever ``experts`` closes over.

    Args:
        x: ``[T, H]`` floating point on the group's device. topk_idx: ``[T, K]`` global expert ids.
        topk_weights: ``[T, K]`` floating point.
        experts: ``(rows [n, H] x.dtype, ids [n, K'] int64, weights [n, K']
            topk_weights.dtype) -> [n, H]``, each row already weighted and summed over its
            selections; ids of selections elsewhere (and of padding rows, which are zero) are
            ``sentinel`` (default -1) with weight 0. With ``distinct_ids`` (a token's ids are distinct,
            as top-k routers make them) ``K' = min(K, num_experts / R)``, a row's selections here
            first; else ``K' = K``.
    Returns:
        ``[T, H]`` in ``x.dtype``.
    """
    T, K = topk_idx.shape
    n = max(1, exchange.plan(T))
    n = min(n, exchange.group.world_size * exchange.max_tokens)
    link = RowsLink(exchange, num_experts, K, dispatch_dtype, n)
    xb = x.to(torch.bfloat16).contiguous()
    wf = topk_weights.float().contiguous()
    idx = topk_idx.contiguous()
    rows, ids, w = DispatchRows.apply(link, xb, wf, idx)
    local = num_experts // exchange.group.world_size
    if distinct_ids and local < K:  # a row holds at most `local` picks here: keep those columns
        order = torch.where(ids < 0, torch.full_like(ids, local), ids).argsort(dim=1, stable=True)[:, :local]
        ids, w = ids.gather(1, order), w.gather(1, order)
    if sentinel is not None:
        ids = torch.where(ids < 0, torch.full_like(ids, sentinel), ids)
    y = experts(rows.to(x.dtype), ids, w.to(topk_weights.dtype))
    out = CombineRows.apply(link, y, wf.detach(), idx)
    return out.to(x.dtype)
