"""Top-k routers of MoE layers: softmax (Mixtral, Qwen3-MoE) and sigmoid with grouped top-k (DeepSeek-V3).

Both compute the same thing the published models do, in the same order of operations, so an
unmodified model and its expert-parallel copy pick the same experts for the same input.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

ROUTERS = ("softmax", "sigmoid")


def check_router_args(router: str, num_experts: int, topk: int, n_group: Optional[int],
                      topk_group: Optional[int]) -> Tuple[int, int]:
    """Validates the router arguments; returns ``(n_group, topk_group)`` with defaults filled in."""
    if router not in ROUTERS:
        raise ValueError(f"router: expected 'softmax' or 'sigmoid', got {router!r}")
    if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= num_experts:
        raise ValueError(f"topk: expected an int in [1, num_experts={num_experts}], got {topk!r}")
    if router == "softmax":
        if n_group not in (None, 1) or topk_group not in (None, 1):
            raise ValueError("n_group/topk_group: grouped top-k needs router='sigmoid'")
        return 1, 1
    n_group = 1 if n_group is None else n_group
    topk_group = n_group if topk_group is None else topk_group
    if not isinstance(n_group, int) or n_group < 1 or num_experts % n_group != 0:
        raise ValueError(f"n_group: expected a positive divisor of num_experts={num_experts}, got {n_group!r}")
    if not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group: expected an int in [1, n_group={n_group}], got {topk_group!r}")
    per_group = num_experts // n_group
    if n_group > 1 and per_group < 2:
        raise ValueError(f"n_group: grouped top-k scores a group by its best two experts; "
                         f"num_experts/n_group={per_group} < 2")
    if topk > topk_group * per_group:
        raise ValueError(f"topk: {topk} exceeds the experts of topk_group={topk_group} groups ({topk_group * per_group})")
    return n_group, topk_group


class Router(nn.Module):
    """Scores every expert for each token and keeps the top-k.

    Args:
        hidden: H. num_experts: E. topk: K.
        router: ``"softmax"``: softmax over all E logits (float32), top-k, renormalised when
            ``norm_topk_prob``. ``"sigmoid"``: float32 sigmoid scores; the choice uses
            ``scores + e_score_correction_bias``, restricted to the ``topk_group`` best of
            ``n_group`` groups (a group scores the sum of its best two); the weights are the
            chosen experts' scores, renormalised when ``norm_topk_prob``.
        routed_scaling_factor: multiplies the final weights.

    Parameters: ``weight [E, H]``; sigmoid also has the buffer ``e_score_correction_bias [E]`` (float32).
    """

    def __init__(self, hidden: int, num_experts: int, topk: int, router: str = "softmax",
                 n_group: Optional[int] = None, topk_group: Optional[int] = None, norm_topk_prob: bool = True,
                 routed_scaling_factor: float = 1.0, device=None, dtype=None):
        super().__init__()
        self.n_group, self.topk_group = check_router_args(router, num_experts, topk, n_group, topk_group)
        self.kind, self.num_experts, self.topk = router, num_experts, topk
        self.norm_topk_prob = bool(norm_topk_prob)
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=hidden ** -0.5)
        if router == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, device=device, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x ``[T, H]`` -> ``(logits [T, E], topk_weights [T, K] float32, topk_idx [T, K] int64)``."""
        if self.kind == "softmax":
            logits = F.linear(x, self.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights, idx = torch.topk(probs, self.topk, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:
            logits = F.linear(x.float(), self.weight.float())
            scores = logits.sigmoid()
            choice = scores.detach() + self.e_score_correction_bias
            if self.n_group > 1:
                T = choice.shape[0]
                grouped = choice.view(T, self.n_group, self.num_experts // self.n_group)
                group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
                keep = torch.topk(group_scores, self.topk_group, dim=-1, sorted=False)[1]
                mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
                choice = grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(T, self.num_experts)
            idx = torch.topk(choice, self.topk, dim=-1, sorted=False)[1]
            weights = scores.gather(1, idx)
            if self.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.routed_scaling_factor
        return logits, weights.float(), idx
