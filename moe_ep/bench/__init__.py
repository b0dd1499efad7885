"""Benchmarks for moe_ep, run with torchrun.

- ``python -m moe_ep.bench`` / ``moe-ep-bench`` (moe_ep/bench/cli.py): moe_ep side by side with NCCL, torch
  symmetric memory and DeepEP; sweeps, JSON (moe_ep/bench/schema.json), tables and plots.
- ``python -m moe_ep.bench.intranode``: the single-point moe_ep vs NCCL benchmark behind
  docs/PERFORMANCE.md (scripts/run_gpu.sh runs its standard points).
"""
