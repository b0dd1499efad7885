"""An MoE layer on DeepEP V2's `ElasticBuffer`: a training step (autograd forward and backward,
cached dispatch) and a decode step (expanded per-expert layout, no host read), run on moe_ep
through an unedited `import deep_ep`.

    python examples/elastic_buffer.py                       # 2 CPU ranks (gloo, Triton interpreter)
    python examples/elastic_buffer.py --ranks 4
    torchrun --nproc-per-node=2 examples/elastic_buffer.py  # GPUs (CPUs: TRITON_INTERPRET=1 torchrun ...)

One ``deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K,
explicitly_destroy=True)`` serves both steps:
- **Training** (as a V2 fused all-to-all runs it): ``dispatch(x, topk_idx=, topk_weights=,
  num_experts=)`` with the default CPU sync (exact shapes; ``handle.num_recv_tokens_per_expert_list``
  sizes the grouped experts); its backward is ``combine(grad, handle, topk_weights=grad_probs)``,
  summing the routing weights' gradient back. ``combine(y, handle)`` forward; its backward is the
  cached dispatch ``dispatch(grad, handle=handle)``. The experts scale each selection by its
  routing weight before the combine (V2's combine adds no weights).
- **Decode** (as vLLM's and SGLang's V2 paths call it): ``dispatch(..., num_max_tokens_per_rank=M,
  expert_alignment=A, do_expand=True, do_cpu_sync=False)``: worst-case shapes, rows grouped per
  local expert in blocks at multiples of A, one weight per row; the experts find their rows from
  ``handle.psum_num_recv_tokens_per_expert`` and ``num_unaligned_recv_tokens_per_expert`` on the
  device (nothing is read back), weight them, and ``combine(y, handle)`` sums them per token.

Rank 0 checks both steps (the training step's output and the gradients of x, topk_weights and the
experts' weights) against the dense layer run on all ranks' tokens with torch autograd, in one
process.
"""
from __future__ import annotations

from typing import Dict, List

import ep_harness  # first: makes `import deep_ep` load moe_ep; the ranks; the dense check

import torch  # noqa: E402

import deep_ep  # noqa: E402  (DeepEP's API; here moe_ep's)

HIDDEN, INTER = 128, 32
EXPERTS_PER_RANK, TOPK = 2, 2
MAX_TOKENS_PER_RANK = 8
EXPERT_ALIGNMENT = 4  # decode: each local expert's block starts at a multiple of this
TOL = 2e-2  # bf16 rounding of the rows that cross ranks (expert outputs, gradients)


class ElasticDispatch(torch.autograd.Function):
    """ElasticBuffer dispatch forward; combine of the gradients backward."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, num_experts, buffer):
        recv_x, recv_topk_idx, recv_topk_weights, handle, _ = buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts)
        ctx.buffer, ctx.handle = buffer, handle
        return recv_x, recv_topk_idx, recv_topk_weights, handle

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_topk_idx, grad_recv_topk_weights, grad_handle):
        grad_x, grad_topk_weights, _ = ctx.buffer.combine(
            grad_recv_x.contiguous(), ctx.handle, topk_weights=grad_recv_topk_weights.float())
        return grad_x, None, grad_topk_weights, None, None


class ElasticCombine(torch.autograd.Function):
    """ElasticBuffer combine forward; cached dispatch of the gradient backward."""

    @staticmethod
    def forward(ctx, y, handle, buffer):
        combined_x, _, _ = buffer.combine(y, handle)
        ctx.buffer, ctx.handle = buffer, handle
        return combined_x

    @staticmethod
    def backward(ctx, grad_combined_x):
        grad_y, _, _, _, _ = ctx.buffer.dispatch(grad_combined_x.contiguous(), handle=ctx.handle)
        return grad_y, None, None


def grouped_experts(recv_x: torch.Tensor, recv_topk_idx: torch.Tensor, recv_topk_weights: torch.Tensor,
                    tokens_per_expert: List[int], w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Training: the local experts on the received rows, bf16 ``[n, H]``: selections permuted by
    local expert, SwiGLU, scaled by their routing weight, summed back per row."""
    rows, k = (recv_topk_idx >= 0).nonzero(as_tuple=True)
    local = recv_topk_idx[rows, k]
    order = torch.argsort(local, stable=True)
    rows, k = rows[order], k[order]
    assert tokens_per_expert == torch.bincount(local, minlength=w1.shape[0]).tolist(), "tokens per expert"
    outs = [ep_harness.expert_mlp(chunk, w1[e], w2[e])
            for e, chunk in enumerate(recv_x.float()[rows].split(tokens_per_expert))]
    weighted = torch.cat(outs) * recv_topk_weights[rows, k].unsqueeze(1)
    y = torch.zeros(recv_x.shape, dtype=torch.float32, device=recv_x.device).index_add(0, rows, weighted)
    return y.to(torch.bfloat16)


def expanded_experts(recv_x: torch.Tensor, recv_weights: torch.Tensor, handle: "deep_ep.EPHandle",
                     w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Decode: the local experts on the expanded rows, bf16 ``[N, H]``, each row times its weight;
    rows outside every expert's block (alignment padding, worst-case tail) are zeros. Expert e's
    rows: ``[end_e - count_e, end_e)``, found on the device."""
    ends = handle.psum_num_recv_tokens_per_expert.long()
    starts = ends - handle.num_unaligned_recv_tokens_per_expert.long()
    row = torch.arange(recv_x.shape[0], device=recv_x.device)
    y = torch.zeros(recv_x.shape, dtype=torch.float32, device=recv_x.device)
    for e in range(w1.shape[0]):
        mine = ((row >= starts[e]) & (row < ends[e])).unsqueeze(1)
        x_e = torch.where(mine, recv_x.float(), 0.0)  # rows not written by the dispatch are not read
        y = torch.where(mine, ep_harness.expert_mlp(x_e, w1[e], w2[e]) * recv_weights.unsqueeze(1), y)
    return y.to(torch.bfloat16)


def main() -> bool:
    group, rank, R, dev, E, w1, w2, mine = ep_harness.world(EXPERTS_PER_RANK, HIDDEN, INTER)
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=MAX_TOKENS_PER_RANK, hidden=HIDDEN,
                                   num_topk=TOPK, explicitly_destroy=True)
    gen = torch.Generator().manual_seed(300 + rank)
    results: Dict[str, torch.Tensor] = {}

    # Training step.
    T = 3 + (5 * rank) % (MAX_TOKENS_PER_RANK - 2)
    x_cpu = torch.randn(T, HIDDEN, generator=gen).to(torch.bfloat16)
    idx_cpu, w_cpu = ep_harness.route(T, E, TOPK, gen)
    probe = torch.randn(T, HIDDEN, generator=gen)  # loss = sum(out * probe)
    x, topk_weights = x_cpu.to(dev).requires_grad_(), w_cpu.to(dev).requires_grad_()
    w1_local, w2_local = w1[mine].to(dev).requires_grad_(), w2[mine].to(dev).requires_grad_()
    recv_x, recv_topk_idx, recv_topk_weights, handle = ElasticDispatch.apply(x, idx_cpu.to(dev), topk_weights, E,
                                                                             buffer)
    y = grouped_experts(recv_x, recv_topk_idx, recv_topk_weights, handle.num_recv_tokens_per_expert_list,
                        w1_local, w2_local)
    out = ElasticCombine.apply(y, handle, buffer)
    (out.float() * probe.to(dev)).sum().backward()
    results.update({"x.train": x_cpu, "ids.train": idx_cpu, "w.train": w_cpu, "probe.train": probe,
                    "out.train": out, "x_grad.train": x.grad, "topk_weights_grad.train": topk_weights.grad,
                    "w1_grad.train": w1_local.grad, "w2_grad.train": w2_local.grad})

    # Decode step.
    T = (2 + 3 * rank) % (MAX_TOKENS_PER_RANK + 1)
    x_cpu = torch.randn(T, HIDDEN, generator=gen).to(torch.bfloat16)
    idx_cpu, w_cpu = ep_harness.route(T, E, TOPK, gen)
    with torch.no_grad():
        recv_x, _, recv_weights, handle, _ = buffer.dispatch(
            x_cpu.to(dev), topk_idx=idx_cpu.to(dev), topk_weights=w_cpu.to(dev), num_experts=E,
            num_max_tokens_per_rank=MAX_TOKENS_PER_RANK, expert_alignment=EXPERT_ALIGNMENT,
            do_expand=True, do_cpu_sync=False)
        y = expanded_experts(recv_x, recv_weights, handle, w1[mine].to(dev), w2[mine].to(dev))
        out, _, _ = buffer.combine(y, handle)
    results.update({"x.decode": x_cpu, "ids.decode": idx_cpu, "w.decode": w_cpu, "out.decode": out})
    buffer.destroy()

    dense = ep_harness.dense_steps({".train": True, ".decode": False}, w1, w2, EXPERTS_PER_RANK)
    return ep_harness.check_on_rank0("ElasticBuffer (training step with backward, expanded decode step)",
                                     results, dense, TOL)


if __name__ == "__main__":
    ep_harness.launch(main, __doc__)
