"""An MoE layer written against DeepEP's Buffer API, running on moe_ep: the only change from a
DeepEP program is the import line.

    python examples/deep_ep_user.py                       # 2 CPU ranks (gloo, Triton interpreter)
    python examples/deep_ep_user.py --ranks 4
    torchrun --nproc-per-node=2 examples/deep_ep_user.py  # GPUs (on CPUs: TRITON_INTERPRET=1)

Prefill goes through the normal mode (get_dispatch_layout -> dispatch -> experts -> combine),
decode through the low-latency pair (low_latency_dispatch -> experts -> low_latency_combine).
Each rank checks its output against the same layer computed densely on its own tokens.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import moe_ep.deep_ep as deep_ep  # was: import deep_ep


def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
    """Expert e of the model: a small fixed affine map (the same on every rank)."""
    return rows.float() * (0.5 + 0.125 * (e % 5)) + 0.01 * e


def route(x: torch.Tensor, num_experts: int, num_topk: int, gen: torch.Generator):
    scores = torch.randn(x.shape[0], num_experts, generator=gen).to(x.device)
    weights, topk_idx = torch.topk(scores.softmax(dim=-1), num_topk, dim=-1)
    return topk_idx.to(deep_ep.topk_idx_t), weights.float()


def dense(x, topk_idx, topk_weights):
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for k in range(topk_idx.shape[1]):
        for t in range(x.shape[0]):
            e = int(topk_idx[t, k])
            if e >= 0:
                out[t] += topk_weights[t, k] * expert(e, x[t:t + 1])[0]
    return out


def moe_prefill(buffer, x, topk_idx, topk_weights, num_experts):
    """DeepEP's normal mode: the received tokens are reduced over this rank's experts here."""
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = \
        buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=num_tokens_per_rank, num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
        is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
        topk_idx=topk_idx, topk_weights=topk_weights)
    first = buffer.rank * (num_experts // buffer.group_size)
    y = torch.zeros(recv_x.shape, dtype=torch.float32, device=recv_x.device)
    for i, count in enumerate(num_recv_tokens_per_expert_list):
        rows, k = (recv_topk_idx == i).nonzero(as_tuple=True)
        assert rows.numel() == count
        y.index_add_(0, rows, recv_topk_weights[rows, k].unsqueeze(1) * expert(first + i, recv_x[rows]))
    combined_x, _, _ = buffer.combine(y.to(torch.bfloat16), handle)
    return combined_x


def moe_decode(buffer, x, topk_idx, topk_weights, num_max_dispatch_tokens_per_rank, num_experts):
    """DeepEP's low-latency pair: experts see [num_local_experts, R * M, H], the weights apply at combine."""
    recv_x, recv_count, handle, _, hook = buffer.low_latency_dispatch(
        x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=False, return_recv_hook=True)
    hook()
    first = buffer.rank * (num_experts // buffer.group_size)
    y = torch.empty_like(recv_x)
    for i in range(recv_x.shape[0]):
        y[i] = expert(first + i, recv_x[i]).to(torch.bfloat16)  # rows past recv_count[i] are not read
    combined_x, _, _ = buffer.low_latency_combine(y, topk_idx, topk_weights, handle)
    return combined_x


def main(hidden: int = 128, num_experts_per_rank: int = 2, num_topk: int = 2, num_tokens: int = 6) -> None:
    group = dist.group.WORLD
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    num_experts = num_experts_per_rank * num_ranks
    num_topk = min(num_topk, num_experts)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and \
        os.environ.get("TRITON_INTERPRET", "0") in ("", "0") else torch.device("cpu")
    buffer = deep_ep.Buffer(group, num_nvl_bytes=int(1e9), num_rdma_bytes=int(1e9), low_latency_mode=True,
                            num_qps_per_rank=num_experts_per_rank)
    gen = torch.Generator().manual_seed(rank)
    worst = 0.0
    for step in range(2):
        T = num_tokens - step * rank % num_tokens  # ranks differ in batch size
        x = torch.randn(T, hidden, generator=gen).to(torch.bfloat16).to(device)
        topk_idx, topk_weights = route(x, num_experts, num_topk, gen)
        expected = dense(x, topk_idx, topk_weights)
        for name, out in (("prefill", moe_prefill(buffer, x, topk_idx, topk_weights, num_experts)),
                          ("decode", moe_decode(buffer, x, topk_idx, topk_weights, num_tokens, num_experts))):
            err = ((out.float() - expected).abs().max() / expected.abs().max().clamp_min(1e-6)).item() if T else 0.0
            assert err < 2e-2, f"rank {rank} {name} step {step}: relative error {err}"
            worst = max(worst, err)
    errs = [None] * num_ranks
    dist.all_gather_object(errs, worst, group=group)
    if rank == 0:
        print(f"deep_ep API on moe_ep, {num_ranks} ranks on {device.type}: prefill and decode match the dense "
              f"layer (max rel err {max(errs):.1e}). OK", flush=True)


def _spawned(rank: int, world_size: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        main()
    except BaseException:
        dist.destroy_process_group()
        raise
    # After a run that passed: a last barrier, then leave without the gloo teardown that aborts a
    # spawned rank now and then after every check has passed (ARCHITECTURE §14).
    from moe_ep.core.group import exit_rank

    exit_rank(0)


if __name__ == "__main__":
    if "WORLD_SIZE" in os.environ:  # under torchrun
        from moe_ep.core.group import init_distributed  # NCCL, or gloo where ranks share a GPU

        gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
        init_distributed("auto" if gpu else "cpu")
        try:
            main()
        finally:
            dist.destroy_process_group()
    else:  # CPU ranks of their own
        import socket

        import torch.multiprocessing as mp

        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        parser.add_argument("--ranks", type=int, default=2)
        args = parser.parse_args()
        os.environ["TRITON_INTERPRET"] = "1"  # the ranks read it before importing triton
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_spawned, args=(args.ranks, port), nprocs=args.ranks)
