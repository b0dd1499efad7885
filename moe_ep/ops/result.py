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
        expert_x: masked ``[E_local, expert_capacity (default R*max_tokens), H]``; packed
            ``[rows, H]``: sized per call (``EPBuffer(max_recv_rows=None)``), exactly this
            dispatch's ``expert_offsets[-1]`` rows; else ``max_recv_rows`` or the worst case
            ``R*max_tokens*K + E_local*(expert_alignment - 1)``; rows ``[rows, H]`` (row i: the
            i-th (source rank, source token) that selected an expert of this rank, in ascending
            order; rows ``< num_recv`` defined), sized as packed: per call exactly ``num_recv``
            rows, else ``max_recv_rows`` or the worst case ``R*max_tokens``; dispatch dtype.
        expert_scales: fp8 only: float32 ``[..., ceil(H/128)]`` with expert_x's leading dims (a
            column-major view in its last two dims with ``EPBuffer(column_major_scales=True)``); else None.
        expert_counts: int32 ``[E_local]`` on the device: selections of each local expert (masked,
            packed: its valid rows).
        expert_offsets: packed only: int32 ``[E_local + 1]``; expert e's rows start at offsets[e].
        recv_topk_idx: rows only: int32 ``[rows, K]`` (expert_x's rows): per received row, the local expert id
            of the token's k-th selection where it is an expert of this rank, else -1.
        recv_topk_weights: rows only: float32 ``[rows, K]``: its weight there, else 0.
        recv_src: rows only: int32 ``[rows]``: ``source rank * max_tokens + source token``.
        num_recv: rows only: int32 ``[1]`` on the device: how many rows are defined.
        num_tokens: T, the tokens this rank passed to the dispatch.
        buffer: the ``EPBuffer`` that returned it, and ``serial``: which of its dispatches (combine
            takes only the latest dispatch's result of its own buffer).
    """

    expert_x: torch.Tensor
    expert_scales: Optional[torch.Tensor]
    expert_counts: torch.Tensor
    expert_offsets: Optional[torch.Tensor]
    recv_topk_idx: Optional[torch.Tensor] = None
    recv_topk_weights: Optional[torch.Tensor] = None
    recv_src: Optional[torch.Tensor] = None
    num_recv: Optional[torch.Tensor] = None
    num_tokens: int = 0
    buffer: object = field(default=None, repr=False)
    serial: int = field(default=0, repr=False)

    @classmethod
    def issued(cls, fields: dict, buffer, num_tokens: int, serial: int) -> "DispatchResult":
        """The result of a dispatch just issued by ``buffer``: ``fields`` (every field but these
        three, the same for each call of one buffer) plus ``buffer``, ``num_tokens`` and ``serial``.
        Built without the dataclass ``__init__`` (1.6 -> 0.6 us of host time per eager dispatch,
        measured on a CPU); the object is the same as one ``__init__`` makes. (``fields`` holds no
        reference to the buffer: the buffer keeps it, and a cycle would keep a deleted buffer's
        device memory until the garbage collector runs.)"""
        r = object.__new__(cls)
        d = fields.copy()
        d["buffer"], d["num_tokens"], d["serial"] = buffer, num_tokens, serial
        r.__dict__ = d
        return r
