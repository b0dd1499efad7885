"""Kernels of the inter-node path (docs/ARCHITECTURE.md §10): pack rows for remote peers into the
proxy's send buffer, expand what the proxy delivered, and the combine rows both ways.

Remote row (``RB`` bytes, a multiple of 16; ``moe_ep.internode.spec.RemoteSpec``): payload (bf16 ``H``
elements, or fp8 ``H`` bytes + ``NB`` float32 scales) at word 0, then the trailer at word ``PW``
(= payload bytes / 4): ``[token, lid[K], j[K], w[K]]`` int32 (``w`` as float32 bits): the source
token index, per k the local expert id at the destination (-1: not for it), the position ``j``
among the source's selections of that expert, the routing weight.

Launches (every grid is fixed by the host, no program waits for another of its launch):
  remote_count_kernel      grid NC chunks: per chunk, rows per destination rank, selections per expert
  remote_pack_kernel       grid P: [HDR_p | rows_p] for every p != rank into the send buffer
  remote_sel_kernel        grid 1: the count matrix sel[R, EL] from the round-1 headers (+ own counts)
  remote_unpack_kernel     grid P: remote sources' rows -> expert layout, recv_pos of each received row
  remote_combine_pack_kernel    grid P: one pre-reduced bf16 row per received row -> combine send buffer
  remote_combine_unpack_kernel  grid P: out[t] = base[t] + the partial rows of t's remote owners
  remote_unpack_rows_kernel     grid P: the rows layout's receive side (one row per source token)
The epoch (for the parity copies of the regions peers write) is read on the device from
``epoch_ptr``, so the launches replay in a CUDA graph.
"""
import triton
import triton.language as tl

from ..kernels.common import (ERR_BAD_EXPERT, ERR_CAPACITY, PHASE_DISPATCH, payload_cols, payload_tile, pre_reduce,
                              record_error, scale_ptr, to_bf16)
from ..kernels.tiles import chunk_sum, col, excl, first_on_rank, gather, load_routing, pick


@triton.jit(do_not_specialize=['T', 'BT'])
def remote_count_kernel(
    topk_ptr,          # [T, K] int32/int64
    rhist_ptr,         # int32 [R, CMAX]: rows (one per token and destination rank) of chunk c to rank d
    ehist_ptr,         # int32 [E, CMAX]: selections of global expert e in chunk c
    err_ptr,           # int64 [8] error record
    epoch_ptr,         # int64 [1]: the epoch of this dispatch
    T, BT,
    R: tl.constexpr, E: tl.constexpr, EL: tl.constexpr, K: tl.constexpr, CMAX: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr,
):
    c = tl.program_id(0)
    S: tl.constexpr = BLOCK_T * BLOCK_K
    tt = tl.arange(0, BLOCK_T)
    kk = tl.arange(0, BLOCK_K)
    t = c * BT + tt
    tm = (tt < BT) & (t < T)
    ids, bad = load_routing(topk_ptr, t, tm, E, K, BLOCK_K)
    if bad > 0:
        record_error(err_ptr, ERR_BAD_EXPERT, -1, PHASE_DISPATCH, tl.load(epoch_ptr), bad)
    valid = ids >= 0
    eh = tl.histogram(tl.reshape(tl.where(valid, ids, 0), [S]), BLOCK_E, mask=tl.reshape(valid, [S]))
    ee = tl.arange(0, BLOCK_E)
    tl.store(ehist_ptr + ee * CMAX + c, eh, mask=ee < E)
    dst = tl.where(valid, ids // EL, -1)
    first = first_on_rank(dst, kk)
    rh = tl.histogram(tl.reshape(tl.where(first, dst, 0), [S]), BLOCK_R, mask=tl.reshape(first, [S]))
    rr = tl.arange(0, BLOCK_R)
    tl.store(rhist_ptr + rr * CMAX + c, rh, mask=rr < R)


@triton.jit(do_not_specialize=['T', 'BT', 'NC'])
def remote_pack_kernel(
    x_ptr,             # [T, H] bf16, or uint8 (fp8 bytes) when PREQ
    xs_ptr,            # [T, NB] float32 scales when PREQ (else unused)
    topk_ptr,          # [T, K] int32/int64
    w_ptr,             # [T, K] float32
    rhist_ptr,         # int32 [R, CMAX] from remote_count_kernel
    ehist_ptr,         # int32 [E, CMAX] from remote_count_kernel
    send_ptr,          # uint8: the proxy's dispatch send buffer
    send_counts_ptr,   # int32 [R]: out, rows this rank sends to each rank (its count vector)
    send_pos_ptr,      # int32 [M, R]: out, row index of token t in rows_p (-1: none, or p not remote)
    err_ptr,           # int64 [8] error record
    epoch_ptr,         # int64 [1]
    T, BT, NC,         # tokens, tokens per chunk, chunks (as for remote_count_kernel)
    RANK: tl.constexpr, R: tl.constexpr, G: tl.constexpr, E: tl.constexpr, EL: tl.constexpr, K: tl.constexpr,
    H: tl.constexpr, NB: tl.constexpr, PW: tl.constexpr, RB: tl.constexpr, HDR: tl.constexpr,
    MAXROWS: tl.constexpr, CMAX: tl.constexpr, FP8: tl.constexpr, PREQ: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_EL: tl.constexpr, INTERP: tl.constexpr,
):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    S: tl.constexpr = BLOCK_T * BLOCK_K
    rr = tl.arange(0, BLOCK_R)
    rmask = rr < R
    kk = tl.arange(0, BLOCK_K)
    km = kk < K
    words = send_ptr.to(tl.pointer_type(tl.int32))
    # Every program derives the whole layout from the chunk histograms (no program waits for another).
    cnt = chunk_sum(rhist_ptr, rr, rmask, NC, CMAX, BLOCK_C)
    remote = rmask & (rr // G != RANK // G)
    rows = tl.where(remote, cnt, 0)
    # Offsets in 16-byte units (HDR and RB are multiples of 16): an address formed as ``units * 16``
    # is known to be 16-byte aligned, so row stores become 16-byte vectors.
    seg = tl.where(rmask & (rr != RANK), HDR // 16 + rows.to(tl.int64) * (RB // 16), 0)
    off = excl(seg)                                                        # [HDR_p | rows_p] of each peer
    total = tl.sum(rows)
    if total > MAXROWS:
        record_error(err_ptr, ERR_CAPACITY, -1, PHASE_DISPATCH, tl.load(epoch_ptr), total)
    if pid == 0:
        tl.store(send_counts_ptr + rr, cnt, mask=rmask)
    # A batch over MAXROWS breaks the epoch (recorded above; the proxy refuses it too), but no
    # header or row is ever written past the buffer: every store is bounded by its size.
    SEND16: tl.constexpr = ((R - 1) * HDR + MAXROWS * RB) // 16
    ee = tl.arange(0, BLOCK_EL)
    for d in range(pid, R, P):
        if (d != RANK) & (pick(off, rr, d) + HDR // 16 <= SEND16):
            hp = words + pick(off, rr, d) * 4
            tl.store(hp + rr, cnt, mask=rmask)
            ecnt = chunk_sum(ehist_ptr, d * EL + ee, ee < EL, NC, CMAX, BLOCK_C)
            tl.store(hp + R + ee, ecnt, mask=ee < EL)
    tt = tl.arange(0, BLOCK_T)
    ff = tl.arange(0, S)
    for c in range(pid, NC, P):
        t = c * BT + tt
        tm = (tt < BT) & (t < T)
        ids, bad = load_routing(topk_ptr, t, tm, E, K, BLOCK_K)
        w = tl.load(w_ptr + t[:, None] * K + kk[None, :], mask=tm[:, None] & km[None, :], other=0.0)
        # Position j of each selection among this rank's selections of its expert (order (token, k)):
        # earlier chunks from the histogram, plus earlier selections of this chunk.
        idf = tl.reshape(ids, (S,))
        pre = chunk_sum(ehist_ptr, idf, idf >= 0, c, CMAX, BLOCK_C)
        within = tl.sum(((idf[:, None] == idf[None, :]) & (ff[None, :] < ff[:, None])).to(tl.int32), axis=1)
        j = tl.reshape(pre + within, (BLOCK_T, BLOCK_K))
        dst = tl.where(ids >= 0, ids // EL, -1)
        go = tl.max((dst[:, :, None] == rr[None, None, :]).to(tl.int32), axis=1)     # [BLOCK_T, BLOCK_R]
        # Row of token t in rows_p: rows to p from earlier chunks + earlier tokens of this chunk.
        # (A compare-and-sum, not tl.cumsum: a scan over a tile this small fails to lower for sm_90.)
        before = tl.sum(tl.where(tt[None, :, None] < tt[:, None, None], go[None, :, :], 0), axis=1)
        pos = chunk_sum(rhist_ptr, rr, rmask, c, CMAX, BLOCK_C)[None, :] + before
        send = (go > 0) & remote[None, :] & tm[:, None]
        tl.store(send_pos_ptr + t[:, None] * R + rr[None, :], tl.where(send, pos, -1),
                 mask=tm[:, None] & rmask[None, :])
        row16 = off[None, :] + HDR // 16 + pos.to(tl.int64) * (RB // 16)  # each (token, peer) row
        ok = send & (row16 + RB // 16 <= SEND16)
        # A token's row to rank d is written by its first selection on d: loops over K selections,
        # not over R ranks (K << R at large EP). Per (token, k): that row (in 16-byte units, so the
        # address is known to be 16-byte aligned) and whether it is written.
        hit = rr[None, None, :] == dst[:, :, None]
        # (Multiplied by 4 only after each column is extracted: a reduction loses the alignment.)
        rowk = tl.sum(tl.where(hit, row16[:, None, :], 0), axis=2)
        okk = first_on_rank(dst, kk) & (tl.max(tl.where(hit, ok[:, None, :].to(tl.int32), 0), axis=2) > 0)
        for k in tl.static_range(K):
            okd = col(okk.to(tl.int32), kk, k) > 0
            dk = col(dst, kk, k)
            tw = words + col(rowk, kk, k) * 4 + PW
            tl.store(tw, t, mask=okd)
            m2 = okd[:, None] & km[None, :]
            tl.store(tw[:, None] + 1 + kk[None, :], tl.where(dst == dk[:, None], ids - dk[:, None] * EL, -1), mask=m2)
            tl.store(tw[:, None] + 1 + K + kk[None, :], j, mask=m2)
            tl.store(tw[:, None] + 1 + 2 * K + kk[None, :], w.to(tl.int32, bitcast=True), mask=m2)
        # Payload: each tile read (and quantized) once, stored to every remote destination.
        for h0 in range(0, H, BLOCK_H):
            hh, hm, bb, bm = payload_cols(h0, tm, H, NB, FP8, BLOCK_H)
            q, sc = payload_tile(x_ptr=x_ptr, xs_ptr=xs_ptr, t=t, hh=hh, hm=hm, bb=bb, bm=bm, H=H, NB=NB, FP8=FP8,
                                 PREQ=PREQ, BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, INTERP=INTERP)
            for k in tl.static_range(K):
                okd = col(okk.to(tl.int32), kk, k) > 0
                rw = col(rowk, kk, k) * 4
                if FP8:
                    tl.store(send_ptr + rw[:, None] * 4 + hh[None, :], q, mask=hm & okd[:, None])
                    tl.store((words + rw + H // 4)[:, None].to(tl.pointer_type(tl.float32)) + bb[None, :], sc,
                             mask=bm & okd[:, None])
                else:
                    tl.store((words + rw)[:, None].to(tl.pointer_type(tl.bfloat16)) + hh[None, :], q,
                             mask=hm & okd[:, None])


@triton.jit(do_not_specialize=['NC'])
def remote_sel_kernel(
    round1_ptr,        # uint8: this rank's round-1 region (after every D1 of the epoch landed)
    ehist_ptr,         # int32 [E, CMAX] of this rank's dispatch
    sel_ptr,           # int32 [R, EL]: out, selections of each local expert from each source
    epoch_ptr,         # int64 [1]
    NC,
    rhist_ptr,         # int32 [R, CMAX] of this rank's dispatch
    rows_from_ptr,     # int32 [R]: out, rows (one per token) each source sends this rank
    RANK: tl.constexpr, R: tl.constexpr, EL: tl.constexpr, HDR: tl.constexpr, SLOT: tl.constexpr,
    CMAX: tl.constexpr, BLOCK_EL: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # Every source s != RANK, node peers included, sent its HDR in round 1; row RANK is our own.
    par = tl.load(epoch_ptr) & 1
    ee = tl.arange(0, BLOCK_EL)
    em = ee < EL
    words = round1_ptr.to(tl.pointer_type(tl.int32))
    one = tl.arange(0, 2)
    for s in range(R):
        if s == RANK:
            v = chunk_sum(ehist_ptr, RANK * EL + ee, em, NC, CMAX, BLOCK_C)
            n = chunk_sum(rhist_ptr, RANK + one * 0, one < 1, NC, CMAX, BLOCK_C)
        else:
            v = tl.load(words + ((par * R + s) * SLOT) // 4 + R + ee, mask=em, other=0)
            n = tl.load(words + ((par * R + s) * SLOT) // 4 + RANK + one * 0, mask=one < 1, other=0)
        tl.store(sel_ptr + s * EL + ee, v, mask=em)
        tl.store(rows_from_ptr + s + one, n, mask=one < 1)


@triton.jit
def received_counts(r1w, par, rr, RANK: tl.constexpr, R: tl.constexpr, G: tl.constexpr, SLOT: tl.constexpr,
                    PCAP: tl.constexpr):
    """``(c, ovoff, goff)`` per source (indexed by ``rr``): ``c_{s,RANK}`` from each remote source's
    round-1 header (0 for the others), the first overflow row of each (remote s' < s), the first
    received-row index in combine order of each. ``r1w``: the round-1 region as int32 words."""
    remote = (rr < R) & (rr // G != RANK // G)
    c = tl.load(r1w + ((par * R + rr) * SLOT) // 4 + RANK, mask=remote, other=0)
    return c, excl(tl.maximum(c - PCAP, 0)), excl(c)


@triton.jit
def received_row(r1w, ovw, par, s, i, n, g, ov0, R: tl.constexpr, SLOT: tl.constexpr, HDR: tl.constexpr,
                 RB: tl.constexpr, PCAP: tl.constexpr, OVCAP: tl.constexpr, ROWS: tl.constexpr):
    """``(words, mask)``: where row ``i`` of remote source ``s`` (``n`` rows, combine index ``g``,
    first overflow row ``ov0``) is, as int32 words: its round-1 slot for ``i < PCAP``, else the
    shared overflow region. (The proxy raises no ready word for counts that do not fit; the
    bounds only keep reads in.)"""
    in1 = i < PCAP
    im = (i < n) & (g < ROWS) & (in1 | (ov0 + i - PCAP < OVCAP))
    w1 = ((par * R + s) * SLOT + HDR + i.to(tl.int64) * RB) // 4
    w2 = (par * OVCAP * RB + (ov0 + i - PCAP).to(tl.int64) * RB) // 4
    src = tl.where(in1, r1w + tl.multiple_of(tl.where(in1, w1, 0), 4), ovw + tl.multiple_of(tl.where(in1, 0, w2), 4))
    return src, im


@triton.jit
def _scatter(ptr, r, kk, width: tl.constexpr, cols, v, m, K: tl.constexpr, CM_ROWS: tl.constexpr = 0):
    """Stores the tile ``v`` [rows, cols] at row ``r[:, k]`` (row width ``width``) of ``ptr`` for
    every k with ``r[:, k] >= 0``; ``CM_ROWS`` > 0: scales, column-major in blocks of that many
    rows (``scale_ptr``)."""
    for k in tl.static_range(K):
        rk = tl.sum(tl.where(kk[None, :] == k, r, 0), axis=1)
        tl.store(scale_ptr(ptr, rk[:, None], cols[None, :], width, CM_ROWS), v, mask=m & (rk[:, None] >= 0))


@triton.jit
def remote_unpack_kernel(
    round1_ptr,        # uint8: round-1 region, [2][R][HDR + PCAP*RB]
    overflow_ptr,      # uint8: overflow region, [2][OVCAP*RB]
    sel_ptr,           # int32 [R, EL]: count matrix (remote_sel_kernel)
    out_x_ptr,         # int32 view of expert_x: [rows, W]
    out_s_ptr,         # float32 [rows, NB] expert_scales (FP8 only)
    counts_ptr,        # int32 [EL]: out, rows of each local expert (every source)
    offsets_ptr,       # int32 [EL + 1]: out (PACKED only)
    rpos_ptr,          # int32 [ROWS, K]: out, row in the expert layout of each received (row, k), or -1
    rw_ptr,            # float32 [ROWS, K]: out, its weight (0 where rpos is -1)
    recv_rows_ptr,     # int32 [R]: out, rows received from each remote source (0 for the others)
    err_ptr,           # int64 [8]
    epoch_ptr,         # int64 [1]
    RANK: tl.constexpr, R: tl.constexpr, G: tl.constexpr, EL: tl.constexpr, K: tl.constexpr, H: tl.constexpr,
    W: tl.constexpr, NB: tl.constexpr, PW: tl.constexpr, RB: tl.constexpr, HDR: tl.constexpr,
    PCAP: tl.constexpr, OVCAP: tl.constexpr, ROWS: tl.constexpr, CAP: tl.constexpr, ALIGN: tl.constexpr,
    PACKED: tl.constexpr, FP8: tl.constexpr, BLOCK_RW: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_EL: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_NB: tl.constexpr,
    CM_ROWS: tl.constexpr,  # fp8 scales column-major in blocks of this many rows (scale_ptr), 0: row-major
):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    SLOT: tl.constexpr = HDR + PCAP * RB
    epoch = tl.load(epoch_ptr)
    par = epoch & 1
    r1w = round1_ptr.to(tl.pointer_type(tl.int32))
    ovw = overflow_ptr.to(tl.pointer_type(tl.int32))
    rr = tl.arange(0, BLOCK_R)
    c, ovoff, goff = received_counts(r1w, par, rr, RANK, R, G, SLOT, PCAP)
    ee = tl.arange(0, BLOCK_EL)
    em = ee < EL
    tot = tl.zeros((BLOCK_EL,), tl.int32)
    for s in range(R):
        tot += tl.load(sel_ptr + s * EL + ee, mask=em, other=0)
    if PACKED:
        padded = (tot + ALIGN - 1) // ALIGN * ALIGN
        eoff = excl(padded)
        over = tl.sum(padded) > CAP
    else:
        eoff = ee * CAP
        over = tl.max(tot) > CAP
    if over | (tl.sum(c) > ROWS):
        record_error(err_ptr, ERR_CAPACITY, -1, PHASE_DISPATCH, epoch, tl.max(tot))
    if pid == 0:
        tl.store(counts_ptr + ee, tot, mask=em)
        tl.store(recv_rows_ptr + rr, c, mask=rr < R)
        if PACKED:
            tl.store(offsets_ptr + ee, eoff, mask=em)
            tl.store(offsets_ptr + EL, tl.sum(padded))
    ii = tl.arange(0, BLOCK_RW)
    kk = tl.arange(0, BLOCK_K)
    below = tl.zeros((BLOCK_EL,), tl.int32)    # rows of each expert from sources below s
    for s in range(R):
        n = pick(c, rr, s)
        ov0 = pick(ovoff, rr, s)
        g0 = pick(goff, rr, s)
        for b in range(pid, tl.cdiv(n, BLOCK_RW), P):
            i = b * BLOCK_RW + ii
            g = g0 + i
            src, im = received_row(r1w=r1w, ovw=ovw, par=par, s=s, i=i, n=n, g=g, ov0=ov0, R=R, SLOT=SLOT, HDR=HDR,
                                   RB=RB, PCAP=PCAP, OVCAP=OVCAP, ROWS=ROWS)
            m2 = im[:, None] & (kk[None, :] < K)
            lid = tl.load(src[:, None] + PW + 1 + kk[None, :], mask=m2, other=-1)
            j = tl.load(src[:, None] + PW + 1 + K + kk[None, :], mask=m2, other=0)
            wt = tl.load(src[:, None] + PW + 1 + 2 * K + kk[None, :], mask=m2, other=0).to(tl.float32, bitcast=True)
            valid = m2 & (lid >= 0) & (lid < EL)
            # Order (source rank, token, k): rows of the expert from lower sources, then j.
            pos = gather(below, ee, lid) + j
            if PACKED:
                valid = valid & (gather(eoff, ee, lid) + pos < CAP)
            else:
                valid = valid & (pos < CAP)
            r = tl.where(valid, gather(eoff, ee, lid) + pos, -1)
            tl.store(rpos_ptr + g[:, None] * K + kk[None, :], r, mask=m2)
            tl.store(rw_ptr + g[:, None] * K + kk[None, :], tl.where(valid, wt, 0.0), mask=m2)
            r = r.to(tl.int64)
            # Payload words, then (fp8) the scales: each row read once, stored once per selection.
            for w0 in range(0, W, BLOCK_W):
                ww = w0 + tl.arange(0, BLOCK_W)
                wm = im[:, None] & (ww[None, :] < W)
                _scatter(out_x_ptr, r, kk, W, ww, tl.load(src[:, None] + ww[None, :], mask=wm), wm, K)
            if FP8:
                bb = tl.arange(0, BLOCK_NB)
                bm = im[:, None] & (bb[None, :] < NB)
                sv = tl.load(src[:, None].to(tl.pointer_type(tl.float32)) + H // 4 + bb[None, :], mask=bm)
                _scatter(out_s_ptr, r, kk, NB, bb, sv, bm, K, CM_ROWS)
        below += tl.load(sel_ptr + s * EL + ee, mask=em, other=0)


@triton.jit
def remote_combine_pack_kernel(
    y_ptr,             # bf16 [rows, H]: expert outputs in the layout of expert_x
    rpos_ptr,          # int32 [ROWS, K] from remote_unpack_kernel
    rw_ptr,            # float32 [ROWS, K]; ROWS and WIN: the caller's combine weights [rows, K]
    recv_rows_ptr,     # int32 [R]
    comb_send_ptr,     # uint8: the proxy's combine send buffer, [ROWS][CRB]
    R: tl.constexpr, K: tl.constexpr, H: tl.constexpr, BLOCK_RW: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, INTERP: tl.constexpr,
    CRB: tl.constexpr, ROWS: tl.constexpr = False, WIN: tl.constexpr = False,
):
    """Rows layout (``ROWS``): row ``rpos[g, 0]`` of ``y`` goes back as it is, followed by its K
    combine weights (float32 at byte ``2H``; zeros without ``WIN``); a row is ``CRB`` bytes."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    rr = tl.arange(0, BLOCK_R)
    total = tl.sum(tl.load(recv_rows_ptr + rr, mask=rr < R, other=0))
    out = comb_send_ptr.to(tl.pointer_type(tl.bfloat16))
    ii = tl.arange(0, BLOCK_RW)
    kk = tl.arange(0, BLOCK_K)
    for b in range(pid, tl.cdiv(total, BLOCK_RW), P):
        g = b * BLOCK_RW + ii
        gm = g < total
        m2 = gm[:, None] & (kk[None, :] < K)
        r = tl.load(rpos_ptr + g[:, None] * K + kk[None, :], mask=m2, other=-1)
        if ROWS:
            row = tl.sum(tl.where(kk[None, :] == 0, r, 0), axis=1).to(tl.int64)
            dst = comb_send_ptr + g.to(tl.int64) * CRB
            if WIN:
                wv = tl.load(rw_ptr + row[:, None] * K + kk[None, :], mask=m2, other=0.0)
            else:
                wv = tl.zeros((BLOCK_RW, BLOCK_K), tl.float32)
            tl.store((dst + 2 * H).to(tl.pointer_type(tl.float32))[:, None] + kk[None, :], wv, mask=m2)
            for h0 in range(0, H, BLOCK_H):
                hh = h0 + tl.arange(0, BLOCK_H)
                hm = gm[:, None] & (hh[None, :] < H)
                tl.store(dst.to(tl.pointer_type(tl.bfloat16))[:, None] + hh[None, :],
                         tl.load(y_ptr + row[:, None] * H + hh[None, :], mask=hm), mask=hm)
        else:
            # Pre-reduction: this rank's experts of the row sum here (float32), one bf16 row goes back.
            w = tl.load(rw_ptr + g[:, None] * K + kk[None, :], mask=m2, other=0.0)
            pre_reduce(y_ptr=y_ptr, r=r, w=w, kk=kk, go=gm, out=out + g.to(tl.int64) * H, K=K, H=H, BLOCK_T=BLOCK_RW,
                       BLOCK_H=BLOCK_H, STAGES=1, INTERP=INTERP)


@triton.jit(do_not_specialize=['T'])
def remote_combine_unpack_kernel(
    comb_recv_ptr,     # uint8: the combine receive region, [2][MAXROWS][2H]
    topk_ptr,          # [T, K] int32/int64: the routing given to pack
    send_pos_ptr,      # int32 [M, R] from remote_pack_kernel
    send_counts_ptr,   # int32 [R] from remote_pack_kernel
    base_ptr,          # float32 [T, H]: the node owners' sum (HAS_BASE), else unused
    out_ptr,           # bf16 [T, H]: out (float32 when OUT_F32: the sum, not rounded)
    epoch_ptr,         # int64 [1]
    T,
    wout_ptr,          # WOUT: float32 [T, K], the node owners' weight sums: the remote owners' are added
    RANK: tl.constexpr, R: tl.constexpr, G: tl.constexpr, E: tl.constexpr, EL: tl.constexpr, K: tl.constexpr,
    H: tl.constexpr, MAXROWS: tl.constexpr, HAS_BASE: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, INTERP: tl.constexpr,
    CRB: tl.constexpr, WOUT: tl.constexpr = False, OUT_F32: tl.constexpr = False,
):
    """A combine row is ``CRB`` bytes (``2H``, or rows layout ``2H`` + K float32 weights, which
    ``WOUT`` sums into ``wout``)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    par = tl.load(epoch_ptr) & 1
    comb = comb_recv_ptr.to(tl.pointer_type(tl.bfloat16))
    rr = tl.arange(0, BLOCK_R)
    rmask = rr < R
    remote = rmask & (rr // G != RANK // G)
    # Owner p's rows start at sum of c_{RANK,p'} over remote p' < p, in the epoch's parity copy.
    roff = excl(tl.where(remote, tl.load(send_counts_ptr + rr, mask=rmask, other=0), 0))
    tt = tl.arange(0, BLOCK_T)
    kk = tl.arange(0, BLOCK_K)
    for c in range(pid, tl.cdiv(T, BLOCK_T), P):
        t = c * BLOCK_T + tt
        tm = t < T
        ids, bad = load_routing(topk_ptr, t, tm, E, K, BLOCK_K)
        dst = tl.where(ids >= 0, ids // EL, -1)
        # One partial row per (token, remote owner): found through the token's first selection on
        # that owner, so the loop runs over K selections, not R ranks.
        hit = rr[None, None, :] == dst[:, :, None]
        use = first_on_rank(dst, kk) & (tl.max(tl.where(hit, remote[None, None, :].to(tl.int32), 0), axis=2) > 0)
        sp = tl.load(send_pos_ptr + t[:, None] * R + dst, mask=use, other=-1)
        row = tl.sum(tl.where(hit, roff[None, None, :], 0), axis=2) + sp
        row = tl.where(use & (sp >= 0), par * MAXROWS + row, -1).to(tl.int64)
        if WOUT:
            wacc = tl.load(wout_ptr + t[:, None] * K + kk[None, :], mask=tm[:, None] & (kk[None, :] < K), other=0.0)
            for k in tl.static_range(K):
                rk = col(row, kk, k)
                wrow = (comb_recv_ptr + rk * CRB + 2 * H).to(tl.pointer_type(tl.float32))
                wacc += tl.load(wrow[:, None] + kk[None, :], mask=(tm & (rk >= 0))[:, None] & (kk[None, :] < K),
                                other=0.0)
            tl.store(wout_ptr + t[:, None] * K + kk[None, :], wacc, mask=tm[:, None] & (kk[None, :] < K))
        for h0 in range(0, H, BLOCK_H):
            hh = h0 + tl.arange(0, BLOCK_H)
            hm = tm[:, None] & (hh[None, :] < H)
            if HAS_BASE:
                acc = tl.load(base_ptr + t[:, None] * H + hh[None, :], mask=hm, other=0.0)
            else:
                acc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
            for k in tl.static_range(K):
                rk = col(row, kk, k)
                acc += tl.load(comb + rk[:, None] * (CRB // 2) + hh[None, :], mask=hm & (rk[:, None] >= 0),
                               other=0.0).to(tl.float32)
            if OUT_F32:
                tl.store(out_ptr + t[:, None] * H + hh[None, :], acc, mask=hm)
            else:
                tl.store(out_ptr + t[:, None] * H + hh[None, :], to_bf16(acc, INTERP), mask=hm)


@triton.jit
def remote_unpack_rows_kernel(
    round1_ptr,        # uint8: round-1 region, [2][R][HDR + PCAP*RB]
    overflow_ptr,      # uint8: overflow region, [2][OVCAP*RB]
    rows_from_ptr,     # int32 [R]: rows each source sends this rank (remote_sel_kernel)
    out_x_ptr,         # int32 view of expert_x: [R*M, W]
    out_s_ptr,         # float32 [R*M, NB] expert_scales (FP8 only)
    ids_ptr,           # int32 [R*M, K]: out, local expert ids of each row (-1: another rank's)
    wts_ptr,           # float32 [R*M, K]: out, their weights (0 where the id is -1)
    src_ptr,           # int32 [R*M]: out, source rank * M + source token
    rpos_ptr,          # int32 [ROWS, K]: out, [g, 0] = the row of received row g (combine order)
    recv_rows_ptr,     # int32 [R]: out, rows received from each remote source (0 for the others)
    err_ptr,           # int64 [8]
    epoch_ptr,         # int64 [1]
    RANK: tl.constexpr, R: tl.constexpr, G: tl.constexpr, M: tl.constexpr, K: tl.constexpr, H: tl.constexpr,
    W: tl.constexpr, NB: tl.constexpr, PW: tl.constexpr, RB: tl.constexpr, HDR: tl.constexpr,
    PCAP: tl.constexpr, OVCAP: tl.constexpr, ROWS: tl.constexpr, FP8: tl.constexpr, BLOCK_RW: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_NB: tl.constexpr,
):
    """Rows layout, receive side of the inter-node path: remote source ``s``'s row ``i`` (token
    order, as packed) becomes row ``rows of every source below s + i``, the intranode order
    (source rank, source token) over all sources."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    SLOT: tl.constexpr = HDR + PCAP * RB
    par = tl.load(epoch_ptr) & 1
    r1w = round1_ptr.to(tl.pointer_type(tl.int32))
    ovw = overflow_ptr.to(tl.pointer_type(tl.int32))
    rr = tl.arange(0, BLOCK_R)
    c, ovoff, goff = received_counts(r1w, par, rr, RANK, R, G, SLOT, PCAP)
    first = excl(tl.load(rows_from_ptr + rr, mask=rr < R, other=0))  # first output row of each source
    if tl.sum(c) > ROWS:  # more than the combine send buffer holds (the proxy refuses it too)
        record_error(err_ptr, ERR_CAPACITY, -1, PHASE_DISPATCH, tl.load(epoch_ptr), tl.sum(c))
    if pid == 0:
        tl.store(recv_rows_ptr + rr, c, mask=rr < R)
    ii = tl.arange(0, BLOCK_RW)
    kk = tl.arange(0, BLOCK_K)
    for s in range(R):
        n = pick(c, rr, s)
        ov0 = pick(ovoff, rr, s)
        g0 = pick(goff, rr, s)
        o0 = pick(first, rr, s)
        for b in range(pid, tl.cdiv(n, BLOCK_RW), P):
            i = b * BLOCK_RW + ii
            g = g0 + i
            src, im = received_row(r1w=r1w, ovw=ovw, par=par, s=s, i=i, n=n, g=g, ov0=ov0, R=R, SLOT=SLOT, HDR=HDR,
                                   RB=RB, PCAP=PCAP, OVCAP=OVCAP, ROWS=ROWS)
            m2 = im[:, None] & (kk[None, :] < K)
            tok = tl.load(src + PW, mask=im, other=0)
            lid = tl.load(src[:, None] + PW + 1 + kk[None, :], mask=m2, other=-1)
            wt = tl.load(src[:, None] + PW + 1 + 2 * K + kk[None, :], mask=m2, other=0).to(tl.float32, bitcast=True)
            o = (o0 + i).to(tl.int64)
            tl.store(ids_ptr + o[:, None] * K + kk[None, :], lid, mask=m2)
            tl.store(wts_ptr + o[:, None] * K + kk[None, :], tl.where(lid >= 0, wt, 0.0), mask=m2)
            tl.store(src_ptr + o, s * M + tok, mask=im)
            tl.store(rpos_ptr + g * K, o.to(tl.int32), mask=im)
            for w0 in range(0, W, BLOCK_W):
                ww = w0 + tl.arange(0, BLOCK_W)
                wm = im[:, None] & (ww[None, :] < W)
                tl.store(out_x_ptr + o[:, None] * W + ww[None, :], tl.load(src[:, None] + ww[None, :], mask=wm), mask=wm)
            if FP8:
                bb = tl.arange(0, BLOCK_NB)
                bm = im[:, None] & (bb[None, :] < NB)
                sv = tl.load(src[:, None].to(tl.pointer_type(tl.float32)) + H // 4 + bb[None, :], mask=bm)
                tl.store(out_s_ptr + o[:, None] * NB + bb[None, :], sv, mask=bm)
