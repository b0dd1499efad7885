"""scripts/host_path.py (host time per eager call on a CPU, launches into a stand-in driver) runs to
its end with a few calls per median: every row of both tables printed with a time, so the script
that PERFORMANCE.md's host-issue rows come from does not rot as the API moves."""
from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_host_path_script_runs():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "host_path.py"), "--calls", "5"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    node, across = r.stdout.split("across nodes")
    times = re.compile(r"^  (\S.*?)\s+(\d+\.\d\d)\s+(\d+\.\d\d)\s+(\d+\.\d\d)$", re.M)
    node_rows = {m.group(1) for m in times.finditer(node)}
    across_rows = {m.group(1) for m in times.finditer(across)}
    for name in ("dispatch", "combine(out=)", "rows: combine(w=, out=f32)", "deep_ep: low_latency_dispatch + hook",
                 "one native launch"):
        assert name in node_rows, (name, r.stdout)
    assert across_rows == {"dispatch", "dispatch + combine", "dispatch + combine(out=)", "both with a hook, + hooks"}, r.stdout
