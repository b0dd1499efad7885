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

from .common import (ERR_BAD_EXPERT, ERR_CAPACITY, PHASE_DISPATCH, last_arrival, ptr_at, raise_flag, record_error,
                     to_fp8_bits, wait_flag)


@triton.jit(do_not_specialize=['T', 'BT', 'NC'])
def dispatch_send_kernel(
    x_ptr,             # [T, H] bf16, or uint8 (fp8 bytes) when PREQ
    xs_ptr,            # [T, NB] float32 scales when PREQ (else unused)
    topk_ptr,          # [T, K] int32/int64
    w_ptr,             # [T, K] float32
    hist_ptr,          # int32 [E, CMAX] from route_hist_kernel (unused when DIRECT)
    tot_ptr,           # int32 [E] zeros: selections per expert, summed here and re-zeroed
    peer_ptr,          # int64 [N]: workspace base of each node peer
    state_ptr,         # int64 [8]: [0] dispatch epoch, [2] arrival counter of this kernel
    err_ptr,           # int64 [8] error record
    T, BT, NC,         # tokens, tokens per chunk, chunks
    off_flag: tl.constexpr, off_hdr: tl.constexpr, off_meta_i: tl.constexpr, off_meta_w: tl.constexpr,
    off_rows: tl.constexpr,
    RANK: tl.constexpr, N: tl.constexpr, M: tl.constexpr, K: tl.constexpr, E: tl.constexpr,
    EL: tl.constexpr, H: tl.constexpr, NB: tl.constexpr, RB: tl.constexpr, HDR: tl.constexpr,
    CMAX: tl.constexpr,
    FP8: tl.constexpr, PREQ: tl.constexpr, DIRECT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, INTERP: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(state_ptr) + 1
    par = epoch & 1
    S: tl.constexpr = BLOCK_T * BLOCK_K
    tt = tl.arange(0, BLOCK_T)
    kk = tl.arange(0, BLOCK_K)
    ff = tl.arange(0, S)
    cc = tl.arange(0, BLOCK_C)
    # One routing chunk (BT tokens) per iteration: the tile is the chunk, so a selection's
    # position j = selections of its expert in earlier chunks (histogram) + earlier in this tile.
    for c in range(pid, NC, nprog):
        t = c * BT + tt
        tm = (tt < BT) & (t < T)
        m2 = tm[:, None] & (kk[None, :] < K)
        ids = tl.load(topk_ptr + t[:, None] * K + kk[None, :], mask=m2, other=-1).to(tl.int32)
        valid = m2 & (ids >= 0) & (ids < E)
        if DIRECT:  # no routing-histogram launch checked the ids: out-of-range ones count as -1, reported
            bad = tl.sum((m2 & ((ids < -1) | (ids >= E))).to(tl.int32))
            if bad > 0:
                record_error(err_ptr, ERR_BAD_EXPERT, -1, PHASE_DISPATCH, epoch, bad)
        ids = tl.where(valid, ids, -1)
        w = tl.load(w_ptr + t[:, None] * K + kk[None, :], mask=m2, other=0.0)
        idf = tl.reshape(ids, (S,))
        vf = idf >= 0
        pre = tl.zeros((S,), tl.int32)
        if DIRECT:
            # Few tokens (decode): count the earlier selections directly; no histogram launch.
            for f0 in range(0, c * BT * K, 256):
                ff2 = f0 + tl.arange(0, 256)
                prev = tl.load(topk_ptr + ff2, mask=ff2 < c * BT * K, other=-1).to(tl.int32)
                pre += tl.sum((idf[:, None] == prev[None, :]).to(tl.int32), axis=1)
        else:
            for c1 in range(0, c, BLOCK_C):
                pre += tl.sum(tl.load(hist_ptr + idf[:, None] * CMAX + c1 + cc[None, :],
                                      mask=vf[:, None] & (c1 + cc[None, :] < c), other=0), axis=1)
        tl.atomic_add(tot_ptr + idf, 1, mask=vf, sem="relaxed", scope="gpu")
        within = tl.sum(((idf[:, None] == idf[None, :]) & (ff[None, :] < ff[:, None])).to(tl.int32), axis=1)
        j = tl.reshape(pre + within, (BLOCK_T, BLOCK_K))
        dst = tl.where(valid, ids // EL, -1)
        slot = (RANK * M + t).to(tl.int64) + par * (N * M)
        for d in tl.static_range(N):
            base = tl.load(peer_ptr + d)
            # Metadata goes to every peer (ids -1 where the token is not for it): it is how the
            # receiver tells this epoch's rows from stale ones without any reset.
            lid = tl.where(dst == d, ids - d * EL, -1)
            mi = ptr_at(base, off_meta_i, tl.int32) + slot[:, None] * (2 * K) + kk[None, :]
            tl.store(mi, lid, mask=m2)
            tl.store(mi + K, j, mask=m2)
            mw = ptr_at(base, off_meta_w, tl.float32) + slot[:, None] * K + kk[None, :]
            tl.store(mw, w, mask=m2)
        # Payload: read (and quantize) each tile once, store it to every destination rank.
        for h0 in range(0, H, BLOCK_H):
            hh = h0 + tl.arange(0, BLOCK_H)
            hm = tm[:, None] & (hh[None, :] < H)
            if FP8:
                bb = h0 // 128 + tl.arange(0, BLOCK_H // 128)
                bm = tm[:, None] & (bb[None, :] < NB)
                if PREQ:
                    q = tl.load(x_ptr + t[:, None] * H + hh[None, :], mask=hm, other=0)
                    sc = tl.load(xs_ptr + t[:, None] * NB + bb[None, :], mask=bm, other=0.0)
                else:
                    v = tl.load(x_ptr + t[:, None] * H + hh[None, :], mask=hm, other=0.0).to(tl.float32)
                    vb = tl.reshape(v, (BLOCK_T * BLOCK_H // 128, 128))
                    amax = tl.maximum(tl.max(tl.abs(vb), axis=1), 1e-4)
                    scf = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
                    qf = tl.math.div_rn(vb, tl.broadcast_to(scf[:, None], vb.shape))
                    q = tl.reshape(to_fp8_bits(qf), (BLOCK_T, BLOCK_H))
                    sc = tl.reshape(scf, (BLOCK_T, BLOCK_H // 128))
            else:
                v = tl.load(x_ptr + t[:, None] * H + hh[None, :], mask=hm, other=0.0)
            for d in tl.static_range(N):
                go = tl.max((dst == d).to(tl.int32), axis=1) > 0
                base = tl.load(peer_ptr + d)
                if FP8:
                    tl.store(ptr_at(base, off_rows, tl.uint8) + slot[:, None] * RB + hh[None, :], q,
                             mask=hm & go[:, None])
                    tl.store(ptr_at(base, off_rows, tl.float32) + slot[:, None] * (RB // 4) + H // 4 + bb[None, :],
                             sc, mask=bm & go[:, None])
                else:
                    tl.store(ptr_at(base, off_rows, tl.bfloat16) + slot[:, None] * (RB // 2) + hh[None, :], v,
                             mask=hm & go[:, None])
    if last_arrival(state_ptr + 2):
        # The last program publishes the per-expert counts and raises every peer's flag.
        ee = tl.arange(0, BLOCK_E)
        tot = tl.load(tot_ptr + ee, mask=ee < E, other=0)
        tl.store(tot_ptr + ee, tl.zeros((BLOCK_E,), tl.int32), mask=ee < E)  # ready for the next call
        for d in tl.static_range(N):
            base = tl.load(peer_ptr + d)
            hdr = ptr_at(base, off_hdr, tl.int32) + (par * N + RANK) * HDR
            tl.store(hdr, T)
            el = ee - d * EL
            tl.store(hdr + 1 + el, tot, mask=(el >= 0) & (el < EL))
        for d in tl.static_range(N):
            base = tl.load(peer_ptr + d)
            raise_flag(ptr_at(base, off_flag, tl.int64) + RANK, epoch)


@triton.jit(do_not_specialize=['ws', 'timeout_ns'])
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
    off_flag: tl.constexpr, off_hdr: tl.constexpr, off_meta_i: tl.constexpr, off_rows: tl.constexpr,
    N: tl.constexpr, M: tl.constexpr, K: tl.constexpr, EL: tl.constexpr,
    W: tl.constexpr, H: tl.constexpr, NB: tl.constexpr, RB: tl.constexpr, HDR: tl.constexpr,
    ALIGN: tl.constexpr, CAP: tl.constexpr, PACKED: tl.constexpr, FP8: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_EL: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_NB: tl.constexpr, INTERP: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(state_ptr) + 1
    par = epoch & 1
    ok = tl.full([], 1, tl.int32)
    for s in range(N):
        ok = ok & wait_flag(ptr_at(ws, off_flag, tl.int64) + s,
                            epoch, timeout_ns, err_ptr, s, PHASE_DISPATCH, INTERP)
    if ok != 0:
        hdr = ptr_at(ws, off_hdr, tl.int32) + par * N * HDR
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
        rr = tl.arange(0, BLOCK_R)
        kk = tl.arange(0, BLOCK_K)
        km = kk < K
        meta = ptr_at(ws, off_meta_i, tl.int32)
        for s in range(N):
            ts = tl.load(hdr + s * HDR)
            # A tile of BLOCK_R slots of source s per iteration: many rows in flight.
            for t0 in range(pid * BLOCK_R, ts, nprog * BLOCK_R):
                t = t0 + rr
                tm = t < ts
                m2 = tm[:, None] & km[None, :]
                slot = (s * M + t).to(tl.int64) + par * (N * M)
                lid = tl.load(meta + slot[:, None] * (2 * K) + kk[None, :], mask=m2, other=-1)
                j = tl.load(meta + slot[:, None] * (2 * K) + K + kk[None, :], mask=m2, other=0)
                valid = m2 & (lid >= 0)
                # Rows of expert e from sources below s come first (deterministic order).
                pos = j
                for s2 in range(s):
                    pos += tl.load(hdr + s2 * HDR + 1 + lid, mask=valid, other=0)
                if PACKED:
                    r = tl.load(scratch_ptr + pid * BLOCK_EL + lid, mask=valid, other=0) + pos
                    valid = valid & (r < CAP)
                else:
                    valid = valid & (pos < CAP)
                    r = lid * CAP + pos
                r = tl.where(valid, r, -1)
                tl.store(recv_pos_ptr + (s * M + t)[:, None] * K + kk[None, :], r, mask=m2)
                r = r.to(tl.int64)
                src = ptr_at(ws, off_rows, tl.int32) + slot * (RB // 4)
                for w0 in range(0, W, BLOCK_W):
                    ww = w0 + tl.arange(0, BLOCK_W)
                    wm = tm[:, None] & (ww[None, :] < W)
                    v = tl.load(src[:, None] + ww[None, :], mask=wm)
                    for k in tl.static_range(K):
                        rk = tl.sum(tl.where(kk[None, :] == k, r, 0), axis=1)
                        tl.store(out_x_ptr + rk[:, None] * W + ww[None, :], v, mask=wm & (rk[:, None] >= 0))
                if FP8:
                    bb = tl.arange(0, BLOCK_NB)
                    bm = tm[:, None] & (bb[None, :] < NB)
                    sv = tl.load(src[:, None].to(tl.pointer_type(tl.float32)) + H // 4 + bb[None, :], mask=bm)
                    for k in tl.static_range(K):
                        rk = tl.sum(tl.where(kk[None, :] == k, r, 0), axis=1)
                        tl.store(out_s_ptr + rk[:, None] * NB + bb[None, :], sv, mask=bm & (rk[:, None] >= 0))
    if last_arrival(state_ptr + 3):
        tl.store(state_ptr, epoch)
