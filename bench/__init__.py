"""Benchmarks for moe_ep (run with torchrun; see bench/intranode.py and bench/run_gpu.sh)."""
