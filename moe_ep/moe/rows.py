"""Dispatched rows as MoELayer's experts see them, and integer side channels carried with the rows
(host side; the rows *layout*'s kernels are ``moe_ep/kernels/rows.py``).

:func:`row_groups` turns a ``DispatchResult`` (masked or packed) into flat rows with one group per
local expert. The side channels (used by the differentiable path of ``MoELayer``) ride in extra
columns of the dispatched rows as base-``b`` digits, which both dispatch dtypes deliver exactly:
bf16 holds the integers 0..256, and fp8 e4m3 holds 0..15 when the 128-channel block also holds a
448 (:data:`SENTINEL`), which makes the block's scale exactly 1.
"""
from __future__ import annotations

from typing import Optional

import torch

from .experts import RowGroups
from ..core.fp8 import FP8_MAX, dequantize_fp8

SENTINEL = FP8_MAX


def num_digits(limit: int, base: int) -> int:
    """Digits in base ``base`` needed for the integers ``[0, limit)``."""
    n, cap = 1, base
    while cap < limit:
        n, cap = n + 1, cap * base
    return n


def encode_digits(values: torch.Tensor, ndigits: int, base: int, dtype: torch.dtype) -> torch.Tensor:
    """Non-negative int64 ``[T, n]`` -> ``[T, n * ndigits]`` digits (least significant first) in ``dtype``."""
    powers = base ** torch.arange(ndigits, device=values.device, dtype=torch.int64)
    digits = (values.unsqueeze(-1) // powers) % base
    return digits.reshape(values.shape[0], values.shape[1] * ndigits).to(dtype)


def decode_digits(digits: torch.Tensor, ndigits: int, base: int) -> torch.Tensor:
    """Inverse of :func:`encode_digits`: ``[N, n * ndigits]`` (any float dtype) -> int64 ``[N, n]``."""
    powers = base ** torch.arange(ndigits, device=digits.device, dtype=torch.int64)
    d = digits.float().round().long().view(digits.shape[0], digits.shape[1] // ndigits, ndigits)
    return (d * powers).sum(-1)


def float_bits(w: torch.Tensor) -> torch.Tensor:
    """float32 -> its 32 bits as non-negative int64."""
    return w.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def bits_float(b: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`float_bits`."""
    return torch.where(b >= 2 ** 31, b - 2 ** 32, b).to(torch.int32).view(torch.float32)


def row_groups(d, layout: str, num_rows: Optional[int] = None, host: bool = False) -> RowGroups:
    """The groups of a dispatch result's rows.

    Args:
        d: a ``DispatchResult``.
        layout: ``"masked"`` (rows ``[EL * capacity]``, group e = expert e's capacity) or ``"packed"``.
        num_rows: packed only: how many leading rows to keep (at least ``offsets[-1]``); default all.
        host: also fill the host ``starts``/``counts`` (a device sync on GPU).
    """
    if layout not in ("masked", "packed"):
        raise ValueError(f"layout: expected 'masked' or 'packed' (a rows-layout result has one row per token, "
                         f"not groups per expert), got {layout!r}")
    counts = d.expert_counts.long()
    EL = counts.shape[0]
    dev = counts.device
    if layout == "masked":
        cap = d.expert_x.shape[1]
        rows = torch.arange(EL * cap, device=dev)
        expert = rows // cap
        starts_t = torch.arange(EL, device=dev) * cap
        ends = ((torch.arange(EL, device=dev) + 1) * cap).to(torch.int32)
        valid = (rows - starts_t[expert]) < counts[expert]
    else:
        n = d.expert_x.shape[0] if num_rows is None else num_rows
        starts_t = d.expert_offsets[:-1].long()
        ends = d.expert_offsets[1:].to(torch.int32, copy=True)  # buffer memory: rewritten by the next dispatch
        rows = torch.arange(n, device=dev)
        expert = torch.searchsorted(ends.long(), rows, right=True).clamp_(max=EL - 1)
        valid = ((rows - starts_t[expert]) < counts[expert]) & (rows >= starts_t[expert])
    g = RowGroups(ends=ends, valid=valid, expert=expert)
    if host:
        g.starts, g.counts = starts_t.tolist(), counts.tolist()
    return g


def flat_rows(t: torch.Tensor, num_rows: int) -> torch.Tensor:
    """A layout tensor (masked ``[EL, C, W]`` or packed ``[cap, W]``) as its first ``num_rows`` flat rows."""
    return t.reshape(-1, t.shape[-1])[:num_rows]


def delivered(d, num_rows: int, channels: slice, dtype: torch.dtype) -> torch.Tensor:
    """The dispatched values of ``channels`` (fp8 dequantized with its scales) as ``[num_rows, n]`` ``dtype``."""
    x = flat_rows(d.expert_x, num_rows)
    if d.expert_scales is None:
        return x[:, channels].to(dtype)
    s = flat_rows(d.expert_scales, num_rows)
    start = channels.start or 0
    if start % 128 != 0:
        raise ValueError("channels: an fp8 slice must start at a 128-channel block")
    return dequantize_fp8(x[:, channels], s[:, start // 128:]).to(dtype)


def to_layout(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Rows ``[N, W]`` bf16 into a tensor shaped like ``like`` (masked or packed, W channels);
    rows past N are left unset (combine never reads them)."""
    n, w = rows.shape
    total = like.numel() // like.shape[-1]
    if n == total:
        return rows.contiguous().view(*like.shape[:-1], w)
    out = torch.empty(total, w, dtype=rows.dtype, device=rows.device)
    out[:n] = rows
    return out.view(*like.shape[:-1], w)
