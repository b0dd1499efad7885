"""moe-ep-bench memory: one rank's EPBuffer memory per EP size, layout and token count, from
``moe_ep.memory_plan`` (computed: no GPU, no process group, nothing allocated).

    moe-ep-bench memory --ep 8,16,32,64,128 --gpus-per-node 8 --tokens 128,4096 --hidden 7168 \\
        --topk 8 --experts 256 --dtype fp8 --layout packed,rows,masked --json memory.json

Per (tokens, EP, layout): device GiB, pinned host GiB, their total, and the largest regions
(``moe_ep.ops.sizing.MemoryPlan``'s names). EP sizes above ``--gpus-per-node`` take the proxy path
(nodes of ``--gpus-per-node`` ranks), whose row regions are planned in GPU memory unless
``--proxy-memory host``. The packed and rows layouts' received tensors (``expert_x`` and the rest
of ``moe_ep.ops.sizing.RECV_ROW_ALLOCS``) are planned as ``--recv-rows`` says: sized per call at a
uniform batch's rows (the default), ``worst`` or a cap (``--packed-rows`` is its old name).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

LAYOUTS = ("masked", "packed", "rows")


def _list(flag: str, kind=int, choices: Optional[Sequence[str]] = None):
    def parse(text: str) -> list:
        try:
            values = [kind(v.strip()) for v in text.split(",") if v.strip()]
        except ValueError:
            values = []
        bad = [v for v in values if (choices is not None and v not in choices) or (kind is int and v < 1)]
        if not values or bad:
            want = f"a comma-separated list of {', '.join(choices)}" if choices else "a comma-separated list of " \
                                                                                      "positive integers"
            raise argparse.ArgumentTypeError(f"{flag}: expected {want}, got {text!r}")
        return list(dict.fromkeys(values))
    return parse


def _recv_rows(text: str):
    if text in ("uniform", "worst"):
        return text
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise argparse.ArgumentTypeError(f"--recv-rows: expected 'uniform', 'worst' or a positive row count, got {text!r}")


def recv_sizing(recv_rows, layout: str, tokens: int, ep: int, topk: int, experts: int, alignment: int = 1) -> dict:
    """``memory_plan``'s keywords for the received tensors that ``--recv-rows`` names: masked none;
    packed and rows at ``"uniform"`` sized per call at a uniform batch (packed
    ``uniform_recv_rows``, rows ``uniform_rows_layout_rows``), else ``max_recv_rows``."""
    from moe_ep.ops.sizing import uniform_recv_rows, uniform_rows_layout_rows

    if layout == "masked":
        return {}
    if recv_rows != "uniform":
        return dict(max_recv_rows=recv_rows)
    if layout == "rows":
        return dict(recv_rows=uniform_rows_layout_rows(ep, tokens, topk, experts))
    return dict(recv_rows=uniform_recv_rows(tokens, topk, experts // ep, alignment))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-ep-bench memory", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ep", type=_list("--ep"), default=[8, 16, 32, 64, 128], help="EP sizes (ranks); default 8,16,32,64,128")
    p.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node (default 8)")
    p.add_argument("--tokens", type=_list("--tokens"), default=[4096], help="max_tokens per rank; a list sweeps (default 4096)")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size H (default 7168, DeepSeek-V3)")
    p.add_argument("--topk", type=int, default=8, help="experts per token K (default 8)")
    p.add_argument("--experts", type=int, default=256, help="routed experts E (default 256)")
    p.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8", help="dispatch payload (default fp8)")
    p.add_argument("--layout", type=_list("--layout", str, LAYOUTS), default=["packed", "rows", "masked"],
                   help="layouts, comma-separated (default packed,rows,masked)")
    p.add_argument("--expert-alignment", type=int, default=1, help="packed: expert blocks start at multiples of this")
    p.add_argument("--recv-rows", "--packed-rows", dest="recv_rows", type=_recv_rows, default="uniform",
                   help="packed and rows layouts' expert_x (and the rows' ids, weights, sources): 'uniform' (sized "
                        "per call, EPBuffer's default: planned at the rows a uniform batch brings, packed M*K + "
                        "E_local*(alignment-1), rows R*M*P(a token touches the rank)), 'worst' (allocated once for "
                        "every row that can come, packed R*M*K + ..., rows R*M) or a cap in rows (max_recv_rows)")
    p.add_argument("--proxy-memory", choices=["auto", "gpu", "host"], default="auto",
                   help="where the proxy's row regions go (auto: GPU memory, as verbs and efa take it; host: pinned)")
    p.add_argument("--num-programs", type=int, default=None, help="programs a launch (default 132: an H100/H200)")
    p.add_argument("--regions", type=int, default=3, help="largest regions shown per line (default 3)")
    p.add_argument("--json", metavar="OUT", default=None, help="also write every plan, region by region, as JSON")
    return p


def plans(a: argparse.Namespace) -> list[dict]:
    """One entry per (tokens, EP, layout): its arguments and ``MemoryPlan.as_dict()``."""
    import torch

    from moe_ep.ops.sizing import memory_plan

    dtype = torch.float8_e4m3fn if a.dtype == "fp8" else torch.bfloat16
    out = []
    for tokens in a.tokens:
        for ep in a.ep:
            node = min(a.gpus_per_node, ep)
            for layout in a.layout:
                plan = memory_plan(world_size=ep, node_size=node, num_experts=a.experts, hidden=a.hidden,
                                   max_tokens=tokens, topk=a.topk, dispatch_dtype=dtype, layout=layout,
                                   expert_alignment=a.expert_alignment if layout != "rows" else 1,
                                   num_programs=a.num_programs, proxy_memory=a.proxy_memory,
                                   **recv_sizing(a.recv_rows, layout, tokens, ep, a.topk, a.experts,
                                                 a.expert_alignment))
                out.append(dict(tokens=tokens, ep=ep, node_size=node, layout=layout, **plan.as_dict()))
    return out


def format_table(entries: list[dict], regions: int = 3) -> str:
    """One line per entry: GiB on the device, in pinned host memory, in all, and the largest regions."""
    gib = float(1 << 30)
    head = f"{'tokens':>6} {'EP':>4} {'nodes':>5} {'layout':<7} {'device':>7} {'pinned':>7} {'total':>7}  largest regions (GiB)"
    lines = [head, "-" * len(head)]
    for e in entries:
        big = sorted(e["regions"], key=lambda r: -r["bytes"])[:regions]
        lines.append(f"{e['tokens']:>6} {e['ep']:>4} {e['ep'] // e['node_size']:>5} {e['layout']:<7} "
                     f"{e['device_bytes'] / gib:>7.2f} {e['pinned_bytes'] / gib:>7.2f} {e['total_bytes'] / gib:>7.2f}  "
                     + ", ".join(f"{r['name']} {r['bytes'] / gib:.2f}" for r in big))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = parser()
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    for flag, v in (("--gpus-per-node", a.gpus_per_node), ("--hidden", a.hidden), ("--topk", a.topk),
                    ("--experts", a.experts), ("--expert-alignment", a.expert_alignment),
                    ("--num-programs", a.num_programs or 1), ("--regions", a.regions)):
        if v < 1:
            p.error(f"{flag}: expected a positive integer, got {v}")
    try:
        entries = plans(a)
    except (TypeError, ValueError) as exc:  # an argument EPBuffer would refuse, named by it
        p.error(str(exc))
    print(f"moe_ep memory per rank, GiB (H={a.hidden}, K={a.topk}, E={a.experts}, {a.dtype} dispatch, "
          f"{a.gpus_per_node} GPUs a node, proxy rows: {a.proxy_memory}, received rows: {a.recv_rows})")
    print(format_table(entries, a.regions))
    if a.json:
        doc = dict(command=" ".join(["moe-ep-bench", "memory", *(sys.argv[1:] if argv is None else argv)]),
                   config=dict(hidden=a.hidden, topk=a.topk, num_experts=a.experts, dispatch_dtype=a.dtype,
                               gpus_per_node=a.gpus_per_node, expert_alignment=a.expert_alignment,
                               proxy_memory=a.proxy_memory, num_programs=a.num_programs,
                               recv_rows=a.recv_rows),
                   entries=entries)
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"results: {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
