"""Benchmarks for moe_ep, run with torchrun.

- ``python -m bench`` / ``moe-ep-bench`` (bench/cli.py): moe_ep side by side with NCCL, torch
  symmetric memory and DeepEP; sweeps, JSON (bench/schema.json), tables and plots.
- ``python -m bench.intranode``: the single-point moe_ep vs NCCL benchmark behind
  docs/PERFORMANCE.md (bench/run_gpu.sh runs its standard points).
"""
