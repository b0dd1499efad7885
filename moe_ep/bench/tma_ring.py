"""Gluon kernels (sm_90+, GPU only): whole rows moved through a shared-memory ring by TMA.

Unlike the Triton kernels of moe_ep.kernels (registers hold the bytes in flight, a few rows per SM), a
program here keeps up to STAGES rows in shared memory (~200 KB per SM) with their loads in flight,
issued by one thread as bulk tensor copies (``cp.async.bulk.tensor``) that complete on an
mbarrier; each row is then stored to its K destinations by bulk copies straight from shared
memory, never through registers. Gluon (``triton.experimental.gluon``) does not run in Triton's
interpreter: these kernels are compiled for sm_90 on CPU by the tests (in a process without
TRITON_INTERPRET, which would swap Triton's own library functions for interpreted ones) and run on
GPUs only.

A row of W elements is seen as [CHUNKS, COLS] (COLS a power of two <= 256 dividing W) and moved
as one box [1, BOX, COLS] with BOX = CHUNKS rounded up to a power of two (TMA boxes are powers of
two): the load fills the chunks past the row's end with zeros and the store skips them.
"""
from __future__ import annotations

import torch
from triton import next_power_of_2 as pow2  # (Triton's own: moe_ep.core.workspace sits above this package)
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
def _ring_barriers(STAGES: gl.constexpr):
    """One mbarrier per ring slot (arrival count 1), initialised before the copy unit uses them."""
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    fence_async_shared()
    return bars


@gluon.jit
def _wait_slot(bars, j, STAGES: gl.constexpr):
    """Waits for step ``j``'s row in its ring slot (``j % STAGES``, in its ``j // STAGES``-th use); returns the slot."""
    stage = j % STAGES
    mbarrier.wait(bars.index(stage), (j // STAGES) & 1)
    return stage


@gluon.jit
def _ring_done(bars, STAGES: gl.constexpr):
    """The program's end: its stores done reading shared memory, the ring's mbarriers invalidated."""
    tma.store_wait(0)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))


@gluon.jit
def _k_offsets(BLOCK_K: gl.constexpr):
    """arange(BLOCK_K) held whole by every thread (a step's K destination rows, read as scalars)."""
    return gl.arange(0, BLOCK_K, layout=gl.BlockedLayout([BLOCK_K], [32], [gl.num_warps()], [0]))


@gluon.jit
def _source_row(idx_ptr, i, rows, GATHER: gl.constexpr):
    """The source row of step ``i`` and whether there is one: ``idx[i]`` (gather) or ``i`` (expand)."""
    ok = i < rows
    row = i
    if GATHER:
        row = gl.load(idx_ptr + i, mask=ok, other=0)
    return row, ok


@gluon.jit
def _dest_rows(idx_ptr, i, rows, offs_k, GATHER: gl.constexpr, K: gl.constexpr):
    """The K destination rows of step ``i`` of an expansion, ``idx[i, :]`` (every thread holds
    all of them; ``offs_k`` is arange(BLOCK_K), K padded to a power of two); zeros for a gather,
    whose destination is ``i`` itself."""
    if GATHER:
        return offs_k * 0
    return gl.load(idx_ptr + i * K + offs_k, mask=(offs_k < K) & (i < rows), other=0)


@gluon.jit
def ring_copy_kernel(src_desc, dst_desc, idx_ptr, rows, GATHER: gl.constexpr, K: gl.constexpr,
                     BLOCK_K: gl.constexpr, STAGES: gl.constexpr, BEHIND: gl.constexpr):
    """GATHER: ``dst[i] = src[idx[i]]`` (K = 1); else ``dst[idx[i, k]] = src[i]`` for k < K (the
    expansion by top-k: a row loaded once, stored K times). Rows i = pid, pid + programs, ...;
    descriptors over [rows, CHUNKS, COLS] views with one-row boxes (module docstring), idx int32.
    Of the STAGES ring slots, BEHIND (>= 1, this step's included) hold rows whose stores may still
    be reading them and the rest rows being loaded. (Measured on an H200, docs/performance-log/gpu.md
    "Ninth pass": neither STAGES nor BEHIND changes the rate; a gather moves ~0.47 us a row per
    program at 32 programs, for 7168- and 14336-byte rows alike.)"""
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    ring = gl.allocate_shared_memory(src_desc.dtype, [STAGES] + src_desc.block_shape, src_desc.layout)
    bars = _ring_barriers(STAGES)
    offs_k = _k_offsets(BLOCK_K)
    steps = (rows - pid + programs - 1) // programs
    AHEAD: gl.constexpr = STAGES - BEHIND  # rows in flight towards shared memory
    for p in gl.static_range(AHEAD):
        row, ok = _source_row(idx_ptr, pid + p * programs, rows, GATHER)
        _load_row(src_desc, ring, bars, p, row, ok)
    # Every index is loaded one step before it is used, so no step waits on an index load (measured:
    # the same rate as loading each where it is used).
    src_next, ok_next = _source_row(idx_ptr, pid + AHEAD * programs, rows, GATHER)
    dst = _dest_rows(idx_ptr, pid, rows, offs_k, GATHER, K)
    for j in range(steps):
        i = pid + j * programs
        dst_next = _dest_rows(idx_ptr, i + programs, rows, offs_k, GATHER, K)
        stage = _wait_slot(bars, j, STAGES)
        for k in gl.static_range(K):
            if GATHER:
                dst_row = i
            else:
                dst_row = gl.sum(gl.where(offs_k == k, dst, 0), axis=0)
            tma.async_copy_shared_to_global(dst_desc, [dst_row, 0, 0], ring.index(stage))
        # the stores of step j - BEHIND are done reading: their slot takes step j - BEHIND + STAGES
        tma.store_wait(K * BEHIND)
        nxt = j + AHEAD
        _load_row(src_desc, ring, bars, nxt % STAGES, src_next, ok_next)
        src_next, ok_next = _source_row(idx_ptr, pid + (nxt + 1) * programs, rows, GATHER)
        dst = dst_next
    _ring_done(bars, STAGES)


@gluon.jit
def ring_fp8_expand_kernel(src_desc, dst_desc, scale_ptr, idx_ptr, rows, scale_stride, CHUNKS: gl.constexpr,
                           K: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, QBUFS: gl.constexpr):
    """The dispatch's own-row work with whole rows in shared memory: bf16 row ``i`` (descriptor over
    [rows, CHUNKS, 128]) quantized to fp8 e4m3 per 128-channel block (``x * (448 / amax)``, scale
    ``amax / 448``) and stored to rows ``idx[i, k]`` for k < K (fp8 descriptor over [N, CHUNKS, 128];
    the CHUNKS float32 scales at ``scale_ptr + row * scale_stride``). Loads run STAGES rows ahead
    into a ring; the quantized row goes through one of QBUFS staging buffers, so the K stores of
    QBUFS - 1 rows stay in flight while the next row is quantized."""
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    BOX: gl.constexpr = src_desc.block_shape[1]
    ring = gl.allocate_shared_memory(src_desc.dtype, [STAGES] + src_desc.block_shape, src_desc.layout)
    qbuf = gl.allocate_shared_memory(dst_desc.dtype, [QBUFS] + dst_desc.block_shape, dst_desc.layout)
    bars = _ring_barriers(STAGES)
    # a thread holds 8 consecutive channels (16-byte shared loads), 16 threads a 128-channel block
    x_layout: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 2, 16], [1, gl.num_warps(), 1], [2, 1, 0])
    s_layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, gl.num_warps()], [1, 0])
    chunk = gl.arange(0, BOX, layout=gl.SliceLayout(0, s_layout))[None, :]
    offs_k = _k_offsets(BLOCK_K)
    steps = (rows - pid + programs - 1) // programs
    for p in gl.static_range(STAGES):
        _load_row(src_desc, ring, bars, p, pid + p * programs, pid + p * programs < rows)
    dst = _dest_rows(idx_ptr, pid, rows, offs_k, False, K)
    for j in range(steps):
        i = pid + j * programs
        dst_next = _dest_rows(idx_ptr, i + programs, rows, offs_k, False, K)
        stage = _wait_slot(bars, j, STAGES)
        x = ring.index(stage).load(x_layout).to(gl.float32)
        # the box's chunks past the row's end were filled with zeros: their NaN is never stored
        amax = gl.max(gl.abs(x), axis=2)
        inv = gl.div_rn(gl.full_like(amax, 448.0), amax)
        q = (x * gl.expand_dims(inv, 2)).to(dst_desc.dtype)
        scale = gl.convert_layout(gl.div_rn(amax, gl.full_like(amax, 448.0)), s_layout)
        b = j % QBUFS
        tma.store_wait(K * (QBUFS - 1))  # buffer b's stores (QBUFS steps back) are done reading it
        qbuf.index(b).store(q)
        fence_async_shared()  # these shared-memory writes before the copy unit reads them
        gl.thread_barrier()  # every thread's part stored, and every thread done reading ring slot `stage`
        for k in gl.static_range(K):
            d = gl.sum(gl.where(offs_k == k, dst, 0), axis=0)
            tma.async_copy_shared_to_global(dst_desc, [d, 0, 0], qbuf.index(b))
            gl.store(scale_ptr + d.to(gl.int64) * scale_stride + chunk, scale, mask=chunk < CHUNKS)
        nxt = i + STAGES * programs
        _load_row(src_desc, ring, bars, stage, nxt, nxt < rows)
        dst = dst_next
    _ring_done(bars, STAGES)


SMEM_BYTES = 232448  # shared memory one program may use on sm_90 (227 KB); the ring must fit


def row_box(row_elems: int) -> tuple[int, int, int]:
    """(CHUNKS, BOX, COLS) of a row of ``row_elems`` elements: COLS the largest power of two <= 256
    dividing it, CHUNKS = row_elems / COLS, BOX = CHUNKS rounded up to a power of two."""
    cols = min(row_elems & -row_elems, 256)
    chunks = row_elems // cols
    return chunks, pow2(chunks), cols


def max_stages(row_bytes: int, row_elems: int) -> int:
    """The most ring slots of rows of ``row_bytes`` bytes (their boxes) that fit one program's shared memory."""
    chunks, box, cols = row_box(row_elems)
    slot = row_bytes // chunks * box
    return (SMEM_BYTES - 1024) // slot  # 1 KB kept for the barriers and the compiler's own


def fp8_stages(hidden: int, qbufs: int) -> int:
    """Ring slots of ``ring_fp8_expand_kernel`` for bf16 rows of ``hidden`` channels that fit with
    its ``qbufs`` fp8 staging buffers."""
    box = pow2(hidden // 128)
    return (SMEM_BYTES - 1024 - qbufs * box * 128) // (box * 128 * 2)


def chunk_descriptor(t: torch.Tensor):
    """A TMA descriptor over ``t`` [N, H] (rows may be strided, channels contiguous, H % 128 == 0)
    seen as [N, H / 128, 128]: one row per box, 128-channel blocks."""
    from triton.experimental.gluon.language._layouts import NVMMASharedLayout
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    N, H = t.shape
    if H % 128 or t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16:
        raise ValueError(f"rows: expected [N, H] with H % 128 == 0, contiguous channels and 16-byte row "
                         f"strides, got {tuple(t.shape)} strides {t.stride()}")
    chunks = H // 128
    layout = NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=t.element_size() * 8, rank=3)
    return TensorDescriptor(t, [N, chunks, 128], [t.stride(0), 128, 1], [1, pow2(chunks), 128],
                            layout)


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


def ring_fp8_expand(x: torch.Tensor, rows_out: torch.Tensor, idx: torch.Tensor, *, qbufs: int, programs: int,
                    num_warps: int = 4) -> None:
    """Launches ``ring_fp8_expand_kernel``: bf16 ``x`` [R, H] quantized into ``rows_out`` uint8
    [N, H + 4 * H / 128] (fp8 payload, then the float32 scales: the dispatch's wire row) at rows
    ``idx`` int32 [R, K] (values < N); all on one GPU; ``qbufs`` >= 2 staging buffers, the ring as
    many slots as fit beside them."""
    if qbufs < 2:
        raise ValueError(f"qbufs: expected at least 2 staging buffers, got {qbufs}")
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise ValueError(f"x: expected bfloat16 [R, H], got {x.dtype} {tuple(x.shape)}")
    R, H = x.shape
    _check_idx(idx, (R, idx.shape[-1]), x.device)
    if rows_out.dtype != torch.uint8 or rows_out.shape[1] != H + 4 * (H // 128) or not rows_out.is_contiguous():
        raise ValueError(f"rows_out: expected contiguous uint8 [N, {H + 4 * (H // 128)}], got "
                         f"{rows_out.dtype} {tuple(rows_out.shape)}")
    src = chunk_descriptor(x)
    dst = chunk_descriptor(rows_out.view(torch.float8_e4m3fn)[:, :H])
    scales = rows_out.view(torch.float32)[:, H // 4:]
    K = idx.shape[1]
    ring_fp8_expand_kernel[(programs,)](src_desc=src, dst_desc=dst, scale_ptr=scales, idx_ptr=idx, rows=R,
                                        scale_stride=rows_out.shape[1] // 4, CHUNKS=H // 128, K=K, BLOCK_K=pow2(K),
                                        STAGES=fp8_stages(H, qbufs), QBUFS=qbufs, num_warps=num_warps)


def _check_idx(idx: torch.Tensor, shape: tuple, device: torch.device) -> None:
    """ValueError naming ``idx`` unless it is a contiguous int32 tensor of ``shape`` on ``device``."""
    if idx.dtype != torch.int32 or tuple(idx.shape) != shape or not idx.is_contiguous() or idx.device != device:
        raise ValueError(f"idx: expected contiguous int32 {list(shape)} on {device}, got {idx.dtype} "
                         f"{tuple(idx.shape)} on {idx.device}")


def ring_copy(src_desc, dst_desc, idx: torch.Tensor, rows: int, *, gather: bool, k: int, stages: int,
              behind: int, programs: int, num_warps: int = 4) -> None:
    """Launches ``ring_copy_kernel`` over ``rows`` source rows (descriptors from ``row_descriptor``;
    ``idx`` int32 [rows] for a gather, [rows, k] for an expansion, on the same device)."""
    _check_idx(idx, (rows,) if gather else (rows, k), idx.device)
    if not 1 <= behind < stages:
        raise ValueError(f"stages, behind: expected 1 <= behind < stages (slots being stored, the rest loading), "
                         f"got stages={stages}, behind={behind}")
    ring_copy_kernel[(programs,)](src_desc=src_desc, dst_desc=dst_desc, idx_ptr=idx, rows=rows, GATHER=gather,
                                  K=k, BLOCK_K=pow2(k), STAGES=stages, BEHIND=behind, num_warps=num_warps)
