"""Workloads of the bench CLI: presets, model shapes, routing, and the inputs of one sweep point.

A *workload point* is one shape (tokens per rank, hidden, top-k, experts, dtypes, layout) with one
routing; every backend runs on the very same inputs of that point (same seed, same tensors), and
its combine output is checked against the oracle (``moe_ep.testing.reference``) with fake experts
``y = x * (1 + (e % 7) / 8)`` (exact in bf16).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch
import torch.distributed as dist

from .intranode import expert_scale, mean_over_ranks, rel_err, row_bytes, traffic  # noqa: F401 (rel_err: for harness)

# Preset: tokens per rank and dtypes/layout; the shape is DeepSeek-V3's unless --model/flags say otherwise.
PRESETS: dict[str, dict] = {
    "decode": dict(tokens=[128], model="deepseek-v3", dispatch_dtype="fp8", combine_dtype="bf16", layout="masked"),
    "prefill": dict(tokens=[4096], model="deepseek-v3", dispatch_dtype="fp8", combine_dtype="bf16", layout="packed"),
}

# Model shapes: hidden, top-k, routed experts (shared experts are not dispatched).
MODELS: dict[str, dict] = {
    "deepseek-v3": dict(hidden=7168, topk=8, num_experts=256),
    "kimi-k2": dict(hidden=7168, topk=8, num_experts=384),
    "qwen3-235b": dict(hidden=4096, topk=8, num_experts=128),
    "qwen3-30b": dict(hidden=2048, topk=8, num_experts=128),
    "mixtral-8x7b": dict(hidden=4096, topk=2, num_experts=8),
}

ROUTINGS = ("uniform", "zipf")
DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}
CHECK_TOL = 3e-2  # max |out - oracle| / max |oracle|: bf16 expert outputs, fp32 accumulation, bf16 result
# A backend that quantizes fp8 itself (DeepEP's low-latency dispatch multiplies by a reciprocal
# scale) may land single elements one e4m3 step (12.5% of the element) away from the oracle's
# exactly rounded bytes; measured 0.05 on H200. Wrong routing or a lost row gives O(1) errors.
CHECK_TOL_OWN_FP8 = 0.15


@dataclass(frozen=True)
class Routing:
    """How tokens pick experts.

    kind: ``uniform`` (each token picks ``topk`` distinct experts uniformly) or ``zipf`` (distinct
        experts drawn with probability proportional to ``1 / (e + 1) ** zipf_s``: expert 0 is the
        hottest, so rank 0 receives the most rows).
    zipf_s: the Zipf exponent (``zipf`` only; 0 is uniform).
    holes: probability that a selection is ``-1`` (no expert).
    """

    kind: str = "uniform"
    zipf_s: float = 1.0
    holes: float = 0.0


@dataclass(frozen=True)
class Workload:
    """One sweep point: the shape every backend runs."""

    num_tokens: int
    hidden: int
    topk: int
    num_experts: int
    dispatch_dtype: str      # "fp8" or "bf16"
    combine_dtype: str       # "bf16"
    layout: str              # moe_ep's output layout: "masked" or "packed"
    expert_alignment: int
    routing: Routing
    seed: int

    @property
    def fp8(self) -> bool:
        return self.dispatch_dtype == "fp8"


@dataclass
class Inputs:
    """This rank's inputs of one point, the oracle's answer and the traffic (mean over ranks)."""

    x: torch.Tensor             # [T, H] bf16
    topk_idx: torch.Tensor      # [T, K] int64, -1 = no expert
    topk_weights: torch.Tensor  # [T, K] float32
    ref: torch.Tensor           # [T, H] float32: dispatch -> fake experts -> combine, from the oracle
    expert_scale: torch.Tensor  # [E] float32: what fake expert e multiplies its rows by
    traffic: dict               # bytes and rows per rank, mean over ranks (see moe_ep/bench/intranode.py)


def make_routing(wl: Workload, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, topk_idx, topk_weights)`` on the CPU, deterministic in ``(seed, rank)``."""
    g = torch.Generator(device="cpu").manual_seed(wl.seed * 1000 + rank)
    t, h, k, e = wl.num_tokens, wl.hidden, wl.topk, wl.num_experts
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    if wl.routing.kind == "uniform":
        idx = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k]
    else:
        p = 1.0 / torch.arange(1, e + 1, dtype=torch.float64) ** wl.routing.zipf_s
        idx = torch.multinomial(p.expand(t, e), k, replacement=False, generator=g) if t else \
            torch.zeros(0, k, dtype=torch.int64)
    if wl.routing.holes > 0:
        idx = torch.where(torch.rand(t, k, generator=g) < wl.routing.holes, -1, idx)
    w = torch.rand(t, k, generator=g) + 0.1
    w = (w / w.sum(dim=1, keepdim=True)).float()
    return x, idx.to(torch.int64).contiguous(), w


def make_inputs(wl: Workload, group) -> Inputs:
    """Collective: this rank's inputs, the oracle's answer and the traffic of the point."""
    from moe_ep.testing.reference import reference_moe

    device, rank, world = group.device, group.rank, group.world_size
    x, idx, w = make_routing(wl, rank)
    x, idx, w = x.to(device), idx.to(device), w.to(device)
    scale = expert_scale(wl.num_experts, device)
    scale_cpu = scale.cpu()
    fn: Callable[[int, torch.Tensor], torch.Tensor] = lambda e, rows: rows * scale_cpu[e]
    ref = reference_moe(group, wl.num_experts, x, idx, w, fn, dispatch_dtype=DTYPES[wl.dispatch_dtype])
    tr = traffic(idx, SimpleNamespace(num_experts=wl.num_experts, hidden=wl.hidden,
                                      dispatch_dtype=wl.dispatch_dtype), rank, world, device)
    avg = dict(zip(tr, mean_over_ranks([float(v) for v in tr.values()], device)))
    avg["dispatch_row_bytes"] = row_bytes(wl.hidden, wl.fp8)
    avg["combine_row_bytes"] = 2 * wl.hidden
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    return Inputs(x, idx, w, ref.to(device), scale, avg)
