"""The copy floor: what persistent Triton kernels move on one GPU, gathering rows through a permutation.

    python -m moe_ep.bench.copy_floor
    python -m moe_ep.bench.copy_floor --programs 16,32,64,132 --rows 32768 --row-bytes 7168 \\
        --inflight 2,4,8 --expand 8 --iters 50 --json copy_floor.json

Without a GPU the same kernels run in Triton's interpreter on tiny sizes, for correctness only
(times are meaningless and marked so):
    TRITON_INTERPRET=1 python -m moe_ep.bench.copy_floor --device cpu --json copy_floor.json

Prefill dispatch and combine move whole rows (7168 bytes: a hidden-7168 token in fp8; its bf16 rows
are 14336, ``--row-bytes 14336``) to or from permuted places, with a fixed number of programs (at
most one per SM). This measures what such a copy can reach, so a kernel's time can be set against
bytes / (floor GB/s). Variants:

- ``plain``: each program walks its rows (i = pid, pid + programs, ...) and copies ``dst[i] =
  src[perm[i]]``, one row loaded then stored per loop step.
- ``inflight-N``: N rows (a [N, BLOCK] tile through the permutation) loaded before any is stored,
  N times the bytes in flight per program.
- ``prefetch-N-aD``: ``inflight-N`` whose rows D steps later are asked of the L2 first (one bulk
  prefetch a row, ``cp.async.bulk.prefetch.L2`` on sm_90; no registers, nothing waited for), so each
  step's loads hit the L2.
- ``read-N``: N rows through the permutation loaded per step (the ``reduce-K`` rows: bf16 small
  integers) and summed by column in float32, nothing stored but each program's sums, added once at
  its end: what reading alone reaches, the floor of a kernel that reads much more than it writes
  (combine reads K rows a token and writes one); bytes = R rows read. With ``--maxnreg B`` the
  read and reduce kernels compile with that register budget (lines ``read-N-rB``, ``reduce-...-rB``):
  ptxas left to itself issues fewer of a step's loads ahead than the registers allow.
- ``pipelined-S``: the ``plain`` loop with ``tl.range(num_stages=S)``: Triton prefetches the next
  S - 1 rows (asynchronous copies into shared memory) while storing this one.
- ``expand-K``: each source row loaded once and stored K times, into K permuted destinations
  (dispatch's expansion by top-k); bytes = R rows read + R*K rows written.
- ``reduce-K-tT-cC``: combine's own work at one rank: each output row the float32 sum of K
  gathered bf16 rows (weighted), R / K output rows from R source rows, T tokens by C channels per
  loop step through the combine's own ``pre_reduce_tile`` (its data loop without its metadata and
  flags; T = 16, C = 512 is the combine's step at 32 programs); bytes = R rows read + R / K rows
  written.
- ``tma-BxC-sS``: the ``pipelined-S`` loop with Triton tensor descriptors (TMA on sm90+): a row is
  seen as [chunks, C] int32 words and moved B chunks per box; "not available: <reason>" where
  tensor descriptors are not.
- ``ring-S-bB`` and ``ring-expand-K-sS-bB``: the gather and the expansion by Gluon kernels
  (``moe_ep.bench.tma_ring``, sm_90+): each program keeps S whole rows in a shared-memory ring,
  loaded by TMA S - B rows ahead and stored from shared memory by TMA (K times for the
  expansion), the stores of B rows in flight; S = 0 in ``--ring-stages`` means as many as fit.
  GPU only ("not available" in the interpreter).
- ``ring-fp8-expand-K-wW-qQ``: the dispatch's own-row work by a Gluon kernel: bf16 rows of
  ``row-bytes`` channels loaded by TMA into a shared-memory ring, quantized to fp8 per
  128-channel block in registers (W warps), staged in one of Q buffers and stored K times by TMA
  with their float32 scales (the wire row); bytes = the bf16 rows read + R*K fp8 rows with scales
  written. Where ``--ring-stages`` is given and the rows are whole 128-channel blocks.
- reference lines, no program count: ``torch copy_`` (contiguous device-to-device memcpy, the
  bandwidth line of the memory itself) and ``torch index_select`` (torch's own gather kernel). A gather
  by the copy engines is not measured: one ``cudaMemcpyAsync`` per row is bound by issue cost.

The default rows (32768 x 7168 bytes, 235 MB) are several times the L2 cache, so the copies
stream from and to HBM; small ``--rows`` would time the L2 instead.

Rows move as int32 words (a bitcast view of any dtype): no casts, the same on GPU and in the
interpreter. GB/s = (bytes read + bytes written) / p50 time (CUDA events, after warm-up); the
permutation's own bytes (4 per row) are not counted. Before timing, every variant's output at every
program count is compared with torch's (``equal``); a mismatch is an error row, never a time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from moe_ep.bench.args import int_list
from moe_ep.kernels.common import pre_reduce_tile, prefetch_l2
from moe_ep.core.interpret import interpreting, speed_up
from moe_ep.kernels.launch import compile_options, register_budget
from moe_ep.core.workspace import pow2

PROG = "python -m moe_ep.bench.copy_floor"
# (tokens, channels) per step of the reduce-K variants: (16, 512) is the combine's receive step at 32
# programs; the last three load as many elements (16 a thread at 16 warps) in pieces of 2-8 KB a row
REDUCE_SHAPES = ((16, 512), (16, 1024), (8, 1024), (4, 2048), (2, 4096))
MAX_BLOCK_WORDS = 4096  # widest row piece per load (16 KB); longer rows are walked in pieces
TMA_MAX_BOX = 256  # a TMA box has at most 256 elements per dimension
CPU_DEFAULTS = dict(rows=64, row_bytes=256, programs=[2, 3], iters=2, warmup=1)
GPU_DEFAULTS = dict(rows=32768, row_bytes=7168, programs=[16, 32, 64, 132], iters=50, warmup=5)


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _gather_kernel(src_ptr, perm_ptr, dst_ptr, rows, WORDS: tl.constexpr, BLOCK_W: tl.constexpr,
                   STAGES: tl.constexpr):
    """``dst[i] = src[perm[i]]`` for i = pid, pid + programs, ...; STAGES=1: one row loaded, then
    stored (``plain``); more: the row loop software-pipelined by Triton, STAGES deep."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_W)
    # persistent: a fixed grid walks all rows, as dispatch/combine do; an int64 row index, as
    # rows * words passes 2**31 at scale. num_stages: the compiler issues the loads of the next
    # STAGES - 1 rows (asynchronous copies into shared memory) before storing this one.
    for i in tl.range(pid.to(tl.int64), rows, programs, num_stages=STAGES):
        s = tl.load(perm_ptr + i).to(tl.int64)
        for c in tl.static_range(0, WORDS, BLOCK_W):
            m = c + cols < WORDS  # WORDS % 4 == 0 keeps the mask constant over 16-byte vectors
            v = tl.load(src_ptr + s * WORDS + c + cols, mask=m)
            tl.store(dst_ptr + i * WORDS + c + cols, v, mask=m)


@triton.jit
def _prefetch_row(src_ptr, perm_ptr, a, rows, WORDS: tl.constexpr, INTERP: tl.constexpr):
    """Source row ``perm[a]`` asked of the L2 (``prefetch_l2``); nothing for ``a >= rows``."""
    if a < rows:
        prefetch_l2(src_ptr + tl.load(perm_ptr + a).to(tl.int64) * WORDS, WORDS * 4, INTERP)


@triton.jit
def _gather_inflight_kernel(src_ptr, perm_ptr, dst_ptr, rows, WORDS: tl.constexpr, BLOCK_W: tl.constexpr,
                            ROWS_IN_FLIGHT: tl.constexpr, AHEAD: tl.constexpr, INTERP: tl.constexpr):
    """``dst[i] = src[perm[i]]``, ROWS_IN_FLIGHT consecutive ``i`` per step: all loaded, then all stored.
    AHEAD > 0 (``prefetch-N-aD``): the source rows of the step AHEAD steps later are asked of the L2
    first (one bulk prefetch a row), so this step's loads hit the L2."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    r = tl.arange(0, ROWS_IN_FLIGHT)
    cols = tl.arange(0, BLOCK_W)
    stride = programs * ROWS_IN_FLIGHT  # rows between a program's steps
    for j in tl.static_range(AHEAD * ROWS_IN_FLIGHT):  # the rows of the first AHEAD steps
        _prefetch_row(src_ptr, perm_ptr, pid.to(tl.int64) * ROWS_IN_FLIGHT + (j // ROWS_IN_FLIGHT) * stride +
                      j % ROWS_IN_FLIGHT, rows, WORDS, INTERP)
    for first in range(pid.to(tl.int64) * ROWS_IN_FLIGHT, rows, stride):
        for j in tl.static_range(ROWS_IN_FLIGHT if AHEAD > 0 else 0):
            _prefetch_row(src_ptr, perm_ptr, first + AHEAD * stride + j, rows, WORDS, INTERP)
        i = first + r
        ok = i < rows
        s = tl.load(perm_ptr + i, mask=ok, other=0).to(tl.int64)
        for c in tl.static_range(0, WORDS, BLOCK_W):
            m = ok[:, None] & (c + cols < WORDS)[None, :]
            # one [N, BLOCK_W] tile: N rows' loads are issued before the first store waits on them,
            # so N times the bytes are in flight per program (latency hidden by more outstanding loads)
            v = tl.load(src_ptr + s[:, None] * WORDS + (c + cols)[None, :], mask=m)
            tl.store(dst_ptr + i[:, None] * WORDS + (c + cols)[None, :], v, mask=m)


@triton.jit
def _read_kernel(src_ptr, perm_ptr, sum_ptr, rows, COLS: tl.constexpr, BLOCK_C: tl.constexpr,
                 ROWS_IN_FLIGHT: tl.constexpr):
    """``sum[j] += src[perm[i], c + j]`` (float32) over every row i and every BLOCK_C-channel piece
    c of a row: bf16 rows loaded ROWS_IN_FLIGHT a step, nothing stored but one atomic add of a
    [BLOCK_C] sum per program at its end."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    r = tl.arange(0, ROWS_IN_FLIGHT)
    cols = tl.arange(0, BLOCK_C)
    acc = tl.zeros([BLOCK_C], tl.float32)
    for first in range(pid.to(tl.int64) * ROWS_IN_FLIGHT, rows, programs * ROWS_IN_FLIGHT):
        i = first + r
        ok = i < rows
        s = tl.load(perm_ptr + i, mask=ok, other=0).to(tl.int64)
        for c in tl.static_range(0, COLS, BLOCK_C):
            m = ok[:, None] & (c + cols < COLS)[None, :]
            # one [N, BLOCK_C] tile, as inflight-N loads it; its float32 sum over the N rows
            v = tl.load(src_ptr + s[:, None] * COLS + (c + cols)[None, :], mask=m, other=0.0)
            acc += tl.sum(v.to(tl.float32), axis=0)
    tl.atomic_add(sum_ptr + cols, acc)


@triton.jit
def _expand_kernel(src_ptr, dest_ptr, dst_ptr, rows, WORDS: tl.constexpr, BLOCK_W: tl.constexpr,
                   K: tl.constexpr):
    """``dst[dest[i, k]] = src[i]`` for k < K: each source row loaded once, stored K times."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_W)
    for i in range(pid.to(tl.int64), rows, programs):
        for c in tl.static_range(0, WORDS, BLOCK_W):
            m = c + cols < WORDS
            v = tl.load(src_ptr + i * WORDS + c + cols, mask=m)  # read once, kept in registers
            for k in tl.static_range(K):  # unrolled: K independent stores, no reload of the row
                d = tl.load(dest_ptr + i * K + k).to(tl.int64)
                tl.store(dst_ptr + d * WORDS + c + cols, v, mask=m)


@triton.jit
def _gather_tma_kernel(src_ptr, perm_ptr, dst_ptr, rows, CHUNKS: tl.constexpr, BOX_ROWS: tl.constexpr,
                       BOX_COLS: tl.constexpr, STAGES: tl.constexpr):
    """``dst[i] = src[perm[i]]`` through tensor descriptors, a row being [CHUNKS, BOX_COLS] words."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    # 3-d view [rows, CHUNKS, BOX_COLS]: a box [1, BOX_ROWS, BOX_COLS] is BOX_ROWS chunks of one row,
    # more than one 256-word box row per copy; chunks past a row's end read as zeros and are not stored
    src = tl.make_tensor_descriptor(src_ptr, shape=[rows, CHUNKS, BOX_COLS],
                                    strides=[CHUNKS * BOX_COLS, BOX_COLS, 1], block_shape=[1, BOX_ROWS, BOX_COLS])
    dst = tl.make_tensor_descriptor(dst_ptr, shape=[rows, CHUNKS, BOX_COLS],
                                    strides=[CHUNKS * BOX_COLS, BOX_COLS, 1], block_shape=[1, BOX_ROWS, BOX_COLS])
    # pipelined as the gather above: the boxes of the next STAGES - 1 rows are requested ahead
    for i in tl.range(pid, rows, programs, num_stages=STAGES):
        s = tl.load(perm_ptr + i)
        for c in tl.static_range(0, CHUNKS, BOX_ROWS):
            # the copy unit moves the box global -> shared -> global; registers only pass it through
            dst.store([i, c, 0], src.load([s, c, 0]))


# ----------------------------------------------------------------------------- launches

def _words(t: torch.Tensor) -> int:
    return t.shape[1]


def _block_words(words: int) -> int:
    return min(pow2(words, 4), MAX_BLOCK_WORDS)


def gather_plain(src: torch.Tensor, perm: torch.Tensor, out: torch.Tensor, *, programs: int,
                 num_warps: int = 16) -> None:
    """``out[i] = src[perm[i]]``. src, out: int32 [R, W] contiguous, same device; perm: int32 [R]."""
    gather_pipelined(src, perm, out, programs=programs, stages=1, num_warps=num_warps)


def gather_inflight(src: torch.Tensor, perm: torch.Tensor, out: torch.Tensor, *, programs: int,
                    rows_in_flight: int, num_warps: int = 16) -> None:
    """``out[i] = src[perm[i]]``, ``rows_in_flight`` (a power of two) rows per step; shapes as gather_plain."""
    gather_prefetch(src, perm, out, programs=programs, rows_in_flight=rows_in_flight, ahead=0, num_warps=num_warps)


def gather_prefetch(src: torch.Tensor, perm: torch.Tensor, out: torch.Tensor, *, programs: int,
                    rows_in_flight: int, ahead: int, num_warps: int = 16) -> None:
    """``gather_inflight`` with the rows ``ahead`` steps later asked of the L2 first (0: none);
    shapes as gather_plain."""
    _gather_inflight_kernel[(programs,)](src_ptr=src, perm_ptr=perm, dst_ptr=out, rows=src.shape[0],
                                         WORDS=_words(src), BLOCK_W=_block_words(_words(src)),
                                         ROWS_IN_FLIGHT=rows_in_flight, AHEAD=ahead, INTERP=interpreting(),
                                         num_warps=num_warps)


def read_rows(src: torch.Tensor, perm: torch.Tensor, out: torch.Tensor, *, programs: int,
              rows_in_flight: int, num_warps: int = 16, maxnreg: str = "") -> None:
    """``out += read_sums(src)``: reads every row ``perm[i]`` (``rows_in_flight``, a power of two,
    per step) and adds its channels by column into ``out``. src: bf16 [R, C] (small integers, so
    the float32 sums are exact in any order: ``reduce_inputs``); perm: int32 [R]; out: float32
    [BLOCK_C] (``read_width``); all contiguous on one device. ``maxnreg``: the registers a thread
    may use, as ``moe_ep.kernels.launch.register_budget`` reads it ("": ptxas's choice)."""
    _read_kernel[(programs,)](src_ptr=src, perm_ptr=perm, sum_ptr=out, rows=src.shape[0], COLS=src.shape[1],
                              BLOCK_C=read_width(src), ROWS_IN_FLIGHT=rows_in_flight,
                              **compile_options(num_warps, maxnreg))


def read_width(src: torch.Tensor) -> int:
    """The columns of ``read_rows``'s sums: the channels of one row piece per load (16 KB at most)."""
    return min(pow2(src.shape[1], 8), 2 * MAX_BLOCK_WORDS)


def reference_read(src: torch.Tensor) -> torch.Tensor:
    """torch's ``read-N`` sums: float32 [BLOCK_C], each row's channels in pieces of BLOCK_C added
    by column (exact: small integers)."""
    R, C = src.shape
    bc = read_width(src)
    padded = torch.zeros(R, -(-C // bc) * bc, dtype=torch.float64, device=src.device)
    padded[:, :C] = src
    return padded.view(R, -1, bc).sum(dim=(0, 1)).to(torch.float32)


def gather_pipelined(src: torch.Tensor, perm: torch.Tensor, out: torch.Tensor, *, programs: int, stages: int,
                     num_warps: int = 16) -> None:
    """``out[i] = src[perm[i]]``, the row loop pipelined ``stages`` deep; shapes as gather_plain."""
    _gather_kernel[(programs,)](src_ptr=src, perm_ptr=perm, dst_ptr=out, rows=src.shape[0],
                                WORDS=_words(src), BLOCK_W=_block_words(_words(src)), STAGES=stages,
                                num_warps=num_warps)


@triton.jit
def _reduce_kernel(src_ptr, idx_ptr, w_ptr, dst_ptr, tokens, COLS: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_C: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """``dst[t] = bf16(sum_k w[t, k] * src[idx[t, k]])`` summed in float32: combine's own work at
    one rank (a token's K expert rows gathered and weighted into one row), BLOCK_T tokens by
    BLOCK_C channels per step through the combine's own helper (``pre_reduce_tile``), without
    the combine's routing metadata or flags."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    kk = tl.arange(0, BLOCK_K)
    km = kk < K
    tt = tl.arange(0, BLOCK_T)
    for t0 in range(pid.to(tl.int64) * BLOCK_T, tokens, programs * BLOCK_T):
        t = t0 + tt
        tm = t < tokens
        m2 = tm[:, None] & km[None, :]
        r = tl.load(idx_ptr + t[:, None] * K + kk[None, :], mask=m2, other=-1)
        w = tl.load(w_ptr + t[:, None] * K + kk[None, :], mask=m2, other=0.0)
        for c in range(0, COLS, BLOCK_C):
            cc = c + tl.arange(0, BLOCK_C)
            cm = tm[:, None] & (cc < COLS)[None, :]
            acc = pre_reduce_tile(src_ptr, r, w, kk, cc, cm, K, COLS, BLOCK_T, BLOCK_C)
            tl.store(dst_ptr + t[:, None] * COLS + cc[None, :], acc.to(tl.bfloat16), mask=cm)


def reduce_rows(src: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *, programs: int,
                block_tokens: int, block_cols: int, num_warps: int = 16, maxnreg: str = "") -> None:
    """``out[t] = sum_k w[t, k] * src[idx[t, k]]``, ``block_tokens`` tokens by ``block_cols``
    channels (powers of two) a step. src: bf16 [R, C]; idx: int32 [T, K]; w: float32 [T, K]; out:
    bf16 [T, C]; all contiguous on one device. ``maxnreg`` as for ``read_rows``."""
    T, K = idx.shape
    _reduce_kernel[(programs,)](src_ptr=src, idx_ptr=idx, w_ptr=w, dst_ptr=out, tokens=T, COLS=src.shape[1],
                                BLOCK_T=block_tokens, BLOCK_C=min(block_cols, pow2(src.shape[1])), K=K,
                                BLOCK_K=pow2(K), **compile_options(num_warps, maxnreg))


def reduce_inputs(inp: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(src, idx, w) of ``reduce-K``: bf16 [R, 2W] small integers (float32 sums of K of them are
    exact, so any summation order gives torch's bits), idx = ``perm`` as [R / K, K], weights 1."""
    R, W = inp.src.shape
    K = inp.dest.shape[1]
    g = torch.Generator(device=inp.src.device).manual_seed(2)
    src = torch.randint(-16, 17, (R, 2 * W), generator=g, device=inp.src.device).to(torch.bfloat16)
    idx = inp.perm[: R // K * K].view(R // K, K)
    return src, idx, torch.ones(idx.shape, dtype=torch.float32, device=inp.src.device)


def reference_reduce(src: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """torch's ``reduce-K``: bf16 [T, C]."""
    return (src[idx.long()].float() * w[:, :, None]).sum(dim=1).to(torch.bfloat16)


def expand_rows(src: torch.Tensor, dest: torch.Tensor, out: torch.Tensor, *, programs: int,
                num_warps: int = 16) -> None:
    """``out[dest[i, k]] = src[i]``. src: int32 [R, W]; dest: int32 [R, K], a permutation of
    range(R * K); out: int32 [R * K, W]; all contiguous on one device."""
    _expand_kernel[(programs,)](src_ptr=src, dest_ptr=dest, dst_ptr=out, rows=src.shape[0], WORDS=_words(src),
                                BLOCK_W=_block_words(_words(src)), K=dest.shape[1], num_warps=num_warps)


def tma_box(words: int, box_rows: int) -> tuple[int, int]:
    """The box [rows, cols] (int32 words) for rows of ``words`` words: cols the largest power of two
    <= 256 dividing ``words`` (a row is a whole number of box rows), rows at most ``box_rows`` and
    no more than a row has chunks (powers of two)."""
    cols = words & -words  # largest power of two dividing words
    cols = min(cols, TMA_MAX_BOX)
    chunks = words // cols
    return min(pow2(box_rows), pow2(chunks), TMA_MAX_BOX), cols


def ring_unavailable(device: torch.device) -> Optional[str]:
    """Why the Gluon ring kernels cannot run on ``device`` (None when they can)."""
    if device.type != "cuda":
        return "Gluon kernels do not run in Triton's interpreter (GPU only)"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"TMA needs sm90 or newer, this GPU is sm{major}{minor}"
    try:
        from moe_ep.bench import tma_ring  # noqa: F401
    except ImportError as e:
        return f"triton {triton.__version__} has no Gluon TMA ({e})"
    return None


def ring_variant(inp: Inputs, out: torch.Tensor, *, expand: bool, stages: int, behind: int) -> Callable[[int], None]:
    """The launch of the ring gather (``out[i] = src[perm[i]]``) or expansion (``out[dest[i, k]] =
    src[i]``) with ``stages`` ring slots (0: as many as fit), ``behind`` of them held by rows being
    stored; descriptors made at the first launch."""
    made: dict = {}

    def launch(programs: int) -> None:
        from moe_ep.bench import tma_ring

        if not made:
            W = inp.src.shape[1]
            made.update(src=tma_ring.row_descriptor(inp.src), dst=tma_ring.row_descriptor(out),
                        stages=stages or tma_ring.max_stages(W * 4, W))
        tma_ring.ring_copy(made["src"], made["dst"], inp.dest if expand else inp.perm, inp.src.shape[0],
                           gather=not expand, k=inp.dest.shape[1] if expand else 1, stages=made["stages"],
                           behind=behind, programs=programs)
    return launch


def fp8_source(inp: Inputs) -> torch.Tensor:
    """bf16 [R, row_bytes] rows of normal values (the fp8 expansion's input: one fp8 byte per channel)."""
    R, W = inp.src.shape
    g = torch.Generator(device=inp.src.device).manual_seed(1)
    return torch.randn(R, W * 4, generator=g, device=inp.src.device).to(torch.bfloat16)


def reference_fp8_expand(x: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """torch's fp8 expansion: uint8 [R * K, H + 4 * H / 128], row ``dest[i, k]`` = fp8 e4m3 of
    ``x[i] * (448 / amax)`` per 128-channel block, then the blocks' ``amax / 448`` as float32."""
    R, H = x.shape
    K = dest.shape[1]
    xf = x.float().view(R, H // 128, 128)
    amax = xf.abs().amax(dim=2)
    # (torch.full_like(amax, 448) / amax: ``448 / amax`` is reciprocal-then-multiply in torch, not IEEE division)
    q = (xf * (torch.full_like(amax, 448.0) / amax)[:, :, None]).to(torch.float8_e4m3fn).view(torch.uint8).view(R, H)
    # (on CUDA, torch divides by a scalar as a multiply by its reciprocal: a tensor divisor is IEEE division)
    row = torch.cat([q, (amax / torch.full_like(amax, 448.0)).view(torch.uint8).view(R, -1)], dim=1)
    ref = torch.empty(R * K, row.shape[1], dtype=torch.uint8, device=x.device)
    ref[dest.reshape(-1).long()] = row.repeat_interleave(K, dim=0)
    return ref


def ring_fp8_variant(x: torch.Tensor, dest: torch.Tensor, out: torch.Tensor, *, qbufs: int,
                     num_warps: int = 4) -> Callable[[int], None]:
    """The launch of the Gluon fp8 expansion of ``x`` into ``out`` at rows ``dest`` (``qbufs``
    staging buffers, as many ring slots as fit beside them)."""
    def launch(programs: int) -> None:
        from moe_ep.bench import tma_ring

        tma_ring.ring_fp8_expand(x, out, dest, qbufs=qbufs, programs=programs, num_warps=num_warps)
    return launch


def tma_unavailable(device: torch.device) -> Optional[str]:
    """Why tensor-descriptor kernels cannot run on ``device`` (None when they can)."""
    if not hasattr(tl, "make_tensor_descriptor"):
        return f"triton {triton.__version__} has no tl.make_tensor_descriptor"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major < 9:
            return f"tensor descriptors (TMA) need sm90 or newer, this GPU is sm{major}{minor}"
    return None


def _set_tma_allocator(device: torch.device) -> None:
    # descriptors made inside a kernel live in a global scratch buffer the launcher asks for
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))


def gather_tma(src: torch.Tensor, perm: torch.Tensor, out: torch.Tensor, *, programs: int, box_rows: int,
               stages: int = 3, num_warps: int = 4) -> None:
    """``out[i] = src[perm[i]]`` with tensor descriptors, box ``tma_box(W, box_rows)``, the row loop
    pipelined ``stages`` deep; shapes as gather_plain, W a multiple of 4 (16-byte rows)."""
    words = _words(src)
    if words % 4:
        raise ValueError(f"tensor descriptors need 16-byte row strides, got rows of {words * 4} bytes")
    rows, cols = tma_box(words, box_rows)
    _set_tma_allocator(src.device)
    _gather_tma_kernel[(programs,)](src_ptr=src, perm_ptr=perm, dst_ptr=out, rows=src.shape[0],
                                    CHUNKS=words // cols, BOX_ROWS=rows, BOX_COLS=cols, STAGES=stages,
                                    num_warps=num_warps)


# ----------------------------------------------------------------------------- inputs and checks

@dataclass
class Inputs:
    """src: int32 [R, W] random words; perm: int32 [R], a permutation of range(R); dest: int32 [R, K],
    a permutation of range(R * K); all on one device."""
    src: torch.Tensor
    perm: torch.Tensor
    dest: torch.Tensor


def make_inputs(rows: int, row_bytes: int, expand: int, device: torch.device | str, seed: int = 0) -> Inputs:
    """Random rows of ``row_bytes`` bytes (a multiple of 4) and random permutations, on ``device``."""
    if row_bytes % 4:
        raise ValueError(f"row bytes must be a multiple of 4 (rows move as int32 words), got {row_bytes}")
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    src = torch.randint(-2**31, 2**31 - 1, (rows, row_bytes // 4), generator=g, dtype=torch.int32, device=device)
    perm = torch.randperm(rows, generator=g, device=device).to(torch.int32)
    dest = torch.randperm(rows * expand, generator=g, device=device).to(torch.int32).view(rows, expand)
    return Inputs(src=src, perm=perm, dest=dest)


def reference_gather(inp: Inputs) -> torch.Tensor:
    """torch's ``src[perm]``: int32 [R, W]."""
    return inp.src[inp.perm.long()]


def reference_expand(inp: Inputs) -> torch.Tensor:
    """torch's expansion: int32 [R * K, W] with row ``dest[i, k]`` = ``src[i]``."""
    R, K = inp.dest.shape
    ref = torch.empty(R * K, inp.src.shape[1], dtype=inp.src.dtype, device=inp.src.device)
    ref[inp.dest.reshape(-1).long()] = inp.src.repeat_interleave(K, dim=0)
    return ref


def check(out: torch.Tensor, ref: torch.Tensor) -> Optional[str]:
    """None when ``out`` equals ``ref`` (same shape, dtype, every word); otherwise what differs."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return f"output {tuple(out.shape)} {out.dtype}, expected {tuple(ref.shape)} {ref.dtype}"
    if out.equal(ref):
        return None
    bad = (out != ref).reshape(out.shape[0], -1).any(dim=1).nonzero().flatten()
    return f"output differs from torch's in {bad.numel()} of {out.shape[0]} rows (first: row {int(bad[0])})"


# ----------------------------------------------------------------------------- variants

@dataclass
class Variant:
    """One measured line. ``launch(programs)`` writes ``out``, which must then equal ``reference()``;
    ``programs`` is None for torch's reference lines (they pick their own grid)."""
    name: str
    launch: Callable[[Optional[int]], None]
    out: torch.Tensor
    reference: Callable[[], torch.Tensor]
    read_bytes: int
    write_bytes: int
    per_program: bool = True
    unavailable: Optional[str] = None


def variants(inp: Inputs, *, inflight: list[int], stages: int, tma_box_rows: list[int],
             num_warps: int, prefetch: tuple[tuple[int, int], ...] = (), ring_stages: tuple[int, ...] = (),
             ring_behind: tuple[int, ...] = (1,), maxnreg: str = "") -> list[Variant]:
    """Every variant over ``inp`` (gather variants share one output buffer); ``maxnreg`` (a
    register budget spec) for the read and reduce kernels."""
    R, W = inp.src.shape
    K = inp.dest.shape[1]
    nbytes = R * W * 4
    out = torch.empty_like(inp.src)
    out_expanded = torch.empty(R * K, W, dtype=inp.src.dtype, device=inp.src.device)
    ref_gather = lambda: reference_gather(inp)  # noqa: E731
    vs = [Variant("plain", lambda p: gather_plain(inp.src, inp.perm, out, programs=p, num_warps=num_warps),
                  out, ref_gather, nbytes, nbytes)]
    for n in inflight:
        vs.append(Variant(f"inflight-{n}", lambda p, n=n: gather_inflight(inp.src, inp.perm, out, programs=p,
                                                                         rows_in_flight=n, num_warps=num_warps),
                          out, ref_gather, nbytes, nbytes))
    rsrc, ridx, rw = reduce_inputs(inp)
    sums = torch.zeros(read_width(rsrc), dtype=torch.float32, device=inp.src.device)
    budget = f"-r{maxnreg}" if maxnreg else ""  # (in the read and reduce lines' names)
    for n in inflight:
        vs.append(Variant(f"read-{n}{budget}", lambda p, n=n: read_rows(rsrc, inp.perm, sums, programs=p, rows_in_flight=n,
                                                                num_warps=num_warps, maxnreg=maxnreg),
                          sums, lambda: reference_read(rsrc), nbytes, 0))
    for n, a in prefetch:
        vs.append(Variant(f"prefetch-{n}-a{a}", lambda p, n=n, a=a: gather_prefetch(
            inp.src, inp.perm, out, programs=p, rows_in_flight=n, ahead=a, num_warps=num_warps),
            out, ref_gather, nbytes, nbytes))
    vs.append(Variant(f"pipelined-{stages}", lambda p: gather_pipelined(inp.src, inp.perm, out, programs=p,
                                                                        stages=stages, num_warps=num_warps),
                      out, ref_gather, nbytes, nbytes))
    vs.append(Variant(f"expand-{K}", lambda p: expand_rows(inp.src, inp.dest, out_expanded, programs=p,
                                                             num_warps=num_warps),
                      out_expanded, lambda: reference_expand(inp), nbytes, nbytes * K))
    out_reduced = torch.empty(ridx.shape[0], rsrc.shape[1], dtype=torch.bfloat16, device=inp.src.device)
    for bt, bc in REDUCE_SHAPES:
        vs.append(Variant(f"reduce-{K}-t{bt}-c{bc}{budget}",
                          lambda p, bt=bt, bc=bc: reduce_rows(rsrc, ridx, rw, out_reduced, programs=p, block_tokens=bt,
                                                              block_cols=bc, num_warps=num_warps, maxnreg=maxnreg),
                          out_reduced, lambda: reference_reduce(rsrc, ridx, rw), ridx.numel() * W * 4,
                          ridx.shape[0] * W * 4))
    why = tma_unavailable(inp.src.device) or (f"rows of {W * 4} bytes are not a multiple of 16" if W % 4 else None)
    for rows, cols in dict.fromkeys(tma_box(W, b) for b in tma_box_rows):  # one line per distinct box
        vs.append(Variant(f"tma-{rows}x{cols}-s{stages}",
                          lambda p, rows=rows: gather_tma(inp.src, inp.perm, out, programs=p, box_rows=rows,
                                                          stages=stages),
                          out, ref_gather, nbytes, nbytes, unavailable=why))
    why = ring_unavailable(inp.src.device)
    for st in ring_stages:
        tag = st or "max"
        for b in (b for b in ring_behind if st == 0 or b < st):
            vs.append(Variant(f"ring-{tag}-b{b}", ring_variant(inp, out, expand=False, stages=st, behind=b), out,
                              ref_gather, nbytes, nbytes, unavailable=why))
            vs.append(Variant(f"ring-expand-{K}-s{tag}-b{b}",
                              ring_variant(inp, out_expanded, expand=True, stages=st, behind=b),
                              out_expanded, lambda: reference_expand(inp), nbytes, nbytes * K, unavailable=why))
    if ring_stages and W % 32 == 0:  # H = row bytes channels in 128-channel blocks
        H = W * 4
        x = fp8_source(inp) if why is None else None  # (never launched where unavailable)
        out_fp8 = torch.empty(R * K, H + 4 * (H // 128), dtype=torch.uint8, device=inp.src.device)
        for w, q in ((4, 2), (4, 4), (8, 4)):
            vs.append(Variant(f"ring-fp8-expand-{K}-w{w}-q{q}",
                              ring_fp8_variant(x, inp.dest, out_fp8, qbufs=q, num_warps=w),
                              out_fp8, lambda: reference_fp8_expand(x, inp.dest), R * H * 2,
                              R * K * out_fp8.shape[1], unavailable=why))
    vs.append(Variant("torch copy_", lambda p: out.copy_(inp.src), out, lambda: inp.src, nbytes, nbytes,
                      per_program=False))
    vs.append(Variant("torch index_select", lambda p: torch.index_select(inp.src, 0, inp.perm, out=out),
                      out, ref_gather, nbytes, nbytes, per_program=False))
    return vs


# ----------------------------------------------------------------------------- timing

def time_us(fn: Callable[[], None], *, iters: int, warmup: int, cuda: bool) -> list[float]:
    """Per-iteration times of ``fn`` in µs: CUDA events on a GPU, the host clock otherwise."""
    for _ in range(warmup):
        fn()
    if not cuda:
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
        return times
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda.synchronize()
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]


def measure(v: Variant, programs: Optional[int], *, iters: int, warmup: int, cuda: bool) -> dict:
    """One row: the variant run once and checked against torch, then timed (unless it failed)."""
    row = dict(variant=v.name, programs=programs if v.per_program else "n/a",
               read_bytes=v.read_bytes, write_bytes=v.write_bytes)
    if v.unavailable:
        return dict(row, error=f"not available: {v.unavailable}")
    try:
        v.out.zero_()
        v.launch(programs)
        err = check(v.out, v.reference())
    except Exception as e:  # noqa: BLE001 - a variant that cannot run is a row, the sweep goes on
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        return dict(row, error=("not available: " if v.name.startswith("tma") else "failed: ") + reason)
    if err:
        return dict(row, error=f"wrong output: {err}")
    times = time_us(lambda: v.launch(programs), iters=iters, warmup=warmup, cuda=cuda)
    p50 = statistics.median(times)
    gbps = (v.read_bytes + v.write_bytes) / (p50 * 1e-6) / 1e9
    return dict(row, p50_us=p50, p90_us=sorted(times)[min(len(times) - 1, int(0.9 * len(times)))],
                gbps=gbps, gbps_per_program=gbps / programs if v.per_program else None)


# ----------------------------------------------------------------------------- output

def format_table(rows: list[dict], meaningful: bool = True) -> str:
    """The table: variant, programs, p50 µs, GB/s, GB/s per program (or the row's error)."""
    lines = [f"{'variant':<20} {'programs':>8} {'p50 us':>10} {'GB/s':>9} {'GB/s/program':>13}"]
    for r in rows:
        head = f"{r['variant']:<20} {str(r['programs']):>8}"
        if "error" in r:
            lines.append(f"{head}  {r['error']}")
        else:
            per = f"{r['gbps_per_program']:>13.1f}" if r["gbps_per_program"] is not None else f"{'n/a':>13}"
            lines.append(f"{head} {r['p50_us']:>10.1f} {r['gbps']:>9.1f} {per}")
    best: dict[int, dict] = {}
    for r in rows:
        if "error" not in r and isinstance(r["programs"], int):
            if r["programs"] not in best or r["gbps"] > best[r["programs"]]["gbps"]:
                best[r["programs"]] = r
    if best and meaningful:
        lines.append("best Triton variant: " + "; ".join(f"{p} programs {r['variant']} {r['gbps']:.1f} GB/s"
                                                         for p, r in sorted(best.items())))
    if not meaningful:
        lines.append("times are meaningless here (Triton interpreter on CPU): correctness only")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: Triton's interpreter (TRITON_INTERPRET=1), tiny sizes, correctness only")
    p.add_argument("--programs", type=int_list("--programs"), default=None,
                   help=f"program counts (default {','.join(map(str, GPU_DEFAULTS['programs']))}; "
                        f"cpu {','.join(map(str, CPU_DEFAULTS['programs']))})")
    p.add_argument("--rows", type=int, default=None, help=f"rows copied (default {GPU_DEFAULTS['rows']}; "
                                                          f"cpu {CPU_DEFAULTS['rows']})")
    p.add_argument("--row-bytes", type=int, default=None,
                   help=f"bytes per row, a multiple of 16 (default {GPU_DEFAULTS['row_bytes']}; "
                        f"cpu {CPU_DEFAULTS['row_bytes']})")
    p.add_argument("--inflight", type=int_list("--inflight", pow2_only=True), default=[2, 4, 8],
                   help="rows in flight per program for the inflight-N variants (default 2,4,8)")
    p.add_argument("--prefetch", type=int_list("--prefetch"), default=[1, 2, 4],
                   help="steps ahead of the prefetch-N-aD variants (L2 prefetch, N of the first two "
                        "--inflight values; default 1,2,4)")
    p.add_argument("--stages", type=int, default=3,
                   help="software-pipelining depth of the pipelined-S and tma variants (default 3)")
    p.add_argument("--expand", type=int, default=8, help="K of expand-K: stores per source row (default 8)")
    p.add_argument("--tma-box-rows", type=int_list("--tma-box-rows", pow2_only=True), default=[4, 8],
                   help="box rows of the tma variants, 256-word chunks of a row per box (default 4,8)")
    p.add_argument("--ring-stages", type=int_list("--ring-stages", zero_ok=True), default=[4, 8, 0],
                   help="ring slots of the ring variants, 0 = as many as fit (default 4,8,0)")
    p.add_argument("--ring-behind", type=int_list("--ring-behind"), default=[1, 2, 4],
                   help="ring slots held by rows being stored, of the ring variants (default 1,2,4)")
    p.add_argument("--num-warps", type=int, default=16, help="warps per program of the gather kernels (default 16)")
    p.add_argument("--maxnreg", default="", help="registers a thread of the read and reduce kernels may use: 'full' "
                   "(the register file over a program's threads) or a count (default: ptxas's choice)")
    p.add_argument("--iters", type=int, default=None, help=f"timed iterations (default {GPU_DEFAULTS['iters']})")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"untimed iterations first (default {GPU_DEFAULTS['warmup']})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the rows and the environment to this file")
    args = p.parse_args(argv)
    defaults = CPU_DEFAULTS if args.device == "cpu" else GPU_DEFAULTS
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.row_bytes < 16 or args.row_bytes % 16:
        p.error(f"--row-bytes: a positive multiple of 16 (16-byte vectors, TMA strides), got {args.row_bytes}")
    if 1 in args.ring_stages:
        p.error("--ring-stages: 0 (as many as fit) or at least 2 (one slot loading while one is stored)")
    if min(args.rows, args.expand, args.stages, args.iters, args.num_warps) < 1 or args.warmup < 0:
        p.error("--rows, --expand, --stages, --iters and --num-warps must be positive, --warmup not negative")
    try:
        register_budget(args.maxnreg, args.num_warps, "--maxnreg")
    except ValueError as e:
        p.error(str(e))
    if args.device == "cpu" and not interpreting():
        p.error("--device cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1 "
                f"(TRITON_INTERPRET=1 {PROG} --device cpu)")
    if args.device == "cuda" and interpreting():
        p.error("TRITON_INTERPRET is set: the kernels would run in the interpreter; unset it for a GPU run, "
                "or pass --device cpu for a correctness-only run")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA GPU: this benchmark times kernels on a GPU; for a correctness-only run on CPU use "
                f"TRITON_INTERPRET=1 {PROG} --device cpu")
    return args


def run(args: argparse.Namespace) -> dict:
    """The sweep: every variant at every program count (reference lines once). Returns the JSON document."""
    from .intranode import environment

    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    cuda = device.type == "cuda"
    if not cuda:
        speed_up()
    inp = make_inputs(args.rows, args.row_bytes, args.expand, device, seed=args.seed)
    rows = []
    prefetch = tuple((n, a) for n in args.inflight[:2] for a in args.prefetch)
    for v in variants(inp, inflight=args.inflight, stages=args.stages, tma_box_rows=args.tma_box_rows,
                      num_warps=args.num_warps, prefetch=prefetch, ring_stages=tuple(args.ring_stages),
                      ring_behind=tuple(args.ring_behind), maxnreg=args.maxnreg):
        for programs in (args.programs if v.per_program else [None]):
            rows.append(measure(v, programs, iters=args.iters, warmup=args.warmup, cuda=cuda))
    return dict(benchmark="copy_floor", hardware=torch.cuda.get_device_name(device) if cuda else "cpu",
                env=environment(device), times_meaningful=cuda, args=vars(args), rows=rows)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    doc = run(args)
    env = doc["env"]
    print(f"{doc['hardware']}; torch {env['torch']}, triton {env['triton']}, commit {env['commit']}; "
          f"{args.rows} rows x {args.row_bytes} bytes, expand {args.expand}, {args.iters} iterations")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    print(format_table(doc["rows"], meaningful=doc["times_meaningful"]))
    return 1 if any(r.get("error", "").startswith(("wrong", "failed")) for r in doc["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
