"""moe_ep.core.interpret: the interpreter speed-up is installed on the pinned Triton, and kernels
with nested helpers still compute the same, with triton.language restored after each launch."""
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                                reason="the speed-up applies to Triton's interpreter only")


import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _inner(v):
    return v * 3 + 1


@triton.jit
def _outer(v):
    return _inner(v) - _inner(v + 1)  # helpers calling helpers: the nested patch path


@triton.jit
def _kernel(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    v = tl.load(x_ptr + i)
    tl.store(y_ptr + i, _outer(v) + _inner(v))


def test_speed_up_installs_and_kernels_compute_the_same():
    from moe_ep.core.interpret import speed_up

    assert speed_up(), "triton's interpreter changed shape: moe_ep.core.interpret no longer applies"
    x = torch.arange(-8, 8, dtype=torch.int32) * 1000003
    y = torch.empty_like(x)
    _kernel[(1,)](x, y, N=16)
    v = x.long()
    exp = ((v * 3 + 1) - ((v + 1) * 3 + 1) + (v * 3 + 1)).to(torch.int64)
    exp = ((exp + 2**31) % 2**32 - 2**31).to(torch.int32)  # int32 wraps, as on a GPU
    assert torch.equal(y, exp)
    assert tl.core.is_builtin(tl.load), "the launch left triton.language patched"
