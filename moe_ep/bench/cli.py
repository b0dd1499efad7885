"""moe-ep-bench: moe_ep dispatch/combine side by side with NCCL, torch symmetric memory and DeepEP.

Run one process per GPU with torchrun (one node or many):

    torchrun --nproc-per-node=2 -m moe_ep.bench --preset decode --output decode.json --plot decode.png
    torchrun --nnodes=4 --nproc-per-node=8 --node-rank=$NODE_RANK --rdzv-backend=c10d \\
        --rdzv-endpoint=$HEAD:29500 -m moe_ep.bench --preset prefill --num-sms 32 --output ep32.json
    moe-ep-bench plot ep16.json ep32.json ep64.json --output ep_sweep.png   # latency vs EP size
    moe-ep-bench table decode.json                                           # the table again
    moe-ep-bench merge a.json b.json --output ab.json                        # one document
    moe-ep-bench proxy --ranks 8 16 32 64 128 --json scale.json --plot scale.png   # proxy cost vs R (null transport)
    moe-ep-bench model --ep 8,16,32,64,128,256 --nic cx7 --tokens 128               # predicted latency per phase (no GPU)
    moe-ep-bench model --check                                                      # the model vs published numbers
    moe-ep-bench memory --ep 8,16,32,64,128 --tokens 128,4096 --layout packed,rows  # memory per rank (computed)

Without a GPU the same runs on CPU ranks (gloo, Triton interpreter; times are meaningless):
    torchrun --nproc-per-node=2 -m moe_ep.bench --device cpu --tokens 4,8 --hidden 128 --num-experts 4 --topk 2 --iters 2

Every backend runs on the same inputs (same seed) after a pre-check of its combine output against
the oracle (moe_ep.testing.reference, fake experts y = x * (1 + (e % 7) / 8)); a backend or mode that
cannot run is reported as "not available: <reason>" and the sweep goes on. Times: p50/p90/p99 over
iterations on each rank, then the max over ranks; GB/s at the p50, two conventions (all rows a
rank receives, its own included, as DeepEP counts; cross-GPU rows only). JSON schema: moe_ep/bench/schema.json.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
from typing import Optional, Sequence

from .args import int_list
from .workloads import MODELS, PRESETS, ROUTINGS, Routing, Workload

BACKEND_NAMES = ("moe_ep", "nccl", "symm_mem", "deepep")
PROG = "moe-ep-bench"


# ----------------------------------------------------------------------------- arguments

def _backend_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in BACKEND_NAMES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"--backends: expected a comma-separated list of {', '.join(BACKEND_NAMES)}, "
                                         f"got {text!r}" + (f" (unknown: {', '.join(bad)})" if bad else ""))
    return list(dict.fromkeys(names))


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n")[0],
        epilog="Subcommands on result files (no torchrun): `plot JSON... --output PNG`, `table JSON...`, "
               "`merge JSON... --output JSON`; without a GPU: `proxy` (the proxy's CPU cost), `memory` (memory "
               "per rank, computed). Full usage: the module docstring of moe_ep/bench/cli.py and README.md "
               "(Benchmarks).")
    w = p.add_argument_group("workload (a preset, then a model shape, then single flags override)")
    w.add_argument("--preset", choices=sorted(PRESETS), default="decode",
                   help="decode: T=128 per rank, fp8 dispatch, bf16 combine, masked layout; prefill: T=4096, "
                        "packed layout. Shape: DeepSeek-V3 (H=7168, K=8, E=256). Default: decode")
    w.add_argument("--model", choices=sorted(MODELS), default=None,
                   help="model shape (hidden, top-k, routed experts): " +
                        "; ".join(f"{m}: H={s['hidden']} K={s['topk']} E={s['num_experts']}" for m, s in MODELS.items()))
    w.add_argument("--tokens", type=int_list("--tokens", zero_ok=True), default=None,
                   help="tokens per rank; a comma-separated list sweeps (e.g. 1,16,128,512). Default: the preset's")
    w.add_argument("--hidden", type=int, default=None, help="hidden size H (a multiple of 16 for moe_ep)")
    w.add_argument("--topk", type=int, default=None, help="experts per token K")
    w.add_argument("--num-experts", type=int, default=None, help="routed experts E (a multiple of the EP size)")
    w.add_argument("--dispatch-dtype", choices=["fp8", "bf16"], default=None,
                   help="dispatch payload: fp8 (e4m3, a float32 scale per 128 channels) or bf16. Default: fp8")
    w.add_argument("--combine-dtype", choices=["bf16"], default=None, help="combine payload (bf16)")
    w.add_argument("--layout", choices=["masked", "packed", "rows"], default=None,
                   help="moe_ep's expert layout: masked [E_local, R*T, H], packed by expert, or rows (one per "
                        "(token, rank)). "
                        "Default: masked for decode, packed for prefill")
    w.add_argument("--expert-alignment", type=int, default=1, help="packed layout: expert blocks start at multiples of this")
    w.add_argument("--routing", choices=ROUTINGS, default="uniform",
                   help="uniform: K distinct experts per token, uniformly; zipf: K distinct experts with "
                        "P(e) ~ 1/(e+1)^s (expert 0 hottest, so rank 0 receives most). Default: uniform")
    w.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent s for --routing zipf (default 1.0)")
    w.add_argument("--holes", type=float, default=0.0,
                   help="probability that a selection is -1 (no expert), in [0, 1). Default 0")
    w.add_argument("--seed", type=int, default=0, help="routing/input seed (same inputs for every backend)")
    r = p.add_argument_group("what runs and how it is timed")
    r.add_argument("--backends", type=_backend_list, default=list(BACKEND_NAMES),
                   help=f"comma-separated, run in this order: {', '.join(BACKEND_NAMES)} (default: all). "
                        "moe_ep: EPBuffer; nccl: all_to_all_single + torch permutations; symm_mem: torch "
                        "all_to_all_vdev_2d(_offset) (NVSHMEM); deepep: DeepEP normal and low-latency modes")
    r.add_argument("--iters", type=int, default=200, help="timed iterations per measurement (default 200)")
    r.add_argument("--warmup", type=int, default=20, help="untimed dispatch+combine pairs first (default 20)")
    r.add_argument("--graph", action=argparse.BooleanOptionalAction, default=True,
                   help="also time moe_ep as CUDA-graph replays (GPU; default on)")
    r.add_argument("--num-sms", type=int_list("--num-sms", zero_ok=True), default=None,
                   help="SMs per launch: moe_ep's Triton programs, DeepEP normal mode's SMs (even); a list sweeps. "
                        "Default: each backend's own (moe_ep: all SMs; DeepEP: its default)")
    r.add_argument("--node-size", type=int, default=None,
                   help="moe_ep's ranks per node; below the EP size, moe_ep takes its inter-node (proxy) path, "
                        "so that path can be measured on one host. Default: the ranks on this host")
    r.add_argument("--timeout-s", type=float, default=60.0, help="moe_ep's deadline for a peer (seconds)")
    r.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="cuda: NCCL, one GPU per rank; cpu: gloo and the Triton interpreter. Default: cuda if present")
    o = p.add_argument_group("output")
    o.add_argument("--output", metavar="JSON", default=None,
                   help="write the results (schema: moe_ep/bench/schema.json), rewritten after every entry")
    o.add_argument("--plot", metavar="PNG", default=None, help="write the plots (needs matplotlib; else a message)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def parse_run_args(argv: Sequence[str]) -> argparse.Namespace:
    p = run_parser()
    a = p.parse_args(list(argv))
    preset = PRESETS[a.preset]
    a.model = a.model or preset["model"]
    shape = MODELS[a.model]
    a.hidden = shape["hidden"] if a.hidden is None else a.hidden
    a.topk = shape["topk"] if a.topk is None else a.topk
    a.num_experts = shape["num_experts"] if a.num_experts is None else a.num_experts
    if (a.hidden, a.topk, a.num_experts) != (shape["hidden"], shape["topk"], shape["num_experts"]):
        a.model = None  # a shape of its own: the config names no model
    a.tokens = a.tokens or list(preset["tokens"])
    a.dispatch_dtype = a.dispatch_dtype or preset["dispatch_dtype"]
    a.combine_dtype = a.combine_dtype or preset["combine_dtype"]
    a.layout = a.layout or preset["layout"]
    checks = [("--hidden", a.hidden >= 1, "a positive integer"), ("--topk", a.topk >= 1, "a positive integer"),
              ("--num-experts", a.num_experts >= 1, "a positive integer"),
              ("--topk", a.topk <= a.num_experts, f"at most --num-experts ({a.num_experts})"),
              ("--expert-alignment", a.expert_alignment >= 1, "a positive integer"),
              ("--holes", 0.0 <= a.holes < 1.0, "a probability in [0, 1)"),
              ("--zipf-s", a.zipf_s >= 0, "a non-negative number"),
              ("--iters", a.iters >= 1, "a positive integer"), ("--warmup", a.warmup >= 0, "a non-negative integer"),
              ("--node-size", a.node_size is None or a.node_size >= 1, "a positive integer"),
              ("--timeout-s", a.timeout_s > 0, "a positive number of seconds"),
              ("--num-sms", a.num_sms is None or min(a.num_sms) >= 1, "positive integers")]
    for flag, ok, expected in checks:
        if not ok:
            value = getattr(a, flag[2:].replace("-", "_"))
            p.error(f"{flag}: expected {expected}, got {value}")
    return a


def config_of(a: argparse.Namespace, device: str) -> dict:
    return dict(preset=a.preset, model=a.model, tokens=a.tokens, hidden=a.hidden, topk=a.topk,
                num_experts=a.num_experts, dispatch_dtype=a.dispatch_dtype, combine_dtype=a.combine_dtype,
                layout=a.layout, expert_alignment=a.expert_alignment,
                routing=dict(kind=a.routing, zipf_s=a.zipf_s, holes=a.holes), iters=a.iters, warmup=a.warmup,
                graph=a.graph, num_sms=a.num_sms, node_size=a.node_size, backends=a.backends, seed=a.seed,
                timeout_s=a.timeout_s, device=device)


# ----------------------------------------------------------------------------- the sweep

def _init_distributed(device_kind: str) -> str:
    """Initialises torch.distributed (env:// from torchrun; a single rank without it): NCCL with a
    GPU per rank, gloo on CPUs or when there are more local ranks than GPUs (they share them)."""
    import torch

    from moe_ep.core.group import init_distributed

    if device_kind == "cpu":
        torch.set_num_threads(1)
    return init_distributed(device_kind, timeout_s=600.0)


def _select_device(requested: str) -> str:
    """``cuda`` or ``cpu``, with the environment each needs set before triton is imported."""
    import torch

    kind = requested
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    elif kind == "cuda" and not torch.cuda.is_available():
        print(f"{PROG}: error: --device cuda: no CUDA GPU is visible (use --device cpu)", file=sys.stderr)
        raise SystemExit(2)
    if kind == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (through moe_ep)
    else:
        os.environ.pop("TRITON_INTERPRET", None)
        for var, value in (("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NCCL_NVLS_ENABLE", "0"),
                           ("NVSHMEM_DISABLE_NVLS", "1")):  # NVLink multicast stays off
            os.environ.setdefault(var, value)
    return kind


def sweep(a: argparse.Namespace, group, on_entry) -> list[dict]:
    """Every backend variant on every point (backend by backend); ``on_entry(entries)`` after each."""
    import torch

    from . import harness
    from .backends import BACKENDS, Context
    from .progress import Progress
    from .workloads import make_inputs

    ctx = Context(group=group, device=group.device, rank=group.rank, world_size=group.world_size, num_sms=None,
                  node_size=a.node_size, tokens=sorted(a.tokens), timeout_s=a.timeout_s,
                  shared_gpus=group.ranks_per_device > 1)
    stream = torch.cuda.Stream(group.device) if group.device.type == "cuda" else None
    opts = harness.Options(iters=a.iters, warmup=a.warmup, graph=a.graph)
    routing = Routing(kind=a.routing, zipf_s=a.zipf_s, holes=a.holes)
    points = list(itertools.product(a.tokens, a.num_sms or [None]))
    backends = [BACKENDS[name](ctx) for name in a.backends]
    progress = Progress(sum(len(b.variants) for b in backends) * len(points),
                        enabled=group.rank == 0 and not a.no_progress)
    inputs_cache: dict = {}
    entries: list[dict] = []
    for backend in backends:
        why = group.all_gather_object(backend.unavailable())[0]
        for variant, (t, sms) in itertools.product(backend.variants, points):
            wl = Workload(num_tokens=t, hidden=a.hidden, topk=a.topk, num_experts=a.num_experts,
                          dispatch_dtype=a.dispatch_dtype, combine_dtype=a.combine_dtype, layout=a.layout,
                          expert_alignment=a.expert_alignment, routing=routing, seed=a.seed)
            progress.step(backend.name + (f"/{variant}" if variant else "") + f" T={t}" +
                          (f" SMs={sms}" if sms else ""))
            ctx.num_sms = sms
            if why is not None:
                entries += harness.not_available(backend, variant, wl, ctx, opts, why)
                continue
            if t not in inputs_cache:
                inputs_cache[t] = make_inputs(wl, group)
            entries += harness.run_variant(backend, variant, wl, inputs_cache[t], ctx, opts, stream)
            on_entry(entries)
        backend.close()
    progress.finish()
    return entries


def run(a: argparse.Namespace) -> int:
    """One rank of a sweep; rank 0 prints the table and writes the JSON (after every entry) and the plot.
    Returns 2 for an --num-experts the ranks cannot split; a sweep that ran to its end ends the
    process (status 0, or 1 when an entry failed) without the interpreter's teardown."""
    device_kind = _select_device(a.device)
    _init_distributed(device_kind)
    import torch.distributed as dist

    import moe_ep

    from . import report

    try:
        group = moe_ep.EPGroup()
        if a.num_experts % group.world_size:
            if group.rank == 0:
                print(f"{PROG}: error: --num-experts: expected a multiple of the EP size {group.world_size}, "
                      f"got {a.num_experts}", file=sys.stderr)
            dist.destroy_process_group()
            return 2
        cfg = config_of(a, group.device.type)
        env = report.environment(group.device, group.world_size)
        env["gpus"] = len(set(group.device_keys)) if group.device.type == "cuda" else 0
        env["ranks_per_gpu"] = group.ranks_per_device if group.device.type == "cuda" else 0
        command = " ".join([PROG] + sys.argv[1:])

        def save(entries: list[dict]) -> None:  # a crash later leaves what was measured
            if group.rank == 0 and a.output:
                report.write_json(a.output, report.document(cfg, env, entries, command))

        entries = sweep(a, group, save)
        failed = [e for e in entries if e["status"] == "failed"]
        if group.rank == 0:
            doc = report.document(cfg, env, entries, command)
            print(report.format_table(doc), flush=True)
            if a.output:
                report.write_json(a.output, doc)
                print(f"results: {a.output}")
            if a.plot:
                _plot([doc], a.plot)
            if failed:
                print(f"{PROG}: {len(failed)} entries failed (see the table)", file=sys.stderr)
        dist.barrier()
        code = 1 if failed else 0
    except BaseException:
        dist.destroy_process_group()  # (what stops peers stuck in a collective)
        raise
    # A sweep that ran to its end, every rank past the last barrier: leave without the group's and
    # the interpreter's teardown, which now and then aborted a gloo rank after everything was
    # done ("terminate called without an active exception", in CI; moe_ep.tools.demo leaves the same
    # way). The buffers are closed; the JSON and the plot are written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ----------------------------------------------------------------------------- subcommands

def _plot(docs: list[dict], path: str) -> int:
    from .plot import PlotUnavailable, plot

    try:
        print(f"plot: {plot(docs, path)}")
        return 0
    except PlotUnavailable as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 3


def files_main(command: str, argv: Sequence[str]) -> int:
    """``plot``, ``table`` and ``merge`` on result files."""
    from . import report

    p = argparse.ArgumentParser(prog=f"{PROG} {command}", description={
        "plot": "PNG plots of result files (several files: merged, e.g. runs at different EP sizes)",
        "table": "print the table of result files",
        "merge": "merge result files into one document"}[command])
    p.add_argument("files", nargs="+", metavar="JSON", help="result files written by --output")
    if command != "table":
        p.add_argument("--output", "-o", required=True, metavar="PNG" if command == "plot" else "JSON",
                       help="the file to write")
    a = p.parse_args(list(argv))
    try:
        docs = report.load(a.files)
    except (OSError, ValueError) as e:
        p.error(str(e))
    if command == "table":
        for doc in docs:
            print(report.format_table(doc))
            print()
        return 0
    if command == "merge":
        report.write_json(a.output, report.merge(docs))
        return 0
    return _plot(docs, a.output)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "proxy":  # one proxy vs simulated peers (no torchrun): moe_ep/bench/proxy_scale.py
        from .proxy_scale import main as proxy_main

        return proxy_main(list(argv[1:]))
    if argv and argv[0] == "model":  # predicted latency and bytes per phase to EP256, no hardware: moe_ep/bench/scale_model.py
        from .scale_model import main as model_main

        return model_main(list(argv[1:]))
    if argv and argv[0] == "memory":  # memory_plan per EP size and layout (no torchrun): moe_ep/bench/memory.py
        from .memory import main as memory_main

        return memory_main(list(argv[1:]))
    if argv and argv[0] in ("plot", "table", "merge"):
        return files_main(argv[0], argv[1:])
    return run(parse_run_args(argv))


if __name__ == "__main__":
    sys.exit(main())
