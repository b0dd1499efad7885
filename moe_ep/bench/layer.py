"""MoELayer forward benchmark: moe_ep against the same layer over an NCCL all_to_all baseline.

GPU (one process per GPU):
    torchrun --nproc-per-node=2 -m moe_ep.bench.layer --model deepseek-v3 --tokens 128,4096 --dispatch-dtype fp8
    torchrun --nproc-per-node=2 -m moe_ep.bench.layer --model qwen3-235b --tokens 128,4096
CPU end-to-end check of this script (gloo, 2 ranks, tiny shapes, interpreter, wall clock):
    python -m moe_ep.bench.layer --cpu-smoke

For each token count T per rank, after warm-up, under ``torch.no_grad``: the whole forward of a
``moe_ep.MoELayer`` (router, dispatch, experts, combine, shared experts), then the same routed
path split into dispatch / experts / combine (each call timed alone, with a device sync around
it), and the same split with ``moe_ep.bench.intranode.NaiveEP`` (all_to_all_single of counts, host sync,
permute, all_to_all_single of rows; combine: weighted index_add_, all_to_all_single back) in
place of dispatch/combine, the experts computed the same way. Numbers are p50 over iterations in
microseconds, max over ranks; the two outputs are compared once (max relative error).
Weights are random (each rank builds only its own experts). Results go to stdout as a table,
and as JSON with ``--output``.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import time
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

MODELS = {
    # hidden, ffn_hidden (per routed expert), experts, topk, router settings, shared experts
    "deepseek-v3": dict(hidden=7168, ffn_hidden=2048, num_experts=256, topk=8, router="sigmoid", n_group=8,
                        topk_group=4, routed_scaling_factor=2.5, shared_experts=1),
    "qwen3-235b": dict(hidden=4096, ffn_hidden=1536, num_experts=128, topk=8, router="softmax",
                       norm_topk_prob=True),
    "smoke": dict(hidden=128, ffn_hidden=64, num_experts=8, topk=2, router="sigmoid", n_group=4, topk_group=2,
                  shared_experts=1),
}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="MoELayer forward: moe_ep vs NCCL all_to_all")
    ap.add_argument("--model", default="deepseek-v3", choices=[m for m in MODELS if m != "smoke"])
    ap.add_argument("--tokens", default="128,4096", help="tokens per rank, comma separated (decode, prefill)")
    ap.add_argument("--dispatch-dtype", default="fp8", choices=["bf16", "fp8"])
    ap.add_argument("--layout", default="packed", choices=["packed", "masked"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--output", help="write the results as JSON here (rank 0)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny shapes on CPU: gloo, 2 ranks (spawned unless under torchrun), 2 iterations")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.model, args.tokens, args.warmup, args.iters = "smoke", "16,40", 1, 2
    args.token_list = [int(t) for t in args.tokens.split(",")]
    return args


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> tuple:
    """(last result, p50 microseconds) of ``fn``, each call between device syncs."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    return out, times[len(times) // 2]


def max_over_ranks(v: float, device: torch.device) -> float:
    """``v``'s maximum over the ranks (itself without torch.distributed)."""
    if not dist.is_initialized():
        return v
    from .intranode import max_over_ranks as max_list

    return max_list([v], device)[0]


def naive_groups(counts: torch.Tensor):
    from moe_ep.moe.experts import RowGroups

    n = int(counts.sum())
    ends = torch.cumsum(counts, 0).to(torch.int32)
    rows = torch.arange(n, device=counts.device)
    expert = torch.searchsorted(ends.long(), rows, right=True)
    host = counts.device.type == "cpu"
    starts = (ends.long() - counts).tolist() if host else None
    return RowGroups(ends=ends, valid=torch.ones(n, dtype=torch.bool, device=counts.device), expert=expert,
                     starts=starts, counts=counts.tolist() if host else None)


def bench_tokens(layer, naive, T: int, args, device) -> dict:
    from moe_ep.core.fp8 import dequantize_fp8
    from moe_ep.moe.rows import delivered, to_layout

    runner = layer.runner
    gate_up, down = layer.experts.gate_up_proj, layer.experts.down_proj
    g = torch.Generator(device=device).manual_seed(1000 + layer.group.rank)
    x = torch.randn(T, layer.hidden, generator=g, device=device).to(gate_up.dtype)
    w_, idx_ = layer.gate(x)[1:]
    xb = x.to(torch.bfloat16)
    res = dict(tokens=T)
    _, res["forward_us"] = timed(lambda: layer(x), device, args.warmup, args.iters)
    _, res["router_us"] = timed(lambda: layer.gate(x), device, args.warmup, args.iters)
    buf = runner.buffer("fwd")

    d, res["moe_ep_dispatch_us"] = timed(lambda: buf.dispatch(xb, idx_, w_), device, args.warmup, args.iters)

    def experts():
        grp = runner.groups(d, gate_up)
        rows = delivered(d, grp.num_rows, slice(0, layer.hidden), gate_up.dtype)
        return to_layout(runner.experts(rows, grp, gate_up, down).to(torch.bfloat16), d.expert_x)

    y, res["moe_ep_experts_us"] = timed(experts, device, args.warmup, args.iters)
    out, res["moe_ep_combine_us"] = timed(lambda: buf.combine(y, d), device, args.warmup, args.iters)

    nd, res["nccl_dispatch_us"] = timed(lambda: naive.dispatch(xb, idx_, w_), device, args.warmup, args.iters)
    ex, sc, counts, h = nd

    def n_experts():
        grp = naive_groups(counts)
        rows = ex.to(gate_up.dtype) if sc is None else dequantize_fp8(ex, sc).to(gate_up.dtype)
        return runner.experts(rows, grp, gate_up, down).to(torch.bfloat16)

    ny, res["nccl_experts_us"] = timed(n_experts, device, args.warmup, args.iters)
    nout, res["nccl_combine_us"] = timed(lambda: naive.combine(ny, h), device, args.warmup, args.iters)
    err = (out.float() - nout.float()).abs().max().item() / max(nout.float().abs().max().item(), 1e-6) if T else 0.0
    res["max_rel_err_vs_nccl"] = err
    for k in list(res):
        if k.endswith("_us") or k == "max_rel_err_vs_nccl":
            res[k] = max_over_ranks(res[k], device)
    for p in ("moe_ep", "nccl"):
        res[f"{p}_routed_us"] = sum(res[f"{p}_{s}_us"] for s in ("dispatch", "experts", "combine"))
    return res


def run(args: argparse.Namespace) -> List[dict]:
    import moe_ep
    from .intranode import NaiveEP

    group = moe_ep.EPGroup()
    dev = group.device
    spec = MODELS[args.model]
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    layer = moe_ep.MoELayer(**spec, group=group, dispatch_dtype=args.dispatch_dtype, layout=args.layout,
                            max_tokens=max(args.token_list), sync_chunks=False, dtype=dtype)
    naive = NaiveEP(spec["num_experts"], args.dispatch_dtype == "fp8")
    results = []
    with torch.no_grad():
        for T in args.token_list:
            r = bench_tokens(layer, naive, T, args, dev)
            r.update(model=args.model, ranks=group.world_size, dispatch_dtype=args.dispatch_dtype,
                     layout=args.layout, device=str(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else "cpu")
            results.append(r)
    layer.close()
    return results


def format_table(results: List[dict]) -> str:
    cols = ["tokens", "forward_us", "router_us", "moe_ep_dispatch_us", "moe_ep_experts_us", "moe_ep_combine_us",
            "moe_ep_routed_us", "nccl_dispatch_us", "nccl_experts_us", "nccl_combine_us", "nccl_routed_us",
            "max_rel_err_vs_nccl"]
    lines = ["  ".join(f"{c:>18}" for c in cols)]
    for r in results:
        lines.append("  ".join(f"{r[c]:>18.3g}" if isinstance(r[c], float) else f"{r[c]:>18}" for c in cols))
    return "\n".join(lines)


def worker(args: argparse.Namespace, rank: int = -1, world: int = -1, port: int = 0) -> None:
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        if rank >= 0:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        else:
            dist.init_process_group("gloo")
    else:
        dist.init_process_group("nccl")
    results = run(args)
    if dist.get_rank() == 0:
        print(f"MoELayer forward, {results[0]['model']}, R={results[0]['ranks']}, {args.dispatch_dtype} dispatch, "
              f"{args.layout}, {results[0]['device']} (p50 us, max over ranks)")
        print(format_table(results), flush=True)
        if args.output:
            with open(args.output, "w") as f:
                json.dump(results, f, indent=1)
    dist.destroy_process_group()


def _spawned(rank: int, args: argparse.Namespace, world: int, port: int) -> None:
    worker(args, rank, world, port)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke and "RANK" not in os.environ:
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_spawned, args=(args, 2, port), nprocs=2, join=True)
    else:
        worker(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
