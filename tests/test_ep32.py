"""EP32 end to end on CPU ranks: 32 rank processes as 8 nodes of 4 (shared memory inside a node,
the proxy over TCP between nodes), one dispatch + combine through the bench CLI, every rank's
output checked against ``moe_ep.testing.reference`` by the bench itself. A correctness run that takes
minutes on 2 cores, so it is ``slow`` (CI leaves it out; ``-m slow`` runs it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["masked", "packed", "rows"])
def test_ep32_on_cpu_ranks(tmp_path, layout):
    out = tmp_path / "ep32.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "32", "-m", "moe_ep.bench",
           "--device", "cpu", "--node-size", "4", "--tokens", "2", "--hidden", "64", "--topk", "2", "--num-experts", "32",
           "--dispatch-dtype", "bf16", "--layout", layout, "--backends", "moe_ep", "--iters", "1", "--warmup", "0",
           "--no-progress", "--timeout-s", "600", "--output", str(out)]
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [r for r in json.loads(out.read_text())["results"] if r["backend"] == "moe_ep" and r["launch"] == "eager"]
    assert rows and all(r["world_size"] == 32 and r["status"] == "ok" for r in rows), rows
    assert max(r["check_rel_err"] for r in rows) < 2e-2, rows  # bf16 rows against the float32 oracle
