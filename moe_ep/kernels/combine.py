"""Combine kernel: the expert owner pre-reduces and sends one row per (token, rank) back; the
source sums the partial rows of its tokens.

Workspace of each rank, ``par`` = combine epoch & 1:
  comb_flag[owner][CMAX]          int64, written by owner only: last combine epoch whose chunk c is in place
  comb[par][owner][M][H]          bf16: sum over owner's experts of w * y for the token in that slot
Chunks are the dispatch chunks of the token's rank (``chunking``); chunk ``c`` of every source is
pre-reduced and flagged by program ``c % P`` of each owner and summed by program ``c % P`` of its
source, so a program only waits for its counterparts. An owner flags chunk 0 even for a source
with no tokens: every combine then waits for every owner once, which keeps the parity argument of
the double-buffered ``comb`` region (ARCHITECTURE.md §5) true for repeated combines too. As in
dispatch, one launch does both halves on a GPU; the interpreter gets them as two launches.

Combine-time weights (``WEIGHTS``; DeepEP's low-latency combine takes the weights at combine, not at
dispatch): before the send half, each source stores its tokens' weights over the ones its dispatch
put in every node peer's ``meta_w`` (same slots, same dispatch parity) and raises
``wgt_flag[source][c]`` there per chunk (the ``PUSH`` part); the owner's send half waits for that
flag before it reads a chunk's weights. The push never waits, so in one launch program ``p`` still
waits only for program ``p`` of its peers; without a fused launch the push is a launch of its own.
Why the slots are free: a source's combine ends only after every node owner has flagged every
chunk back, i.e. has read that source's weights of the previous combine.

``ROWS`` (the rows layout): the owner sends each received row back as it is (the caller has
reduced its local experts) with the row's combine weights (``comb_w``, zeros when the caller gave
none), and the source sums rows and weights over owners; ``OWN_Y``: this rank's own rows skip the
workspace (the receive half reads them from ``expert_y``).

``XROWS`` (the inter-node path, ``moe_ep/internode``): a token with owners on other nodes also sums
their partial rows, which the proxy delivered to ``xrecv``; ``xrows`` gives each one's row there
(the inter-node send half wrote it at dispatch), so every partial row is summed in float32 and
the output rounded once.
"""
import triton
import triton.language as tl

from .common import (ABORT_FLAG, ERR_CAPACITY, PHASE_COMBINE, PHASE_DISPATCH, chunking, deadline_start, pre_reduce,
                     pre_reduce_tile, ptr_at, raise_flag, record_error, to_bf16, wait_flag)


@triton.jit(do_not_specialize=['ws', 'timeout_ns', 'T'])
def node_combine_kernel(
    y_ptr,             # bf16 [rows, H]: expert outputs in the layout of expert_x
    topk_ptr,          # int32 [T, K]: the dispatch's expert ids (the buffer's copy, -1 where none)
    out_ptr,           # bf16 [T, H]; float32 when BASE_F32 (the sum, not rounded)
    ws,                # int: address of this rank's workspace
    peer_ptr,          # int64 [N]: workspace base of each node peer
    state_ptr,         # int64 [2, P]: [0, p] dispatch epoch, [1, p] combine epoch completed by program p
    err_ptr,           # int64 [8] error record
    recv_pos_ptr,      # int32 [N, M, K] from the dispatch kernel
    timeout_ns, T,
    wy_ptr,            # ROWS and WIN: float32 [rows, K] combine weights of each received row
    wout_ptr,          # ROWS and WOUT: float32 [T, K] out: their sum over owners
    cw_ptr,            # WEIGHTS: float32 [T, K] combine-time weights of this rank's tokens (masked/packed)
    xrows_ptr,         # XROWS: int32 [M, K] row in xrecv of each token's partial row from an owner on another node, or -1
    xrecv_ptr,         # XROWS: uint8, where those rows landed: [2][XMAX][XCRB], copy dispatch epoch & 1
    SEND: tl.constexpr, RECV: tl.constexpr,  # the halves this launch does
    PUSH: tl.constexpr,  # WEIGHTS: this launch pushes the combine-time weights (a launch of its own unless fused)
    OFF: tl.constexpr,   # Offsets: the workspace regions
    DIM: tl.constexpr,   # Dims: the buffer's sizes
    MODE: tl.constexpr,  # CombineModes
    TILE: tl.constexpr,  # CombineTiles
    XCRB: tl.constexpr = 0, XMAX: tl.constexpr = 0,  # XROWS: bytes of an xrecv row, rows of a copy of xrecv
):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    t0_ns = deadline_start(MODE.INTERP)
    # Both halves in one launch with OWN_Y: this rank's own tokens need no flag (nothing of theirs
    # goes through the workspace; a system-scope release would wait for every store before it).
    SELF_SYNC: tl.constexpr = SEND and RECV and MODE.OWN_Y
    dpar = tl.load(state_ptr + pid) & 1
    epoch = tl.load(state_ptr + P + pid) + 1
    par = epoch & 1
    rr = tl.arange(0, TILE.BLOCK_T)
    rt = tl.arange(0, TILE.BLOCK_TR)  # the receive half's tokens per step (BLOCK_TR <= BLOCK_T)
    kk = tl.arange(0, TILE.BLOCK_K)
    km = kk < DIM.K
    if PUSH:
        BT, NC = chunking(T, DIM.CMAX)
        for c in range(pid, tl.maximum(NC, 1), P):
            t = c * BT + rr
            m2 = ((rr < BT) & (t < T))[:, None] & km[None, :]
            w = tl.load(cw_ptr + t[:, None] * DIM.K + kk[None, :], mask=m2, other=0.0)
            slot = ((dpar * DIM.N + DIM.RANK) * DIM.M + t).to(tl.int64)
            for d in tl.static_range(DIM.N):
                # Every peer gets the chunk's weights, as at dispatch: the owner reads only its own
                # experts' (recv_pos says which), and the flag then means the same on every peer.
                base = tl.load(peer_ptr + d)
                tl.store(ptr_at(base, OFF.meta_w, tl.float32) + slot[:, None] * DIM.K + kk[None, :], w, mask=m2)
            tl.debug_barrier()  # every thread's stores happen before the flag's release
            for d in tl.static_range(DIM.N):
                raise_flag(ptr_at(tl.load(peer_ptr + d), OFF.wgt_flag, tl.int64) + DIM.RANK * DIM.CMAX + c, epoch)
    if SEND:
        hdr = ptr_at(ws, OFF.hdr, tl.int32) + dpar * DIM.N * DIM.HDR
        meta_w = ptr_at(ws, OFF.meta_w, tl.float32)
        for s in range(DIM.N):
            ts = tl.load(hdr + s * DIM.HDR)
            BT, NC = chunking(ts, DIM.CMAX)
            base = tl.load(peer_ptr + s)
            dst = ptr_at(base, OFF.comb, tl.bfloat16)
            for c in range(pid, tl.maximum(NC, 1), P):
                ok = tl.full([], 1, tl.int32)
                if MODE.WEIGHTS:  # the source's combine-time weights of this chunk are in place
                    ok = wait_flag(ptr_at(ws, OFF.wgt_flag, tl.int64) + s * DIM.CMAX + c, epoch, t0_ns, timeout_ns,
                                   err_ptr, DIM.NODE0 + s, PHASE_COMBINE, MODE.INTERP)
                t = c * BT + rr
                tm = (rr < BT) & (t < ts) & (ok != 0)  # no weights in time: nothing sent, no flag
                m2 = tm[:, None] & km[None, :]
                r = tl.load(recv_pos_ptr + (s * DIM.M + t)[:, None] * DIM.K + kk[None, :], mask=m2, other=-1)
                w = tl.load(meta_w + ((dpar * DIM.N + s) * DIM.M + t)[:, None] * DIM.K + kk[None, :],
                            mask=m2 & (r >= 0), other=0.0)
                go = tl.max((r >= 0).to(tl.int32), axis=1) > 0
                out = dst + ((par * DIM.N + DIM.RANK) * DIM.M + t).to(tl.int64) * DIM.H
                if MODE.OWN_Y and (s == DIM.RANK):
                    pass  # this rank's own tokens: its receive half reads expert_y itself
                elif MODE.ROWS:
                    _send_rows(y_ptr, wy_ptr, r, kk, out, ptr_at(base, OFF.comb_w, tl.float32) +
                               ((par * DIM.N + DIM.RANK) * DIM.M + t).to(tl.int64) * DIM.K, DIM.K, DIM.H, MODE.WIN,
                               TILE.BLOCK_H, TILE.STAGES)
                else:
                    pre_reduce(y_ptr=y_ptr, r=r, w=w, kk=kk, go=go, out=out, K=DIM.K, H=DIM.H, BLOCK_T=TILE.BLOCK_T,
                               BLOCK_H=TILE.BLOCK_H, STAGES=TILE.STAGES, INTERP=MODE.INTERP)
                tl.debug_barrier()  # every thread's stores happen before the flag's release
                if ok != 0:  # (else the source times out too, naming this rank: never a stale weight)
                    if SELF_SYNC:
                        if s != DIM.RANK:
                            raise_flag(ptr_at(base, OFF.comb_flag, tl.int64) + DIM.RANK * DIM.CMAX + c, epoch)
                    else:
                        raise_flag(ptr_at(base, OFF.comb_flag, tl.int64) + DIM.RANK * DIM.CMAX + c, epoch)
    if RECV:
        BT, NC = chunking(T, DIM.CMAX)
        comb = ptr_at(ws, OFF.comb, tl.bfloat16)
        for c in range(pid, tl.maximum(NC, 1), P):
            ok = tl.full([], 1, tl.int32)
            for owner in range(DIM.N):
                flag = ptr_at(ws, OFF.comb_flag, tl.int64) + owner * DIM.CMAX + c
                if SELF_SYNC:
                    if owner != DIM.RANK:
                        ok = ok & wait_flag(flag, epoch, t0_ns, timeout_ns, err_ptr, DIM.NODE0 + owner, PHASE_COMBINE,
                                            MODE.INTERP)
                else:
                    ok = ok & wait_flag(flag, epoch, t0_ns, timeout_ns, err_ptr, DIM.NODE0 + owner, PHASE_COMBINE,
                                        MODE.INTERP)
                v = tl.load(flag)  # (an own-dispatch overflow is still seen: abort_combines wrote it)
                if v >= ABORT_FLAG:  # the owner overflowed its masked layout in the dispatch combined here
                    record_error(err_ptr, ERR_CAPACITY, DIM.NODE0 + owner, PHASE_DISPATCH, tl.load(state_ptr + pid),
                                 v - ABORT_FLAG)
            # The chunk in sub-blocks of BLOCK_TR tokens: one when BLOCK_TR == BLOCK_T (the code as
            # without the loop); more give a channel step as many elements in longer pieces of each row.
            for sb in tl.static_range(TILE.BLOCK_T // TILE.BLOCK_TR):
                if ok != 0:
                    t = c * BT + sb * TILE.BLOCK_TR + rt
                    tm = (sb * TILE.BLOCK_TR + rt < BT) & (t < T)
                    ids = tl.load(topk_ptr + t[:, None] * DIM.K + kk[None, :], mask=tm[:, None] & km[None, :],
                                  other=-1).to(tl.int32)
                    dst = tl.where((ids >= 0) & (ids < DIM.E), ids // DIM.EL - DIM.NODE0, -1)  # node peer, if any
                    if MODE.XROWS:  # owners on other nodes: their rows' place in xrecv (bytes, -1: none)
                        xr = tl.load(xrows_ptr + t[:, None] * DIM.K + kk[None, :], mask=tm[:, None] & km[None, :],
                                     other=-1)
                        xoff = tl.where(xr >= 0, (dpar * XMAX + xr).to(tl.int64) * XCRB, -1)
                    if MODE.OWN_Y:  # this rank's rows of its own tokens, read from expert_y where dispatch put them
                        if MODE.ROWS:  # one row per token
                            own = tl.load(recv_pos_ptr + (DIM.RANK * DIM.M + t) * DIM.K, mask=tm, other=-1).to(tl.int64)
                        else:  # every selection's row, and its weight, for the pre-reduction here
                            m2 = tm[:, None] & km[None, :]
                            own_r = tl.load(recv_pos_ptr + (DIM.RANK * DIM.M + t)[:, None] * DIM.K + kk[None, :],
                                            mask=m2, other=-1)
                            if MODE.WEIGHTS:
                                own_w = tl.load(cw_ptr + t[:, None] * DIM.K + kk[None, :], mask=m2 & (own_r >= 0),
                                                other=0.0)
                            else:
                                own_w = tl.load(ptr_at(ws, OFF.meta_w, tl.float32)
                                                + ((dpar * DIM.N + DIM.RANK) * DIM.M + t)[:, None] * DIM.K
                                                + kk[None, :], mask=m2 & (own_r >= 0), other=0.0)
                    if MODE.WOUT:  # the rows' combine weights, summed over owners like the rows
                        wacc = tl.zeros((TILE.BLOCK_TR, TILE.BLOCK_K), tl.float32)
                        for d in tl.static_range(DIM.N):
                            go = tl.max((dst == d).to(tl.int32), axis=1) > 0
                            m2 = go[:, None] & km[None, :]
                            if MODE.OWN_Y and d == DIM.RANK:
                                if MODE.WIN:
                                    wacc += tl.load(wy_ptr + own[:, None] * DIM.K + kk[None, :], mask=m2, other=0.0)
                            else:
                                wsrc = ptr_at(ws, OFF.comb_w, tl.float32) + \
                                    ((par * DIM.N + d) * DIM.M + t).to(tl.int64) * DIM.K
                                wacc += tl.load(wsrc[:, None] + kk[None, :], mask=m2, other=0.0)
                        if MODE.XROWS:  # each row's K weights follow its 2H bytes of payload
                            for k in tl.static_range(DIM.K):
                                xk = tl.sum(tl.where(kk[None, :] == k, xoff, 0), axis=1)
                                wrow = (xrecv_ptr + xk + 2 * DIM.H).to(tl.pointer_type(tl.float32))
                                wacc += tl.load(wrow[:, None] + kk[None, :], mask=(xk >= 0)[:, None] & km[None, :],
                                                other=0.0)
                        tl.store(wout_ptr + t[:, None] * DIM.K + kk[None, :], wacc, mask=tm[:, None] & km[None, :])
                    if MODE.OWN_Y and MODE.ROWS:  # this rank's own rows: the first tile's loads, ahead of the loop
                        own_m = tm & (tl.max((dst == DIM.RANK).to(tl.int32), axis=1) > 0)
                        hh = tl.arange(0, TILE.BLOCK_HR)
                        nxt = tl.load(y_ptr + own[:, None] * DIM.H + hh[None, :],
                                      mask=own_m[:, None] & (hh[None, :] < DIM.H), other=0.0)
                    for h0 in range(0, DIM.H, TILE.BLOCK_HR):  # (its own channel tile: K loads per step with OWN_Y)
                        hh = h0 + tl.arange(0, TILE.BLOCK_HR)
                        hm = tm[:, None] & (hh[None, :] < DIM.H)
                        if MODE.OWN_Y and MODE.ROWS:
                            # The next tile's loads go out before this one is summed and stored (a
                            # register double buffer, as in dispatch's store_own_rows).
                            cur = nxt
                            hn = hh + TILE.BLOCK_HR
                            nxt = tl.load(y_ptr + own[:, None] * DIM.H + hn[None, :],
                                          mask=own_m[:, None] & (hn[None, :] < DIM.H), other=0.0)
                        acc = tl.zeros((TILE.BLOCK_TR, TILE.BLOCK_HR), tl.float32)
                        for d in tl.static_range(DIM.N):
                            go = tl.max((dst == d).to(tl.int32), axis=1) > 0
                            if MODE.OWN_Y and (d == DIM.RANK) and (not MODE.ROWS):
                                # The owner's pre-reduction of this rank's own tokens, done here and
                                # rounded to bf16 as the owner's row would be: same bits, no round trip.
                                part = pre_reduce_tile(y_ptr, own_r, own_w, kk, hh, hm & go[:, None], DIM.K, DIM.H,
                                                       TILE.BLOCK_TR, TILE.BLOCK_HR)
                                acc += to_bf16(part, MODE.INTERP).to(tl.float32)
                            elif MODE.OWN_Y and (d == DIM.RANK):
                                acc += cur.to(tl.float32)
                            else:
                                src = comb + ((par * DIM.N + d) * DIM.M + t).to(tl.int64) * DIM.H
                                acc += tl.load(src[:, None] + hh[None, :], mask=hm & go[:, None],
                                               other=0.0).to(tl.float32)
                        if MODE.XROWS:
                            for k in tl.static_range(DIM.K):
                                xk = tl.sum(tl.where(kk[None, :] == k, xoff, 0), axis=1)
                                src = (xrecv_ptr + xk).to(tl.pointer_type(tl.bfloat16))
                                acc += tl.load(src[:, None] + hh[None, :], mask=hm & (xk >= 0)[:, None],
                                               other=0.0).to(tl.float32)
                        if MODE.BASE_F32:  # a float32 out: the sum itself, not rounded
                            tl.store(out_ptr + t[:, None] * DIM.H + hh[None, :], acc, mask=hm)
                        else:
                            tl.store(out_ptr + t[:, None] * DIM.H + hh[None, :], to_bf16(acc, MODE.INTERP), mask=hm)
        tl.store(state_ptr + P + pid, epoch)  # each program keeps its own epoch: no cross-program step


@triton.jit
def _send_rows(y_ptr, wy_ptr, r, kk, out, wout, K: tl.constexpr, H: tl.constexpr, WIN: tl.constexpr,
               BLOCK_H: tl.constexpr, STAGES: tl.constexpr):
    """Rows layout, owner side: the received row ``r[:, 0]`` of each token of a chunk (-1: none)
    back into its source's ``comb`` slot ``out`` as it is, and its combine weights (or zeros)
    into ``wout``."""
    rk = tl.sum(tl.where(kk[None, :] == 0, r, 0), axis=1).to(tl.int64)
    go = rk >= 0
    m2 = go[:, None] & (kk[None, :] < K)
    if WIN:
        wv = tl.load(wy_ptr + rk[:, None] * K + kk[None, :], mask=m2, other=0.0)
    else:
        wv = tl.zeros(m2.shape, tl.float32)
    tl.store(wout[:, None] + kk[None, :], wv, mask=m2)
    for h0 in tl.range(0, H, BLOCK_H, num_stages=STAGES):
        hh = h0 + tl.arange(0, BLOCK_H)
        hm = go[:, None] & (hh[None, :] < H)
        tl.store(out[:, None] + hh[None, :], tl.load(y_ptr + rk[:, None] * H + hh[None, :], mask=hm), mask=hm)
