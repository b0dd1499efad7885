"""Backend ``moe_ep``: EPBuffer dispatch/combine (NVLink path; the proxy path when --node-size < R)."""
from __future__ import annotations

from typing import Optional

import torch

from ..intranode import fake_expert_output
from ..workloads import DTYPES, Inputs, Workload
from . import base
from .base import Backend, NotAvailable, Runner


class MoeEpRunner(Runner):
    graphable = True

    def __init__(self, buf, wl: Workload, inputs: Inputs, rank: int):
        self.buf, self.wl, self.inp, self.rank = buf, wl, inputs, rank
        self.sms = int(getattr(buf, "num_programs", 0)) or None
        self.d = None
        self.y: Optional[torch.Tensor] = None

    def dispatch(self) -> None:
        self.d = self.buf.dispatch(self.inp.x, self.inp.topk_idx, self.inp.topk_weights)

    def make_expert_output(self) -> None:
        self.y = fake_expert_output(self.d, self.wl.layout, self.rank, self.buf.num_local_experts,
                                    self.inp.expert_scale)

    def combine(self) -> None:
        self.out = self.buf.combine(self.y, self.d)

    def close(self) -> None:
        self.buf.close()


class MoeEpBackend(Backend):
    name = "moe_ep"
    graphable = True

    def open(self, variant: str, wl: Workload, inputs: Inputs) -> Runner:
        import moe_ep

        ctx = self.ctx
        group = ctx.group if ctx.node_size is None else moe_ep.EPGroup(ctx.group.pg, node_size=ctx.node_size)
        kwargs = dict(dispatch_dtype=DTYPES[wl.dispatch_dtype], combine_dtype=DTYPES[wl.combine_dtype],
                      layout=wl.layout, expert_alignment=wl.expert_alignment, timeout_s=ctx.timeout_s)
        if ctx.num_sms is not None:
            kwargs["num_programs"] = ctx.num_sms
        if wl.layout != "masked":  # the kernels' time as before (sized per call, a dispatch adds a host sync)
            kwargs["max_recv_rows"] = "worst"
        if ctx.device.type == "cuda" and ctx.world_size > 1:
            why = base.claim("symm_mem_backend", "CUDA", self.name)
            if why is not None:
                raise NotAvailable(why)
        try:
            buf = moe_ep.EPBuffer(group, wl.num_experts, wl.hidden, max(1, wl.num_tokens), wl.topk, **kwargs)
        except NotImplementedError as e:
            raise NotAvailable(str(e)) from e
        except (TypeError, ValueError) as e:  # EPBuffer names the argument it refuses, before any memory
            raise NotAvailable(f"moe_ep refuses this configuration: {e}") from e
        return MoeEpRunner(buf, wl, inputs, ctx.rank)
