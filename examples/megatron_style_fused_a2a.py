"""An MoE layer trained through DeepEP's normal mode the way Megatron-core's fused all-to-all calls
it (forward, backward with the routing weights' gradient summed back, cached dispatch), run on
moe_ep through an unedited `import deep_ep`.

    python examples/megatron_style_fused_a2a.py                       # 2 CPU ranks (gloo, Triton interpreter)
    python examples/megatron_style_fused_a2a.py --ranks 4
    torchrun --nproc-per-node=2 examples/megatron_style_fused_a2a.py  # GPUs (CPUs: TRITON_INTERPRET=1 torchrun ...)

The calls are those of Megatron-core's flex dispatcher (megatron/core/transformer/moe/fused_a2a.py):
- one ``deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes)`` sized from
  ``Buffer.get_dispatch_config`` / ``get_combine_config`` and their ``get_*_buffer_size_hint``;
- ``FusedDispatch`` (an autograd Function): ``get_dispatch_layout`` then ``dispatch(x,
  topk_idx=, topk_weights=, num_tokens_per_rank=, ..., previous_event=, async_finish=True,
  allocate_on_comm_stream=True)``, waiting on the returned event; its backward is a
  ``combine(grad, handle, topk_weights=grad_probs)``, which sums the routing weights' gradient
  back to the tokens' ranks;
- ``FusedCombine``: ``combine(x, handle=handle, ...)``; its backward is a cached dispatch,
  ``dispatch(grad, handle=handle, ...)``, which sends the output gradient along the forward's
  routing again.
Between them the experts run as Megatron's grouped MLP does: the received rows permuted by local
expert (``tokens_per_expert`` from the dispatch), SwiGLU per expert, each selection scaled by its
routing weight and summed back per row before the combine.

Rank 0 checks the output and the gradients of x, topk_weights and the experts' weights against the
dense layer run on all ranks' tokens with torch autograd, in one process.
"""
from __future__ import annotations

from typing import Dict, Optional

import ep_harness  # first: makes `import deep_ep` load moe_ep; the ranks; the dense check

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from deep_ep import Buffer  # noqa: E402  (DeepEP's API; here moe_ep's)
from deep_ep.utils import EventHandle, EventOverlap  # noqa: E402

HIDDEN, INTER = 128, 32
EXPERTS_PER_RANK, TOPK = 2, 2
STEPS = 2
TOL = 2e-2  # bf16 rounding of the rows that cross ranks (expert outputs, gradients)

_buffer: Optional[Buffer] = None


def get_hidden_bytes(x: torch.Tensor) -> int:
    """Bytes per token row, as the buffer sizes count them (at least 2 per element)."""
    return x.size(1) * max(x.element_size(), 2)


def get_buffer(group: dist.ProcessGroup, hidden_bytes: int) -> Buffer:
    """The one Buffer, made again when the group changes or its sizes fall short."""
    global _buffer
    num_nvl_bytes = num_rdma_bytes = 0
    for config in (Buffer.get_dispatch_config(group.size()), Buffer.get_combine_config(group.size())):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), num_rdma_bytes)
    if _buffer is None or _buffer.group != group or _buffer.num_nvl_bytes < num_nvl_bytes \
            or _buffer.num_rdma_bytes < num_rdma_bytes:
        _buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes)
    return _buffer


class FusedDispatch(torch.autograd.Function):
    """Dispatch forward; combine of the gradients backward."""

    @staticmethod
    def forward(ctx, x, token_indices, token_probs, num_experts, group, async_finish=True,
                allocate_on_comm_stream=True):
        previous_event = EventOverlap(EventHandle()) if async_finish else None
        buffer = get_buffer(group, get_hidden_bytes(x))
        num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, event = \
            buffer.get_dispatch_layout(token_indices, num_experts, previous_event=previous_event,
                                       async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream)
        recv_x, recv_token_indices, recv_token_probs, num_recv_tokens_per_expert_list, handle, after = \
            buffer.dispatch(x, topk_idx=token_indices, topk_weights=token_probs,
                            num_tokens_per_rank=num_tokens_per_rank, num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
                            is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
                            previous_event=event, async_finish=async_finish,
                            allocate_on_comm_stream=allocate_on_comm_stream)
        if async_finish:
            after.current_stream_wait()
        ctx.group, ctx.handle = group, handle
        ctx.async_finish, ctx.allocate_on_comm_stream = async_finish, allocate_on_comm_stream
        tokens_per_expert = torch.tensor(num_recv_tokens_per_expert_list)
        return recv_x, recv_token_indices, recv_token_probs, tokens_per_expert, handle

    @staticmethod
    def backward(ctx, grad_output, grad_token_indices, grad_token_probs, grad_tokens_per_expert, grad_handle):
        buffer = get_buffer(ctx.group, get_hidden_bytes(grad_output))
        previous_event = EventOverlap(EventHandle()) if ctx.async_finish else None
        grad_x, grad_token_probs, after = buffer.combine(
            grad_output.contiguous(), ctx.handle, topk_weights=grad_token_probs.float(),
            previous_event=previous_event, async_finish=ctx.async_finish,
            allocate_on_comm_stream=ctx.allocate_on_comm_stream)
        if ctx.async_finish:
            after.current_stream_wait()
        return grad_x, None, grad_token_probs, None, None, None, None


class FusedCombine(torch.autograd.Function):
    """Combine forward; cached dispatch of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, handle, async_finish=True, allocate_on_comm_stream=True):
        previous_event = EventOverlap(EventHandle()) if async_finish else None
        buffer = get_buffer(group, get_hidden_bytes(x))
        combined_x, _, after = buffer.combine(x, handle=handle, async_finish=async_finish,
                                              previous_event=previous_event,
                                              allocate_on_comm_stream=allocate_on_comm_stream)
        if async_finish:
            after.current_stream_wait()
        ctx.group, ctx.handle = group, handle
        ctx.async_finish, ctx.allocate_on_comm_stream = async_finish, allocate_on_comm_stream
        return combined_x, None

    @staticmethod
    def backward(ctx, grad_output, grad_none):
        buffer = get_buffer(ctx.group, get_hidden_bytes(grad_output))
        previous_event = EventOverlap(EventHandle()) if ctx.async_finish else None
        grad_x, _, _, _, _, after = buffer.dispatch(grad_output.contiguous(), handle=ctx.handle,
                                                    previous_event=previous_event, async_finish=ctx.async_finish,
                                                    allocate_on_comm_stream=ctx.allocate_on_comm_stream)
        if ctx.async_finish:
            after.current_stream_wait()
        return grad_x, None, None, None, None


def grouped_experts(recv_x: torch.Tensor, recv_indices: torch.Tensor, recv_probs: torch.Tensor,
                    tokens_per_expert: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The local experts on the received rows, bf16 ``[n, H]``: selections permuted by local expert
    (``tokens_per_expert`` rows each), SwiGLU, scaled by their routing weight, summed back per row."""
    rows, k = (recv_indices >= 0).nonzero(as_tuple=True)
    local = recv_indices[rows, k]
    order = torch.argsort(local, stable=True)  # permute
    rows, k = rows[order], k[order]
    splits = tokens_per_expert.tolist()
    assert splits == torch.bincount(local, minlength=w1.shape[0]).tolist(), "tokens_per_expert"
    permuted = recv_x.float()[rows]
    outs = [ep_harness.expert_mlp(chunk, w1[e], w2[e]) for e, chunk in enumerate(permuted.split(splits))]
    weighted = torch.cat(outs) * recv_probs[rows, k].unsqueeze(1)
    y = torch.zeros(recv_x.shape, dtype=torch.float32, device=recv_x.device).index_add(0, rows, weighted)  # unpermute
    return y.to(torch.bfloat16)


def moe_layer(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
              group: dist.ProcessGroup, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Dispatch, experts, combine: differentiable in x, topk_weights and the local experts' weights."""
    recv_x, recv_indices, recv_probs, tokens_per_expert, handle = FusedDispatch.apply(
        x.contiguous(), topk_idx, topk_weights, num_experts, group)
    y = grouped_experts(recv_x, recv_indices, recv_probs, tokens_per_expert, w1, w2)
    out, _ = FusedCombine.apply(y, group, handle)
    return out


def main() -> bool:
    group, rank, R, dev, E, w1, w2, mine = ep_harness.world(EXPERTS_PER_RANK, HIDDEN, INTER)
    gen = torch.Generator().manual_seed(200 + rank)
    results: Dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        T = 4 + (3 * rank + step) % 5  # ranks differ in batch size
        x_cpu = torch.randn(T, HIDDEN, generator=gen).to(torch.bfloat16)
        idx_cpu, w_cpu = ep_harness.route(T, E, TOPK, gen)
        probe = torch.randn(T, HIDDEN, generator=gen)  # loss = sum(out * probe)
        x = x_cpu.to(dev).requires_grad_()
        topk_weights = w_cpu.to(dev).requires_grad_()
        w1_local = w1[mine].to(dev).requires_grad_()  # this rank's experts
        w2_local = w2[mine].to(dev).requires_grad_()
        out = moe_layer(x, idx_cpu.to(dev), topk_weights, E, group, w1_local, w2_local)
        (out.float() * probe.to(dev)).sum().backward()
        s = f".{step}"
        results.update({"x" + s: x_cpu, "ids" + s: idx_cpu, "w" + s: w_cpu, "probe" + s: probe,
                        "out" + s: out, "x_grad" + s: x.grad, "topk_weights_grad" + s: topk_weights.grad,
                        "w1_grad" + s: w1_local.grad, "w2_grad" + s: w2_local.grad})

    dense = ep_harness.dense_steps({f".{step}": True for step in range(STEPS)}, w1, w2, EXPERTS_PER_RANK)
    return ep_harness.check_on_rank0("Megatron-style fused all-to-all (forward, backward, cached dispatch)",
                                     results, dense, TOL)


if __name__ == "__main__":
    ep_harness.launch(main, __doc__)
