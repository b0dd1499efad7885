"""Tuning sweep in one process: ``moe_ep.bench.intranode`` at several settings of the buffer's
tuning variables (``MOE_EP_TILE``, ``MOE_EP_NUM_WARPS``, ``MOE_EP_MAX_CHUNKS``, ...), one buffer
each, without a new process (and CUDA context, and torch import) per point; one table last.

    torchrun --standalone --nproc-per-node=1 -m moe_ep.bench.variants --preset prefill \\
        --num-programs 32 --iters 50 --point "fp8 rows" --point "fp8 rows MOE_EP_NUM_WARPS=16"

A point is ``DTYPE LAYOUT [NAME=VALUE ...]``: the variables are set while that point's buffer is
made and run, then restored. Kernel p50 (torch.profiler, graph replays) and the closed-form check
of each point; a point that fails prints its error and the sweep goes on.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Optional

import torch
import torch.distributed as dist

from .intranode import checks_ok, parse_args, run_bench


def parse_point(text: str) -> tuple[str, str, dict]:
    """``"fp8 rows MOE_EP_TILE=2"`` -> ``("fp8", "rows", {"MOE_EP_TILE": "2"})``; ValueError naming
    the point otherwise."""
    words = text.split()
    if len(words) < 2 or words[0] not in ("fp8", "bf16") or words[1] not in ("masked", "packed", "rows"):
        raise ValueError(f"--point: expected 'DTYPE LAYOUT [NAME=VALUE ...]', got {text!r}")
    env = {}
    for w in words[2:]:
        name, eq, value = w.partition("=")
        if not eq or not name.startswith("MOE_EP_"):
            raise ValueError(f"--point {text!r}: expected MOE_EP_NAME=VALUE, got {w!r}")
        env[name] = value
    return words[0], words[1], env


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moe_ep.bench.variants", description=__doc__.split("\n")[0])
    p.add_argument("--point", action="append", required=True, help="'DTYPE LAYOUT [MOE_EP_NAME=VALUE ...]'")
    known, rest = p.parse_known_args(argv)
    points = [parse_point(t) for t in known.point]
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    rows, failed = [], 0
    try:
        for text, (dtype, layout, env) in zip(known.point, points):
            args = parse_args(rest + ["--dispatch-dtype", dtype, "--layout", layout, "--no-baseline"])
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                res = run_bench(args)
                v = {(r["op"], r["mode"]): r["p50_us"] for r in res["results"]}
                rows.append((text, v.get(("dispatch", "kernel")), v.get(("combine", "kernel")),
                             max(res["checks_rel_err"].values()), checks_ok(res)))
            except Exception:  # noqa: BLE001 - one bad point must not end the sweep
                traceback.print_exc()
                rows.append((text, None, None, None, False))
            finally:
                for k, old in saved.items():
                    if old is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = old
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
