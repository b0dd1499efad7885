"""The kernels compile for sm_90 (H100/H200) on a machine with no GPU, with 16-byte accesses.

The CPU interpreter never runs Triton's compiler, so GPU-only compile errors (loop-carried types,
constexpr misuse) and lost vectorization would otherwise show up only on a GPU. Launches are
recorded from real dispatch/combine calls at decode and prefill shapes (without running them),
then compiled for sm_90 in a process without TRITON_INTERPRET.
"""
import os
import pickle
import re
import subprocess
import sys

import pytest
import torch

import moe_ep
from moe_ep.kernels.aot import signature

_COMPILE = r"""
import importlib, pickle, re, sys
from moe_ep.kernels.aot import compile_for
out = []
for mod, name, spec in pickle.load(open(sys.argv[1], "rb")):
    k = compile_for(getattr(importlib.import_module(mod), name), spec)
    ptx = k.asm["ptx"]
    out.append((name, len(re.findall(r"st\.global\.v[24]", ptx)), len(re.findall(r"st\.global\.b8", ptx)),
                len(re.findall(r"globaltimer", ptx)), len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx))))
pickle.dump(out, open(sys.argv[1] + ".out", "wb"))
"""


def _record(monkeypatch, configs):
    rec = []

    def spy(key, fn, grid, args, consts, dynamic=None):
        consts = consts() if callable(consts) else consts
        rec.append((fn.fn.__module__, fn.fn.__name__, signature(fn.arg_names, args, consts)))

    g = moe_ep.EPGroup()
    for T, H, dt, layout, fused in configs:
        buf = moe_ep.EPBuffer(g, 256, H, T, 8, dispatch_dtype=dt, layout=layout, num_programs=132)
        buf.num_warps = 8
        # What a GPU launches: both halves in one kernel; or, with more programs than SMs, the two
        # halves as two kernels (then the receive half spins on the GPU).
        buf.fused = fused
        buf.interp = False
        buf._launch = spy
        x = torch.zeros(T, H, dtype=torch.bfloat16)
        h = buf.dispatch(x, torch.zeros(T, 8, dtype=torch.int64), torch.zeros(T, 8))
        buf.combine(torch.empty(h.expert_x.shape, dtype=torch.bfloat16), h)
        buf.close()
    return rec


def test_kernels_compile_for_sm90(monkeypatch, tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    rec = _record(monkeypatch, [(128, 7168, torch.float8_e4m3fn, "masked", True),
                                (512, 7168, torch.bfloat16, "packed", True),
                                (512, 2048, torch.float8_e4m3fn, "packed", True),
                                (128, 7168, torch.float8_e4m3fn, "masked", False)])
    # one launch each when fused (decode, T*K <= 2048, needs no routing-histogram launch); two
    # halves each when not
    assert len(rec) == 2 + 3 + 3 + 4
    path = tmp_path / "launches.pkl"
    pickle.dump(rec, open(path, "wb"))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", _COMPILE, str(path)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    results = pickle.load(open(str(path) + ".out", "rb"))
    fp8_cvt = 0
    for name, vec_stores, byte_stores, timers, cvts in results:
        # Peer stores must be 8- or 16-byte vectors: one NVLink transaction per byte is 10-100x slower.
        if name in ("dispatch_kernel", "combine_kernel"):
            assert vec_stores > 0 and byte_stores == 0, (name, vec_stores, byte_stores)
            assert timers > 0, f"{name}: compiled without the GPU deadline (INTERP variant?)"
            fp8_cvt += cvts
    assert fp8_cvt > 0, "fp8 quantization does not use the hardware conversion on sm_90"
