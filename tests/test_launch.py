"""The cached launch path (kernels/launch.py), which only GPUs take.

On CPU, with a stand-in for Triton's compiled kernel, what the Launcher itself decides: the
kernel's arguments in signature order, constexprs built only to compile, which changes make a new
compile, which positions are read again. What it hands Triton's C launcher before those arguments
(Triton's ABI) a stand-in cannot show: on CPU it is compared with the launch call in the installed
Triton's source; on a GPU (``-m gpu``) with what Triton's own launch passes, call for call.
"""
import inspect
import re

import pytest
import torch
import triton
import triton.language as tl

import dist_util
import moe_ep.kernels.launch as L


@triton.jit(do_not_specialize=["n"])
def _k(a_ptr, b_ptr, n, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    pass


class _Compiled:
    function, packed_metadata = 7, (1, 2)

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


@pytest.fixture
def fake_gpu(monkeypatch):
    compiled = []

    class _Jit:  # what kernel[grid] returns: the compiled kernel (after launching it)
        arg_names = _k.arg_names

        def __getitem__(self, grid):
            def go(*args, **consts):
                c = _Compiled()
                compiled.append((grid, args, consts, c))
                return c
            return go

    monkeypatch.setattr(L, "_interpreting", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda dev: 1000 + dev, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(L, "_GLOBAL", L.Launcher())
    return compiled, _Jit()


def test_cached_launch_passes_raw_args_in_signature_order(fake_gpu):
    compiled, fn = fake_gpu
    la = L.Launcher(torch.device("cuda", 3))
    a, b = torch.zeros(64), torch.zeros(64, dtype=torch.int32)
    built = []

    def consts():
        built.append(1)
        return dict(FLAG=True, BLOCK=16)  # deliberately not in signature order

    la(("k",), fn, 3, (a, b, 5), consts)             # first: compiles through kernel[grid]
    assert len(compiled) == 1 and compiled[0][0] == (3,) and compiled[0][2] == dict(FLAG=True, BLOCK=16)
    la(("k",), fn, 3, (a, b, 9), consts)             # then: straight to the C launcher
    assert len(compiled) == 1 and len(built) == 1    # constexprs are not even built again
    call = compiled[0][3].calls[-1]
    assert call[:9] == L.leading_args(compiled[0][3], 3, 1003)          # the buffer's device's stream
    assert call[9:] == (a.data_ptr(), b.data_ptr(), 9, 16, True)        # signature order, constexprs last


def test_keys_decide_compiles(fake_gpu):
    compiled, fn = fake_gpu
    la = L.Launcher(torch.device("cuda", 0))
    a, b = torch.zeros(64), torch.zeros(64, dtype=torch.int32)
    la(("x", 1), fn, 3, (a, b, 5), dict(BLOCK=16, FLAG=True))
    la(("x", 2), fn, 3, (a, b, 5), dict(BLOCK=16, FLAG=True))   # another key: another compile
    la(("x", 1), fn, 3, (a, b, 6), dict(BLOCK=16, FLAG=True))   # same key: none
    assert len(compiled) == 2
    assert L.Launcher(torch.device("cuda", 0))._plans == {}     # caches are per launcher (per buffer)


def test_global_launch_keys_on_every_argument(fake_gpu):
    compiled, fn = fake_gpu
    a, b = torch.zeros(64), torch.zeros(64, dtype=torch.int32)
    L.launch(fn, 3, (a, b, 5), dict(BLOCK=16, FLAG=True))
    L.launch(fn, 4, (a, b, 5), dict(BLOCK=16, FLAG=True))          # grid
    L.launch(fn, 3, (a, b, 5), dict(BLOCK=32, FLAG=True))          # constexpr
    L.launch(fn, 3, (a[1:], b, 5), dict(BLOCK=16, FLAG=True))      # pointer no longer 16-byte aligned
    L.launch(fn, 3, (a, b.long(), 5), dict(BLOCK=16, FLAG=True))   # pointer dtype
    L.launch(fn, 3, (a, b, 2**40), dict(BLOCK=16, FLAG=True))      # int needs 64 bits
    assert len(compiled) == 6
    L.launch(fn, 3, (a, b, 77), dict(BLOCK=16, FLAG=True))         # same code: no compile
    assert len(compiled) == 6


def test_only_dynamic_positions_are_read_again(fake_gpu):
    compiled, fn = fake_gpu
    la = L.Launcher(torch.device("cuda", 0))
    a, b, c = torch.zeros(64), torch.zeros(64, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)
    la(("k",), fn, 3, (a, b, 5), dict(BLOCK=16, FLAG=True), dynamic=(0, 2))
    la(("k",), fn, 3, (torch.zeros(64), c, 6), dict(BLOCK=16, FLAG=True), dynamic=(0, 2))
    call = compiled[0][3].calls[-1]
    assert call[10] == b.data_ptr() and call[11] == 6  # position 1 is fixed: read when compiled


def test_leading_arguments_are_those_of_tritons_own_launch():
    """The installed Triton launches a compiled kernel with TRITON_LEADING, then the arguments:
    a Triton whose launch call differs fails here (and the GPU test below fails on the device)."""
    src = inspect.getsource(triton.runtime.jit.JITFunction.run)
    m = re.search(r"kernel\.run\(([^()]*)\*bound_args\.values\(\)\)", src)
    assert m, "triton's JITFunction.run no longer calls kernel.run(..., *bound_args.values())"
    names = tuple(n.strip() for n in m.group(1).split(",") if n.strip())
    assert names == L.TRITON_LEADING, names
    assert len(L.leading_args(_Compiled(), 5, 0)) == len(L.TRITON_LEADING)


@triton.jit(do_not_specialize=["n"])
def _axpb(x_ptr, y_ptr, n, BLOCK: tl.constexpr, ADD: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i) * n + ADD)


@pytest.mark.gpu
def test_cached_launch_matches_tritons_launch_gpu():
    """Triton's own launch and the Launcher's cached one hand CompiledKernel.run the same values
    (but for launch metadata and hooks), and the cached launch computes the right thing."""
    if dist_util.cuda_device_count() < 1:
        pytest.skip("needs a CUDA GPU")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    x = torch.arange(64, dtype=torch.float32, device=dev)
    y1, y2 = torch.empty_like(x), torch.empty_like(x)
    consts = dict(BLOCK=64, ADD=1.0)
    kernel = _axpb[(1,)](x, y1, 3, **consts)
    calls = []
    run = kernel.run  # loads the kernel; CompiledKernel.run is a property over _run
    kernel._run = lambda *a: (calls.append(a), run(*a))[1]
    _axpb[(1,)](x, y1, 5, **consts)                        # Triton's launch (cached compile)
    la = L.Launcher(dev)
    la(("axpb",), _axpb, 1, (x, y2, 3), consts)             # first: through kernel[grid] (the same kernel)
    la(("axpb",), _axpb, 1, (x, y2, 5), consts)             # then: straight to CompiledKernel.run
    torch.cuda.synchronize()
    outs = (y1.data_ptr(), y2.data_ptr())  # Triton's launch wrote y1, ours y2: the same argument

    def raw(call):
        vals = (a.data_ptr() if isinstance(a, torch.Tensor) else a for a in call)
        return tuple("y" if isinstance(v, int) and v in outs else v for v in vals)
    theirs, ours = raw(calls[0]), raw(calls[-1])
    assert len(calls) == 3 and len(theirs) == len(ours)
    assert theirs[:6] == ours[:6]                          # grid, stream, function, metadata
    assert theirs[9:] == ours[9:]                          # the arguments (tensors as addresses), constexprs
    assert torch.equal(y2, x * 5 + 1) and torch.equal(y1, y2)
