"""fp8 e4m3 block quantization, the torch reference of what the dispatch kernel does in-kernel.

Format: one float32 scale per 128 channels (the last block may be shorter),
``scale = max(amax(|x_block|), 1e-4) / 448`` and ``q = fp8_e4m3fn(x * (448 / max(amax, 1e-4)))``
rounded to nearest even (DeepEP's rounding: both quotients exact IEEE divisions, then one float32
multiply per element); ``x ~= q * scale``.

Non-finite input: a block holding a NaN or an infinity (e4m3fn has no infinity, and an infinite
scale would turn the block's finite values into ``0 * inf``) becomes NaN as a whole: its scale is
the float32 NaN ``0x7FC00000`` and each of its bytes the e4m3fn NaN ``0x7F``, so it dequantizes
to NaN and the NaN reaches the expert and combine. Other blocks of the row are unaffected.
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0
FP8_BLOCK = 128
AMAX_FLOOR = 1e-4
NAN_SCALE_BITS = 0x7FC00000  # the scale of a block with a non-finite value (float32 quiet NaN)
NAN_BYTE = 0x7F              # each byte of such a block (e4m3fn NaN)


def num_scale_blocks(hidden: int) -> int:
    """ceil(hidden / 128): scales per row."""
    return (hidden + FP8_BLOCK - 1) // FP8_BLOCK


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[T, H]`` (any float dtype, any device) -> (q ``[T, H]`` float8_e4m3fn, scales ``[T, ceil(H/128)]`` float32)."""
    t, h = x.shape
    nb = num_scale_blocks(h)
    xf = x.float()
    pad = nb * FP8_BLOCK - h
    blocks = torch.nn.functional.pad(xf, (0, pad)).view(t, nb, FP8_BLOCK)
    bad = ~torch.isfinite(blocks).all(dim=-1)  # [t, nb]: blocks with a NaN or an infinity
    amax = blocks.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    # A tensor divisor on purpose: torch on CUDA turns division by a Python scalar into a multiply
    # by its reciprocal (one bit less exact), while the kernel and torch on CPU divide exactly.
    scales = amax / torch.full_like(amax, FP8_MAX)
    inv = torch.full_like(amax, FP8_MAX) / amax
    q = (blocks * inv.unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8)
    nan_scale = torch.tensor(NAN_SCALE_BITS, dtype=torch.int32, device=x.device).view(torch.float32)
    scales = torch.where(bad, nan_scale, scales)
    q = torch.where(bad.unsqueeze(-1), torch.tensor(NAN_BYTE, dtype=torch.uint8, device=x.device), q)
    q = q.view(t, nb * FP8_BLOCK)[:, :h].view(torch.float8_e4m3fn)
    return q.contiguous(), scales.contiguous()


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q ``[..., H]`` float8_e4m3fn, scales ``[..., ceil(H/128)]`` float32 -> float32 ``[..., H]``."""
    h = q.shape[-1]
    s = scales.repeat_interleave(FP8_BLOCK, dim=-1)[..., :h]
    return q.float() * s
