"""The cached launch path (kernels/launch.py), which only GPUs take, checked on CPU with a stand-in
for Triton's compiled kernel: argument order, and which changes make a new compile."""
import pytest
import torch
import triton
import triton.language as tl

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

    class _Launcher:  # what kernel[grid] returns: the compiled kernel (after launching it)
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            def go(*args, **consts):
                c = _Compiled()
                compiled.append((grid, args, consts, c))
                return c
            return go

    monkeypatch.setattr(L, "_interpreting", lambda: False)
    monkeypatch.setattr(L, "_CACHE", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda dev: 1234, raising=False)
    return compiled, _Launcher


def test_cached_launch_passes_raw_args_in_signature_order(fake_gpu):
    compiled, Launcher = fake_gpu
    fn = Launcher(_k)
    fn.arg_names = _k.arg_names
    a, b = torch.zeros(64), torch.zeros(64, dtype=torch.int32)
    consts = dict(FLAG=True, BLOCK=16)  # deliberately not in signature order
    L.launch(fn, 3, (a, b, 5), consts)            # first: compiles through kernel[grid]
    assert len(compiled) == 1 and compiled[0][0] == (3,)
    L.launch(fn, 3, (a, b, 9), consts)            # then: straight to the C launcher
    assert len(compiled) == 1
    call = compiled[0][3].calls[-1]
    assert call[:9] == (3, 1, 1, 1234, 7, (1, 2), None, None, None)
    assert call[9:] == (a.data_ptr(), b.data_ptr(), 9, 16, True)


def test_new_compile_when_code_would_change(fake_gpu):
    compiled, Launcher = fake_gpu
    fn = Launcher(_k)
    fn.arg_names = _k.arg_names
    a, b = torch.zeros(64), torch.zeros(64, dtype=torch.int32)
    L.launch(fn, 3, (a, b, 5), dict(BLOCK=16, FLAG=True))
    L.launch(fn, 4, (a, b, 5), dict(BLOCK=16, FLAG=True))          # grid
    L.launch(fn, 3, (a, b, 5), dict(BLOCK=32, FLAG=True))          # constexpr
    L.launch(fn, 3, (a[1:], b, 5), dict(BLOCK=16, FLAG=True))      # pointer no longer 16-byte aligned
    L.launch(fn, 3, (a, b, 2**40), dict(BLOCK=16, FLAG=True))      # int needs 64 bits
    assert len(compiled) == 5
    L.launch(fn, 3, (a, b, 77), dict(BLOCK=16, FLAG=True))         # same code: no compile
    assert len(compiled) == 5
