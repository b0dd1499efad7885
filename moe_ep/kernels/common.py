"""Triton helpers shared by the kernels: flags with deadlines, error records, rounding casts.

Every helper runs on a GPU and under TRITON_INTERPRET=1 on a CPU; ``INTERP`` (constexpr) picks
the form that is right in each place.
"""
import triton
import triton.language as tl

from ..core.errors import ErrorCode, Phase

# Error record (int64[8], host-visible): [code, peer, phase, epoch, detail, ...]; the codes and
# phases are moe_ep.core.errors' (the host decodes the record by the same names).
ERR_NONE = tl.constexpr(int(ErrorCode.NONE))
ERR_TIMEOUT = tl.constexpr(int(ErrorCode.TIMEOUT))
ERR_BAD_EXPERT = tl.constexpr(int(ErrorCode.BAD_EXPERT))
ERR_CAPACITY = tl.constexpr(int(ErrorCode.CAPACITY))
ERR_PROXY = tl.constexpr(int(ErrorCode.PROXY))  # the proxy recorded an error (its mailbox has the details)

ABORT_FLAG = tl.constexpr(1 << 62)  # a comb_flag value above every epoch: the owner overflowed (abort_combines)
NAN_SCALE_BITS = tl.constexpr(0x7FC00000)  # moe_ep.core.fp8: a block with a non-finite value
NAN_BYTE = tl.constexpr(0x7F)
RECIP_448 = tl.constexpr(0.0022321429569274187)  # float32 0x3B124925, RN(1 / 448): exact as a float32 literal

PHASE_DISPATCH = tl.constexpr(int(Phase.DISPATCH))
PHASE_COMBINE = tl.constexpr(int(Phase.COMBINE))
# The most bytes one prefetch_l2 asks for: the instruction's size field holds 16-bit counts of 16 bytes.
PREFETCH_MAX = tl.constexpr(0xFFFF * 16)
# store_own_rows unrolls its channel loop when a row has at most this many tiles.
UNROLL_TILES = tl.constexpr(8)


@triton.jit
def ptr_at(base, off: tl.constexpr, TYPE: tl.constexpr):
    """Pointer to TYPE at byte address ``base + off``. Workspaces are 256-byte aligned and so are
    region offsets: saying so lets the compiler use 16-byte vector loads and stores (without the
    hint every element of a peer store is its own NVLink transaction)."""
    return tl.multiple_of((base + off).to(tl.pointer_type(TYPE)), 16)


@triton.jit
def record_error(err_ptr, code, peer, phase, epoch, detail):
    """First error wins: later ones (other programs, other kernels) leave the record alone."""
    old = tl.atomic_cas(err_ptr, tl.full([], 0, tl.int64), tl.full([], code, tl.int64), sem="relaxed",
                        scope="sys")
    if old == 0:
        tl.store(err_ptr + 1, peer)
        tl.store(err_ptr + 2, phase)
        tl.store(err_ptr + 3, epoch)
        tl.store(err_ptr + 4, detail)


@triton.jit
def raise_flag(flag_ptr, epoch):
    """Publishes everything this program wrote before, then the flag (single writer, monotonic:
    an atomic max, so an ``ABORT_FLAG`` value already there outranks every epoch and stays)."""
    tl.atomic_max(flag_ptr, epoch.to(tl.int64), sem="release", scope="sys")


@triton.jit
def abort_combines(peer_ptr, info, off_cflag: tl.constexpr, RANK: tl.constexpr, N: tl.constexpr,
                   CMAX: tl.constexpr):
    """A masked-layout overflow on this rank: every chunk flag this rank owns in every node peer's
    ``comb_flag`` becomes ``ABORT_FLAG | info`` (``info`` = global expert << 32 | rows), so their
    combine does not wait for a combine this rank will not run, and raises ``CapacityError``
    naming this rank and the expert instead."""
    cc = tl.arange(0, CMAX)
    val = tl.full((CMAX,), ABORT_FLAG, tl.int64) + info
    for d in tl.static_range(N):
        tl.atomic_max(ptr_at(tl.load(peer_ptr + d), off_cflag, tl.int64) + RANK * CMAX + cc, val, sem="release",
                      scope="sys")


@triton.jit
def deadline_start(INTERP: tl.constexpr):
    """The launch's start on the GPU's global timer (ns), from which every wait's deadline runs
    (0 under the interpreter, where the host keeps the deadline)."""
    if INTERP:
        return tl.full([], 0, tl.int64)
    else:
        return tl.extra.cuda.globaltimer()


@triton.jit
def prefetch_l2(ptr, nbytes, INTERP: tl.constexpr):
    """Asks the L2 cache to fetch the bytes ``[ptr, ptr + nbytes)`` (``ptr``: a scalar pointer of
    any type; only the 16-byte-aligned part inside is asked for, at most ``PREFETCH_MAX`` bytes).
    A hint: one bulk prefetch by thread 0 (sm_90 ``cp.async.bulk.prefetch.L2``), no registers held
    and nothing waited for, so a loop's later loads of these bytes hit the L2 instead of waiting on
    HBM. Nothing under the interpreter."""
    if not INTERP:
        a = ptr.to(tl.int64, bitcast=True)
        lo = (a + 15) & -16
        n = tl.minimum(((a + nbytes) & -16) - lo, PREFETCH_MAX)
        tl.inline_asm_elementwise(
            """{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0;
            setp.gt.and.s32 p, $2, 0, p; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }""",
            "=r,l,r", [lo, n.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def own_prefetch(x_ptr, t0, n, H: tl.constexpr, INTERP: tl.constexpr):
    """``prefetch_l2`` of the ``n`` rows of ``x`` (``[T, H]``, any element type) from token ``t0``
    (contiguous: a chunk's own tokens); nothing for ``n <= 0``."""
    if n > 0:
        prefetch_l2(x_ptr + t0.to(tl.int64) * H, n * (H * (x_ptr.dtype.element_ty.primitive_bitwidth // 8)), INTERP)


@triton.jit
def wait_flag(flag_ptr, epoch, t0_ns, timeout_ns, err_ptr, peer, phase, INTERP: tl.constexpr):
    """Waits until ``*flag_ptr >= epoch`` (acquire, system scope) or ``timeout_ns`` after ``t0_ns``.

    Returns 1 when the flag arrived, 0 on timeout (the error record names peer and phase). One
    deadline for the whole launch, however many flags it waits for. Under the interpreter the host
    has already waited with its own deadline, so one look suffices (programs run one after another
    there: spinning could never see a later write).
    """
    v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    ok = (v >= epoch).to(tl.int32)
    if not INTERP:
        late = tl.full([], 0, tl.int32)
        while (ok == 0) & (late == 0):
            v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
            ok = (v >= epoch).to(tl.int32)
            late = ((tl.extra.cuda.globaltimer() - t0_ns) > timeout_ns).to(tl.int32)
    if ok == 0:
        record_error(err_ptr, ERR_TIMEOUT, peer, phase, epoch, 0)
    return ok


@triton.jit
def chunking(T, CMAX: tl.constexpr):
    """(tokens per chunk, chunks) of a source with ``T`` tokens: ``BT = max(1, ceil(T / CMAX))``,
    ``NC = ceil(T / BT)``; the same rule as ``moe_ep.core.workspace.chunking`` on the host."""
    BT = tl.maximum((T + CMAX - 1) // CMAX, 1)
    return BT, (T + BT - 1) // BT


@triton.jit
def to_bf16(x, INTERP: tl.constexpr):
    """float32 -> bfloat16 rounded to nearest even (the interpreter's own cast truncates)."""
    if INTERP:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def payload_tile(x_ptr, xs_ptr, t, hh, hm, bb, bm, H: tl.constexpr, NB: tl.constexpr, FP8: tl.constexpr,
                 PREQ: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, INTERP: tl.constexpr):
    """One tile of dispatch payload for tokens ``t`` and channels ``hh`` (masks ``hm``; for fp8 the
    128-channel blocks ``bb``, mask ``bm``): ``quantize_tile(load_tile(...))``. The one place both
    the node send and the remote pack get their payload from."""
    v, s = load_tile(x_ptr, xs_ptr, t, hh, hm, bb, bm, H, NB, FP8, PREQ)
    return quantize_tile(v, s, FP8, PREQ, BLOCK_T, BLOCK_H, INTERP)


@triton.jit
def load_tile(x_ptr, xs_ptr, t, hh, hm, bb, bm, H: tl.constexpr, NB: tl.constexpr, FP8: tl.constexpr,
              PREQ: tl.constexpr):
    """The loads of a ``payload_tile``: ``x[t, hh]`` (bf16, or fp8 bytes when PREQ) and, when
    PREQ, ``x_scales[t, bb]`` (else the same values again, unused). Apart from the quantization so
    that a loop can issue the next tile's loads before it works on this one."""
    if FP8 and PREQ:
        return (tl.load(x_ptr + t[:, None] * H + hh[None, :], mask=hm, other=0),
                tl.load(xs_ptr + t[:, None] * NB + bb[None, :], mask=bm, other=0.0))
    else:
        v = tl.load(x_ptr + t[:, None] * H + hh[None, :], mask=hm, other=0.0)
        return v, v


@triton.jit
def quantize_tile(v, s, FP8: tl.constexpr, PREQ: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                  INTERP: tl.constexpr, FLAT: tl.constexpr = False):
    """A loaded tile (``load_tile``) as payload: bf16 values (returned twice), or fp8 bits (uint8)
    and their float32 scales. fp8 is quantized here (``moe_ep.core.fp8``: ``scale = max(amax, 1e-4) / 448``
    per 128 channels, ``q = rne(x * (448 / amax))``; a block with a NaN or an infinity all NaN)
    unless PREQ, where bytes and scales travel as given. ``FLAT`` (quantized here only): the
    scales as ``[BLOCK_T * BLOCK_H // 128]``, one per block in the layout of the block maxima
    (``per_block`` gives other values that layout), not ``[BLOCK_T, BLOCK_H // 128]``."""
    if FP8 and not PREQ:
        vb = tl.reshape(v.to(tl.float32), (BLOCK_T * BLOCK_H // 128, 128))
        if INTERP:  # the interpreter's max drops NaN (np.nanmax): test the exponent bits per element
            raw = tl.max(tl.abs(vb), axis=1)
            exp_ones = (vb.to(tl.uint32, bitcast=True) & 0x7F800000) == 0x7F800000
            bad = tl.max(exp_ones.to(tl.int32), axis=1) > 0
        else:  # one NaN-propagating max per element (max.NaN.f32): NaN or inf in the block <=> not finite
            raw = tl.reduce(tl.abs(vb), 1, _max_nan)
            bad = ~(raw <= 3.4028234663852886e38)
        scf, inv = block_scale(tl.maximum(raw, 1e-4), INTERP)
        # A block with a NaN or an infinity is NaN as a whole, scale and bytes (moe_ep.core.fp8).
        nan = tl.full(scf.shape, NAN_SCALE_BITS, tl.int32).to(tl.float32, bitcast=True)
        scf = tl.where(bad, nan, scf)
        if INTERP:  # the bit-level conversion does not map NaN to NaN: select the bytes
            qf = vb * tl.broadcast_to(inv[:, None], vb.shape)
            q = tl.where(bad[:, None], tl.full(vb.shape, NAN_BYTE, tl.uint8), to_fp8(qf, INTERP))
        else:  # a NaN factor makes every product NaN, which the hardware conversion maps to 0x7F:
            # no per-element select (with its byte unpacking, a quarter of the loop's instructions)
            qf = vb * tl.broadcast_to(tl.where(bad, nan, inv)[:, None], vb.shape)
            q = to_fp8(qf, INTERP)
        if FLAT:
            return tl.reshape(q, (BLOCK_T, BLOCK_H)), scf
        else:
            return tl.reshape(q, (BLOCK_T, BLOCK_H)), tl.reshape(scf, (BLOCK_T, BLOCK_H // 128))
    else:
        return v, s


@triton.jit
def block_scale(amax, INTERP: tl.constexpr):
    """float32 block maxima (>= 1e-4, finite) -> ``(amax / 448, 448 / amax)``, both correctly
    rounded (``moe_ep.core.fp8``'s scale and DeepEP's factor ``x * (448 / amax)``): exact divisions
    once per block, then one multiply per element (a per-element division cost ~100 us of a
    4096-token dispatch at 32 SMs). On a GPU neither needs the division's range check and slow
    path (together a tenth of the own-row loop's issue); both are checked equal to IEEE division
    for every float32 amax >= 1e-4 (tests/test_fp8.py). A non-finite amax gives values of no
    meaning: ``quantize_tile`` replaces both with NaN for such a block (test_nonfinite_input*)."""
    if INTERP:
        return (tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)),
                tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax))
    else:
        # amax / 448: one correction of amax * RN(1/448).
        q0 = amax * RECIP_448
        scf = tl.fma(tl.fma(q0, -448.0, amax), RECIP_448, q0)
        # 448 / amax as 1.75 / (amax / 256), the same quotient: with the divisor scaled down its
        # reciprocal is normal for every finite amax, so the fast path (a refined reciprocal,
        # then one correction of the quotient) holds throughout.
        inv = tl.inline_asm_elementwise(
            """{ .reg .f32 s, r, e, q;
            mul.rn.f32 s, $1, 0f3B800000;
            rcp.approx.ftz.f32 r, s;
            neg.f32 s, s;
            fma.rn.f32 e, s, r, 0f3F800000;
            fma.rn.f32 r, r, e, r;
            mul.rn.f32 q, r, 0f3FE00000;
            fma.rn.f32 e, s, q, 0f3FE00000;
            fma.rn.f32 $0, e, r, q; }""", "=r,r", [amax], dtype=tl.float32, is_pure=True, pack=1)
        return scf, inv


@triton.jit
def first_own_tile(x_ptr, xs_ptr, t, tm, H: tl.constexpr, NB: tl.constexpr, FP8: tl.constexpr, PREQ: tl.constexpr,
                   BLOCK_H: tl.constexpr):
    """The loads of the first tile ``store_own_rows`` stores (tokens ``t``, mask ``tm``): a
    receiver issues them as soon as it knows the chunk's tokens, before it reads the chunk's
    metadata, so their latency hides behind that."""
    hh, hm, bb, bm = payload_cols(0, tm, H, NB, FP8, BLOCK_H)
    return load_tile(x_ptr, xs_ptr, t, hh, hm, bb, bm, H, NB, FP8, PREQ)


@triton.jit
def scale_ptr(ptr, row, b, NB: tl.constexpr, CM_ROWS: tl.constexpr):
    """Address of scale block ``b`` of expert-layout row ``row`` in ``expert_scales`` (``ptr``):
    row-major ``[rows, NB]`` when ``CM_ROWS`` is 0; else column-major within each block of
    ``CM_ROWS`` rows (``[rows / CM_ROWS, NB, CM_ROWS]``: a masked layout's expert blocks, the
    scale layout DeepEP's low-latency dispatch returns and grouped GEMMs read by TMA). (The
    row-major sum keeps the order of the stores it replaced: the same SASS.)"""
    if CM_ROWS == 0:
        return ptr + row * NB + b
    else:
        return ptr + (row // CM_ROWS) * (NB * CM_ROWS) + b * CM_ROWS + row % CM_ROWS


@triton.jit
def store_own_rows(v, vs, nt, nm, x_ptr, xs_ptr, t, tm, r, kk, out_x_ptr, out_s_ptr, KS: tl.constexpr,
                   H: tl.constexpr, NB: tl.constexpr, FP8: tl.constexpr, PREQ: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_H: tl.constexpr, INTERP: tl.constexpr, CM_ROWS: tl.constexpr):
    """A rank's own tokens ``t`` (mask ``tm``) straight from ``x`` into the expert layout: each
    tile read (and quantized) once, stored as rows ``r[:, k]`` (int64 [BLOCK_T, BLOCK_K], -1:
    none) for ``k < KS`` of ``expert_x`` (``out_x_ptr`` of any element type: bytes for fp8, bf16
    otherwise) and, for fp8, of ``expert_scales`` (float32, at ``scale_ptr``). ``v, vs``: the first
    tile, from ``first_own_tile``. Returns the first tile of the tokens ``nt`` (mask ``nm``, all
    false for none), loaded by the last step: the next call's ``v, vs`` when a caller goes on
    with more tokens (a rows chunk's next sub-block) without a gap in the loads."""
    # One row per token (KS = 1, fp8 quantized here): the scales are stored from the layout the
    # block maxima come in, with pointers made in it once per call; converting the scales to the
    # tile's layout instead costs a trip through shared memory and two CTA barriers per tile.
    FLAT: tl.constexpr = FP8 and (not PREQ) and KS == 1 and CM_ROWS == 0
    if FLAT:
        row0 = tl.sum(tl.where(kk[None, :] == 0, r, 0), axis=1)
        hl = tl.arange(0, BLOCK_H)
        srow = per_block(tl.broadcast_to(row0[:, None], (BLOCK_T, BLOCK_H)), BLOCK_T, BLOCK_H)
        sblk = per_block(tl.broadcast_to((hl // 128)[None, :], (BLOCK_T, BLOCK_H)), BLOCK_T, BLOCK_H)
        sptr = out_s_ptr + srow * NB + sblk
    else:
        sptr, srow, sblk = out_s_ptr, 0, 0
    if KS == 1 and H // BLOCK_H <= UNROLL_TILES:
        # One row per token and few tiles a row (rows layout: 7 of 1024 channels at hidden
        # 7168): unrolled, so each step's columns, masks and offsets are constants and no loop
        # state is carried. The loop was issue-bound there: fp8 at 32 warps, ~115 SASS
        # instructions a thread a step against ~165 as a loop (~95 with block_scale). (With K
        # rows per token the unrolled steps' row pointers spill.)
        for h0 in tl.static_range(0, H, BLOCK_H):
            v, vs = _own_rows_step(v=v, vs=vs, nt=nt, nm=nm, x_ptr=x_ptr, xs_ptr=xs_ptr, t=t, tm=tm, r=r, kk=kk,
                                   out_x_ptr=out_x_ptr, out_s_ptr=out_s_ptr, sptr=sptr, srow=srow, sblk=sblk, h0=h0,
                                   last=h0 + BLOCK_H >= H, KS=KS, H=H, NB=NB, FP8=FP8, PREQ=PREQ, BLOCK_T=BLOCK_T,
                                   BLOCK_H=BLOCK_H, INTERP=INTERP, FLAT=FLAT, STATIC=True, CM_ROWS=CM_ROWS)
    else:
        for h0 in range(0, H, BLOCK_H):
            v, vs = _own_rows_step(v=v, vs=vs, nt=nt, nm=nm, x_ptr=x_ptr, xs_ptr=xs_ptr, t=t, tm=tm, r=r, kk=kk,
                                   out_x_ptr=out_x_ptr, out_s_ptr=out_s_ptr, sptr=sptr, srow=srow, sblk=sblk, h0=h0,
                                   last=h0 + BLOCK_H >= H, KS=KS, H=H, NB=NB, FP8=FP8, PREQ=PREQ, BLOCK_T=BLOCK_T,
                                   BLOCK_H=BLOCK_H, INTERP=INTERP, FLAT=FLAT, STATIC=False, CM_ROWS=CM_ROWS)
    return v, vs


@triton.jit
def _own_rows_step(v, vs, nt, nm, x_ptr, xs_ptr, t, tm, r, kk, out_x_ptr, out_s_ptr, sptr, srow, sblk, h0, last,
                   KS: tl.constexpr, H: tl.constexpr, NB: tl.constexpr, FP8: tl.constexpr, PREQ: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, INTERP: tl.constexpr, FLAT: tl.constexpr,
                   STATIC: tl.constexpr, CM_ROWS: tl.constexpr):
    """One step of ``store_own_rows``: tile ``h0`` (``v, vs``, loaded) quantized and stored;
    returns the next tile, whose loads go out first so that their latency hides behind this
    tile's work (a program keeps two tiles in flight, not one); after the last tile (``last``),
    the next tokens' first one. ``STATIC``: ``h0`` and ``last`` are constants (unrolled loop)."""
    if STATIC:
        if last:
            vn, vsn = load_tile(x_ptr, xs_ptr, nt, *payload_cols(0, nm, H, NB, FP8, BLOCK_H, BLOCK_H <= H), H, NB,
                                FP8, PREQ)
        else:
            vn, vsn = load_tile(x_ptr, xs_ptr, t, *payload_cols(h0 + BLOCK_H, tm, H, NB, FP8, BLOCK_H,
                                                                h0 + 2 * BLOCK_H <= H), H, NB, FP8, PREQ)
        hh, hm, bb, bm = payload_cols(h0, tm, H, NB, FP8, BLOCK_H, h0 + BLOCK_H <= H)
    else:
        tn = tl.where(last, nt, t)
        hn, hnm, bn, bnm = payload_cols(tl.where(last, 0, h0 + BLOCK_H), tl.where(last, nm, tm), H, NB, FP8, BLOCK_H)
        vn, vsn = load_tile(x_ptr, xs_ptr, tn, hn, hnm, bn, bnm, H, NB, FP8, PREQ)
        hh, hm, bb, bm = payload_cols(h0, tm, H, NB, FP8, BLOCK_H)
    q, sc = quantize_tile(v, vs, FP8, PREQ, BLOCK_T, BLOCK_H, INTERP, FLAT)
    if FLAT:
        store_in_place(sptr + h0 // 128, sc, (srow >= 0) & (h0 // 128 + sblk < NB), INTERP)
    for k in tl.static_range(KS):
        row = tl.sum(tl.where(kk[None, :] == k, r, 0), axis=1)
        go = (row >= 0)[:, None]
        if FP8:
            # Streaming stores (.cs): the layout is written once and read after the launch, so
            # it need not stay in cache (3% at prefill, 32 programs, against plain stores).
            tl.store(out_x_ptr.to(tl.pointer_type(tl.uint8)) + row[:, None] * H + hh[None, :], q, mask=hm & go,
                     cache_modifier=".cs")
            if not FLAT:
                tl.store(scale_ptr(out_s_ptr, row[:, None], bb[None, :], NB, CM_ROWS), sc, mask=bm & go,
                         cache_modifier=".cs")
        else:
            tl.store(out_x_ptr.to(tl.pointer_type(tl.bfloat16)) + row[:, None] * H + hh[None, :], q,
                     mask=hm & go, cache_modifier=".cs")
    return vn, vsn


@triton.jit
def own_rows_in_blocks(v, vs, s, c, hdr, kk, io, DIM: tl.constexpr, MODE: tl.constexpr, TILE: tl.constexpr,
                       KS: tl.constexpr, CM_ROWS: tl.constexpr):
    """Chunk ``c`` of this rank's own rows (source ``s``), ``store_own_rows`` in sub-blocks of
    ``BLOCK_TS`` tokens (tiles of ``BLOCK_HS`` channels), each token stored as ``KS`` rows: 1 (rows
    layout: ``recv_pos[s, t, 0]``) or K (masked, packed: ``recv_pos[s, t, :K]``). A large chunk
    pays its metadata once, and its payload still moves in the tiles of a small one. Each
    sub-block's rows come back from ``recv_pos`` (stored by the whole program before the call),
    one sub-block ahead; each sub-block's last step loads the next one's first tile, so the loads
    never stop between sub-blocks. ``v, vs``: the first sub-block's first tile. ``PREFETCH`` > 0:
    sub-block ``b + PREFETCH`` is asked of the L2 when sub-block ``b`` starts (the kernel's start
    asked for the first ones of a program's first chunk), so the loop's loads hit the L2: more
    bytes in flight than its registers hold."""
    tl.debug_barrier()  # every thread's recv_pos stores of this chunk before they are read back
    ts = tl.load(hdr + s * DIM.HDR)
    BT = chunking(ts, DIM.CMAX)[0]
    ar = tl.arange(0, TILE.BLOCK_TS)
    rpos = io.recv_pos_ptr + (s * DIM.M + c * BT).to(tl.int64) * DIM.K
    row = _sub_block_rows(rpos, ar, (ar < BT) & (c * BT + ar < ts), kk, DIM.K, KS)
    end = tl.minimum(BT, ts - c * BT)
    for b in range(0, BT, TILE.BLOCK_TS):
        if TILE.PREFETCH > 0:
            ahead = b + TILE.PREFETCH * TILE.BLOCK_TS
            own_prefetch(io.x_ptr, c * BT + ahead, tl.minimum(TILE.BLOCK_TS, end - ahead), DIM.H, MODE.INTERP)
        tb = c * BT + b + ar
        nxt = b + TILE.BLOCK_TS + ar
        nm = (nxt < BT) & (c * BT + nxt < ts)
        row_n = _sub_block_rows(rpos, nxt, nm, kk, DIM.K, KS)  # the next sub-block's rows, in flight meanwhile
        r = row.to(tl.int64)
        if KS == 1:
            r, has = tl.where(kk[None, :] == 0, r[:, None], -1), r >= 0
        else:
            has = tl.max(r, axis=1) >= 0
        v, vs = store_own_rows(v=v, vs=vs, nt=c * BT + nxt, nm=nm, x_ptr=io.x_ptr, xs_ptr=io.xs_ptr, t=tb, tm=has, r=r,
                               kk=kk, out_x_ptr=io.out_x_ptr, out_s_ptr=io.out_s_ptr, KS=KS, H=DIM.H, NB=DIM.NB,
                               FP8=MODE.FP8, PREQ=MODE.PREQ, BLOCK_T=TILE.BLOCK_TS, BLOCK_H=TILE.BLOCK_HS,
                               INTERP=MODE.INTERP, CM_ROWS=CM_ROWS)
        row = row_n


@triton.jit
def _sub_block_rows(rpos, a, m, kk, K: tl.constexpr, KS: tl.constexpr):
    """``recv_pos`` rows of the sub-block tokens ``a`` (mask ``m``; -1: none): [BLOCK_TS] int32
    for ``KS`` = 1 (each token's first), [BLOCK_TS, BLOCK_K] for ``KS`` = K."""
    if KS == 1:
        return tl.load(rpos + a * K, mask=m, other=-1)
    else:
        return tl.load(rpos + a[:, None] * K + kk[None, :], mask=m[:, None] & (kk[None, :] < KS), other=-1)


@triton.jit
def store_in_place(ptr, val, mask, INTERP: tl.constexpr):
    """``tl.store(ptr, val, mask=mask)`` (float32, streaming) in the layout ``val`` comes in.
    ``tl.store`` gives a store a layout of its own, and a value from a reduction then goes there
    through shared memory between two CTA barriers; here each thread stores what it holds (a
    value several threads hold is stored by each: the same bytes to the same address)."""
    if INTERP:
        tl.store(ptr, val, mask=mask)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.cs.f32 [$1], $2; mov.b32 $0, 0; }",
            "=r,l,f,r", [ptr.to(tl.uint64, bitcast=True), val, mask.to(tl.int32)], dtype=tl.int32, is_pure=False,
            pack=1)


@triton.jit
def per_block(v, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """``v`` (int [BLOCK_T, BLOCK_H], constant over each 128-channel block of a row) as one value
    per block, ``[BLOCK_T * BLOCK_H // 128]``: the shape and layout of ``quantize_tile``'s FLAT scales."""
    return tl.max(tl.reshape(v, (BLOCK_T * BLOCK_H // 128, 128)), axis=1)


@triton.jit
def to_fp8(v, INTERP: tl.constexpr):
    """float32 (|v| <= 448) -> float8_e4m3fn bits (uint8), rounded to nearest even.

    On a GPU the hardware conversion (sm_89+: ``cvt.rn.satfinite.e4m3x2.f32``, one instruction
    for two values) is exact; it is what Triton emits for a float32 -> float8e4nv cast on sm_90.
    The interpreter's cast is wrong, so there the rounding is done on the bits (``to_fp8_bits``).
    Both are checked bit for bit against torch's cast (tests on CPU and GPU).
    """
    if INTERP:
        return to_fp8_bits(v)
    else:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def to_fp8_bits(v):
    """float32 (|v| <= 448) -> float8_e4m3fn bits (uint8), rounded to nearest even.

    Done on the integer bits, for the interpreter, whose fp8 cast drops the carry into the
    exponent and rounds ties away. Adding 0x7FFFF + lsb to the float32 magnitude rounds
    its mantissa to 3 bits and carries into the exponent; rebias by (127 - 7) << 3. Subnormals
    (< 2^-6) are multiples of 2^-9, rounded half to even by hand.
    """
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 31) & 1
    a = tl.abs(v)
    mag = bits & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - 960
    y = a * 512.0
    r = tl.floor(y)
    frac = y - r
    ri = r.to(tl.uint32)
    up = (frac > 0.5) | ((frac == 0.5) & ((ri & 1) == 1))
    sub = ri + up.to(tl.uint32)
    code = tl.where(a < 0.015625, sub, normal)
    return ((sign << 7) | code).to(tl.uint8)


@triton.jit
def pre_reduce(y_ptr, r, w, kk, go, out, K: tl.constexpr, H: tl.constexpr, BLOCK_T: tl.constexpr,
               BLOCK_H: tl.constexpr, STAGES: tl.constexpr, INTERP: tl.constexpr):
    """Masked / packed layouts, owner side of combine: ``sum_k w[:, k] * y[r[:, k]]`` (float32,
    rows ``r`` -1 where none) of each of ``BLOCK_T`` tokens (``go``: it has a row here) into the
    bf16 row ``out`` (pointers), rounded once."""
    for h0 in tl.range(0, H, BLOCK_H, num_stages=STAGES):
        hh = h0 + tl.arange(0, BLOCK_H)
        hm = hh[None, :] < H
        acc = pre_reduce_tile(y_ptr, r, w, kk, hh, hm, K, H, BLOCK_T, BLOCK_H)
        tl.store(out[:, None] + hh[None, :], to_bf16(acc, INTERP), mask=go[:, None] & hm)


@triton.jit
def pre_reduce_tile(y_ptr, r, w, kk, hh, hm, K: tl.constexpr, H: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    """float32 [BLOCK_T, BLOCK_H]: ``sum_k w[:, k] * y[r[:, k], hh]`` (rows ``r`` -1 where none,
    channel mask ``hm``): the pre-reduction of one tile of channels."""
    acc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    for k in tl.static_range(K):
        # Pre-reduction: this rank's experts of a token sum here, one row goes back.
        # (A [rows, K, H] block load measured slower: 360 vs 284 us at prefill.)
        rk = tl.sum(tl.where(kk[None, :] == k, r, 0), axis=1).to(tl.int64)
        wk = tl.sum(tl.where(kk[None, :] == k, w, 0.0), axis=1)
        # Each expert row is read once: .cg keeps it out of L1 (2% at prefill, 32 programs)
        y = tl.load(y_ptr + rk[:, None] * H + hh[None, :], mask=(rk[:, None] >= 0) & hm, other=0.0,
                    cache_modifier=".cg")
        acc += y.to(tl.float32) * wk[:, None]
    return acc


@triton.jit
def payload_cols(h0, tm, H: tl.constexpr, NB: tl.constexpr, FP8: tl.constexpr, BLOCK_H: tl.constexpr,
                 FULL: tl.constexpr = False):
    """``(hh, hm, bb, bm)`` of the payload tile at channel ``h0`` for the tokens ``tm`` (mask):
    its channels and their mask, and for fp8 its 128-channel scale blocks and their mask (for
    bf16 the channels again, unused); what ``payload_tile`` takes. ``FULL``: the caller knows the
    tile lies inside the row (``h0 + BLOCK_H <= H``), so the masks are the tokens' alone."""
    hh = h0 + tl.arange(0, BLOCK_H)
    if FULL:
        hm = tm[:, None] & (tl.arange(0, BLOCK_H) >= 0)[None, :]
    else:
        hm = tm[:, None] & (hh[None, :] < H)
    if FP8:
        bb = h0 // 128 + tl.arange(0, BLOCK_H // 128)
        if FULL:
            bm = tm[:, None] & (tl.arange(0, BLOCK_H // 128) >= 0)[None, :]
        else:
            bm = tm[:, None] & (bb[None, :] < NB)
    else:
        bb, bm = hh, hm
    return hh, hm, bb, bm


@triton.jit
def landed_chunk(s, c, hdr, io, at, OFF: tl.constexpr, DIM: tl.constexpr, MODE: tl.constexpr, TILE: tl.constexpr,
                 SELF_SYNC: tl.constexpr):
    """Dispatch receive side: waits for chunk ``c`` of node source ``s`` (if the source has that
    chunk, from its header ``hdr``); returns ``(ok, t, tm, slot)``: whether it landed (0 also for
    no such chunk), the chunk's token indices, their mask, their workspace slots (int64).
    ``SELF_SYNC`` (both halves in one launch): chunk ``c`` of this rank itself was sent by this
    very program an iteration earlier, and a CTA barrier since orders its writes before these
    reads, so it is not waited for (its flag is not raised either)."""
    ts = tl.load(hdr + s * DIM.HDR)
    BT, NC = chunking(ts, DIM.CMAX)
    ok = tl.full([], 0, tl.int32)
    if c < NC:
        if SELF_SYNC:  # one launch: this program itself wrote its own chunk (no flag, no wait)
            ok = tl.full([], 1, tl.int32)
            if s != DIM.RANK:
                ok = wait_flag(ptr_at(io.ws, OFF.disp_flag, tl.int64) + s * DIM.CMAX + c, at.epoch, at.t0_ns,
                               at.timeout_ns, io.err_ptr, DIM.NODE0 + s, PHASE_DISPATCH, MODE.INTERP)
        else:
            ok = wait_flag(ptr_at(io.ws, OFF.disp_flag, tl.int64) + s * DIM.CMAX + c, at.epoch, at.t0_ns, at.timeout_ns,
                           io.err_ptr, DIM.NODE0 + s, PHASE_DISPATCH, MODE.INTERP)
    rr = tl.arange(0, TILE.BLOCK_T)
    t = c * BT + rr
    tm = (rr < BT) & (t < ts)
    return ok, t, tm, (s * DIM.M + t).to(tl.int64) + at.par * (DIM.N * DIM.M)
