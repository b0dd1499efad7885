"""Backend ``nccl``: the EP a user writes with all_to_all_single and torch permutations.

The implementation is ``NaiveEP`` of moe_ep/bench/intranode.py (counts all-to-all, host sync for the
split sizes, permute once per (token, rank), all-to-all of rows and metadata, expand per expert;
combine: weighted ``index_add_``, all-to-all back, ``index_add_`` per token). On CPU it runs over gloo.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..intranode import NaiveEP
from ..workloads import Inputs, Workload
from .base import Backend, Runner, fake_expert_rows, needs_own_gpus


class NcclRunner(Runner):
    def __init__(self, wl: Workload, inputs: Inputs, rank: int):
        self.ep = NaiveEP(wl.num_experts, wl.fp8)
        self.inp, self.rank = inputs, rank
        self.d = None
        self.y: Optional[torch.Tensor] = None

    def dispatch(self) -> None:
        self.d = self.ep.dispatch(self.inp.x, self.inp.topk_idx, self.inp.topk_weights)

    def make_expert_output(self) -> None:
        ex, es, counts, _ = self.d
        el = self.ep.e_local
        expert_of_row = torch.repeat_interleave(torch.arange(el, device=counts.device), counts)
        factor = self.inp.expert_scale[self.rank * el + expert_of_row][:, None]
        self.y = fake_expert_rows(ex, es, factor)

    def combine(self) -> None:
        self.out = self.ep.combine(self.y, self.d[3])


class NcclBackend(Backend):
    name = "nccl"

    def unavailable(self) -> Optional[str]:
        return needs_own_gpus(self.ctx, "NCCL") if self.ctx.device.type == "cuda" else None

    def open(self, variant: str, wl: Workload, inputs: Inputs) -> Runner:
        return NcclRunner(wl, inputs, self.ctx.rank)
