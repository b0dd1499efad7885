"""``get_dispatch_layout`` in plain torch on the caller's stream: counts and the token-to-rank map
of DeepEP's normal mode (a few small reductions over ``topk_idx``; no communication)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..ops.calls import on_device


def check_topk_idx(name: str, topk_idx, num_experts: int, device: torch.device,
                   num_tokens: Optional[int] = None, topk: Optional[int] = None) -> None:
    """``topk_idx``: an int64 (DeepEP's ``topk_idx_t``) or int32 ``[T, K]`` tensor on ``device``."""
    if not isinstance(topk_idx, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(topk_idx).__name__}")
    if topk_idx.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name}: expected dtype torch.int64 (deep_ep.topk_idx_t) or torch.int32, got {topk_idx.dtype}")
    if topk_idx.dim() != 2 or (num_tokens is not None and topk_idx.shape[0] != num_tokens) or \
            (topk is not None and topk_idx.shape[1] != topk):
        want = f"[{num_tokens if num_tokens is not None else 'num_tokens'}, {topk if topk is not None else 'num_topk'}]"
        raise ValueError(f"{name}: expected shape {want}, got {list(topk_idx.shape)}")
    if not on_device(topk_idx, device):
        raise ValueError(f"{name}: expected a tensor on {device}, got {topk_idx.device}")


def rank_of(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """int64 ``[T, K]``: the rank owning each selected expert, -1 for ids outside [0, E)."""
    idx = topk_idx.long()
    return torch.where((idx >= 0) & (idx < num_experts), idx // (num_experts // num_ranks), -1)


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, node_size: int
                    ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """``(num_tokens_per_rank int32 [R], num_tokens_per_rdma_rank int32 [R / node_size] or None
    when one node, num_tokens_per_expert int32 [E], is_token_in_rank bool [T, R])``, on the device of
    ``topk_idx``; a token counts once per rank (node) however many of its experts are there, and
    once per selection for the expert counts."""
    T, dev = topk_idx.shape[0], topk_idx.device
    idx = topk_idx.long()
    # Ids outside [-1, E) count nowhere here; dispatch reports them (ValueError naming topk_idx).
    valid = (idx >= 0) & (idx < num_experts)
    owner = rank_of(idx, num_experts, num_ranks)
    is_token_in_rank = torch.zeros(T, num_ranks + 1, dtype=torch.bool, device=dev)
    is_token_in_rank.scatter_(1, torch.where(valid, owner, num_ranks), True)  # column R: the -1 ids
    is_token_in_rank = is_token_in_rank[:, :num_ranks].contiguous()
    num_tokens_per_rank = is_token_in_rank.sum(dim=0, dtype=torch.int32)
    # A scatter-add, not ``bincount(idx[valid])``: the mask and bincount each read a size back to
    # the host, which would make the call wait for its stream (async_finish would not be async).
    ones = torch.ones(idx.numel(), dtype=torch.int32, device=dev)
    num_tokens_per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=dev).scatter_add_(
        0, torch.where(valid, idx, num_experts).flatten(), ones)[:num_experts]
    per_node = None
    if node_size < num_ranks:
        in_node = is_token_in_rank.view(T, num_ranks // node_size, node_size).any(dim=2)
        per_node = in_node.sum(dim=0, dtype=torch.int32)
    return num_tokens_per_rank, per_node, num_tokens_per_expert, is_token_in_rank
