"""Dispatch kernel: every rank stores its tokens into its node peers, then expands what it got.

Workspace of each rank (bytes from its base, offsets from ``moe_ep.core.workspace``), ``par`` = epoch & 1:
  hdr_flag[src]                       int64, written by src only: last epoch whose header is in place
  disp_flag[src][CMAX]                int64, written by src only: last epoch whose chunk c is in place
  hdr[par][src][HDR]                  int32: [0] tokens of src, [1 + e] selections of local expert e
  meta_i[par][src][M][2K]             int32: local expert id (-1: not for this rank), position j
  meta_w[par][src][M][K]              float32 weights
  rows[par][src][M][RB]               payload: H elements (+ NB float32 scales for fp8)
Slot = token index on the source, so a sender never waits to learn where to write; the parity
double-buffers every region, so a rank one epoch ahead never overwrites rows still being read.

A source's tokens go in chunks of ``BT = ceil(T / CMAX)`` tokens; chunk ``c`` is sent by program
``c % P`` and flagged on its own, so a receiver expands chunk ``c`` as soon as it has landed
(no launch-wide arrival counter, no serial tail). One launch does both halves on a GPU (``SEND``
and ``RECV``): program ``p`` only ever waits for program ``p`` of its peers (and for the headers,
which every program writes before any wait), so programs of one launch never wait for each other
beyond that, and a grid no larger than the SM count is always co-resident. The interpreter runs
programs one after another, so on a CPU the host launches the two halves separately.
"""
import triton
import triton.language as tl

from .common import (ERR_BAD_EXPERT, ERR_CAPACITY, PHASE_DISPATCH, abort_combines, chunking, deadline_start,
                     first_own_tile, landed_chunk, own_prefetch, own_rows_in_blocks, payload_cols, payload_tile,
                     ptr_at, raise_flag, record_error, scale_ptr, store_own_rows, wait_flag)
from .args import Clock, DispatchIO
from .rows import on_peer, recv_rows_chunk, tokens_before
from .tiles import chunk_sum


@triton.jit
def local_counts(io, NC, d, DIM: tl.constexpr, MODE: tl.constexpr, TILE: tl.constexpr):
    """This rank's selections of each local expert of rank ``d``: int32 [BLOCK_EL]."""
    ee = tl.arange(0, TILE.BLOCK_EL)
    cnt = tl.zeros((TILE.BLOCK_EL,), tl.int32)
    if MODE.DIRECT:  # decode sizes (T*K <= 2048): count the ids themselves, no histogram launch
        for f0 in range(0, io.T * DIM.K, 1024):
            ff = f0 + tl.arange(0, 1024)
            loc = tl.load(io.topk_ptr + ff, mask=ff < io.T * DIM.K, other=-1).to(tl.int32) - d * DIM.EL
            mine = (loc >= 0) & (loc < DIM.EL) & (ff < io.T * DIM.K)
            cnt += tl.histogram(tl.where(mine, loc, 0), TILE.BLOCK_EL, mask=mine)
    else:
        cc = tl.arange(0, TILE.BLOCK_C)
        for c0 in range(0, NC, TILE.BLOCK_C):
            m = (ee[:, None] < DIM.EL) & (c0 + cc[None, :] < NC)
            cnt += tl.sum(tl.load(io.hist_ptr + (d * DIM.EL + ee)[:, None] * DIM.CMAX + c0 + cc[None, :], mask=m,
                                  other=0), axis=1)
    return cnt


@triton.jit
def selections_before(io, idf, c, DIM: tl.constexpr, MODE: tl.constexpr, TILE: tl.constexpr):
    """Per flat selection ``idf`` of chunk ``c``: this rank's selections of the same expert in earlier
    chunks (counted from the ids at decode sizes, else from the routing histogram [E, CMAX]);
    anything for a selection of none (``idf`` -1)."""
    pre = tl.zeros(idf.shape, tl.int32)
    if MODE.DIRECT:
        for f0 in range(0, c * io.BT * DIM.K, 256):
            ff = f0 + tl.arange(0, 256)
            prev = tl.load(io.topk_ptr + ff, mask=ff < c * io.BT * DIM.K, other=-1).to(tl.int32)
            pre += tl.sum((idf[:, None] == prev[None, :]).to(tl.int32), axis=1)
    else:
        pre = chunk_sum(io.hist_ptr, idf, idf >= 0, c, DIM.CMAX, TILE.BLOCK_C)
    return pre


@triton.jit
def _send_chunk(c, io, at, OFF: tl.constexpr, DIM: tl.constexpr, MODE: tl.constexpr, TILE: tl.constexpr,
                SELF_SYNC: tl.constexpr):
    """Chunk ``c`` (tokens [c*BT, (c+1)*BT)): the buffer's copy of its expert ids (what combine
    reads, so the caller may reuse ``topk_idx``), metadata to every peer, the payload once per
    destination rank, then the chunk's flag in every peer. ``ROWS``: the metadata's ``j`` columns
    carry the token's row among this rank's rows for the peer (``kernels/rows.py``); ``OWN_X``:
    no payload for this rank itself (its receive half reads ``x``); ``SELF_SYNC``: no flag for
    this rank itself (``landed_chunk``)."""
    S: tl.constexpr = TILE.BLOCK_T * TILE.BLOCK_K
    tt = tl.arange(0, TILE.BLOCK_T)
    kk = tl.arange(0, TILE.BLOCK_K)
    ff = tl.arange(0, S)
    t = c * io.BT + tt
    tm = (tt < io.BT) & (t < io.T)
    m2 = tm[:, None] & (kk[None, :] < DIM.K)
    ids = tl.load(io.topk_ptr + t[:, None] * DIM.K + kk[None, :], mask=m2, other=-1).to(tl.int32)
    valid = m2 & (ids >= 0) & (ids < DIM.E)
    if MODE.DIRECT:  # no routing-histogram launch checked the ids: out-of-range ones count as -1, reported
        bad = tl.sum((m2 & ((ids < -1) | (ids >= DIM.E))).to(tl.int32))
        if bad > 0:
            record_error(io.err_ptr, ERR_BAD_EXPERT, -1, PHASE_DISPATCH, at.epoch, bad)
    ids = tl.where(valid, ids, -1)
    tl.store(io.route_ptr + t[:, None] * DIM.K + kk[None, :], ids, mask=m2)
    w = tl.load(io.w_ptr + t[:, None] * DIM.K + kk[None, :], mask=m2, other=0.0)
    idf = tl.reshape(ids, (S,))
    # Position j of each selection among this rank's selections of its expert, which fixes the
    # order (source rank, token, k): earlier chunks + earlier in this chunk.
    if MODE.ROWS:
        pre = tl.zeros((S,), tl.int32)  # no per-expert positions: the rows layout places whole tokens
    else:
        pre = selections_before(io, idf, c, DIM, MODE, TILE)
    within = tl.sum(((idf[:, None] == idf[None, :]) & (ff[None, :] < ff[:, None])).to(tl.int32), axis=1)
    j = tl.reshape(pre + within, (TILE.BLOCK_T, TILE.BLOCK_K))
    # Node peer of each selection (global rank - NODE0); one outside [0, N) is on another node.
    dst = tl.where(valid, ids // DIM.EL - DIM.NODE0, -1)
    slot = (DIM.RANK * DIM.M + t).to(tl.int64) + at.par * (DIM.N * DIM.M)
    for d in tl.static_range(DIM.N):
        base = tl.load(io.peer_ptr + d)
        # Metadata goes to every peer (ids -1 where the token is not for it): it is how the
        # receiver tells this epoch's rows from stale ones without any reset.
        lid = tl.where(dst == d, ids - (DIM.NODE0 + d) * DIM.EL, -1)
        mi = ptr_at(base, OFF.meta_i, tl.int32) + slot[:, None] * (2 * DIM.K) + kk[None, :]
        tl.store(mi, lid, mask=m2)
        if MODE.ROWS:  # the token's row among this rank's rows for d: earlier chunks + earlier in the chunk
            on = on_peer(ids, d, DIM.NODE0, DIM.EL)
            pos = tokens_before(topk_ptr=io.topk_ptr, hist_ptr=io.hist_ptr, c=c, BT=io.BT, T=io.T, d=d,
                                NODE0=DIM.NODE0, E=DIM.E, EL=DIM.EL, K=DIM.K, CMAX=DIM.CMAX, DIRECT=MODE.DIRECT,
                                BLOCK_K=TILE.BLOCK_K) + \
                tl.cumsum(on, 0) - on
            tl.store(mi + DIM.K, tl.broadcast_to(pos[:, None], (TILE.BLOCK_T, TILE.BLOCK_K)), mask=m2)
        else:
            tl.store(mi + DIM.K, j, mask=m2)
        mw = ptr_at(base, OFF.meta_w, tl.float32) + slot[:, None] * DIM.K + kk[None, :]
        tl.store(mw, w, mask=m2)
    # Payload: read (and quantize) each tile once, store it to every destination rank.
    if not (MODE.OWN_X and DIM.N == 1):  # OWN_X alone in its node: no payload goes through the workspace
        if MODE.OWN_X:  # only tokens bound for another node peer are read here
            tm = tm & (tl.max(((dst >= 0) & (dst < DIM.N) & (dst != DIM.RANK)).to(tl.int32), axis=1) > 0)
        for h0 in tl.range(0, DIM.H, TILE.BLOCK_H, num_stages=TILE.STAGES):
            hh, hm, bb, bm = payload_cols(h0, tm, DIM.H, DIM.NB, MODE.FP8, TILE.BLOCK_H)
            q, sc = payload_tile(x_ptr=io.x_ptr, xs_ptr=io.xs_ptr, t=t, hh=hh, hm=hm, bb=bb, bm=bm, H=DIM.H, NB=DIM.NB,
                                 FP8=MODE.FP8, PREQ=MODE.PREQ, BLOCK_T=TILE.BLOCK_T, BLOCK_H=TILE.BLOCK_H,
                                 INTERP=MODE.INTERP)
            for d in tl.static_range(DIM.N):
                if not (MODE.OWN_X and d == DIM.RANK):
                    go = tl.max((dst == d).to(tl.int32), axis=1) > 0
                    base = tl.load(io.peer_ptr + d)
                    if MODE.FP8:
                        tl.store(ptr_at(base, OFF.rows, tl.uint8) + slot[:, None] * DIM.RB + hh[None, :], q,
                                 mask=hm & go[:, None])
                        tl.store(ptr_at(base, OFF.rows, tl.float32) + slot[:, None] * (DIM.RB // 4) + DIM.H // 4
                                 + bb[None, :], sc, mask=bm & go[:, None])
                    else:
                        tl.store(ptr_at(base, OFF.rows, tl.bfloat16) + slot[:, None] * (DIM.RB // 2) + hh[None, :], q,
                                 mask=hm & go[:, None])
    tl.debug_barrier()  # every thread's stores happen before the flag's release
    for d in tl.static_range(DIM.N):
        # (A system-scope release waits for every store of the program before it: skipping the
        # one this rank does not need keeps them in flight at R = 1.)
        if not (SELF_SYNC and d == DIM.RANK):
            raise_flag(ptr_at(tl.load(io.peer_ptr + d), OFF.disp_flag, tl.int64) + DIM.RANK * DIM.CMAX + c, at.epoch)


@triton.jit
def _recv_chunk(v, vs, s, c, hdr, scratch_ptr, io, at, OFF: tl.constexpr, DIM: tl.constexpr,
                MODE: tl.constexpr, TILE: tl.constexpr, SELF_SYNC: tl.constexpr):
    """Waits for chunk ``c`` of source ``s``, then copies each of its rows to every position its
    selections have in the expert layout and records those positions in ``recv_pos``. ``OWN_X``:
    this rank's own rows (``s == RANK``) come from ``x`` (quantized here for fp8), not the workspace,
    in sub-blocks of ``BLOCK_TS`` tokens (tiles of ``BLOCK_HS`` channels) when the chunk is larger,
    and ``v, vs`` is their first tile (``first_own_tile``, loaded by the caller)."""
    ok, t, tm, slot = landed_chunk(s, c, hdr, io, at, OFF, DIM, MODE, TILE, SELF_SYNC)
    if ok != 0:
        kk = tl.arange(0, TILE.BLOCK_K)
        m2 = tm[:, None] & (kk[None, :] < DIM.K)
        meta = ptr_at(io.ws, OFF.meta_i, tl.int32)
        lid = tl.load(meta + slot[:, None] * (2 * DIM.K) + kk[None, :], mask=m2, other=-1)
        j = tl.load(meta + slot[:, None] * (2 * DIM.K) + DIM.K + kk[None, :], mask=m2, other=0)
        valid = m2 & (lid >= 0)
        # Rows of expert e from sources below s come first (deterministic order); with other
        # nodes, every global source below this one, from the count matrix.
        pos = j
        if MODE.GLOBAL:
            for s2 in range(DIM.NODE0 + s):
                pos += tl.load(io.sel_ptr + s2 * DIM.EL + lid, mask=valid, other=0)
        else:
            for s2 in range(s):
                pos += tl.load(hdr + s2 * DIM.HDR + 1 + lid, mask=valid, other=0)
        if MODE.PACKED:
            r = tl.load(scratch_ptr + lid, mask=valid, other=0) + pos
            valid = valid & (r < DIM.CAP)
        else:
            valid = valid & (pos < DIM.CAP)
            r = lid * DIM.CAP + pos
        r = tl.where(valid, r, -1)
        tl.store(io.recv_pos_ptr + (s * DIM.M + t)[:, None] * DIM.K + kk[None, :], r, mask=m2)
        r = r.to(tl.int64)
        if MODE.OWN_X and (s == DIM.RANK):
            # Own rows straight from x: one read (and one quantization) feeds the K stores, and
            # nothing goes through the workspace (at R = 1 that is all rows).
            if TILE.BLOCK_TS == TILE.BLOCK_T:
                store_own_rows(v=v, vs=vs, nt=t, nm=t < 0, x_ptr=io.x_ptr, xs_ptr=io.xs_ptr, t=t, tm=tm, r=r, kk=kk,
                               out_x_ptr=io.out_x_ptr, out_s_ptr=io.out_s_ptr, KS=DIM.K, H=DIM.H, NB=DIM.NB,
                               FP8=MODE.FP8, PREQ=MODE.PREQ, BLOCK_T=TILE.BLOCK_T, BLOCK_H=TILE.BLOCK_H,
                               INTERP=MODE.INTERP, CM_ROWS=TILE.CM_ROWS)  # (t < 0: no tokens after these)
            else:
                own_rows_in_blocks(v, vs, s, c, hdr, kk, io, DIM, MODE, TILE, KS=DIM.K, CM_ROWS=TILE.CM_ROWS)
        else:
            _expand_rows(ptr_at(io.ws, OFF.rows, tl.int32) + slot * (DIM.RB // 4), r, tm, kk, io, DIM, MODE, TILE)


@triton.jit
def _expand_rows(src, r, tm, kk, io, DIM: tl.constexpr, MODE: tl.constexpr, TILE: tl.constexpr):
    """Workspace rows ``src`` (int32 words) of a chunk's tokens (mask ``tm``) to the K positions
    ``r`` [tokens, BLOCK_K] (-1: none) of each: each tile read once, stored K times (the scales
    at ``scale_ptr``)."""
    for w0 in tl.range(0, DIM.W, TILE.BLOCK_W, num_stages=TILE.STAGES):
        ww = w0 + tl.arange(0, TILE.BLOCK_W)
        wm = tm[:, None] & (ww[None, :] < DIM.W)
        v = tl.load(src[:, None] + ww[None, :], mask=wm)
        for k in tl.static_range(DIM.K):
            rk = tl.sum(tl.where(kk[None, :] == k, r, 0), axis=1)
            tl.store(io.out_x_ptr + rk[:, None] * DIM.W + ww[None, :], v, mask=wm & (rk[:, None] >= 0),
                     cache_modifier=".cs")
    if MODE.FP8:
        bb = tl.arange(0, TILE.BLOCK_NB)
        bm = tm[:, None] & (bb[None, :] < DIM.NB)
        sv = tl.load(src[:, None].to(tl.pointer_type(tl.float32)) + DIM.H // 4 + bb[None, :], mask=bm)
        for k in tl.static_range(DIM.K):
            rk = tl.sum(tl.where(kk[None, :] == k, r, 0), axis=1)
            tl.store(scale_ptr(io.out_s_ptr, rk[:, None], bb[None, :], DIM.NB, TILE.CM_ROWS), sv,
                     mask=bm & (rk[:, None] >= 0), cache_modifier=".cs")


@triton.jit(do_not_specialize=['T', 'BT', 'NC', 'ws', 'timeout_ns'])
def node_dispatch_kernel(
    x_ptr,             # [T, H] bf16, or uint8 (fp8 bytes) when PREQ
    xs_ptr,            # [T, NB] float32 scales when PREQ (else unused)
    topk_ptr,          # [T, K] int32/int64
    w_ptr,             # [T, K] float32
    hist_ptr,          # int32 [E, CMAX] from route_hist_kernel (unused when DIRECT)
    peer_ptr,          # int64 [N]: workspace base of each node peer
    ws,                # int: address of this rank's workspace
    state_ptr,         # int64 [2, P]: [0, p] dispatch epoch completed by program p
    err_ptr,           # int64 [8] error record
    out_x_ptr,         # int32 view of expert_x: [rows, W]
    out_s_ptr,         # float32 [rows, NB] expert_scales (FP8 only)
    counts_ptr,        # int32 [EL]
    offsets_ptr,       # int32 [EL + 1] (PACKED only)
    recv_pos_ptr,      # int32 [N, M, K]: row of each (source, slot, k) in the expert layout, or -1
    scratch_ptr,       # int32 [P, BLOCK_EL]: this program's copy of the packed expert offsets
    sel_ptr,           # int32 [R, EL] count matrix (GLOBAL only): selections per source and local expert
    route_ptr,         # int32 [M, K]: this rank's expert ids (-1 where none or out of range), read by combine
    T, BT, NC,         # tokens, tokens per chunk, chunks (of this rank)
    timeout_ns,
    rows_from_ptr,     # ROWS and GLOBAL: int32 [R], rows each source sends this rank (the count matrix's)
    recv_ids_ptr,      # ROWS: int32 [rows, K] local expert ids of each received row (-1: another rank's)
    recv_wts_ptr,      # ROWS: float32 [rows, K] their weights (0 where the id is -1)
    recv_src_ptr,      # ROWS: int32 [rows] source rank * M + source token of each received row
    num_recv_ptr,      # ROWS: int32 [1] received rows (with a cap: those needed, more than CAP when over)
    SEND: tl.constexpr, RECV: tl.constexpr,  # the halves this launch does
    OFF: tl.constexpr,   # Offsets: the workspace regions
    DIM: tl.constexpr,   # Dims: the buffer's sizes
    MODE: tl.constexpr,  # DispatchModes
    TILE: tl.constexpr,  # DispatchTiles
):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    t0_ns = deadline_start(MODE.INTERP)
    # Both halves in one launch: a program receives its own rank's chunks, which it sent itself
    # (landed_chunk), without a flag.
    SELF_SYNC: tl.constexpr = SEND and RECV
    epoch = tl.load(state_ptr + pid) + 1
    par = epoch & 1
    hdr = ptr_at(ws, OFF.hdr, tl.int32) + par * DIM.N * DIM.HDR
    # what the helpers take (named tuples: no code of their own)
    at = Clock(epoch, par, t0_ns, timeout_ns)
    io = DispatchIO(x_ptr=x_ptr, xs_ptr=xs_ptr, topk_ptr=topk_ptr, w_ptr=w_ptr, hist_ptr=hist_ptr, peer_ptr=peer_ptr,
                    ws=ws, err_ptr=err_ptr, out_x_ptr=out_x_ptr, out_s_ptr=out_s_ptr, recv_pos_ptr=recv_pos_ptr,
                    sel_ptr=sel_ptr, route_ptr=route_ptr, rows_from_ptr=rows_from_ptr, recv_ids_ptr=recv_ids_ptr,
                    recv_wts_ptr=recv_wts_ptr, recv_src_ptr=recv_src_ptr, T=T, BT=BT)
    if MODE.OWN_X and RECV and TILE.PREFETCH > 0 and TILE.BLOCK_TS < TILE.BLOCK_T and pid < NC:
        # This program's first own chunk, asked of the L2 while the metadata below is made.
        t0 = pid * BT
        own_prefetch(x_ptr, t0, tl.minimum(tl.minimum(BT, TILE.PREFETCH * TILE.BLOCK_TS), T - t0), DIM.H, MODE.INTERP)
    if SEND:
        # Headers first (program d writes the one for rank d) and the first chunk, before any wait.
        for d in range(pid, DIM.N, P):
            cnt = local_counts(io, NC, DIM.NODE0 + d, DIM, MODE, TILE)
            base = tl.load(peer_ptr + d)
            ph = ptr_at(base, OFF.hdr, tl.int32) + (par * DIM.N + DIM.RANK) * DIM.HDR
            tl.store(ph, T)
            ee = tl.arange(0, TILE.BLOCK_EL)
            tl.store(ph + 1 + ee, cnt, mask=ee < DIM.EL)
            if MODE.ROWS:  # this rank's rows for d: where d places the rows of the sources above this one
                tl.store(ph + 1 + DIM.EL, tokens_before(topk_ptr=topk_ptr, hist_ptr=hist_ptr, c=NC, BT=BT, T=T, d=d,
                                                        NODE0=DIM.NODE0, E=DIM.E, EL=DIM.EL, K=DIM.K, CMAX=DIM.CMAX,
                                                        DIRECT=MODE.DIRECT, BLOCK_K=TILE.BLOCK_K))
            tl.debug_barrier()
            raise_flag(ptr_at(base, OFF.hdr_flag, tl.int64) + DIM.RANK, epoch)
        if pid < NC:
            _send_chunk(pid, io, at, OFF, DIM, MODE, TILE, SELF_SYNC)
    ok = tl.full([], 1, tl.int32)
    nrecv = 0
    if RECV:
        for s in range(DIM.N):
            ok = ok & wait_flag(ptr_at(ws, OFF.hdr_flag, tl.int64) + s, epoch, t0_ns, timeout_ns, err_ptr,
                                DIM.NODE0 + s, PHASE_DISPATCH, MODE.INTERP)
        if ok != 0:
            ee = tl.arange(0, TILE.BLOCK_EL)
            em = ee < DIM.EL
            tot = tl.zeros((TILE.BLOCK_EL,), tl.int32)
            for s in range(DIM.N):
                if not MODE.GLOBAL:
                    tot += tl.load(hdr + s * DIM.HDR + 1 + ee, mask=em, other=0)
                nrecv = tl.maximum(nrecv, chunking(tl.load(hdr + s * DIM.HDR), DIM.CMAX)[1])
            if MODE.GLOBAL:  # every source of every node (the count matrix from the proxy's headers)
                for s in range(DIM.R):
                    tot += tl.load(sel_ptr + s * DIM.EL + ee, mask=em, other=0)
            if MODE.ROWS:  # one row per (source, token): over only past a cap (max_recv_rows)
                nrows = tl.zeros([], tl.int32)
                if MODE.GLOBAL:
                    for s in range(DIM.R):
                        nrows += tl.load(rows_from_ptr + s)
                else:
                    for s in range(DIM.N):
                        nrows += tl.load(hdr + s * DIM.HDR + 1 + DIM.EL)
                over = nrows > DIM.CAP
                if pid == 0:
                    tl.store(num_recv_ptr, nrows)
            elif MODE.PACKED:
                padded = (tot + DIM.ALIGN - 1) // DIM.ALIGN * DIM.ALIGN
                incl = tl.cumsum(padded, 0)
                total = tl.max(incl)
                over = total > DIM.CAP
                tl.store(scratch_ptr + pid * TILE.BLOCK_EL + ee, incl - padded)
                if pid == 0:
                    tl.store(offsets_ptr + ee, incl - padded, mask=em)
                    tl.store(offsets_ptr + DIM.EL, total)
            else:
                over = tl.max(tot) > DIM.CAP
            if over:  # detail: global expert << 32 | its rows; the node peers' combines learn it too
                worst = tl.argmax(tot, axis=0)
                need = tl.max(tot)
                if MODE.PACKED:  # the first expert whose block ends past the cap, and the rows the call needs
                    worst = tl.argmax((incl > DIM.CAP).to(tl.int32), axis=0)
                    need = total
                if MODE.ROWS:  # the rows the call needs (no expert: rows are per token)
                    worst = 0
                    need = nrows
                info = ((DIM.NODE0 + DIM.RANK) * DIM.EL + worst).to(tl.int64) * 4294967296 + need
                record_error(err_ptr, ERR_CAPACITY, DIM.NODE0 + DIM.RANK, PHASE_DISPATCH, epoch, info)
                if pid == 0:
                    abort_combines(peer_ptr, info, OFF.comb_flag, DIM.RANK, DIM.N, DIM.CMAX)
            if pid == 0:
                tl.store(counts_ptr + ee, tot, mask=em)
            tl.debug_barrier()
    # Software pipeline: iteration i sends chunk i and expands chunk i - P (sent one iteration
    # ago by the peers' program p, so it has usually landed): NVLink and local copies overlap.
    LAG = P if SEND else 0
    end = tl.maximum(NC if SEND else 0, (nrecv + LAG) if RECV else 0)
    for i in range(pid + LAG, end, P):
        if MODE.OWN_X and RECV:  # own chunk i - LAG: its first tile's loads go out before the send work
            tt = tl.arange(0, TILE.BLOCK_TS)
            v, vs = first_own_tile(x_ptr, xs_ptr, (i - LAG) * BT + tt, (tt < BT) & ((i - LAG) * BT + tt < T), DIM.H,
                                   DIM.NB, MODE.FP8, MODE.PREQ, TILE.BLOCK_HS)
        else:
            v, vs = 0, 0
        if SEND:
            if i < NC:
                _send_chunk(i, io, at, OFF, DIM, MODE, TILE, SELF_SYNC)
        if RECV:
            if ok != 0:
                for s in range(DIM.N):
                    if MODE.ROWS:
                        recv_rows_chunk(v, vs, s, i - LAG, hdr, io, at, OFF, DIM, MODE, TILE, SELF_SYNC)
                    else:
                        _recv_chunk(v, vs, s, i - LAG, hdr, scratch_ptr + pid * TILE.BLOCK_EL, io, at, OFF, DIM, MODE,
                                    TILE, SELF_SYNC)
    if RECV:
        tl.store(state_ptr + pid, epoch)  # each program keeps its own epoch: no cross-program step
