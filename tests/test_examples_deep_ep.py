"""The framework-style DeepEP examples (examples/vllm_style_low_latency.py, megatron_style_fused_a2a.py,
elastic_buffer.py) run as a user runs them, on 2 CPU ranks of their own with `import deep_ep`
switched onto moe_ep, and pass their check against the dense layer; with a fault put into the
adapter each of them fails, naming what differs."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Dict, Optional

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# example -> (the start of its result line, what its check covers)
EXAMPLES = {
    "vllm_style_low_latency": ("vLLM-style low-latency", ["out"]),
    "megatron_style_fused_a2a": ("Megatron-style fused all-to-all",
                                 ["out", "topk_weights_grad", "w1_grad", "w2_grad", "x_grad"]),
    "elastic_buffer": ("ElasticBuffer", ["out", "topk_weights_grad", "w1_grad", "w2_grad", "x_grad"]),
}

# A fault per example, in what only that example's check can see; loaded into every process of the
# run (the parent and its spawned ranks) as sitecustomize.
FAULTS = {
    # UE8M0 scales one exponent too high (a wrong bias): every dequantized row doubles
    "vllm_style_low_latency": """
        import moe_ep.deep_ep.low_latency as ll
        _orig = ll.pow2_quantize
        def pow2_quantize(x, q_out, scales_cm, ue8m0):
            _orig(x, q_out, scales_cm, ue8m0)
            if ue8m0:
                scales_cm.add_(0x01010101)
        ll.pow2_quantize = pow2_quantize
        """,
    # combine no longer sums the routing weights back: only topk_weights' gradient changes
    "megatron_style_fused_a2a": """
        import moe_ep.deep_ep.normal as normal
        _orig = normal.combine
        def combine(handle, x, topk_weights, bias):
            out, w = _orig(handle, x, topk_weights, bias)
            return out, (w * 0.5 if w is not None else None)
        normal.combine = combine
        """,
    # the cached dispatch (combine's backward) delivers its rows in reverse order
    "elastic_buffer": """
        import moe_ep.deep_ep.elastic as elastic
        _orig = elastic.ElasticBuffer.dispatch
        def dispatch(self, x, *args, handle=None, **kwargs):
            res = _orig(self, x, *args, handle=handle, **kwargs)
            return (res[0].flip(0),) + tuple(res[1:]) if handle is not None else res
        elastic.ElasticBuffer.dispatch = dispatch
        """,
}


def _run(name: str, fault_dir: Optional[str] = None) -> subprocess.CompletedProcess:
    paths = [p for p in (fault_dir, REPO, os.environ.get("PYTHONPATH")) if p]
    env: Dict[str, str] = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "TRITON_INTERPRET": "1"}
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, os.path.join(REPO, "examples", f"{name}.py"), "--ranks", "2"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_matches_dense_layer(name):
    p = _run(name)
    start, checked = EXAMPLES[name]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(start)]
    assert p.returncode == 0 and len(lines) == 1 and lines[0].endswith(". OK"), p.stdout[-3000:] + p.stderr[-3000:]
    assert "2 ranks on cpu, deep_ep is moe_ep.deep_ep" in lines[0]
    assert f"{', '.join(checked)} match" in lines[0] or f"{checked[0]} matches" in lines[0], lines[0]


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_fails_on_a_broken_adapter(name, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(FAULTS[name]))
    p = _run(name, str(tmp_path))
    start, _ = EXAMPLES[name]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(start)]
    assert p.returncode != 0 and len(lines) == 1 and lines[0].endswith("MISMATCH"), p.stdout[-3000:] + p.stderr[-3000:]
    if name == "megatron_style_fused_a2a":  # the forward is right: the gradient check caught it
        assert ": topk_weights_grad." in lines[0], lines[0]
