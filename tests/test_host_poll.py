"""moe_ep.bench.host_poll on a CPU: its copy kernel moves exactly the words it is given (the
interpreter), its pollers (GPU only: they read the GPU's clock) compile for sm_90, and its
arguments are checked, a machine without a GPU refused with a clear line."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from moe_ep.bench import host_poll


@pytest.mark.parametrize("n, programs", [(5000, 3), (2048, 1), (7, 4)])
def test_copy_kernel_moves_every_word(n, programs):
    src = torch.arange(n, dtype=torch.int64) * 7 - 3
    dst = torch.full((n + 5,), -1, dtype=torch.int64)
    host_poll._copy_kernel[(programs,)](src, dst, n, BLOCK=2048)
    assert torch.equal(dst[:n], src)
    assert (dst[n:] == -1).all()  # nothing past n


@pytest.mark.parametrize("argv, says", [
    (["--bytes", "12"], "--bytes: a positive multiple of 8"),
    (["--warps", "3"], "--warps: expected a comma-separated list of powers of two"),
    (["--iters", "0"], "--iters must be positive"),
    (["--pollers", "x"], "--pollers: expected a comma-separated list"),
    (["--who", "one thread,sometimes"], "--who: expected a comma-separated list of every warp"),
    (["--space-ns", "-1"], "--space-ns: expected >= 0"),
    ([], "no CUDA GPU"),
])
def test_arguments_checked(argv, says, capsys):
    if not argv and torch.cuda.is_available():
        pytest.skip("a GPU is here: nothing to refuse")
    with pytest.raises(SystemExit) as e:
        host_poll.parse_args(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


# Compiles each poller for sm_90 (no GPU needed) and prints, per way of looking, whether each
# volatile global load of its PTX is predicated. In its own process: this one interprets kernels.
_COMPILE = r"""
import json
from moe_ep.bench import host_poll as h
from moe_ep.testing.aot import compile_for
ptrs = dict(flag_ptr="*i64", looks_ptr="*i64", timeout_ns="i64")
kernels = {"every warp": (h._poll_kernel, ptrs), "one thread": (h._poll_one_kernel, ptrs),
           "one program": (h._poll_leader_kernel, {**ptrs, "mirror_ptr": "*i64"}),
           "spaced": (h._poll_spaced_kernel, {**ptrs, "space_ns": "i64"})}
out = {}
for who, (fn, sig) in kernels.items():
    k = compile_for(fn, {"sig": sig, "consts": {"num_warps": 16}})
    assert k.asm["cubin"]
    out[who] = [ln.strip().startswith("@") for ln in k.asm["ptx"].splitlines() if "ld.volatile.global" in ln]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled_pollers():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("who", host_poll.WHO)
def test_pollers_compile_for_sm90(who, compiled_pollers):
    """Each way of looking compiles to sm_90 machine code here (the GPU run finds no compile
    error), and the host word is read by one thread of a program (its loads predicated on the
    lane) where ``who`` says so, by every thread where it says every warp."""
    predicated = compiled_pollers[who]
    if who == "every warp":
        assert predicated and not any(predicated)  # every thread loads
    elif who == "one program":  # the host look predicated; the others spin on the device word
        assert any(predicated) and not all(predicated)
    else:
        assert predicated and all(predicated)  # each look one lane's
