"""Backend ``deepep``: DeepEP V1 (``deep_ep.Buffer``), normal mode and low-latency mode.

Written from DeepEP's documented Python API:
- ``normal``: ``Buffer(group, num_nvl_bytes, num_rdma_bytes)`` sized by the dispatch/combine
  configs' size hints; ``Buffer.set_num_sms(--num-sms)``; dispatch = ``get_dispatch_layout`` +
  ``dispatch`` (fp8: the input is quantized beforehand, outside the timed region, as DeepEP takes
  ``(x_fp8, scales)``); tokens arrive un-expanded, one row per (token, rank), with local expert
  ids and weights; the fake experts sum ``w * y_e`` per received row; ``combine`` sums rows back.
- ``low_latency``: ``Buffer(group, 0, low-latency RDMA size hint, low_latency_mode=True,
  num_qps_per_rank=E/R)`` sized for the sweep's largest token count; ``low_latency_dispatch``
  (in-kernel fp8 when the dispatch dtype is fp8) into ``[E_local, R*max_tokens, H]``, then
  ``low_latency_combine`` (weighted). DeepEP chooses its SMs itself in this mode.
On one node, DeepEP's low-latency mode needs ``NVSHMEM_REMOTE_TRANSPORT=none`` when there is no
RDMA NIC; scripts/compare.sh sets it for single-node runs.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..workloads import Inputs, Workload
from . import base
from .base import Backend, NotAvailable, Runner, fake_expert_rows, needs_own_gpus


LL_MAX_TOKENS = 256  # DeepEP recommends its low-latency mode for decode batches below 256 tokens per rank


def _call(what: str, fn, *args, **kwargs):
    """Runs a DeepEP call; a refusal (RuntimeError/AssertionError) becomes NotAvailable with its message."""
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, AssertionError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise NotAvailable(f"DeepEP {what} refused: {first}") from e


class NormalRunner(Runner):
    def __init__(self, buf, wl: Workload, inputs: Inputs, ctx: base.Context, sms: int):
        self.buf, self.wl, self.inp, self.ctx = buf, wl, inputs, ctx
        self.sms = sms
        if wl.fp8:
            from moe_ep.core.fp8 import quantize_fp8

            self.x = quantize_fp8(inputs.x)
        else:
            self.x = inputs.x
        self.recv = None
        self.y: Optional[torch.Tensor] = None

    def dispatch(self) -> None:
        b, inp = self.buf, self.inp
        n_rank, n_rdma, n_expert, in_rank, _ = _call("get_dispatch_layout", b.get_dispatch_layout,
                                                     inp.topk_idx, self.wl.num_experts)
        self.recv = _call("dispatch", b.dispatch, self.x, topk_idx=inp.topk_idx, topk_weights=inp.topk_weights,
                          num_tokens_per_rank=n_rank, num_tokens_per_rdma_rank=n_rdma,
                          is_token_in_rank=in_rank, num_tokens_per_expert=n_expert)

    def make_expert_output(self) -> None:
        recv_x, recv_idx, recv_w = self.recv[0], self.recv[1], self.recv[2]
        q, s = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        ne = self.wl.num_experts // self.ctx.world_size
        local = recv_idx.long()
        scale = self.inp.expert_scale[self.ctx.rank * ne + local.clamp(0, ne - 1)]
        factor = torch.where((local >= 0) & (local < ne), recv_w.float() * scale, 0.0).sum(dim=1)
        self.y = fake_expert_rows(q, s, factor[:, None])

    def combine(self) -> None:
        self.out = _call("combine", self.buf.combine, self.y, self.recv[4])[0]


class LowLatencyRunner(Runner):
    own_fp8 = True  # quantizes in its kernel (its own rounding): the pre-check allows one e4m3 step

    def __init__(self, buf, max_tokens: int, wl: Workload, inputs: Inputs, ctx: base.Context):
        self.buf, self.max_tokens, self.wl, self.inp, self.ctx = buf, max_tokens, wl, inputs, ctx
        self.recv = None
        self.y: Optional[torch.Tensor] = None

    def dispatch(self) -> None:
        self.recv = _call("low_latency_dispatch", self.buf.low_latency_dispatch, self.inp.x, self.inp.topk_idx,
                          self.max_tokens, self.wl.num_experts, use_fp8=self.wl.fp8, async_finish=False,
                          return_recv_hook=False)

    def make_expert_output(self) -> None:
        recv_x = self.recv[0]
        q, s = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        ne = self.wl.num_experts // self.ctx.world_size
        factor = self.inp.expert_scale[self.ctx.rank * ne + torch.arange(ne, device=self.ctx.device)]
        self.y = fake_expert_rows(q, s, factor[:, None, None])

    def combine(self) -> None:
        self.out = _call("low_latency_combine", self.buf.low_latency_combine, self.y, self.inp.topk_idx,
                         self.inp.topk_weights, self.recv[2], async_finish=False, return_recv_hook=False)[0]


class DeepEPBackend(Backend):
    name = "deepep"
    variants = ("normal", "low_latency")

    def __init__(self, ctx: base.Context):
        super().__init__(ctx)
        self._buffers: dict[tuple, object] = {}
        self._ll_limits: tuple = (None, {}, 0)

    def unavailable(self) -> Optional[str]:
        if self.ctx.device.type != "cuda":
            return "needs CUDA GPUs (DeepEP's kernels are CUDA-only)"
        if needs_own_gpus(self.ctx, "DeepEP"):
            return needs_own_gpus(self.ctx, "DeepEP")
        try:
            import deep_ep
        except Exception as e:  # noqa: BLE001 - any import failure means: not here
            return f"deep_ep is not importable ({type(e).__name__}: {e})"
        if not hasattr(deep_ep, "Buffer"):
            return "this deep_ep has no V1 Buffer API (deep_ep.Buffer), which this backend uses"
        return None

    def _buffer(self, key: tuple, make):
        if key not in self._buffers:
            self._buffers[key] = _call("Buffer()", make)
        return self._buffers[key]

    def open(self, variant: str, wl: Workload, inputs: Inputs) -> Runner:
        from deep_ep import Buffer

        group, R = dist.group.WORLD, self.ctx.world_size
        if variant == "normal":
            sms = self.ctx.num_sms if self.ctx.num_sms is not None else int(Buffer.num_sms)
            if sms % 2:
                raise NotAvailable(f"DeepEP normal mode needs an even SM count, got --num-sms {sms}")
            Buffer.set_num_sms(sms)
            hidden_bytes = 2 * wl.hidden

            def make():
                nvl = rdma = 0
                for cfg in (Buffer.get_dispatch_config(R), Buffer.get_combine_config(R)):
                    nvl = max(nvl, cfg.get_nvl_buffer_size_hint(hidden_bytes, R))
                    rdma = max(rdma, cfg.get_rdma_buffer_size_hint(hidden_bytes, R))
                return Buffer(group, nvl, rdma)

            # the buffer size hints grow with the SM count (channels): one buffer per (hidden, SMs)
            return NormalRunner(self._buffer(("normal", hidden_bytes, sms), make), wl, inputs, self.ctx, sms)
        return self._open_low_latency(wl, inputs)

    def _open_low_latency(self, wl: Workload, inputs: Inputs) -> Runner:
        """One low-latency buffer per launch (NVSHMEM is initialised once), sized for the largest
        token count of the sweep whose buffer takes at most half of the free GPU memory."""
        from deep_ep import Buffer

        why = base.claim("nvshmem", "deep_ep", self.name)
        if why is not None:
            raise NotAvailable(why)
        if wl.num_tokens > LL_MAX_TOKENS:
            raise NotAvailable(f"DeepEP recommends its low-latency mode for decode batches (below 256 tokens "
                               f"per rank); T={wl.num_tokens} is above the {LL_MAX_TOKENS} this bench allows")
        R = self.ctx.world_size
        key = ("low_latency", wl.hidden, wl.num_experts)
        if key not in self._buffers:
            free = min(self.ctx.group.all_gather_object(torch.cuda.mem_get_info(self.ctx.device)[0]))
            tokens = [t for t in self.ctx.tokens if t <= LL_MAX_TOKENS]
            sizes = {t: Buffer.get_low_latency_rdma_size_hint(max(1, t), wl.hidden, R, wl.num_experts) for t in tokens}
            fits = [t for t in tokens if sizes[t] <= free // 2]
            self._ll_limits = (fits[-1] if fits else None, sizes, free)
            if fits:
                self._buffer(key, lambda: Buffer(dist.group.WORLD, 0, sizes[fits[-1]], low_latency_mode=True,
                                                 num_qps_per_rank=wl.num_experts // R))
        max_tokens, sizes, free = self._ll_limits
        if max_tokens is None or wl.num_tokens > max_tokens:
            raise NotAvailable(f"DeepEP's low-latency buffer for T={wl.num_tokens} would take "
                               f"{sizes[wl.num_tokens] / 2**30:.1f} GiB per rank, more than half of the "
                               f"{free / 2**30:.1f} GiB free (the mode is meant for decode batches)")
        return LowLatencyRunner(self._buffers[key], max(1, max_tokens), wl, inputs, self.ctx)

    def close(self) -> None:
        self._buffers.clear()
