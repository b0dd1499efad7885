"""Gluon kernels (sm_90+, GPU only): whole rows moved through a shared-memory ring by TMA.

Unlike the Triton kernels beside it (registers hold the bytes in flight, a few rows per SM), a
program here keeps up to STAGES rows in shared memory (~200 KB per SM) with their loads in flight,
issued by one thread as bulk tensor copies (``cp.async.bulk.tensor``) that complete on an
mbarrier; each row is then stored to its K destinations by bulk copies straight from shared
memory, never through registers. Gluon (``triton.experimental.gluon``) does not run in Triton's
interpreter: these kernels are compiled for sm_90 on CPU by the tests and run on GPUs only.

A row of W elements is seen as [CHUNKS, COLS] (COLS a power of two <= 256 dividing W) and moved
as one box [1, BOX, COLS] with BOX = CHUNKS rounded up to a power of two (TMA boxes are powers of
two): the load fills the chunks past the row's end with zeros and the store skips them.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma


@gluon.jit
def _load_row(src_desc, ring, bars, stage, row, ok):
    """Row ``row`` of the source into ring slot ``stage``, completing on ``bars[stage]`` (nothing when not ``ok``)."""
    bar = bars.index(stage)
    mbarrier.expect(bar, src_desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(src_desc, [row, 0, 0], bar, ring.index(stage), pred=ok)


@gluon.jit
def _source_row(idx_ptr, i, rows, GATHER: gl.constexpr):
    """The source row of step ``i`` and whether there is one: ``idx[i]`` (gather) or ``i`` (expand)."""
    ok = i < rows
    row = i
    if GATHER:
        row = gl.load(idx_ptr + i, mask=ok, other=0)
    return row, ok


@gluon.jit
def ring_copy_kernel(src_desc, dst_desc, idx_ptr, rows, GATHER: gl.constexpr, K: gl.constexpr,
                     STAGES: gl.constexpr):
    """GATHER: ``dst[i] = src[idx[i]]`` (K = 1); else ``dst[idx[i, k]] = src[i]`` for k < K (the
    expansion by top-k: a row loaded once, stored K times). Rows i = pid, pid + programs, ...;
    descriptors over [rows, CHUNKS, COLS] views with one-row boxes (module docstring), idx int32."""
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    ring = gl.allocate_shared_memory(src_desc.dtype, [STAGES] + src_desc.block_shape, src_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    fence_async_shared()  # the barriers' initialisation before the copy unit uses them
    steps = (rows - pid + programs - 1) // programs
    # STAGES - 1 rows in flight before the first store: the bytes in flight are what sets one SM's rate
    for p in gl.static_range(STAGES - 1):
        row, ok = _source_row(idx_ptr, pid + p * programs, rows, GATHER)
        _load_row(src_desc, ring, bars, p, row, ok)
    for j in range(steps):
        stage = j % STAGES
        mbarrier.wait(bars.index(stage), (j // STAGES) & 1)
        i = pid + j * programs
        for k in gl.static_range(K):
            if GATHER:
                dst_row = i
            else:
                dst_row = gl.load(idx_ptr + i * K + k)
            tma.async_copy_shared_to_global(dst_desc, [dst_row, 0, 0], ring.index(stage))
        # step j + STAGES - 1 refills the slot of step j - 1: only this step's K stores may still
        # be reading shared memory then
        tma.store_wait(K)
        nxt = j + STAGES - 1
        row, ok = _source_row(idx_ptr, pid + nxt * programs, rows, GATHER)
        _load_row(src_desc, ring, bars, nxt % STAGES, row, ok)
    tma.store_wait(0)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))


SMEM_BYTES = 232448  # shared memory one program may use on sm_90 (227 KB); the ring must fit


def row_box(row_elems: int) -> tuple[int, int, int]:
    """(CHUNKS, BOX, COLS) of a row of ``row_elems`` elements: COLS the largest power of two <= 256
    dividing it, CHUNKS = row_elems / COLS, BOX = CHUNKS rounded up to a power of two."""
    cols = min(row_elems & -row_elems, 256)
    chunks = row_elems // cols
    return chunks, 1 << (chunks - 1).bit_length(), cols


def max_stages(row_bytes: int, row_elems: int) -> int:
    """The most ring slots of rows of ``row_bytes`` bytes (their boxes) that fit one program's shared memory."""
    chunks, box, cols = row_box(row_elems)
    slot = row_bytes // chunks * box
    return (SMEM_BYTES - 1024) // slot  # 1 KB kept for the barriers and the compiler's own


def row_descriptor(t: torch.Tensor):
    """A TMA descriptor over contiguous ``t`` [N, W] seen as [N, CHUNKS, COLS], one row per box."""
    from triton.experimental.gluon.language._layouts import NVMMASharedLayout
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if t.dim() != 2 or not t.is_contiguous():
        raise ValueError(f"rows: expected a contiguous 2-d tensor, got {tuple(t.shape)} strides {t.stride()}")
    chunks, box, cols = row_box(t.shape[1])
    if cols * t.element_size() < 16:
        raise ValueError(f"rows of {t.shape[1]} x {t.element_size()} bytes: TMA needs 16-byte pieces")
    v = t.view(t.shape[0], chunks, cols)
    layout = NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=t.element_size() * 8, rank=3)
    return TensorDescriptor(v, list(v.shape), list(v.stride()), [1, box, cols], layout)


def ring_copy(src_desc, dst_desc, idx: torch.Tensor, rows: int, *, gather: bool, k: int, stages: int,
              programs: int, num_warps: int = 4) -> None:
    """Launches ``ring_copy_kernel`` over ``rows`` source rows (descriptors from ``row_descriptor``;
    ``idx`` int32 [rows] for a gather, [rows, k] for an expansion, on the same device)."""
    if stages < 2:
        raise ValueError(f"stages: expected at least 2 ring slots (one loading while one is stored), got {stages}")
    ring_copy_kernel[(programs,)](src_desc=src_desc, dst_desc=dst_desc, idx_ptr=idx, rows=rows, GATHER=gather,
                                  K=k, STAGES=stages, num_warps=num_warps)
