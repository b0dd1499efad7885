"""Tuning sweep in one process: ``moe_ep.bench.intranode`` at several ``moe_ep.Tuning``s, written as
the tuning variables (``MOE_EP_TILE``, ``MOE_EP_NUM_WARPS``, ``MOE_EP_MAX_CHUNKS``, ...), one buffer
each, without a new process (and CUDA context, and torch import) per point; one table last.

    torchrun --standalone --nproc-per-node=1 -m moe_ep.bench.variants --preset prefill \\
        --num-programs 32 --iters 50 --point "fp8 rows" --point "fp8 rows MOE_EP_NUM_WARPS=16"

A point is ``DTYPE LAYOUT [NAME=VALUE ...]``: its buffer takes ``Tuning.from_env`` of the process's
variables with the point's on top (the environment itself is left alone). Kernel p50 (torch.profiler, graph replays) and the closed-form check
of each point; a point that fails prints its error and the sweep goes on.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from ..core.tuning import ENV, Tuning
from .intranode import checks_ok, parse_args, run_bench


def parse_point(text: str, env: Optional[Mapping[str, str]] = None) -> tuple[str, str, Tuning]:
    """``"fp8 rows MOE_EP_TILE=2"`` -> ``("fp8", "rows", Tuning(tile=2))``, on top of the tuning
    variables of ``env`` (default ``os.environ``); ValueError naming the point (or the variable
    and its bad value) otherwise."""
    words = text.split()
    if len(words) < 2 or words[0] not in ("fp8", "bf16") or words[1] not in ("masked", "packed", "rows"):
        raise ValueError(f"--point: expected 'DTYPE LAYOUT [NAME=VALUE ...]', got {text!r}")
    names = [var for var, _ in ENV.values()]
    point = {}
    for w in words[2:]:
        name, eq, value = w.partition("=")
        if not eq or name not in names:
            raise ValueError(f"--point {text!r}: expected NAME=VALUE with NAME one of {', '.join(names)}, got {w!r}")
        point[name] = value
    return words[0], words[1], Tuning.from_env({**(os.environ if env is None else env), **point})


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moe_ep.bench.variants", description=__doc__.split("\n")[0])
    p.add_argument("--point", action="append", required=True, help="'DTYPE LAYOUT [MOE_EP_NAME=VALUE ...]'")
    known, rest = p.parse_known_args(argv)
    points = [parse_point(t) for t in known.point]
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    rows, failed = [], 0
    try:
        for text, (dtype, layout, tuning) in zip(known.point, points):
            args = parse_args(rest + ["--dispatch-dtype", dtype, "--layout", layout, "--no-baseline"])
            try:
                res = run_bench(args, tuning)
                v = {(r["op"], r["mode"]): r["p50_us"] for r in res["results"]}
                rows.append((text, v.get(("dispatch", "kernel")), v.get(("combine", "kernel")),
                             max(res["checks_rel_err"].values()), checks_ok(res)))
            except Exception:  # noqa: BLE001 - one bad point must not end the sweep
                traceback.print_exc()
                rows.append((text, None, None, None, False))
            failed += not rows[-1][4]
        if dist.get_rank() == 0:
            fmt = lambda x: f"{x:9.1f}" if x is not None else "   failed"  # noqa: E731
            print(f"{'point':<56} {'disp kern':>9} {'comb kern':>9} {'check':>8}")
            for text, d, c, chk, ok in rows:
                print(f"{text:<56} {fmt(d)} {fmt(c)} {chk if chk is not None else float('nan'):>8.1e}"
                      + ("" if ok else "  FAILED"))
    finally:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
