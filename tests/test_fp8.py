"""moe_ep.core.fp8: the reference block quantization that the dispatch kernel must reproduce bit for bit."""
from __future__ import annotations

import pytest
import torch

from moe_ep.core.fp8 import AMAX_FLOOR, FP8_BLOCK, FP8_MAX, dequantize_fp8, num_scale_blocks, quantize_fp8

FP8 = torch.float8_e4m3fn


def _e4m3_table():
    """All finite e4m3fn values (float64) and their byte codes, sorted by value, -0 dropped."""
    codes = torch.arange(256, dtype=torch.uint8)
    vals = codes.view(FP8).double()
    keep = torch.isfinite(vals) & ~((vals == 0) & (codes >= 128))
    vals, codes = vals[keep], codes[keep]
    order = torch.argsort(vals)
    return vals[order], codes[order]


def _round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Independent round-to-nearest-even into e4m3fn (|v| <= 448): returns the byte codes."""
    vals, codes = _e4m3_table()
    v = v.double().flatten()
    hi = torch.searchsorted(vals, v).clamp(1, len(vals) - 1)
    lo = hi - 1
    dlo, dhi = (v - vals[lo]).abs(), (vals[hi] - v).abs()
    # Ties go to the even code (mantissa LSB 0); the sign bit does not affect evenness.
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (codes[hi] % 2 == 0))
    out = torch.where(pick_hi, codes[hi], codes[lo])
    # Exact zero keeps its sign as torch does: -0.0 -> 0x80.
    out = torch.where((v == 0) & (torch.signbit(v)), torch.tensor(128, dtype=torch.uint8), out)
    return out


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


@pytest.mark.parametrize("hidden", [128, 256, 200, 16, 7168])
def test_scale_formula_and_shapes(hidden):
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(9, hidden, generator=g) * torch.logspace(-3, 3, 9).unsqueeze(1)).to(torch.bfloat16)
    q, s = quantize_fp8(x)
    nb = num_scale_blocks(hidden)
    assert nb == -(-hidden // FP8_BLOCK)
    assert q.dtype == FP8 and q.shape == (9, hidden) and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == (9, nb) and s.is_contiguous()
    xf = x.float()
    for b in range(nb):
        blk = xf[:, b * FP8_BLOCK:(b + 1) * FP8_BLOCK]  # the last block may be shorter
        expect = blk.abs().amax(dim=1).clamp_min(AMAX_FLOOR) / FP8_MAX
        assert torch.equal(s[:, b], expect), f"block {b}"


@pytest.mark.parametrize("hidden", [128, 384, 200])
def test_bits_are_round_to_nearest_even(hidden):
    g = torch.Generator().manual_seed(7 + hidden)
    x = torch.randn(64, hidden, generator=g) * torch.exp(torch.randn(64, 1, generator=g) * 3)
    x = x.to(torch.bfloat16)
    q, s = quantize_fp8(x)
    # DeepEP's rounding: x * (448 / amax), the reciprocal an exact division (amax = 448 * scale).
    xf = x.float()
    amax = torch.stack([xf[:, b * FP8_BLOCK:(b + 1) * FP8_BLOCK].abs().amax(1) for b in range(s.shape[1])], 1)
    inv = torch.full_like(amax, FP8_MAX) / amax.clamp_min(AMAX_FLOOR)
    scaled = xf * inv.repeat_interleave(FP8_BLOCK, dim=1)[:, :hidden]
    # x * (448 / amax) can round to just above 448; it must still become 448 (not NaN).
    assert scaled.abs().max() <= FP8_MAX * (1 + 2 ** -20)
    assert not torch.isnan(q.float()).any()
    assert torch.equal(_bits(q).flatten(), _round_e4m3(scaled))


def test_rounding_edge_cases():
    # Values around e4m3 rounding points, ties, the carry into the exponent, and subnormals.
    scaled = torch.tensor([124.3, 68.0, 120.0, 124.0, 126.0, 7.5, 7.75, 15.5, 0.0, -0.0, 2 ** -9, 2 ** -10,
                           3 * 2 ** -10, 1.5 * 2 ** -9, 447.0, 448.0, -448.0, 0.001953125, 13.0, 11.0])
    assert torch.equal(_round_e4m3(scaled), _bits(scaled.to(FP8)))
    # A row whose block max is 448 * scale; the others land on the exact scaled values.
    x = torch.zeros(1, 128)
    x[0, : len(scaled)] = scaled
    x[0, 127] = 448.0
    q, s = quantize_fp8(x)
    assert s.item() == 1.0
    assert torch.equal(_bits(q)[0, : len(scaled)], _round_e4m3(scaled))


@pytest.mark.parametrize("hidden", [128, 256, 200, 7168])
def test_round_trip_error_bound(hidden):
    g = torch.Generator().manual_seed(3 * hidden)
    x = (torch.randn(32, hidden, generator=g) * torch.exp(torch.randn(32, 1, generator=g) * 4)).to(torch.bfloat16)
    q, s = quantize_fp8(x)
    back = dequantize_fp8(q, s)
    assert back.dtype == torch.float32 and back.shape == x.shape
    xf = x.float()
    scale = s.repeat_interleave(FP8_BLOCK, dim=1)[:, :hidden]
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; subnormal step 2^-9 -> abs <= 2^-10.
    bound = xf.abs() * 2 ** -4 + scale * 2 ** -10
    err = (back - xf).abs()
    assert (err <= bound * (1 + 1e-6)).all(), f"max excess {(err - bound).max()}"
    # The block maximum survives (448 is exact in e4m3).
    for b in range(s.shape[1]):
        blk = slice(b * FP8_BLOCK, min(hidden, (b + 1) * FP8_BLOCK))
        amax = xf[:, blk].abs().amax(dim=1)
        got = back[:, blk].abs().amax(dim=1)
        torch.testing.assert_close(got, amax, rtol=2e-7, atol=0)


def test_partial_last_block_is_independent():
    hidden = 200  # blocks of 128 and 72
    g = torch.Generator().manual_seed(11)
    x = torch.randn(4, hidden, generator=g)
    x[:, 128:] *= 1000.0  # the short block's scale must not leak into the first block
    q, s = quantize_fp8(x)
    q1, s1 = quantize_fp8(x[:, :128].contiguous())
    assert torch.equal(s[:, 0], s1[:, 0]) and torch.equal(_bits(q[:, :128]), _bits(q1))
    # The short block alone equals a quantization of those 72 channels.
    q2, s2 = quantize_fp8(x[:, 128:].contiguous())
    assert torch.equal(s[:, 1], s2[:, 0]) and torch.equal(_bits(q[:, 128:]), _bits(q2))
    assert torch.equal(s[:, 1], x[:, 128:].abs().amax(dim=1) / FP8_MAX)


def test_zero_rows_and_tiny_blocks():
    x = torch.zeros(3, 256, dtype=torch.bfloat16)
    x[1, 130] = 1e-6  # amax below the floor in block 1
    x[2, :128] = 5.0
    q, s = quantize_fp8(x)
    floor = torch.tensor(AMAX_FLOOR, dtype=torch.float32) / FP8_MAX
    assert torch.equal(s[0], floor.repeat(2))
    assert torch.equal(s[1], floor.repeat(2))
    assert s[2, 0] == torch.tensor(5.0) / FP8_MAX and s[2, 1] == floor
    assert torch.equal(_bits(q[0]), torch.zeros(256, dtype=torch.uint8))
    assert torch.equal(dequantize_fp8(q, s)[0], torch.zeros(256))
    assert torch.equal(dequantize_fp8(q, s)[2, :128], torch.full((128,), 448.0) * s[2, 0])
    # A value under the floor is quantized against the floor, not blown up to 448.
    assert q[1, 130].float() == _round_e4m3(torch.tensor([1e-6 / floor.item()])).view(FP8).float()


def test_integer_data_with_pinned_block_max_is_exact():
    """The tests' tagged rows: integers in [-15, 15] with one channel of 28 per block quantize
    exactly (scale 1/16), so fp8 dispatch of tagged rows is checked exactly."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-15, 16, (8, 384), generator=g).float()
    x[:, ::128] = 28.0
    q, s = quantize_fp8(x.to(torch.bfloat16))
    assert torch.equal(s, torch.full_like(s, 1 / 16))
    assert torch.equal(dequantize_fp8(q, s), x)


def test_dequantize_leading_dims():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 200, generator=g)
    q, s = quantize_fp8(x.view(6, 200))
    d3 = dequantize_fp8(q.view(2, 3, 200), s.view(2, 3, 2))
    assert torch.equal(d3.view(6, 200), dequantize_fp8(q, s))
    assert dequantize_fp8(q[:0], s[:0]).shape == (0, 200)


def test_empty_input():
    q, s = quantize_fp8(torch.zeros(0, 256, dtype=torch.bfloat16))
    assert q.shape == (0, 256) and s.shape == (0, 2)


def test_nonfinite_blocks_become_nan():
    """A block holding a NaN or an infinity is NaN as a whole: scale 0x7FC00000, bytes 0x7F; the
    other blocks of the row quantize as if it were not there."""
    from moe_ep.core.fp8 import NAN_BYTE, NAN_SCALE_BITS

    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 320, generator=g).to(torch.bfloat16)  # blocks of 128, 128, 64
    x[0, 5], x[1, 130], x[2, 0], x[3, 319], x[3, 10] = float("nan"), float("inf"), -float("inf"), float("nan"), 1.0
    q, s = quantize_fp8(x)
    bad = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 1], [0, 0, 0]], dtype=torch.bool)
    assert torch.equal(s.view(torch.int32) == NAN_SCALE_BITS, bad)
    qb = _bits(q)
    for r, b in bad.nonzero().tolist():
        assert (qb[r, b * FP8_BLOCK:(b + 1) * FP8_BLOCK] == NAN_BYTE).all(), (r, b)
    assert dequantize_fp8(q, s).isnan().sum().item() == 128 * 3 + 64
    finite = x.clone()
    finite[~torch.isfinite(finite)] = 0.0
    qf, sf = quantize_fp8(finite)
    good = ~bad.repeat_interleave(FP8_BLOCK, dim=1)[:, :320]
    assert torch.equal(s[~bad], sf[~bad]) and torch.equal(qb[good], _bits(qf)[good])


# The kernels' block scale (moe_ep.kernels.common.block_scale) computes amax / 448 on a GPU as
# q0 = amax * RN(1/448), then fma(fma(q0, -448, amax), RN(1/448), q0), not as a division.

def _scale_by_correction(a: "np.ndarray") -> "np.ndarray":
    """That sequence on float32 ``a``, emulated exactly (each fma rounded once) with float64."""
    import numpy as np

    r = np.float32(0.0022321429569274187)
    q0 = a * r  # a float32 multiply, rounded once
    # fma(q0, -448, a): q0 * 448 and the difference with a are exact in float64 (33 and ~34 bits)
    rem = (a.astype(np.float64) - q0.astype(np.float64) * 448.0).astype(np.float32)
    # fma(rem, r, q0): rem * r is exact in float64; the sum is t + err exactly (Fast2Sum, |q0| >= |s|)
    s = rem.astype(np.float64) * np.float64(r)
    q64 = q0.astype(np.float64)
    t = q64 + s
    err = (q64 - t) + s
    y = t.astype(np.float32)  # round to nearest even from t: right unless t is a float32 midpoint
    y64 = y.astype(np.float64)
    up = np.nextafter(y, np.float32(np.inf)).astype(np.float64)
    down = np.nextafter(y, np.float32(-np.inf)).astype(np.float64)
    mid_up, mid_down = t == (y64 + up) / 2, t == (y64 + down) / 2  # t halfway, rounded to y
    y = np.where(mid_up & (err > 0), up.astype(np.float32), y)
    return np.where(mid_down & (err < 0), down.astype(np.float32), y)


def test_block_scale_correction_equals_division():
    """The sequence equals IEEE division by 448 for every mantissa at several exponents (the
    floor 1e-4, around 1, 448 and 2^100, the largest) and for 2^22 random amax in range; the GPU
    test below checks every float32 amax >= 1e-4 on the device itself."""
    import numpy as np

    assert np.array(np.float32(0.0022321429569274187)).view(np.uint32) == 0x3B124925
    assert np.float32(0.0022321429569274187) == np.float32(1) / np.float32(448)
    lo = int(np.array(np.float32(1e-4)).view(np.uint32))
    rng = np.random.default_rng(0)
    parts = [np.arange(lo, lo + (1 << 23), dtype=np.uint32)]
    for e in (127, 135, 227, 254):  # biased exponents: [1, 2), [256, 512), [2^100, 2^101), the top
        parts.append(np.arange(e << 23, (e << 23) + (1 << 23), dtype=np.uint32))
    parts.append(rng.integers(lo, 0x7F7FFFFF + 1, size=1 << 22, dtype=np.uint32))
    for u in parts:
        a = u.view(np.float32)
        got, want = _scale_by_correction(a), a / np.float32(448)
        bad = np.nonzero(got.view(np.uint32) != want.view(np.uint32))[0]
        assert bad.size == 0, f"amax {a[bad[:3]]}: {got[bad[:3]]} != {want[bad[:3]]}"


@pytest.mark.gpu
def test_block_scale_exhaustive_gpu():
    """The kernels' block scale on the GPU, for every float32 amax in [1e-4, FLT_MAX]: scale and
    factor bit for bit equal to IEEE division (torch's elementwise division of two tensors)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import triton
    import triton.language as tl

    from moe_ep.kernels.common import block_scale

    @triton.jit
    def scales(a_ptr, s_ptr, f_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        s, f = block_scale(tl.load(a_ptr + i, mask=m, other=1.0), False)
        tl.store(s_ptr + i, s, mask=m)
        tl.store(f_ptr + i, f, mask=m)

    dev = torch.device("cuda", 0)
    lo = int(torch.tensor(1e-4, dtype=torch.float32).view(torch.int32))
    top, step = 0x7F7FFFFF + 1, 1 << 28
    for b in range(lo, top, step):
        a = torch.arange(b, min(b + step, top), dtype=torch.int32, device=dev).view(torch.float32)
        s, f = torch.empty_like(a), torch.empty_like(a)
        scales[(triton.cdiv(a.numel(), 1024),)](a, s, f, a.numel(), BLOCK=1024)
        want_s = a / torch.full_like(a, 448.0)
        want_f = torch.full_like(a, 448.0) / a
        for name, got, want in (("amax / 448", s, want_s), ("448 / amax", f, want_f)):
            bad = (got.view(torch.int32) != want.view(torch.int32)).nonzero()
            assert bad.numel() == 0, f"{name} at amax {a[bad[:3, 0]].tolist()}: {got[bad[:3, 0]].tolist()}"
