"""Intranode benchmark: moe_ep dispatch/combine against an NCCL all-to-all baseline.

GPU (one process per GPU, NVLink):
    torchrun --nproc-per-node=2 -m moe_ep.bench.intranode --preset decode --dispatch-dtype fp8 --layout masked
    torchrun --nproc-per-node=2 -m moe_ep.bench.intranode --preset prefill --dispatch-dtype fp8 --layout packed
    torchrun --nproc-per-node=1 -m moe_ep.bench.intranode --preset prefill --layout rows --num-programs 32

CPU end-to-end check of this script (gloo, 2 ranks, tiny shapes, interpreter, wall clock):
    python -m moe_ep.bench.intranode --cpu-smoke

Summary table of earlier JSON results:
    python -m moe_ep.bench.intranode --summarize results/*.json

What is timed (GPU), all on one CUDA stream, CUDA events around each call, after warm-up:
  - eager: dispatch alone, combine alone, and the pair, as a caller without CUDA graphs runs them;
  - graph: dispatch alone and combine alone (two captured graphs replayed alternately, so every
    combine follows its dispatch), and the pair captured as one graph;
  - kernel: the device time of each dispatch and combine call (the sum of its kernels' durations
    from torch.profiler, graph replays): what the GPU spends, without launch gaps;
  - nccl: the baseline a user would write (all_to_all_single of counts, host sync, permute once
    per (token, rank), all_to_all_single of rows and of metadata, expand per expert; combine:
    weighted index_add_ per received row, all_to_all_single back, index_add_ per token). Eager.
Each number is the p50 / p99 over iterations on each rank, then the max over ranks.

Bandwidth, per rank, two ways (bytes / p50 time, bytes averaged over ranks):
  - "all": every row a rank receives, its own included (DeepEP's convention);
  - "xgpu": rows received from other GPUs only.
  Dispatch moves one row per (token, destination rank): fp8 row = H + 4*ceil(H/128) bytes,
  bf16 row = 2H bytes. Combine moves one bf16 row per (token, expert-owning rank) back.
  Routing metadata (expert ids, weights, flags) is not counted.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..core import settings
from ..core.tuning import Tuning

PRESETS = {
    # tokens per rank, hidden, topk, experts
    "decode": dict(num_tokens=128, hidden=7168, topk=8, num_experts=256),
    "prefill": dict(num_tokens=4096, hidden=7168, topk=8, num_experts=256),
    "smoke": dict(num_tokens=16, hidden=256, topk=4, num_experts=8),
}
FP8_BLOCK = 128


# ----------------------------------------------------------------------------- arguments

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moe_ep.bench.intranode", description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=["decode", "prefill"], default="decode")
    p.add_argument("--dispatch-dtype", choices=["fp8", "bf16"], default="fp8")
    p.add_argument("--layout", choices=["masked", "packed", "rows"], default=None,
                   help="default: masked for decode, packed for prefill (rows: one row per (token, rank), "
                        "the fake experts reduce each row over its local experts)")
    p.add_argument("--expert-alignment", type=int, default=1)
    p.add_argument("--num-tokens", type=int, default=None, help="override the preset's tokens per rank")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--topk", type=int, default=None)
    p.add_argument("--num-experts", type=int, default=None)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--graph", action=argparse.BooleanOptionalAction, default=True,
                   help="also time CUDA-graph replays (default on)")
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the NCCL all-to-all baseline (default on)")
    p.add_argument("--num-programs", type=int, default=None,
                   help="passed to EPBuffer(num_programs=N); default: the buffer's choice")
    p.add_argument("--combine-out", action="store_true",
                   help="combine into one preallocated tensor (combine(..., out=)): no allocation per call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=str, default=None, help="write results as JSON (rank 0)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes on CPU: gloo, 2 ranks (spawned unless under torchrun), "
                        "TRITON_INTERPRET=1, no graphs, wall-clock timing")
    p.add_argument("--summarize", nargs="+", metavar="JSON", default=None,
                   help="print the summary table of earlier --output files and exit")
    args = p.parse_args(argv)
    if args.layout is None:
        args.layout = "masked" if args.preset == "decode" else "packed"
    shape = dict(PRESETS["smoke" if args.cpu_smoke else args.preset])
    for key in shape:
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    for key, value in shape.items():
        setattr(args, key, value)
    if args.cpu_smoke:
        args.graph = False
        args.iters = min(args.iters, 5)
        args.warmup = min(args.warmup, 1)
    return args


# ----------------------------------------------------------------------------- timing

class Timer:
    """Times a sequence of callables per iteration: CUDA events on GPU, wall clock on CPU."""

    def __init__(self, device: torch.device, stream: Optional["torch.cuda.Stream"]):
        self.cuda = device.type == "cuda"
        self.stream = stream

    def run(self, fns: list[Callable[[], object]], iters: int) -> list[list[float]]:
        """Runs ``fns`` in order, ``iters`` times; returns microseconds per call, per fn."""
        if not self.cuda:
            out: list[list[float]] = [[] for _ in fns]
            for _ in range(iters):
                for i, fn in enumerate(fns):
                    t = time.perf_counter()
                    fn()
                    out[i].append((time.perf_counter() - t) * 1e6)
            return out
        events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                   for _ in range(iters)] for _ in fns]
        with torch.cuda.stream(self.stream):
            for it in range(iters):
                for i, fn in enumerate(fns):
                    start, end = events[i][it]
                    start.record()
                    fn()
                    end.record()
        torch.cuda.synchronize()
        return [[s.elapsed_time(e) * 1e3 for s, e in per_fn] for per_fn in events]


def kernel_times(d_fn, c_fn, iters: int, stream, per_kernel: Optional[dict] = None) -> tuple[list[float], list[float]]:
    """Device time of each call (the sum of its kernels' durations, torch.profiler), for ``iters``
    alternating dispatch / combine calls: what the GPU spends, without launch gaps. ``per_kernel``
    (a dict) gets each kernel's name -> its durations (µs), to see which launch of a call takes
    the time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.cuda.stream(stream):
        for _ in range(iters):
            d_fn()
            c_fn()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and ("dispatch" in e.name or "route" in e.name or "combine" in e.name)),
                     key=lambda e: e.time_range.start)
    d, c = [], []
    last = None
    for e in kernels:  # consecutive kernels of one op belong to one call
        if per_kernel is not None:
            per_kernel.setdefault(e.name, []).append(e.device_time)
        op = "c" if "combine" in e.name else "d"
        out = c if op == "c" else d
        if op == last:
            out[-1] += e.device_time
        else:
            out.append(e.device_time)
        last = op
    return d, c


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))]


def collective_device(device: torch.device) -> torch.device:
    """``device`` under NCCL; the CPU under gloo (ranks sharing GPUs), which gathers host tensors only."""
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=collective_device(device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def mean_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=collective_device(device))
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return (t / dist.get_world_size()).tolist()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


# ----------------------------------------------------------------------------- inputs

def make_inputs(args: argparse.Namespace, rank: int, device: torch.device):
    """Random uniform routing: each token picks ``topk`` distinct experts; weights sum to 1."""
    g = torch.Generator(device="cpu").manual_seed(args.seed * 1000 + rank)
    t, h, k, e = args.num_tokens, args.hidden, args.topk, args.num_experts
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    topk_idx = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k].contiguous()
    w = torch.rand(t, k, generator=g) + 0.1
    topk_weights = (w / w.sum(dim=1, keepdim=True)).float()
    return x.to(device), topk_idx.to(device), topk_weights.to(device)


def expert_scale(num_experts: int, device: torch.device) -> torch.Tensor:
    """What the fake experts multiply their input by: 1 + (e % 7) / 8, exact in bf16."""
    return 1 + (torch.arange(num_experts, device=device) % 7).float() / 8


def row_bytes(hidden: int, fp8: bool) -> int:
    return hidden + 4 * math.ceil(hidden / FP8_BLOCK) if fp8 else 2 * hidden


def traffic(topk_idx: torch.Tensor, args: argparse.Namespace, rank: int, world: int, device) -> dict:
    """Bytes this rank receives in dispatch and in combine, all and cross-GPU only."""
    e_local = args.num_experts // world
    valid = topk_idx >= 0
    dst = torch.where(valid, topk_idx // e_local, torch.full_like(topk_idx, world))
    hit = torch.zeros(topk_idx.shape[0], world + 1, dtype=torch.bool, device=topk_idx.device)
    hit.scatter_(1, dst.long(), True)
    send = hit[:, :world].sum(dim=0).to(torch.int64)              # rows this rank sends to each rank
    device = collective_device(device)
    gathered = [torch.empty(world, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(gathered, send.to(device))
    m = torch.stack(gathered).cpu()                                  # m[src, dst]
    fp8 = args.dispatch_dtype == "fp8"
    d_all, d_x = int(m[:, rank].sum()), int(m[:, rank].sum() - m[rank, rank])
    c_all, c_x = int(m[rank, :].sum()), int(m[rank, :].sum() - m[rank, rank])
    return dict(
        dispatch_rows=d_all, dispatch_rows_xgpu=d_x, combine_rows=c_all, combine_rows_xgpu=c_x,
        dispatch_bytes=d_all * row_bytes(args.hidden, fp8),
        dispatch_bytes_xgpu=d_x * row_bytes(args.hidden, fp8),
        combine_bytes=c_all * 2 * args.hidden,
        combine_bytes_xgpu=c_x * 2 * args.hidden,
    )


# ----------------------------------------------------------------------------- fake experts + check

def dequant(q: torch.Tensor, scales: Optional[torch.Tensor]) -> torch.Tensor:
    if scales is None:
        return q.float()
    h = q.shape[-1]
    return q.float() * scales.repeat_interleave(FP8_BLOCK, dim=-1)[..., :h]


def fake_expert_output(d, layout: str, rank: int, e_local: int, scale: torch.Tensor) -> torch.Tensor:
    """y = dequant(expert_x) * scale[global expert], bf16, in the dispatch output's layout (rows:
    each row times ``sum_k w[k] * scale[its k-th local expert]``, the row reduced over its local
    experts; rows past ``num_recv`` are never read)."""
    xf = dequant(d.expert_x, d.expert_scales)
    s = scale[rank * e_local: (rank + 1) * e_local]
    if layout == "masked":
        return (xf * s[:, None, None]).to(torch.bfloat16)
    if layout == "rows":
        ids = d.recv_topk_idx.long()
        coef = torch.where(ids >= 0, d.recv_topk_weights * s[ids.clamp(0, e_local - 1)], 0.0).sum(dim=1)
        return (xf * coef[:, None]).to(torch.bfloat16)
    rows = torch.arange(xf.shape[0], device=xf.device)
    offsets = d.expert_offsets.to(torch.int64)
    expert_of_row = (torch.searchsorted(offsets[1:], rows, right=True)).clamp_max(e_local - 1)
    return (xf * s[expert_of_row][:, None]).to(torch.bfloat16)


def reference_out(x, topk_idx, topk_weights, fp8: bool, scale: torch.Tensor) -> torch.Tensor:
    """out[t] = xhat[t] * sum_k w[t,k] * scale[e_k]: what combine(fake experts) must give."""
    if fp8:
        from moe_ep.core.fp8 import dequantize_fp8, quantize_fp8
        xhat = dequantize_fp8(*quantize_fp8(x))
    else:
        xhat = x.float()
    valid = topk_idx >= 0
    coef = torch.where(valid, topk_weights * scale[topk_idx.clamp_min(0).long()], 0).sum(dim=1)
    return xhat * coef[:, None]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if ref.numel() == 0:
        return 0.0
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


# ----------------------------------------------------------------------------- NCCL baseline

@dataclass
class NaiveHandle:
    send_token: torch.Tensor   # [n_send] source token of each sent row, rows sorted by destination rank
    send_splits: list[int]
    recv_splits: list[int]
    sel_row: torch.Tensor      # [n_sel] received row of each selection, sorted by local expert
    sel_weight: torch.Tensor   # [n_sel] float32 routing weight of each selection
    num_tokens: int


class NaiveEP:
    """Expert parallelism the way a user writes it with NCCL all_to_all_single and torch ops."""

    def __init__(self, num_experts: int, fp8: bool):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.e_local = num_experts // self.world
        self.fp8 = fp8

    def _a2a(self, inp: torch.Tensor, recv_splits: list[int], send_splits: list[int]) -> torch.Tensor:
        out = inp.new_empty((sum(recv_splits),) + tuple(inp.shape[1:]))
        dist.all_to_all_single(out, inp, output_split_sizes=recv_splits, input_split_sizes=send_splits)
        return out

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
        """Returns (expert_x [n_sel, H] packed by local expert, expert_scales or None, counts, handle)."""
        t, k = topk_idx.shape
        idx = topk_idx.long()
        valid = idx >= 0
        dst = torch.where(valid, idx // self.e_local, torch.full_like(idx, self.world))
        hit = torch.zeros(t, self.world + 1, dtype=torch.bool, device=x.device).scatter_(1, dst, True)
        dst_rank, send_token = hit[:, : self.world].t().nonzero(as_tuple=True)  # by rank, then token
        send_counts = torch.bincount(dst_rank, minlength=self.world)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        send_splits, recv_splits = torch.stack([send_counts, recv_counts]).cpu().tolist()  # host sync

        # permute: one row per (token, destination rank), plus metadata for that rank
        local = idx[send_token] - dst_rank[:, None] * self.e_local
        mine = valid[send_token] & (local >= 0) & (local < self.e_local)
        meta = [torch.where(mine, local, -1).float(), torch.where(mine, topk_weights[send_token], 0.0)]
        if self.fp8:
            from moe_ep.core.fp8 import quantize_fp8
            q, scales = quantize_fp8(x)
            payload = q.view(torch.uint8)[send_token]
            meta.append(scales[send_token])
        else:
            payload = x.view(torch.uint8)[send_token]  # bytes: every backend moves uint8
        recv_x = self._a2a(payload, recv_splits, send_splits)
        recv_meta = self._a2a(torch.cat(meta, dim=1), recv_splits, send_splits)

        # expand per local expert
        ids = recv_meta[:, :k].long()
        row, col = (ids >= 0).nonzero(as_tuple=True)
        expert = ids[row, col]
        order = torch.argsort(expert, stable=True)
        sel_row = row[order]
        sel_weight = recv_meta[:, k: 2 * k][row, col][order]
        counts = torch.bincount(expert, minlength=self.e_local)
        if self.fp8:
            expert_x = recv_x[sel_row].view(torch.float8_e4m3fn)
            expert_scales = recv_meta[sel_row, 2 * k:]
        else:
            expert_x, expert_scales = recv_x[sel_row].view(torch.bfloat16), None
        handle = NaiveHandle(send_token, send_splits, recv_splits, sel_row, sel_weight, t)
        return expert_x, expert_scales, counts, handle

    def combine(self, expert_y: torch.Tensor, h: NaiveHandle) -> torch.Tensor:
        hidden = expert_y.shape[1]
        partial = torch.zeros(sum(h.recv_splits), hidden, dtype=torch.float32, device=expert_y.device)
        partial.index_add_(0, h.sel_row, expert_y.float() * h.sel_weight[:, None])
        back = self._a2a(partial.to(torch.bfloat16).view(torch.uint8), h.send_splits, h.recv_splits)
        out = torch.zeros(h.num_tokens, hidden, dtype=torch.float32, device=expert_y.device)
        out.index_add_(0, h.send_token, back.view(torch.bfloat16).float())
        return out.to(torch.bfloat16)


# ----------------------------------------------------------------------------- the benchmark

def stats(name: str, mode: str, times_us: list[float], device, nbytes: Optional[tuple[float, float]],
          programs: Optional[int]) -> dict:
    p50, p99 = max_over_ranks([percentile(times_us, 50), percentile(times_us, 99)], device)
    row = dict(op=name, mode=mode, p50_us=p50, p99_us=p99, programs=programs)
    if nbytes is not None:
        row["gbps_all"] = nbytes[0] / (p50 * 1e-6) / 1e9
        row["gbps_xgpu"] = nbytes[1] / (p50 * 1e-6) / 1e9
    return row


def run_bench(args: argparse.Namespace, tuning: Optional[Tuning] = None) -> dict:
    """The bench of ``args``; ``tuning``: the buffer's (default: ``Tuning.from_env()``, as EPBuffer's)."""
    import moe_ep

    group = moe_ep.EPGroup()
    device, rank, world = group.device, group.rank, group.world_size
    fp8 = args.dispatch_dtype == "fp8"
    e_local = args.num_experts // world
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    timer = Timer(device, stream)

    def measure(mode, d_fn, c_fn, pair_fn, programs_used):
        """Times dispatch and combine alone (alternating), then the pair; appends three rows."""
        sync(device)
        t_d, t_c = timer.run([d_fn, c_fn], args.iters)
        sync(device)
        (t_p,) = timer.run([pair_fn], args.iters)
        sync(device)
        results.append(stats("dispatch", mode, t_d, device, d_bytes, programs_used))
        results.append(stats("combine", mode, t_c, device, c_bytes, programs_used))
        results.append(stats("dispatch+combine", mode, t_p, device, pair_bytes, programs_used))

    x, topk_idx, topk_weights = make_inputs(args, rank, device)
    scale = expert_scale(args.num_experts, device)
    ref = reference_out(x, topk_idx, topk_weights, fp8, scale)
    tr = traffic(topk_idx, args, rank, world, device)
    avg = dict(zip(tr, mean_over_ranks(list(map(float, tr.values())), device)))
    d_bytes = (avg["dispatch_bytes"], avg["dispatch_bytes_xgpu"])
    c_bytes = (avg["combine_bytes"], avg["combine_bytes_xgpu"])
    pair_bytes = (d_bytes[0] + c_bytes[0], d_bytes[1] + c_bytes[1])
    sync(device)  # inputs and reference are ready before work starts on `stream`

    kwargs = dict(dispatch_dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
                  combine_dtype=torch.bfloat16, layout=args.layout,
                  expert_alignment=args.expert_alignment, tuning=tuning)
    if args.num_programs is not None:
        kwargs["num_programs"] = args.num_programs
    if args.layout != "masked":  # the kernels' time as before (sized per call, a dispatch adds a host sync)
        kwargs["max_recv_rows"] = "worst"
    results: list[dict] = []
    checks: dict[str, float] = {}

    with moe_ep.EPBuffer(group, args.num_experts, args.hidden, args.num_tokens, args.topk, **kwargs) as buf:
        programs = getattr(buf, "num_programs", None)
        state: dict = {}

        def dispatch():
            state["d"] = buf.dispatch(x, topk_idx, topk_weights)

        combine_kw = (dict(out=torch.empty(x.shape[0], args.hidden, dtype=torch.bfloat16, device=device))
                      if args.combine_out else {})

        def combine():
            state["out"] = buf.combine(state["y"], state["d"], **combine_kw)

        def pair():
            dispatch()
            combine()

        # warm-up (compiles the kernels), fake expert output, correctness check; all on `stream`
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            dispatch()
            state["y"] = fake_expert_output(state["d"], args.layout, rank, e_local, scale)
            for _ in range(max(1, args.warmup)):
                pair()
        sync(device)
        checks["moe_ep"] = max_over_ranks([rel_err(state["out"], ref)], device)[0]

        # eager pair first: captured graphs advance the buffer's device-side epochs
        measure("eager", dispatch, combine, pair, programs)

        if args.graph and device.type == "cuda":
            g_d, g_c, g_p = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            sync(device)
            with torch.cuda.graph(g_d, stream=stream, capture_error_mode="thread_local"):
                dispatch()
            with torch.cuda.graph(g_c, stream=stream, capture_error_mode="thread_local"):
                combine()
            with torch.cuda.graph(g_p, stream=stream, capture_error_mode="thread_local"):
                pair()
            sync(device)
            with torch.cuda.stream(stream):   # graph warm-up
                for _ in range(args.warmup):
                    g_d.replay()
                    g_c.replay()
                    g_p.replay()
            measure("graph", g_d.replay, g_c.replay, g_p.replay, programs)
            per_kernel: dict = {}
            t_d, t_c = kernel_times(g_d.replay, g_c.replay, args.iters, stream, per_kernel)
            if rank == 0:
                print("kernel p50 by launch: " + ", ".join(f"{name} {percentile(v, 50):.1f} µs"
                                                           for name, v in sorted(per_kernel.items())), flush=True)
            results.append(stats("dispatch", "kernel", t_d, device, d_bytes, programs))
            results.append(stats("combine", "kernel", t_c, device, c_bytes, programs))
            results.append(stats("dispatch+combine", "kernel", [a + b for a, b in zip(t_d, t_c)], device,
                                 pair_bytes, programs))
            checks["moe_ep_graph"] = max_over_ranks([rel_err(state["out"], ref)], device)[0]
        sync(device)

    if args.baseline:
        naive = NaiveEP(args.num_experts, fp8)
        nstate: dict = {}

        def n_dispatch():
            nstate["d"] = naive.dispatch(x, topk_idx, topk_weights)

        def n_combine():
            nstate["out"] = naive.combine(nstate["y"], nstate["d"][3])

        def n_pair():
            n_dispatch()
            n_combine()

        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            n_dispatch()
            ex, es, counts, _ = nstate["d"]
            expert_of_row = torch.repeat_interleave(torch.arange(e_local, device=device), counts)
            nstate["y"] = (dequant(ex, es) * scale[rank * e_local + expert_of_row][:, None]).to(torch.bfloat16)
            for _ in range(max(1, args.warmup)):
                n_pair()
        sync(device)
        checks["nccl"] = max_over_ranks([rel_err(nstate["out"], ref)], device)[0]
        measure("nccl", n_dispatch, n_combine, n_pair, None)

    return dict(
        config=dict(preset="cpu-smoke" if args.cpu_smoke else args.preset,
                    dispatch_dtype=args.dispatch_dtype, combine_dtype="bf16", layout=args.layout,
                    expert_alignment=args.expert_alignment, num_tokens=args.num_tokens,
                    hidden=args.hidden, topk=args.topk, num_experts=args.num_experts,
                    world_size=world, node_size=group.node_size, iters=args.iters,
                    warmup=args.warmup, graph=args.graph, num_programs=programs, seed=args.seed),
        traffic_per_rank_mean=avg,
        checks_rel_err=checks,
        results=results,
        env=environment(device),
        command=" ".join([os.path.basename(sys.executable), "-m", "moe_ep.bench.intranode"] + sys.argv[1:]),
    )


def environment(device: torch.device) -> dict:
    import triton

    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        commit = (commit + ("-dirty" if dirty else "")) if commit else None
    except OSError:
        commit = None
    # A copy of the tree (e.g. shipped to a GPU box, maybe with a stale .git) names its commit by environment.
    commit = settings.commit() or commit or None  # an explicit name wins
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        host=socket.gethostname(), commit=commit, torch=torch.__version__, triton=triton.__version__,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        num_sms=(torch.cuda.get_device_properties(device).multi_processor_count
                 if device.type == "cuda" else None),
    )


# ----------------------------------------------------------------------------- output

CHECK_TOL = 3e-2  # bf16 expert outputs, fp32 accumulation, bf16 result


def format_table(res: dict) -> str:
    c = res["config"]
    head = (f"{c['preset']} T={c['num_tokens']} H={c['hidden']} K={c['topk']} E={c['num_experts']} "
            f"R={c['world_size']} dispatch={c['dispatch_dtype']} layout={c['layout']} "
            f"programs={c['num_programs']} iters={c['iters']}  [{res['env']['device']}, {res['env']['commit']}]")
    lines = [head, f"{'op':<17} {'mode':<6} {'p50 us':>9} {'p99 us':>9} {'GB/s all':>9} {'GB/s xgpu':>9}"]
    for r in res["results"]:
        lines.append(f"{r['op']:<17} {r['mode']:<6} {r['p50_us']:>9.1f} {r['p99_us']:>9.1f} "
                     f"{r.get('gbps_all', float('nan')):>9.4g} {r.get('gbps_xgpu', float('nan')):>9.4g}")
    checks = "  ".join(f"{k}={v:.1e}" for k, v in res["checks_rel_err"].items())
    lines.append(f"check (max rel err vs closed form, tol {CHECK_TOL:g}): {checks}")
    return "\n".join(lines)


def checks_ok(res: dict) -> bool:
    return all(v <= CHECK_TOL for v in res["checks_rel_err"].values())


def summarize(paths: list[str]) -> int:
    for path in paths:
        with open(path) as f:
            print(format_table(json.load(f)))
            print()
    return 0


# ----------------------------------------------------------------------------- entry points

def worker(args: argparse.Namespace, rank: int = -1, world: int = -1, port: int = 0) -> int:
    """One rank: initialise torch.distributed, run, print and save on rank 0."""
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before moe_ep (and its kernels) import
        if rank >= 0:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        else:
            dist.init_process_group("gloo")
    else:
        from moe_ep.core.group import init_distributed
        init_distributed("cuda")   # NCCL, or gloo where ranks share a GPU (then --no-baseline: no NCCL all-to-all)
    try:
        res = run_bench(args)
        ok = checks_ok(res)
        if dist.get_rank() == 0:
            if args.output:
                os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
                with open(args.output, "w") as f:
                    json.dump(res, f, indent=2)
            print(format_table(res), flush=True)
            if not ok:
                print(f"ERROR: an output differs from the closed form by more than {CHECK_TOL:g}", flush=True)
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, args: argparse.Namespace, world: int, port: int) -> None:
    rc = worker(args, rank, world, port)
    if rc:
        sys.exit(rc)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.summarize:
        return summarize(args.summarize)
    if args.cpu_smoke and "RANK" not in os.environ:
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_spawned, args=(args, 2, port), nprocs=2, join=True)
        return 0
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
