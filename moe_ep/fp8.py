"""fp8 e4m3 block quantization, the torch reference of what the dispatch kernel does in-kernel.

Format: one float32 scale per 128 channels (the last block may be shorter),
``scale = max(amax(|x_block|), 1e-4) / 448`` and ``q = fp8_e4m3fn(x / scale)`` rounded to nearest
even; ``x ~= q * scale``.
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0
FP8_BLOCK = 128
AMAX_FLOOR = 1e-4


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
    amax = blocks.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    # A tensor divisor on purpose: torch on CUDA turns division by a Python scalar into a multiply
    # by its reciprocal (one bit less exact), while the kernel and torch on CPU divide exactly.
    scales = amax / torch.full_like(amax, FP8_MAX)
    q = (blocks / scales.unsqueeze(-1)).view(t, nb * FP8_BLOCK)[:, :h].to(torch.float8_e4m3fn)
    return q.contiguous(), scales.contiguous()


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q ``[..., H]`` float8_e4m3fn, scales ``[..., ceil(H/128)]`` float32 -> float32 ``[..., H]``."""
    h = q.shape[-1]
    s = scales.repeat_interleave(FP8_BLOCK, dim=-1)[..., :h]
    return q.float() * s
