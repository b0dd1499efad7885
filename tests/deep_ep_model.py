"""A pure-torch model of what DeepEP V1's ``deep_ep.Buffer`` calls return, written from its
docstrings and published tests, computed from every rank's inputs (``moe_ep.testing.reference.gather_inputs``).
Loops over ranks and tokens on purpose: slow and plain, nothing shared with the module it checks.

- ``layout``: ``get_dispatch_layout``.
- ``normal_dispatch``: the rows a rank receives (ascending source rank, then token), their local
  top-k ids (-1 where another rank's), weights (0 there), and the per-expert counts rounded up to
  ``expert_alignment``.
- ``normal_combine``: per source token, the sum over the ranks that received it of their rows;
  ``combined_weights``: the weights' sum.
- ``ll_dispatch``: per local expert, the rows (ascending source rank, then token) and their count;
  fp8 as DeepEP quantizes (``scale = amax / 448`` per 128 channels, ``q = x * (448 / amax)``; with
  ``round_scale`` the scale is the power of two ``2^ceil(log2(amax / 448))``, and with ``use_ue8m0``
  its exponent byte, four to an int32).
- ``ll_combine``: ``sum_k w[t, k] * y(expert, row)`` in float32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

FP8 = torch.float8_e4m3fn


def layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, node_size: int):
    """``(num_tokens_per_rank, num_tokens_per_rdma_rank or None, num_tokens_per_expert, is_token_in_rank)``."""
    T = topk_idx.shape[0]
    EL = num_experts // num_ranks
    per_rank = torch.zeros(num_ranks, dtype=torch.int32)
    per_expert = torch.zeros(num_experts, dtype=torch.int32)
    in_rank = torch.zeros(T, num_ranks, dtype=torch.bool)
    for t in range(T):
        for e in topk_idx[t].tolist():
            if e >= 0:
                per_expert[e] += 1
                in_rank[t, e // EL] = True
    per_rank += in_rank.sum(0).to(torch.int32)
    per_node = None
    if node_size < num_ranks:
        nodes = num_ranks // node_size
        per_node = torch.tensor([int(in_rank[:, n * node_size:(n + 1) * node_size].any(1).sum()) for n in range(nodes)],
                                dtype=torch.int32)
    return per_rank, per_node, per_expert, in_rank


@dataclass
class NormalRecv:
    x: torch.Tensor               # [n, H] as sent (bf16, or fp8 bytes)
    scales: Optional[torch.Tensor]  # [n, H/128] float32 for fp8
    topk_idx: torch.Tensor        # int64 [n, K]
    topk_weights: torch.Tensor    # float32 [n, K]
    src: List[tuple]              # (source rank, source token) per row
    counts: List[int]             # per local expert, aligned


def normal_dispatch(xs: List[torch.Tensor], scales: Optional[List[torch.Tensor]], idxs: List[torch.Tensor],
                    ws: List[torch.Tensor], rank: int, num_experts: int, alignment: int = 1) -> NormalRecv:
    R = len(xs)
    EL = num_experts // R
    lo = rank * EL
    rows, srows, ids, wts, src = [], [], [], [], []
    counts = [0] * EL
    for s in range(R):
        for t in range(xs[s].shape[0]):
            sel = idxs[s][t].tolist()
            if not any(lo <= e < lo + EL for e in sel):
                continue
            rows.append(xs[s][t])
            if scales is not None:
                srows.append(scales[s][t])
            ids.append([e - lo if lo <= e < lo + EL else -1 for e in sel])
            wts.append([float(w) if lo <= e < lo + EL else 0.0 for e, w in zip(sel, ws[s][t].tolist())])
            src.append((s, t))
            for e in sel:
                if lo <= e < lo + EL:
                    counts[e - lo] += 1
    H, K = xs[0].shape[1], idxs[0].shape[1]
    x = torch.stack(rows) if rows else torch.zeros(0, H, dtype=xs[0].dtype)
    sc = (torch.stack(srows) if srows else torch.zeros(0, H // 128)) if scales is not None else None
    counts = [-(-c // alignment) * alignment for c in counts]
    return NormalRecv(x, sc, torch.tensor(ids, dtype=torch.int64).view(-1, K),
                      torch.tensor(wts, dtype=torch.float32).view(-1, K), src, counts)


def normal_combine(vals: torch.Tensor, idx: torch.Tensor, num_experts: int, num_ranks: int,
                   y_of: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """float32 ``[T, H]`` for this rank's tokens: the sum, over the ranks that received token t
    (each once, however many of its experts are there), of the row that rank sends back,
    ``y_of(rank, vals[t])`` (``vals``: what the token's row held on arrival, float32)."""
    T, H = vals.shape
    EL = num_experts // num_ranks
    out = torch.zeros(T, H)
    for t in range(T):
        for r in sorted({e // EL for e in idx[t].tolist() if e >= 0}):
            out[t] += y_of(r, vals[t]).float()
    return out


def combined_weights(idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 ``[T, K]``: what combine returns for the weights when every rank sends back the
    ``recv_topk_weights`` it received: each k comes from the one rank owning its expert."""
    return torch.where(idx >= 0, w, torch.zeros_like(w))


def deepep_quantize(x: torch.Tensor, round_scale: bool = False):
    """DeepEP's per-128-channel fp8 cast of bf16 ``[n, H]``: ``(fp8 [n, H], float32 [n, H/128])``."""
    n, H = x.shape
    b = x.float().view(n, H // 128, 128)
    amax = b.abs().amax(-1).clamp_min(1e-4)
    if round_scale:
        scale = torch.tensor([[2.0 ** math.ceil(math.log2(v / 448.0)) for v in row] for row in amax.tolist()]
                             ).view(n, H // 128)
        for i in range(n):  # log2 may round across a power of two: the smallest 2^e >= amax / 448
            for j in range(H // 128):
                while scale[i, j] / 2 >= amax[i, j] / 448.0:
                    scale[i, j] /= 2
                while scale[i, j] < amax[i, j] / 448.0:
                    scale[i, j] *= 2
        return (b / scale.unsqueeze(-1)).to(FP8).view(n, H), scale
    q = (b * (448.0 / amax).unsqueeze(-1)).to(FP8).view(n, H)
    return q, amax / 448.0


def ue8m0_pack(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales ``[n, B]`` -> int32 ``[n, B/4]``: each scale's biased exponent
    (``log2(scale) + 127``) as a byte, block ``4j + i`` in byte ``i`` of int ``j``."""
    n, B = scale.shape
    out = torch.zeros(n, B // 4, dtype=torch.int64)
    for i in range(n):
        for j in range(B):
            e = int(round(math.log2(float(scale[i, j])))) + 127
            out[i, j // 4] |= e << (8 * (j % 4))
    return torch.where(out >= 2 ** 31, out - 2 ** 32, out).to(torch.int32)


@dataclass
class LLRecv:
    rows: List[torch.Tensor]       # per local expert: [n, H] bf16 (or the model's fp8 bytes)
    scales: Optional[List[torch.Tensor]]
    src: List[List[tuple]]         # per local expert: (source rank, token) per row
    counts: List[int]


def ll_dispatch(xs: List[torch.Tensor], idxs: List[torch.Tensor], rank: int, num_experts: int, fp8: bool,
                round_scale: bool = False, use_ue8m0: bool = False) -> LLRecv:
    R = len(xs)
    EL = num_experts // R
    out = LLRecv([], [] if fp8 else None, [], [])
    for le in range(EL):
        e = rank * EL + le
        rows, src = [], []
        for s in range(R):
            for t in range(xs[s].shape[0]):
                for _ in range(int((idxs[s][t] == e).sum())):
                    rows.append(xs[s][t])
                    src.append((s, t))
        H = xs[0].shape[1]
        x = torch.stack(rows) if rows else torch.zeros(0, H, dtype=torch.bfloat16)
        if fp8:
            q, sc = deepep_quantize(x, round_scale) if rows else (torch.zeros(0, H, dtype=FP8), torch.zeros(0, H // 128))
            out.rows.append(q)
            out.scales.append(ue8m0_pack(sc) if use_ue8m0 else sc)
        else:
            out.rows.append(x)
        out.src.append(src)
        out.counts.append(len(rows))
    return out


def ll_combine(idx: torch.Tensor, w: torch.Tensor, y_of_token: Callable[[int, int], torch.Tensor],
               H: int) -> torch.Tensor:
    """float32 ``[T, H]``: ``sum_k w[t, k] * y_of_token(expert, t)`` over the valid ids of this rank's
    tokens (``y_of_token`` gives the expert's output row for the token, float32 ``[H]``)."""
    T, K = idx.shape
    out = torch.zeros(T, H)
    for t in range(T):
        for k in range(K):
            e = int(idx[t, k])
            if e >= 0:
                out[t] += float(w[t, k]) * y_of_token(e, t).float()
    return out


def e4m3_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many e4m3 codes apart ``a`` and ``b`` (float8_e4m3fn) are, elementwise (sign-aware)."""
    def ordered(q):
        c = q.view(torch.uint8).to(torch.int32)
        mag = c & 0x7F
        return torch.where(c >= 0x80, -mag, mag)
    return (ordered(a) - ordered(b)).abs()
