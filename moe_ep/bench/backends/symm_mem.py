"""Backend ``symm_mem``: torch's NVSHMEM all-to-all ops ``all_to_all_vdev_2d`` (dispatch) and
``all_to_all_vdev_2d_offset`` (combine), with torch permutations around them.

Dispatch sends one row per valid selection (token, k), sorted by global expert (that is, by
destination rank, then local expert: the ops' "rank-major" input order); rows arrive grouped by
local expert, then source rank. fp8 rows travel as their bytes (payload + float32 scales) viewed
as bf16. Combine sends each expert output row back to its source position (the ``_offset`` op is
the exact inverse), where the rows are weighted and summed per token. No host synchronisation.

torch's symmetric memory has one allocation backend per process: this backend needs NVSHMEM,
moe_ep allocates with the CUDA backend, so the two do not run in the same launch (the second one
reports why); ``scripts/compare.sh`` runs each backend in its own launch.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist

from ..workloads import Inputs, Workload
from . import base
from .base import Backend, NotAvailable, Runner, fake_expert_rows, needs_own_gpus


# NVSHMEM memory is kept until the process exits (freeing it is collective; the sweep's points are few).
_KEEP: list[torch.Tensor] = []


def _payload(x: torch.Tensor, fp8: bool) -> torch.Tensor:
    """Rows as bf16 words: bf16 ``x`` itself, or fp8 bytes + float32 scales viewed as bf16."""
    if not fp8:
        return x
    from moe_ep.core.fp8 import quantize_fp8

    q, s = quantize_fp8(x)
    return torch.cat([q.view(torch.uint8), s.view(torch.uint8)], dim=1).view(torch.bfloat16)


class SymmMemRunner(Runner):
    def __init__(self, wl: Workload, inputs: Inputs, ctx: base.Context):
        import torch.distributed._symmetric_memory as symm_mem

        self.wl, self.inp, self.ctx = wl, inputs, ctx
        self.group_name = dist.group.WORLD.group_name
        R, dev = ctx.world_size, ctx.device
        self.ne = wl.num_experts // R
        t, k, h = wl.num_tokens, wl.topk, wl.hidden
        self.cols = _payload(torch.zeros(1, h, dtype=torch.bfloat16, device=dev), wl.fp8).shape[1]
        n_in = max(1, t * k)
        n_out = n_in * R + self.ne  # major_align=1: an empty expert still takes one row
        self.inp_buf = symm_mem.empty(n_in, self.cols, dtype=torch.bfloat16, device=dev)
        self.out_buf = symm_mem.empty(n_out, self.cols, dtype=torch.bfloat16, device=dev)
        self.in_splits = symm_mem.empty(R * self.ne, dtype=torch.int64, device=dev)
        self.out_so = symm_mem.empty(2, R * self.ne, dtype=torch.int64, device=dev)
        self.y_buf = symm_mem.empty(n_out, h, dtype=torch.bfloat16, device=dev)
        self.back_buf = symm_mem.empty(n_in, h, dtype=torch.bfloat16, device=dev)
        self.back_so = symm_mem.empty(2, R * self.ne, dtype=torch.int64, device=dev)
        for t in (self.inp_buf, self.out_buf, self.in_splits, self.out_so, self.y_buf, self.back_buf, self.back_so):
            symm_mem.rendezvous(t, self.group_name)
            _KEEP.append(t)
        self._sorted: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None

    def _op(self, name: str, *args) -> None:
        try:
            getattr(torch.ops.symm_mem, name)(*args)
        except RuntimeError as e:
            raise NotAvailable(f"torch {name} refused this shape: {str(e).splitlines()[0]}") from e

    def dispatch(self) -> None:
        wl, inp = self.wl, self.inp
        idx = inp.topk_idx.reshape(-1)
        valid = idx >= 0
        key = torch.where(valid, idx, wl.num_experts)                    # invalid selections sort last
        order = torch.argsort(key, stable=True)
        token = order // wl.topk
        self._sorted = (token, valid[order], inp.topk_weights.reshape(-1)[order])
        self.in_splits.copy_(torch.bincount(key, minlength=wl.num_experts + 1)[: wl.num_experts])
        n = order.numel()
        self.inp_buf[:n].copy_(_payload(inp.x, wl.fp8)[token])
        self._op("all_to_all_vdev_2d", self.inp_buf, self.out_buf, self.in_splits, self.out_so, self.group_name, 1)

    def make_expert_output(self) -> None:
        """Fake experts on every received chunk (host reads the splits once; not timed)."""
        R, ne, h = self.ctx.world_size, self.ne, self.wl.hidden
        splits, offsets = self.out_so.tolist()
        rows, experts = [], []
        for c, (s, o) in enumerate(zip(splits, offsets)):
            rows.append(torch.arange(o, o + s, device=self.ctx.device))
            experts.append(torch.full((s,), self.ctx.rank * ne + c // R, device=self.ctx.device))
        rows_t, experts_t = torch.cat(rows), torch.cat(experts)
        got = self.out_buf[rows_t]
        if self.wl.fp8:
            b = got.view(torch.uint8)
            q, s = b[:, :h].view(torch.float8_e4m3fn), b[:, h:].contiguous().view(torch.float32)
        else:
            q, s = got, None
        self.y_buf.zero_()
        self.y_buf[rows_t] = fake_expert_rows(q, s, self.inp.expert_scale[experts_t][:, None])

    def combine(self) -> None:
        self._op("all_to_all_vdev_2d_offset", self.y_buf, self.back_buf, self.out_so, self.back_so, self.group_name)
        token, valid, w = self._sorted
        n = token.numel()
        rows = torch.where(valid[:, None], self.back_buf[:n].float() * w[:, None], 0.0)
        out = torch.zeros(self.wl.num_tokens, self.wl.hidden, dtype=torch.float32, device=self.ctx.device)
        self.out = out.index_add_(0, token, rows).to(torch.bfloat16)


class SymmMemBackend(Backend):
    name = "symm_mem"

    def unavailable(self) -> Optional[str]:
        if self.ctx.device.type != "cuda":
            return "needs CUDA GPUs (torch's NVSHMEM symmetric memory)"
        if needs_own_gpus(self.ctx, "torch's NVSHMEM"):
            return needs_own_gpus(self.ctx, "torch's NVSHMEM")
        import torch.distributed._symmetric_memory as symm_mem

        if not hasattr(torch.ops.symm_mem, "all_to_all_vdev_2d"):
            return f"torch {torch.__version__} has no torch.ops.symm_mem.all_to_all_vdev_2d"
        if not symm_mem.is_nvshmem_available():
            return "torch's NVSHMEM backend is not available (symm_mem.is_nvshmem_available() is False)"
        return None

    def open(self, variant: str, wl: Workload, inputs: Inputs) -> Runner:
        import torch.distributed._symmetric_memory as symm_mem

        for resource, value in (("symm_mem_backend", "NVSHMEM"), ("nvshmem", "torch")):
            why = base.claim(resource, value, self.name)
            if why is not None:
                raise NotAvailable(why)
        try:
            symm_mem.set_backend("NVSHMEM")
        except Exception as e:  # noqa: BLE001 - torch refuses once another backend has allocated
            raise NotAvailable(f"torch symmetric memory cannot switch to NVSHMEM in this process ({e}); "
                               f"run symm_mem in its own launch (the repository's scripts/compare.sh)") from e
        with contextlib.suppress(Exception):  # needed by older torch, deprecated by newer
            symm_mem.enable_symm_mem_for_group(dist.group.WORLD.group_name)
        return SymmMemRunner(wl, inputs, self.ctx)
