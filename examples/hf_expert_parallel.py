"""Expert parallelism for a tiny HF transformers MoE model: forward and backward, under torchrun.

    # GPUs (one process per GPU, NCCL)
    torchrun --nproc-per-node=2 examples/hf_expert_parallel.py --family deepseek_v3 --dispatch-dtype fp8
    # CPU (gloo, the Triton kernels in the interpreter)
    TRITON_INTERPRET=1 torchrun --nproc-per-node=2 examples/hf_expert_parallel.py --family mixtral

Every rank builds the same model, keeps an unmodified copy, replaces the MoE blocks with
``moe_ep.integrations.hf.apply_expert_parallel`` and runs its own tokens through both: it prints
the largest logits difference, then, after one backward of the LM loss, the largest gradient
difference of the router and of this rank's experts (whose gradients gather every rank's tokens:
the unmodified copies' gradients are summed over ranks to compare).
"""
from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="mixtral", choices=["mixtral", "qwen3_moe", "deepseek_v3"])
    ap.add_argument("--dispatch-dtype", default="bf16", choices=["bf16", "fp8"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="model dtype (bfloat16 runs the experts as torch grouped GEMMs on GPU)")
    ap.add_argument("--tokens", type=int, default=16, help="sequence length per rank (batch 2)")
    args = ap.parse_args()

    cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if cuda else "gloo")
    import moe_ep
    from moe_ep.integrations.hf import apply_expert_parallel
    from moe_ep.integrations.hf_tiny import VOCAB, tiny_model

    group = moe_ep.EPGroup()
    rank, R, dev = group.rank, group.world_size, group.device
    ref = tiny_model(args.family).to(dev, getattr(torch, args.dtype))
    model = apply_expert_parallel(copy.deepcopy(ref), group, dispatch_dtype=args.dispatch_dtype,
                                  max_tokens=2 * args.tokens)
    ids = torch.randint(0, VOCAB, (2, args.tokens), generator=torch.Generator().manual_seed(rank)).to(dev)

    out, want = model(ids, labels=ids), ref(ids, labels=ids)
    diff = (out.logits.float() - want.logits.float()).abs().max().item()
    out.loss.backward()
    want.loss.backward()
    ref_params = dict(ref.named_parameters())
    router_diff = expert_diff = 0.0
    for name, p in model.named_parameters():
        w = ref_params[name].grad
        if w is None or p.grad is None or ".mlp." not in name:
            continue
        if ".experts." in name:
            if R > 1:
                dist.all_reduce(w)
            EL = p.shape[0]
            expert_diff = max(expert_diff, (p.grad - w[rank * EL:(rank + 1) * EL]).float().abs().max().item())
        elif ".gate." in name:
            router_diff = max(router_diff, (p.grad - w).float().abs().max().item())
    print(f"rank {rank}/{R} {args.family} dispatch {args.dispatch_dtype}: loss {out.loss.item():.5f} "
          f"(unmodified {want.loss.item():.5f}), max |logits diff| {diff:.2e}, "
          f"max |grad diff| router {router_diff:.2e} experts {expert_diff:.2e}", flush=True)
    for m in model.modules():
        if isinstance(m, moe_ep.MoELayer):
            m.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
