"""The pure-torch oracle: what dispatch and combine must produce, computed from all ranks' inputs.

Nothing here is fast or clever on purpose. Every function that takes a ``group`` is collective:
all ranks of the group call it, in the same order, with their own inputs (``T`` may differ per
rank and may be 0).

- :func:`gather_inputs` brings every rank's ``x``, ``topk_idx``, ``topk_weights`` (and ``x_scales``)
  to every rank with ``torch.distributed.all_gather`` (gloo on CPU, NCCL on GPU).
- :func:`reference_dispatch` lists, for each local expert of this rank, the rows it must receive:
  one row per selection ``(source rank, token, k)`` with ``topk_idx == e``, in ascending
  ``(source rank, token, k)`` order (an implementation may order rows differently; compare as
  multisets).
- :func:`reference_rows` is what the ``rows`` layout delivers to this rank: one row per
  ``(source rank, source token)`` that selected at least one expert of this rank, in ascending
  ``(source rank, source token)`` order (exact: the rows layout's order is part of its contract),
  with the token's ids mapped to local ids (-1 elsewhere) and its weights (0 elsewhere);
  :func:`rows_combine_local` is what its combine returns for a per-rank row function.
- :func:`reference_moe` is the end-to-end answer of dispatch, an expert function and combine:
  ``out[t] = sum_{k: topk_idx[t,k] != -1} topk_weights[t,k] * expert_fn(topk_idx[t,k], xq[t])``
  in float32, where ``xq`` is what dispatch delivers (the bf16 values, or the dequantized fp8
  values); rows that select no expert are 0.

fp8 follows :mod:`moe_ep.core.fp8`: bf16 input dispatched as fp8 is ``quantize_fp8(x)``; pre-quantized
input (``x`` fp8 with ``x_scales``) is delivered as given.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..core.fp8 import dequantize_fp8, quantize_fp8

FP8 = torch.float8_e4m3fn


# ---------------------------------------------------------------------------- gathering
_WIRE_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8)


def _gather_ragged(group, t: torch.Tensor, counts: Sequence[int]) -> List[torch.Tensor]:
    """all_gather of a ``[T_r, ...]`` tensor whose ``T_r`` (``counts[r]``) differs per rank.

    Dtypes a backend may not gather (fp8, bf16) travel as their bytes (uint8)."""
    if group.pg is None or group.world_size == 1:
        return [t.clone()]
    t = t.contiguous()
    wire = t if t.dtype in _WIRE_DTYPES else t.view(torch.uint8)
    n = max(1, max(counts))  # never gather empty tensors
    dev = group.collective_device
    padded = torch.zeros((n,) + tuple(wire.shape[1:]), dtype=wire.dtype, device=dev)
    padded[: t.shape[0]] = wire.to(dev)
    outs = [torch.empty_like(padded) for _ in range(group.world_size)]
    dist.all_gather(outs, padded, group=group.pg)
    return [o[:c].to(t.device, copy=True).view(t.dtype) for o, c in zip(outs, counts)]


@dataclass
class GatheredInputs:
    """Every rank's inputs, indexed by rank."""

    x: List[torch.Tensor]
    topk_idx: List[torch.Tensor]
    topk_weights: List[torch.Tensor]
    x_scales: Optional[List[torch.Tensor]]

    @property
    def num_tokens(self) -> List[int]:
        return [int(t.shape[0]) for t in self.x]


def gather_inputs(group, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                  x_scales: Optional[torch.Tensor] = None) -> GatheredInputs:
    """Collective: every rank's ``(x, topk_idx, topk_weights, x_scales)``, as lists indexed by rank.

    Tensors keep their dtypes (fp8 travels as bytes); they live on ``group.device``. ``topk_idx``
    comes back as int64. ``x_scales`` must be given on all ranks or on none.
    """
    counts = [int(c) for c in group.all_gather_object(int(x.shape[0]))]
    has_scales = group.all_gather_object(x_scales is not None)
    if any(has_scales) != all(has_scales):
        raise ValueError("x_scales: given on some ranks and not on others")
    xs = _gather_ragged(group, x, counts)
    idx = _gather_ragged(group, topk_idx.to(torch.int64), counts)
    w = _gather_ragged(group, topk_weights, counts)
    sc = _gather_ragged(group, x_scales, counts) if x_scales is not None else None
    return GatheredInputs(xs, idx, w, sc)


# ---------------------------------------------------------------------------- what dispatch delivers
def delivered_rows(x: torch.Tensor, x_scales: Optional[torch.Tensor], dispatch_dtype: torch.dtype):
    """``(values float32 [T,H], q fp8 [T,H] or None, scales float32 [T,nb] or None)``: what dispatch
    delivers for each token row of ``x``."""
    if x.dtype == FP8:
        if x_scales is None:
            raise ValueError("x_scales: required with fp8 x")
        if dispatch_dtype != FP8:
            raise ValueError(f"dispatch_dtype: pre-quantized fp8 input needs fp8 dispatch, got {dispatch_dtype}")
        return dequantize_fp8(x, x_scales.float()), x, x_scales.float()
    if x_scales is not None:
        raise ValueError("x_scales: only with fp8 x")
    if dispatch_dtype == FP8:
        q, s = quantize_fp8(x)
        return dequantize_fp8(q, s), q, s
    if dispatch_dtype != torch.bfloat16:
        raise ValueError(f"dispatch_dtype: expected torch.bfloat16 or torch.float8_e4m3fn, got {dispatch_dtype}")
    return x.to(torch.bfloat16).float(), None, None


@dataclass
class ReferenceDispatch:
    """The rows each local expert of ``rank`` must receive (lists indexed by local expert).

    ``rows[e]`` float32 ``[n, H]`` (dequantized for fp8); ``q[e]`` fp8 ``[n, H]`` and ``scales[e]``
    float32 ``[n, nb]`` (fp8 only, else None); ``src_rank[e]``, ``src_token[e]``, ``src_k[e]`` int64
    ``[n]``; ``weight[e]`` float32 ``[n]``; ``counts[e] == n``. Rows are in ascending
    ``(src_rank, src_token, src_k)`` order.
    """

    rank: int
    world_size: int
    num_experts: int
    first_expert: int
    rows: List[torch.Tensor] = field(default_factory=list)
    q: Optional[List[torch.Tensor]] = None
    scales: Optional[List[torch.Tensor]] = None
    src_rank: List[torch.Tensor] = field(default_factory=list)
    src_token: List[torch.Tensor] = field(default_factory=list)
    src_k: List[torch.Tensor] = field(default_factory=list)
    weight: List[torch.Tensor] = field(default_factory=list)
    counts: List[int] = field(default_factory=list)

    @property
    def num_local_experts(self) -> int:
        return len(self.counts)


def _check_ids(idx: torch.Tensor, num_experts: int, src: int) -> None:
    if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= num_experts):
        raise ValueError(f"topk_idx: rank {src} has expert ids outside [-1, {num_experts})")


def dispatch_from_gathered(inputs: GatheredInputs, rank: int, world_size: int, num_experts: int,
                           dispatch_dtype: torch.dtype = torch.bfloat16) -> ReferenceDispatch:
    """The non-collective part of :func:`reference_dispatch`: ``inputs`` holds all ranks' inputs."""
    if num_experts % world_size != 0:
        raise ValueError(f"num_experts: expected a multiple of world_size={world_size}, got {num_experts}")
    n_local = num_experts // world_size
    first = rank * n_local
    fp8 = dispatch_dtype == FP8
    out = ReferenceDispatch(rank, world_size, num_experts, first,
                            q=[] if fp8 else None, scales=[] if fp8 else None)
    per_src = []
    for s in range(len(inputs.x)):
        sc = inputs.x_scales[s] if inputs.x_scales is not None else None
        vals, q, scl = delivered_rows(inputs.x[s], sc, dispatch_dtype)
        idx = inputs.topk_idx[s].to(torch.int64)
        _check_ids(idx, num_experts, s)
        per_src.append((vals, q, scl, idx, inputs.topk_weights[s].float()))
    for e in range(first, first + n_local):
        rows, qs, ss, rk, tk, kk, ws = [], [], [], [], [], [], []
        for s, (vals, q, scl, idx, w) in enumerate(per_src):
            t, k = (idx == e).nonzero(as_tuple=True)  # row-major: ascending (t, k)
            rows.append(vals[t])
            if fp8:
                qs.append(q[t])
                ss.append(scl[t])
            rk.append(torch.full_like(t, s))
            tk.append(t)
            kk.append(k)
            ws.append(w[t, k])
        h = per_src[0][0].shape[1] if per_src else 0
        out.rows.append(torch.cat(rows) if rows else torch.zeros(0, h))
        if fp8:
            out.q.append(torch.cat(qs))
            out.scales.append(torch.cat(ss))
        out.src_rank.append(torch.cat(rk))
        out.src_token.append(torch.cat(tk))
        out.src_k.append(torch.cat(kk))
        out.weight.append(torch.cat(ws))
        out.counts.append(int(out.rows[-1].shape[0]))
    return out


def reference_dispatch(group, num_experts: int, x: torch.Tensor, topk_idx: torch.Tensor,
                       topk_weights: torch.Tensor, x_scales: Optional[torch.Tensor] = None,
                       dispatch_dtype: torch.dtype = torch.bfloat16) -> ReferenceDispatch:
    """Collective: the rows each local expert of this rank receives; see :class:`ReferenceDispatch`."""
    inputs = gather_inputs(group, x, topk_idx, topk_weights, x_scales)
    return dispatch_from_gathered(inputs, group.rank, group.world_size, num_experts, dispatch_dtype)


# ---------------------------------------------------------------------------- the rows layout
@dataclass
class ReferenceRows:
    """What a ``rows``-layout dispatch delivers to ``rank``: ``n`` rows, one per ``(source rank,
    source token)`` that selected at least one of ``rank``'s experts, in ascending (source rank,
    source token) order.

    ``rows`` float32 ``[n, H]`` (dequantized for fp8); ``q`` fp8 ``[n, H]`` and ``scales`` float32
    ``[n, nb]`` (fp8 only, else None); ``topk_idx`` int32 ``[n, K]``: local expert id (global id -
    rank * E_local) where the token's k-th selection is on ``rank``, else -1; ``topk_weights``
    float32 ``[n, K]``: the weight there, else 0; ``src`` int64 ``[n]``: ``source rank *
    max_tokens + source token``; ``counts``: selections of each local expert among the rows (a
    token listing an expert twice counts 2). Tensors are on the host (CPU) for every input device.
    """

    rank: int
    rows: torch.Tensor
    q: Optional[torch.Tensor]
    scales: Optional[torch.Tensor]
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    src: torch.Tensor
    counts: List[int]

    @property
    def num_recv(self) -> int:
        return int(self.src.shape[0])


def local_routing(topk_idx: torch.Tensor, topk_weights: torch.Tensor, rank: int, num_local_experts: int):
    """``(ids int32 [T, K], weights float32 [T, K], mask bool [T])`` of ``topk_idx`` as ``rank``
    sees it: local ids where a selection is one of its experts (-1 elsewhere), the weight there (0
    elsewhere), and which tokens selected at least one of its experts."""
    idx = topk_idx.to(torch.int64)
    mine = (idx >= rank * num_local_experts) & (idx < (rank + 1) * num_local_experts)
    lid = torch.where(mine, idx - rank * num_local_experts, torch.full_like(idx, -1)).to(torch.int32)
    w = torch.where(mine, topk_weights.float(), torch.zeros_like(topk_weights, dtype=torch.float32))
    return lid, w, mine.any(dim=1)


def rows_from_gathered(inputs: GatheredInputs, rank: int, world_size: int, num_experts: int, max_tokens: int,
                       dispatch_dtype: torch.dtype = torch.bfloat16) -> ReferenceRows:
    """The non-collective part of :func:`reference_rows`: ``inputs`` holds all ranks' inputs."""
    if num_experts % world_size != 0:
        raise ValueError(f"num_experts: expected a multiple of world_size={world_size}, got {num_experts}")
    EL = num_experts // world_size
    fp8 = dispatch_dtype == FP8
    rows, qs, ss, ids, ws, src = [], [], [], [], [], []
    counts = torch.zeros(EL, dtype=torch.int64)
    for s in range(len(inputs.x)):
        sc = inputs.x_scales[s] if inputs.x_scales is not None else None
        vals, q, scl = delivered_rows(inputs.x[s], sc, dispatch_dtype)
        _check_ids(inputs.topk_idx[s], num_experts, s)
        lid, w, has = local_routing(inputs.topk_idx[s], inputs.topk_weights[s], rank, EL)
        t = has.nonzero().flatten()  # ascending token order
        rows.append(vals[t])
        if fp8:
            qs.append(q[t])
            ss.append(scl[t])
        ids.append(lid[t])
        ws.append(w[t])
        src.append(s * max_tokens + t)
        counts += torch.bincount(lid[lid >= 0].to(torch.int64), minlength=EL).cpu()
    K = inputs.topk_idx[0].shape[1] if inputs.topk_idx else 0
    H = inputs.x[0].shape[1] if inputs.x else 0
    # On the host, whatever device the inputs are on: the oracle is compared, not computed with.
    cat = lambda parts, shape, dt: torch.cat(parts).cpu() if parts else torch.zeros(shape, dtype=dt)  # noqa: E731
    return ReferenceRows(rank, cat(rows, (0, H), torch.float32), cat(qs, (0, H), FP8) if fp8 else None,
                         cat(ss, (0, 0), torch.float32) if fp8 else None, cat(ids, (0, K), torch.int32),
                         cat(ws, (0, K), torch.float32), cat(src, (0,), torch.int64), counts.tolist())


def reference_rows(group, num_experts: int, max_tokens: int, x: torch.Tensor, topk_idx: torch.Tensor,
                   topk_weights: torch.Tensor, x_scales: Optional[torch.Tensor] = None,
                   dispatch_dtype: torch.dtype = torch.bfloat16) -> ReferenceRows:
    """Collective: what a ``rows``-layout dispatch delivers to this rank; see :class:`ReferenceRows`."""
    inputs = gather_inputs(group, x, topk_idx, topk_weights, x_scales)
    return rows_from_gathered(inputs, group.rank, group.world_size, num_experts, max_tokens, dispatch_dtype)


RowFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rows_combine_local(num_experts: int, world_size: int, x: torch.Tensor, topk_idx: torch.Tensor,
                       topk_weights: torch.Tensor, row_fn: RowFn, x_scales: Optional[torch.Tensor] = None,
                       dispatch_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """float32 ``[T, W]``: what a ``rows``-layout combine returns on this rank when every rank ``r``
    hands back ``row_fn(r, rows, ids, weights)`` for the rows it received (``rows`` float32
    ``[n, H]`` as delivered, ``ids``/``weights`` ``[n, K]`` as in :class:`ReferenceRows`; it must
    map each row on its own and return float32 ``[n, W]``): per token, the float32 sum over the
    ranks that received it (0 for a token sent nowhere). Needs no other rank."""
    vals, _, _ = delivered_rows(x, x_scales, dispatch_dtype)
    vals = vals.cpu()
    idx, w = topk_idx.to(torch.int64).cpu(), topk_weights.float().cpu()
    _check_ids(idx, num_experts, -1)
    EL = num_experts // world_size
    out = None
    for r in range(world_size):
        lid, wr, has = local_routing(idx, w, r, EL)
        t = has.nonzero().flatten()
        y = row_fn(r, vals[t], lid[t], wr[t]).float().cpu()  # called for every rank, even with 0 rows
        if out is None:
            out = torch.zeros(vals.shape[0], y.shape[1])
        out.index_add_(0, t, y)
    return out.to(x.device)


# ---------------------------------------------------------------------------- dispatch + experts + combine
ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


def moe_local(num_experts: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
              expert_fn: ExpertFn, x_scales: Optional[torch.Tensor] = None,
              dispatch_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """float32 ``[T, H]``: the MoE output of one rank's tokens (needs no other rank: an expert
    function maps each row on its own)."""
    vals, _, _ = delivered_rows(x, x_scales, dispatch_dtype)
    vals = vals.cpu()
    idx = topk_idx.to(torch.int64).cpu()
    w = topk_weights.float().cpu()
    _check_ids(idx, num_experts, -1)
    out = torch.zeros_like(vals)
    for e in range(num_experts):
        t, k = (idx == e).nonzero(as_tuple=True)
        if t.numel() == 0:
            continue
        y = expert_fn(e, vals[t]).float().cpu()
        if y.shape != (t.numel(), vals.shape[1]):
            raise ValueError(f"expert_fn: expected [{t.numel()}, {vals.shape[1]}] from expert {e}, got {list(y.shape)}")
        out.index_add_(0, t, w[t, k].unsqueeze(1) * y)
    return out.to(x.device)


def reference_moe(group, num_experts: int, x: torch.Tensor, topk_idx: torch.Tensor,
                  topk_weights: torch.Tensor, expert_fn: ExpertFn, x_scales: Optional[torch.Tensor] = None,
                  dispatch_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """float32 ``[T, H]`` for this rank's tokens: the answer of dispatch -> ``expert_fn`` -> combine.

    ``expert_fn(e, rows)`` takes the global expert id and float32 ``[n, H]`` rows (what dispatch
    delivers) and returns float32 ``[n, H]``; it must map each row independently (as an MoE
    expert does). Accumulates in float32 with no intermediate rounding. Collective for symmetry
    with the other oracles (it checks every rank's expert ids).
    """
    if num_experts % group.world_size != 0:
        raise ValueError(f"num_experts: expected a multiple of world_size={group.world_size}, got {num_experts}")
    ok = group.all_gather_object(bool(topk_idx.numel() == 0 or (int(topk_idx.min()) >= -1 and
                                                                 int(topk_idx.max()) < num_experts)))
    if not all(ok):
        raise ValueError(f"topk_idx: ranks {[r for r, o in enumerate(ok) if not o]} have expert ids "
                         f"outside [-1, {num_experts})")
    return moe_local(num_experts, x, topk_idx, topk_weights, expert_fn, x_scales, dispatch_dtype)


def reference_combine(group, num_experts: int, x: torch.Tensor, topk_idx: torch.Tensor,
                      topk_weights: torch.Tensor, expert_fn: ExpertFn, x_scales: Optional[torch.Tensor] = None,
                      dispatch_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Same as :func:`reference_moe` (the combine of ``expert_fn`` applied to the dispatched rows)."""
    return reference_moe(group, num_experts, x, topk_idx, topk_weights, expert_fn, x_scales, dispatch_dtype)


__all__ = ["GatheredInputs", "ReferenceDispatch", "gather_inputs", "delivered_rows", "dispatch_from_gathered",
           "reference_dispatch", "ReferenceRows", "local_routing", "rows_from_gathered", "reference_rows",
           "rows_combine_local", "moe_local", "reference_moe", "reference_combine"]
