"""DispatchResult: what ``EPBuffer.dispatch`` returns and ``EPBuffer.combine`` takes back."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class DispatchResult:
    """What ``EPBuffer.dispatch`` returns; the tensors are views of buffer memory, valid until the
    next dispatch on the same buffer.

    Attributes:
        expert_x: masked ``[E_local, R*max_tokens, H]``; packed ``[capacity, H]``; dispatch dtype.
        expert_scales: fp8 only: float32 ``[..., ceil(H/128)]`` with expert_x's leading dims; else None.
        expert_counts: int32 ``[E_local]`` on the device: valid rows per local expert.
        expert_offsets: packed only: int32 ``[E_local + 1]``; expert e's rows start at offsets[e].
    """

    expert_x: torch.Tensor
    expert_scales: Optional[torch.Tensor]
    expert_counts: torch.Tensor
    expert_offsets: Optional[torch.Tensor]
    num_tokens: int = 0
    _buffer: object = field(default=None, repr=False)
    _serial: int = field(default=0, repr=False)
