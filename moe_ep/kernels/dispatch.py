"""Dispatch kernels: send (every rank stores its tokens into its node peers) and receive.

Workspace of each rank (bytes from its base, offsets from ``moe_ep.layout``), ``par`` = epoch & 1:
  disp_flag[src]                      int64, written by src only, = last dispatch epoch sent
  hdr[par][src][HDR]                  int32: [0] tokens of src, [1 + e] selections of local expert e
  meta_i[par][src][M][2K]             int32: local expert id (-1: not for this rank), position j
  meta_w[par][src][M][K]              float32 weights
  rows[par][src][M][RB]               payload: H elements (+ NB float32 scales for fp8)
Slot = token index on the source, so a sender never waits to learn where to write; the parity
double-buffers every region, so a rank one epoch ahead never overwrites rows still being read.
"""
import triton
import triton.language as tl

from .common import (ERR_CAPACITY, PHASE_DISPATCH, last_arrival, raise_flag, record_error,
                     to_fp8_bits, wait_flag)


@triton.jit
def dispatch_send_kernel(
    x_ptr,             # [T, H] bf16, or uint8 (fp8 bytes) when PREQ
    xs_ptr,            # [T, NB] float32 scales when PREQ (else unused)
    topk_ptr,          # [T, K] int32/int64
    w_ptr,             # [T, K] float32
    hist_ptr,          # int32 [E, CMAX] from route_hist_kernel
    peer_ptr,          # int64 [N]: workspace base of each node peer
    state_ptr,         # int64 [8]: [0] dispatch epoch, [2] arrival counter of this kernel
    T, BT, NC,
    off_flag, off_hdr, off_meta_i, off_meta_w, off_rows,
    RANK: tl.constexpr, N: tl.constexpr, M: tl.constexpr, K: tl.constexpr, E: tl.constexpr,
    EL: tl.constexpr, H: tl.constexpr, NB: tl.constexpr, RB: tl.constexpr, HDR: tl.constexpr,
    CMAX: tl.constexpr,
    FP8: tl.constexpr, PREQ: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, INTERP: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(state_ptr) + 1
    par = epoch & 1
    kk = tl.arange(0, BLOCK_K)
    km = kk < K
    nn = tl.arange(0, BLOCK_N)
    nm = nn < N
    cc = tl.arange(0, BLOCK_C)
    ss = tl.arange(0, BLOCK_S)
    bases = tl.load(peer_ptr + nn, mask=nm, other=0)
    for t in range(pid, T, nprog):
        ids = tl.load(topk_ptr + t * K + kk, mask=km, other=-1).to(tl.int32)
        valid = km & (ids >= 0) & (ids < E)
        ids = tl.where(valid, ids, -1)
        w = tl.load(w_ptr + t * K + kk, mask=km, other=0.0)
        # j = selections of the same expert before (t, k) on this rank, in (token, k) order:
        # earlier chunks (histogram) + earlier tokens of this chunk + earlier k of this token.
        c = t // BT
        c0 = c * BT
        pre = tl.sum(tl.load(hist_ptr + ids[:, None] * CMAX + cc[None, :],
                             mask=valid[:, None] & (cc[None, :] < c), other=0), axis=1)
        prev = tl.load(topk_ptr + c0 * K + ss, mask=ss < (t - c0) * K, other=-1).to(tl.int32)
        within = tl.sum((ids[:, None] == prev[None, :]).to(tl.int32), axis=1)
        same = tl.sum(((ids[:, None] == ids[None, :]) & (kk[None, :] < kk[:, None])).to(tl.int32), axis=1)
        j = pre + within + same
        dst = tl.where(valid, ids // EL, -1)
        # Metadata goes to every peer (ids -1 where the token is not for it): it is how the
        # receiver tells this epoch's rows from stale ones without any reset.
        lid = tl.where(dst[None, :] == nn[:, None], ids[None, :] - nn[:, None] * EL, -1)
        go = tl.max((lid >= 0).to(tl.int32), axis=1) > 0
        slot = ((par * N + RANK) * M + t).to(tl.int64)
        m2 = nm[:, None] & km[None, :]
        mi = (bases[:, None] + off_meta_i + slot * (8 * K)).to(tl.pointer_type(tl.int32))
        tl.store(mi + kk[None, :], lid, mask=m2)
        tl.store(mi + K + kk[None, :], tl.broadcast_to(j[None, :], (BLOCK_N, BLOCK_K)), mask=m2)
        mw = (bases[:, None] + off_meta_w + slot * (4 * K)).to(tl.pointer_type(tl.float32))
        tl.store(mw + kk[None, :], tl.broadcast_to(w[None, :], (BLOCK_N, BLOCK_K)), mask=m2)
        # Payload: read (and quantize) each chunk once, store it to every destination rank.
        row = bases + off_rows + slot * RB
        gm = go & nm
        for h0 in range(0, H, BLOCK_H):
            hh = h0 + tl.arange(0, BLOCK_H)
            hm = hh < H
            m2h = gm[:, None] & hm[None, :]
            if FP8:
                if PREQ:
                    q = tl.load(x_ptr + t * H + hh, mask=hm, other=0)
                    bb = h0 // 128 + tl.arange(0, BLOCK_H // 128)
                    sc = tl.load(xs_ptr + t * NB + bb, mask=bb < NB, other=0.0)
                else:
                    v = tl.load(x_ptr + t * H + hh, mask=hm, other=0.0).to(tl.float32)
                    vb = tl.reshape(v, (BLOCK_H // 128, 128))
                    amax = tl.maximum(tl.max(tl.abs(vb), axis=1), 1e-4)
                    sc = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
                    qf = tl.math.div_rn(vb, tl.broadcast_to(sc[:, None], vb.shape))
                    q = tl.reshape(to_fp8_bits(qf, INTERP), (BLOCK_H,))
                    bb = h0 // 128 + tl.arange(0, BLOCK_H // 128)
                dq = (row[:, None] + hh[None, :]).to(tl.pointer_type(tl.uint8))
                tl.store(dq, tl.broadcast_to(q[None, :], (BLOCK_N, BLOCK_H)), mask=m2h)
                ds = (row[:, None] + H + bb[None, :] * 4).to(tl.pointer_type(tl.float32))
                tl.store(ds, tl.broadcast_to(sc[None, :], (BLOCK_N, BLOCK_H // 128)),
                         mask=gm[:, None] & (bb[None, :] < NB))
            else:
                v = tl.load(x_ptr + t * H + hh, mask=hm, other=0.0)
                dv = (row[:, None] + hh[None, :] * 2).to(tl.pointer_type(tl.bfloat16))
                tl.store(dv, tl.broadcast_to(v[None, :], (BLOCK_N, BLOCK_H)), mask=m2h)
    if last_arrival(state_ptr + 2):
        # The last program publishes the per-expert counts and raises every peer's flag.
        ee = tl.arange(0, BLOCK_E)
        tot = tl.zeros((BLOCK_E,), tl.int32)
        for c1 in range(0, CMAX, BLOCK_C):
            tot += tl.sum(tl.load(hist_ptr + ee[:, None] * CMAX + c1 + cc[None, :],
                                  mask=(ee[:, None] < E) & (c1 + cc[None, :] < NC), other=0), axis=1)
        for d in tl.static_range(N):
            base = tl.load(peer_ptr + d)
            hdr = (base + off_hdr).to(tl.pointer_type(tl.int32)) + (par * N + RANK) * HDR
            tl.store(hdr, T)
            el = ee - d * EL
            tl.store(hdr + 1 + el, tot, mask=(el >= 0) & (el < EL))
        for d in tl.static_range(N):
            base = tl.load(peer_ptr + d)
            raise_flag((base + off_flag).to(tl.pointer_type(tl.int64)) + RANK, epoch)


@triton.jit
def dispatch_recv_kernel(
    ws,                # int: address of this rank's workspace
    state_ptr,         # int64 [8]: [0] dispatch epoch, [3] arrival counter of this kernel
    err_ptr,           # int64 [8] error record
    out_x_ptr,         # int32 view of expert_x: [rows, W]
    out_s_ptr,         # float32 [rows, NB] expert_scales (FP8 only)
    counts_ptr,        # int32 [EL]
    offsets_ptr,       # int32 [EL + 1] (PACKED only)
    recv_pos_ptr,      # int32 [N, M, K]: row of each (source, slot, k) in the expert layout, or -1
    scratch_ptr,       # int32 [programs, BLOCK_EL]
    timeout_ns,
    off_flag, off_hdr, off_meta_i, off_rows,
    N: tl.constexpr, M: tl.constexpr, K: tl.constexpr, EL: tl.constexpr,
    W: tl.constexpr, H: tl.constexpr, NB: tl.constexpr, RB: tl.constexpr, HDR: tl.constexpr,
    ALIGN: tl.constexpr, CAP: tl.constexpr, PACKED: tl.constexpr, FP8: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_EL: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_NB: tl.constexpr, INTERP: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(state_ptr) + 1
    par = epoch & 1
    ok = tl.full([], 1, tl.int32)
    for s in range(N):
        ok = ok & wait_flag((ws + off_flag).to(tl.pointer_type(tl.int64)) + s,
                            epoch, timeout_ns, err_ptr, s, PHASE_DISPATCH, INTERP)
    if ok != 0:
        hdr = (ws + off_hdr).to(tl.pointer_type(tl.int32)) + par * N * HDR
        ee = tl.arange(0, BLOCK_EL)
        em = ee < EL
        tot = tl.zeros((BLOCK_EL,), tl.int32)
        for s in range(N):
            tot += tl.load(hdr + s * HDR + 1 + ee, mask=em, other=0)
        if PACKED:
            padded = (tot + ALIGN - 1) // ALIGN * ALIGN
            incl = tl.cumsum(padded, 0)
            total = tl.max(incl)
            over = total > CAP
            tl.store(scratch_ptr + pid * BLOCK_EL + ee, incl - padded)
            if pid == 0:
                tl.store(offsets_ptr + ee, incl - padded, mask=em)
                tl.store(offsets_ptr + EL, total)
        else:
            over = tl.max(tot) > CAP
        if over:
            record_error(err_ptr, ERR_CAPACITY, -1, PHASE_DISPATCH, epoch, tl.max(tot))
        if pid == 0:
            tl.store(counts_ptr + ee, tot, mask=em)
        tl.debug_barrier()
        kk = tl.arange(0, BLOCK_K)
        km = kk < K
        nn = tl.arange(0, BLOCK_N)
        meta = (ws + off_meta_i).to(tl.pointer_type(tl.int32))
        rows = ws + off_rows
        for s in range(N):
            ts = tl.load(hdr + s * HDR)
            for t in range(pid, ts, nprog):
                slot = ((par * N + s) * M + t).to(tl.int64)
                lid = tl.load(meta + slot * 2 * K + kk, mask=km, other=-1)
                j = tl.load(meta + slot * 2 * K + K + kk, mask=km, other=0)
                valid = km & (lid >= 0)
                # Rows of expert e from sources below s come first (deterministic order).
                below = tl.sum(tl.load(hdr + nn[:, None] * HDR + 1 + lid[None, :],
                                       mask=(nn[:, None] < s) & valid[None, :], other=0), axis=0)
                pos = below + j
                if PACKED:
                    r = tl.load(scratch_ptr + pid * BLOCK_EL + lid, mask=valid, other=0) + pos
                    valid = valid & (r < CAP)
                else:
                    valid = valid & (pos < CAP)
                    r = lid * CAP + pos
                r = tl.where(valid, r, -1).to(tl.int64)
                tl.store(recv_pos_ptr + (s * M + t) * K + kk, r.to(tl.int32), mask=km)
                src = (rows + slot * RB).to(tl.pointer_type(tl.int32))
                for w0 in range(0, W, BLOCK_W):
                    ww = w0 + tl.arange(0, BLOCK_W)
                    wm = ww < W
                    v = tl.load(src + ww, mask=wm)
                    tl.store(out_x_ptr + r[:, None] * W + ww[None, :],
                             tl.broadcast_to(v[None, :], (BLOCK_K, BLOCK_W)), mask=valid[:, None] & wm[None, :])
                if FP8:
                    bb = tl.arange(0, BLOCK_NB)
                    sv = tl.load((rows + slot * RB + H).to(tl.pointer_type(tl.float32)) + bb,
                                 mask=bb < NB)
                    tl.store(out_s_ptr + r[:, None] * NB + bb[None, :],
                             tl.broadcast_to(sv[None, :], (BLOCK_K, BLOCK_NB)), mask=valid[:, None] & (bb[None, :] < NB))
    if last_arrival(state_ptr + 3):
        tl.store(state_ptr, epoch)
