"""transformers' own expert parallelism with moe_ep's dispatch and combine: a random small MoE model,
loaded with ``from_pretrained(..., distributed_config=DistributedConfig(ep_size=R, fsdp_size=R,
ep_implementation="moe_ep"))`` on R ranks, each with its own batch.

    # CPU ranks (gloo, moe_ep's Triton kernels in the interpreter); no downloads
    TRITON_INTERPRET=1 torchrun --nproc-per-node=2 examples/transformers_ep.py --family qwen3_moe
    # GPUs, one process per GPU
    torchrun --nproc-per-node=2 examples/transformers_ep.py --family deepseek_v3 --dtype bfloat16
    # forward times against transformers' "all_to_all", same run, same inputs
    TRITON_INTERPRET=1 torchrun --nproc-per-node=2 examples/transformers_ep.py --time

Rank 0 builds the model from its config class (``moe_ep.integrations.hf_tiny``) and saves it; every
rank loads it through transformers' distributed loading (experts sharded over the ranks, the rest
FSDP-sharded), runs a training step and a greedy generate() with ``"moe_ep"`` and with
``"all_to_all"``, and prints how far the two are apart.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist


def load(path: str, impl: str, R: int, dtype: torch.dtype):
    """The checkpoint at ``path`` with its experts spread over R ranks by ``impl``."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, distributed_config=DistributedConfig(
        ep_size=R, fsdp_size=R, ep_implementation=impl))


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts the calls that read a tensor's values on the host: ``syncs``, those of a tensor on a
    GPU (each waits for the device), and ``host``, those of a host tensor (e.g. moe_ep's token-count
    agreement, a gloo all_gather of one int per rank: no device wait). Not counted: reads inside
    moe_ep's kernel launches (under the CPU interpreter its kernels and their waits run on the host;
    on a GPU they read nothing back)."""

    NAMES = {"tolist", "item", "__int__", "__float__", "__bool__", "nonzero", "cpu", "numpy"}
    LAUNCH = tuple(f"moe_ep{os.sep}{m}" for m in (*(f"ops{os.sep}{f}" for f in ("dispatch.py", "combine.py", "host_wait.py", "calls.py", "replay.py")),
                                                   "kernels")) + (f"triton{os.sep}",)

    def __init__(self):
        super().__init__()
        self.syncs = self.host = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.NAMES:
            frames = [f.filename for f in traceback.extract_stack()[:-1]]
            if not any(any(m in f for m in self.LAUNCH) for f in frames):
                on_gpu = any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args)
                self.syncs += on_gpu
                self.host += not on_gpu
        return func(*args, **(kwargs or {}))


def _timed(fn, iters: int) -> float:
    """Median seconds of ``fn()`` over ``iters`` runs, the slowest rank's (all ranks run it)."""
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    t = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def time_impls(path: str, R: int, rank: int, dtype: torch.dtype, tokens: int, iters: int) -> None:
    """One MoE layer's experts call and a whole model forward, moe_ep against all_to_all."""
    from moe_ep.integrations.hf_tiny import VOCAB

    ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(rank))
    res = {}
    for impl in ("moe_ep", "all_to_all"):
        model = load(path, impl, R, dtype)
        dev = model.device
        ids_d = ids.to(dev)
        experts = model.model.layers[-1].mlp.experts
        H, E = model.config.hidden_size, experts.num_experts * R
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(tokens, H, generator=g).to(dev, dtype)
        idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(tokens)]).to(dev)
        w = torch.rand(tokens, 2, generator=g).to(dev, dtype)
        with torch.no_grad():
            model(ids_d)  # warm-up (FSDP lazy init, buffers)
            reads = HostReads()
            with reads:
                experts(x, idx, w)
            layer_s = _timed(lambda: experts(x, idx, w), iters)
            model_s = _timed(lambda: model(ids_d), iters)
        res[impl] = (layer_s, model_s, reads.syncs, reads.host)
        del model
    if rank == 0:
        print(f"{R} ranks, {tokens} tokens per rank, {dtype}, median of {iters} (slowest rank):")
        for impl, (layer_s, model_s, syncs, host) in res.items():
            print(f"  {impl:10s} one MoE layer {layer_s * 1e3:8.2f} ms   model forward {model_s * 1e3:8.2f} ms   "
                  f"per layer call: device syncs {syncs}, host-tensor reads {host}")


def main() -> None:
    from moe_ep.integrations.hf_tiny import EP_FAMILIES, VOCAB, tiny_ep_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="qwen3_moe", choices=EP_FAMILIES)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--time", action="store_true", help="time one MoE layer and a model forward against all_to_all")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per rank for --time")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()

    from moe_ep.core.group import init_distributed  # NCCL with a GPU per rank, gloo where ranks share one

    cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    init_distributed("auto" if cuda else "cpu")
    if cuda:  # transformers binds each rank to cuda:<LOCAL_RANK>; where ranks share GPUs, name the one it has
        os.environ["LOCAL_RANK"] = str(torch.cuda.current_device())
    import moe_ep.integrations.transformers  # noqa: F401  registers ep_implementation="moe_ep"

    rank, R = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    tmp = [tempfile.mkdtemp(prefix="moe_ep_tiny_") if rank == 0 else None]
    dist.broadcast_object_list(tmp)
    path = os.path.join(tmp[0], args.family)
    if rank == 0:
        tiny_ep_model(args.family).save_pretrained(path)
    dist.barrier()

    if args.time:
        time_impls(path, R, rank, dtype, args.tokens, args.iters)
    else:
        ids = torch.randint(0, VOCAB, (2, 8 + rank), generator=torch.Generator().manual_seed(rank))
        outs = {}
        for impl in ("moe_ep", "all_to_all"):
            model = load(path, impl, R, dtype)
            ids_d = ids.to(model.device)
            out = model(ids_d, labels=ids_d)
            out.loss.backward()
            grad = model.model.layers[-1].mlp.experts.down_proj.grad.full_tensor()
            new = model.generate(ids_d, max_new_tokens=4, do_sample=False)[:, ids.shape[1]:]
            outs[impl] = (out.logits.detach().float(), out.loss.item(), grad.float(), new)
            del model
        (lg, loss, grad, new), (lg2, loss2, grad2, new2) = outs["moe_ep"], outs["all_to_all"]
        print(f"rank {rank}/{R} {args.family}: loss moe_ep {loss:.5f} all_to_all {loss2:.5f}; "
              f"max |logits diff| {(lg - lg2).abs().max().item():.2e}; max |experts grad diff| "
              f"{(grad - grad2).abs().max().item():.2e} (of {grad2.abs().max().item():.2e}); "
              f"generated {new.tolist()} {'==' if torch.equal(new, new2) else '!='} all_to_all", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
