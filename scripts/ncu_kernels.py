"""One dispatch and one combine at the prefill size, between ``cudaProfilerStart`` and ``Stop``:
the program to run under Nsight Compute when a kernel's time needs the hardware counters (memory
throughput, warp stall reasons) rather than more variants. One rank, one GPU, public API only.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats \\
        python scripts/ncu_kernels.py --programs 32 --dtype fp8 --layout packed

``python scripts/ncu_kernels.py --summary FILE.csv ...`` prints the counters of such runs (``ncu
--csv --page raw``; ``NCU=... bash scripts/run_gpu.sh`` makes them) as one table per file, a
column per kernel. The calls before the profiled one compile the kernels and warm the buffer; the profiled call's
combine output is checked against a float32 sum (an error raises: counters of a wrong kernel
are worth nothing). The buffer's tuning variables (``MOE_EP_*``) apply as usual.
"""
from __future__ import annotations

import argparse
import csv
import sys

import torch

import moe_ep

# Short names of the counters in the summary (a stall reason: cycles per issued instruction).
_SHORT = {"gpu__time_duration.sum": "time (ns)", "dram__bytes_read.sum": "DRAM read (B)",
          "dram__bytes_write.sum": "DRAM written (B)",
          "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM % of peak",
          "lts__t_sector_hit_rate.pct": "L2 hit %", "smsp__inst_executed.sum": "warp instructions",
          "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue active %",
          "sm__warps_active.avg.per_cycle_active": "warps active per SM"}


def summary(paths: list[str]) -> None:
    """One table per ``ncu --csv --page raw`` file: a row per counter, a column per kernel; stall
    reasons under 0.1 cycles are left out."""
    for path in paths:
        rows = list(csv.reader(open(path)))
        head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
        names, data = rows[head], rows[head + 2:]
        kernels = [r[names.index("Kernel Name")].split("(")[0] for r in data]
        print(f"{path.rsplit('/', 1)[-1]}:")
        print(f"  {'counter':<28}" + "".join(f"{k[:18]:>20}" for k in kernels))
        for j, name in enumerate(names):
            stall = name.startswith("smsp__average_warps_issue_stalled_")
            label = (f"stall: {name[34:].split('_per_issue')[0]}" if stall else _SHORT.get(name))
            if label is None:
                continue
            vals = [r[j] for r in data]
            if stall and all(float(v.replace(",", "") or 0) < 0.1 for v in vals):
                continue
            print(f"  {label:<28}" + "".join(f"{v:>20}" for v in vals))


def main() -> None:
    if sys.argv[1:2] == ["--summary"]:
        return summary(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--programs", type=int, default=32)
    p.add_argument("--dtype", choices=("fp8", "bf16"), default="fp8")
    p.add_argument("--layout", choices=("masked", "packed", "rows"), default="packed")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    a = p.parse_args()
    T, H, E, K = a.tokens, a.hidden, a.experts, a.topk
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # (cpu: a check of this script, interpreted)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
    idx = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices
    w = torch.rand(T, K, device=dev, generator=g).softmax(dim=1)
    gpu = dev == "cuda"
    dtype = torch.float8_e4m3fn if a.dtype == "fp8" else torch.bfloat16
    with moe_ep.EPBuffer(moe_ep.EPGroup(), E, H, T, K, dispatch_dtype=dtype, layout=a.layout,
                         num_programs=a.programs if gpu else None) as buf:
        for it in range(3):
            if it == 2 and gpu:
                torch.cuda.synchronize()
                torch.cuda.profiler.start()
            h = buf.dispatch(x, idx, w)
            # identity experts: the combine gives sum_k w_k * dequant(x), checked below
            y = h.expert_x.to(torch.bfloat16) if a.dtype == "bf16" else torch.ones(
                h.expert_x.shape, dtype=torch.bfloat16, device=dev)
            out = buf.combine(y, h)
            if it == 2 and gpu:
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
        want = x.float() * w.sum(1, keepdim=True) if a.dtype == "bf16" else w.sum(1, keepdim=True).expand(T, H)
        err = ((out.float() - want).abs().max() / want.abs().max()).item()
        if not err < 1e-2:
            raise SystemExit(f"combine output off by {err:.3g} (relative): the counters above are of a wrong result")
        print(f"checked: combine output within {err:.2e} of the float32 sum")


if __name__ == "__main__":
    main()
