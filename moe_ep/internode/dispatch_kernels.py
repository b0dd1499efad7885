"""The inter-node dispatch kernel (docs/ARCHITECTURE.md §10), its halves as two launches or, where
every program is resident and ``Tuning.fused_internode`` asks, one: the send half packs rows for
remote peers and rings their bells, then stores into node peers; the receive half waits for the
headers, places node peers' rows and unpacks each remote source's as it lands.

Remote row (``REM.RB`` bytes, a multiple of 16; ``moe_ep.internode.spec.RemoteSpec``): payload
(bf16 ``H`` elements, or fp8 ``H`` bytes + ``NB`` float32 scales) at word 0, then the trailer at
word ``REM.PW`` (= payload bytes / 4): ``[token, lid[K], j[K], w[K]]`` int32 (``w`` as float32
bits): the source token index, per k the local expert id at the destination (-1: not for it),
the position ``j`` among the source's selections of that expert, the routing weight.
Send buffer: ``[HDR_p | rows_p]`` for every peer ``p`` != this rank in rank order (rows only for
remote ``p``, in token order); ``HDR_p`` = the count vector ``int32[R]`` (rows to each rank) +
``int32[EL]`` (selections of each of ``p``'s local experts).

Both halves call the node kernel (``node_dispatch_kernel``, its constexpr groups handed on from
``NODE``; one half each, in one launch too) for the node peers' part, so the node path and this
one share every line of it; the epoch is the node kernel's (``state[0, pid] + 1``).
"""
import triton
import triton.language as tl

from ..kernels.common import (ERR_CAPACITY, ERR_PROXY, ERR_TIMEOUT, PHASE_DISPATCH, deadline_start, payload_cols,
                              payload_tile, record_error, scale_ptr)
from ..kernels.args import DispatchIO, RemoteIO
from ..kernels.dispatch import local_counts, node_dispatch_kernel, selections_before
from ..kernels.rows import copy_rows, tokens_before
from ..kernels.tiles import chunk_sum, col, excl, first_on_rank, gather, load_routing, pick
from .mailbox import (MB_DISP_READY, MB_ERR_CODE, MB_ERR_PEER, MB_HDR_BELL, MB_HDR_READY, MB_OV_DONE, MB_OV_READY,
                      arrive_and_ring, look_word, look_words, ov_window, proxy_deadline, ready1, rows_bell,
                      wait_window, wait_word, window_count)


@triton.jit
def rank_counts(topk_ptr, rhist_ptr, T, NC, DIM: tl.constexpr, MODE: tl.constexpr, TILE: tl.constexpr,
                REM: tl.constexpr):
    """int32 [BLOCK_R]: this rank's rows to each rank (one per token with a selection there): at
    decode sizes (``DIRECT``) counted from the ids, else summed over the routing histogram's rank
    rows ``rhist`` [R, CMAX]."""
    rr = tl.arange(0, REM.BLOCK_R)
    if MODE.DIRECT:
        cnt = tl.zeros((REM.BLOCK_R,), tl.int32)
        tt = tl.arange(0, 64)
        kk = tl.arange(0, TILE.BLOCK_K)
        for t0 in range(0, T, 64):
            ids, bad = load_routing(topk_ptr, t0 + tt, t0 + tt < T, DIM.E, DIM.K, TILE.BLOCK_K)
            dst = tl.where(ids >= 0, ids // DIM.EL, -1)
            first = first_on_rank(dst, kk)
            cnt += tl.histogram(tl.reshape(tl.where(first, dst, 0), [64 * TILE.BLOCK_K]), REM.BLOCK_R,
                                mask=tl.reshape(first, [64 * TILE.BLOCK_K]))
        return cnt
    else:
        return chunk_sum(rhist_ptr, rr, rr < DIM.R, NC, DIM.CMAX, TILE.BLOCK_C)


@triton.jit
def pack_chunk_for(d, c, first_peer, off16, roff, io, rio, DIM: tl.constexpr, MODE: tl.constexpr,
                   TILE: tl.constexpr, REM: tl.constexpr):
    """Chunk ``c``'s rows for remote rank ``d`` into ``rows_d`` of the send buffer (``off16``: where
    ``rows_d`` starts, in 16-byte units): one row per token with a selection on ``d``, in token
    order, its trailer, and the token's combine row index ``roff + its row`` at its first
    selection on ``d`` in ``comb_row`` [M, K]. ``first_peer``: the chunk's first remote peer also
    writes -1 at every other selection of ``comb_row`` (each (token, k) is written once)."""
    ME: tl.constexpr = DIM.NODE0 + DIM.RANK
    S: tl.constexpr = TILE.BLOCK_T * TILE.BLOCK_K
    SEND16: tl.constexpr = REM.MAXROWS * REM.RB // 16
    K: tl.constexpr = DIM.K
    tt = tl.arange(0, TILE.BLOCK_T)
    kk = tl.arange(0, TILE.BLOCK_K)
    km = kk < K
    t = c * io.BT + tt
    tm = (tt < io.BT) & (t < io.T)
    ids, bad = load_routing(io.topk_ptr, t, tm, DIM.E, K, TILE.BLOCK_K)
    dst = tl.where(ids >= 0, ids // DIM.EL, -1)
    hit = dst == d
    go = (tl.max(hit.to(tl.int32), axis=1) > 0) & tm
    g = go.to(tl.int32)
    # The token's row among this rank's rows for d: tokens of earlier chunks with a selection on d
    # (the histogram's rank rows follow its N node rows), then earlier tokens of the chunk.
    pos = tokens_before(topk_ptr=io.topk_ptr, hist_ptr=io.hist_ptr + DIM.N * DIM.CMAX, c=c, BT=io.BT, T=io.T, d=d,
                        NODE0=0, E=DIM.E, EL=DIM.EL, K=K, CMAX=DIM.CMAX, DIRECT=MODE.DIRECT,
                        BLOCK_K=TILE.BLOCK_K) + tl.cumsum(g, 0) - g
    first = first_on_rank(dst, kk)
    cm = tm[:, None] & km[None, :]
    tl.store(rio.comb_row_ptr + t[:, None] * K + kk[None, :],
             tl.broadcast_to((roff + pos)[:, None], (TILE.BLOCK_T, TILE.BLOCK_K)), mask=cm & first & hit)
    if first_peer:  # every selection that is not a token's first on some remote rank
        remote_first = first & (dst >= 0) & (dst // DIM.N != ME // DIM.N)
        tl.store(rio.comb_row_ptr + t[:, None] * K + kk[None, :], tl.full((TILE.BLOCK_T, TILE.BLOCK_K), -1, tl.int32),
                 mask=cm & (remote_first == 0))
    # Position j of each selection among this rank's selections of its expert (order (token, k)).
    ff = tl.arange(0, S)
    idf = tl.reshape(ids, (S,))
    within = tl.sum(((idf[:, None] == idf[None, :]) & (ff[None, :] < ff[:, None])).to(tl.int32), axis=1)
    pre = tl.where(idf >= 0, selections_before(io, idf, c, DIM, MODE, TILE), 0)
    j = tl.reshape(pre + within, (TILE.BLOCK_T, TILE.BLOCK_K))
    w = tl.load(io.w_ptr + t[:, None] * K + kk[None, :], mask=cm, other=0.0)
    # Rows in 16-byte units, so the compiler sees every row address 16-byte aligned (vector stores).
    row16 = off16 + pos.to(tl.int64) * (REM.RB // 16)
    ok = go & (row16 + REM.RB // 16 <= SEND16)  # never past the send buffer (the count check records it)
    words = rio.send_ptr.to(tl.pointer_type(tl.int32))
    tw = words + row16 * 4 + REM.PW
    tl.store(tw, t, mask=ok)
    m2 = ok[:, None] & km[None, :]
    tl.store(tw[:, None] + 1 + kk[None, :], tl.where(hit, ids - d * DIM.EL, -1), mask=m2)
    tl.store(tw[:, None] + 1 + K + kk[None, :], j, mask=m2)
    tl.store(tw[:, None] + 1 + 2 * K + kk[None, :], w.to(tl.int32, bitcast=True), mask=m2)
    rw = row16 * 4
    for h0 in range(0, DIM.H, REM.BLOCK_RH):
        hh, hm, bb, bm = payload_cols(h0, ok, DIM.H, DIM.NB, MODE.FP8, REM.BLOCK_RH)
        q, sc = payload_tile(x_ptr=io.x_ptr, xs_ptr=io.xs_ptr, t=t, hh=hh, hm=hm, bb=bb, bm=bm, H=DIM.H, NB=DIM.NB,
                             FP8=MODE.FP8, PREQ=MODE.PREQ, BLOCK_T=TILE.BLOCK_T, BLOCK_H=REM.BLOCK_RH,
                             INTERP=MODE.INTERP)
        if MODE.FP8:
            tl.store(rio.send_ptr + rw[:, None] * 4 + hh[None, :], q, mask=hm)
            tl.store((words + rw + DIM.H // 4)[:, None].to(tl.pointer_type(tl.float32)) + bb[None, :], sc, mask=bm)
        else:
            tl.store((words + rw)[:, None].to(tl.pointer_type(tl.bfloat16)) + hh[None, :], q, mask=hm)


@triton.jit
def count_matrix(hdr_recv_ptr, own_ptr, sel_ptr, rows_from_ptr, ok, par, ME: tl.constexpr, R: tl.constexpr,
                 EL: tl.constexpr, REM_HDR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_EL: tl.constexpr, own=0,
                 own_n=0, OWN_GIVEN: tl.constexpr = False):
    """This program's copy of the count matrix ``sel`` [R, EL] (selections of each local expert from
    each source: row ``s`` from ``s``'s header in the epoch's header copy, this rank's own from
    ``own``) and of ``rows_from`` [R] (each source's rows for this rank), loaded as one tile each
    (host memory: one round of reads, not one per source). Zeros where the headers are not
    in (``ok`` 0: the error is recorded). ``OWN_GIVEN``: this rank's own row is ``own`` [BLOCK_EL] and
    its rows for itself ``own_n`` (the caller counted them), not ``own_ptr``'s."""
    rr = tl.arange(0, BLOCK_R)
    ee = tl.arange(0, BLOCK_EL)
    em = ee < EL
    r1w = hdr_recv_ptr.to(tl.pointer_type(tl.int32))
    hdr = ((par * R + rr) * REM_HDR) // 4
    peer = (rr < R) & (rr != ME) & (ok != 0)
    sel = tl.load(r1w + hdr[:, None] + R + ee[None, :], mask=peer[:, None] & em[None, :], other=0)
    if OWN_GIVEN:
        sel += tl.where((rr == ME)[:, None] & em[None, :], own[None, :], 0)
    else:
        sel += tl.where((rr == ME)[:, None], tl.load(own_ptr + ee, mask=em, other=0)[None, :], 0)
    tl.store(sel_ptr + rr[:, None] * EL + ee[None, :], sel, mask=(rr < R)[:, None] & em[None, :])
    if OWN_GIVEN:
        rf = tl.load(r1w + hdr + ME, mask=peer, other=0) + tl.where(rr == ME, own_n, 0)
    else:
        rf = tl.load(r1w + hdr + ME, mask=peer, other=0) + tl.where(rr == ME, tl.load(own_ptr + EL), 0)
    tl.store(rows_from_ptr + rr, rf, mask=rr < R)
    tl.debug_barrier()  # the node receive reads these copies from other threads of this program


@triton.jit
def unpack_block(src, im, g, below, eoff, ee, io, rio, DIM: tl.constexpr, MODE: tl.constexpr, TILE: tl.constexpr,
                 REM: tl.constexpr):
    """Masked / packed layouts: received rows ``src`` (int32 word addresses, mask ``im``; combine
    order ``g``) into the expert layout, each selection at ``eoff[lid] + below[lid] + j`` (rows of
    the expert from lower sources, then the source's own order): the order (source rank, token,
    k) of the node path. Records each (row, k)'s layout row and weight in ``rpos`` / ``rw``."""
    K: tl.constexpr = DIM.K
    kk = tl.arange(0, TILE.BLOCK_K)
    m2 = im[:, None] & (kk[None, :] < K)
    lid = tl.load(src[:, None] + REM.PW + 1 + kk[None, :], mask=m2, other=-1)
    j = tl.load(src[:, None] + REM.PW + 1 + K + kk[None, :], mask=m2, other=0)
    wt = tl.load(src[:, None] + REM.PW + 1 + 2 * K + kk[None, :], mask=m2, other=0).to(tl.float32, bitcast=True)
    valid = m2 & (lid >= 0) & (lid < DIM.EL)
    r = gather(eoff, ee, lid) + gather(below, ee, lid) + j
    if MODE.PACKED:
        valid = valid & (r < DIM.CAP)
    else:
        valid = valid & (gather(below, ee, lid) + j < DIM.CAP)
    r = tl.where(valid, r, -1)
    tl.store(rio.rpos_ptr + g[:, None] * K + kk[None, :], r, mask=m2)
    tl.store(rio.rw_ptr + g[:, None] * K + kk[None, :], tl.where(valid, wt, 0.0), mask=m2)
    r = r.to(tl.int64)
    # Payload words, then (fp8) the scales: each row read once, stored once per selection.
    for w0 in range(0, DIM.W, TILE.BLOCK_W):
        ww = w0 + tl.arange(0, TILE.BLOCK_W)
        wm = im[:, None] & (ww[None, :] < DIM.W)
        v = tl.load(src[:, None] + ww[None, :], mask=wm)
        for k in tl.static_range(K):
            rk = col(r, kk, k)
            tl.store(io.out_x_ptr + rk[:, None] * DIM.W + ww[None, :], v, mask=wm & (rk[:, None] >= 0))
    if MODE.FP8:
        bb = tl.arange(0, TILE.BLOCK_NB)
        bm = im[:, None] & (bb[None, :] < DIM.NB)
        sv = tl.load(src[:, None].to(tl.pointer_type(tl.float32)) + DIM.H // 4 + bb[None, :], mask=bm)
        for k in tl.static_range(K):
            rk = col(r, kk, k)
            tl.store(scale_ptr(io.out_s_ptr, rk[:, None], bb[None, :], DIM.NB, TILE.CM_ROWS), sv,
                     mask=bm & (rk[:, None] >= 0))


@triton.jit
def unpack_rows_block(src, im, g, o, s, io, rio, DIM: tl.constexpr, MODE: tl.constexpr, TILE: tl.constexpr,
                      REM: tl.constexpr):
    """Rows layout: received rows ``src`` of source ``s`` (mask ``im``, combine order ``g``) become
    rows ``o`` (the source's first row among every source's, plus its token order), with their
    local ids, weights and source; ``rpos[g, 0] = o``. Rows at or past ``DIM.CAP`` (a cap,
    ``max_recv_rows``, whose overflow the count check recorded) are not written (``rpos`` -1)."""
    K: tl.constexpr = DIM.K
    tl.store(rio.rpos_ptr + g * K, tl.where(o < DIM.CAP, o, -1).to(tl.int32), mask=im)
    im = im & (o < DIM.CAP)
    kk = tl.arange(0, TILE.BLOCK_K)
    m2 = im[:, None] & (kk[None, :] < K)
    tok = tl.load(src + REM.PW, mask=im, other=0)
    lid = tl.load(src[:, None] + REM.PW + 1 + kk[None, :], mask=m2, other=-1)
    wt = tl.load(src[:, None] + REM.PW + 1 + 2 * K + kk[None, :], mask=m2, other=0).to(tl.float32, bitcast=True)
    o = o.to(tl.int64)
    tl.store(io.recv_ids_ptr + o[:, None] * K + kk[None, :], lid, mask=m2)
    tl.store(io.recv_wts_ptr + o[:, None] * K + kk[None, :], tl.where(lid >= 0, wt, 0.0), mask=m2)
    tl.store(io.recv_src_ptr + o, s * DIM.M + tok, mask=im)
    copy_rows(src, im, o, io, DIM, MODE, TILE, STAGES=None)


@triton.jit
def unpack_any(src, im, g, o, s, below, eoff, ee, io, rio, DIM: tl.constexpr, MODE: tl.constexpr, TILE: tl.constexpr,
               REM: tl.constexpr):
    """A block of source ``s``'s received rows (``src``, mask ``im``, combine order ``g``) into the
    layout: ``unpack_rows_block`` (rows layout, at rows ``o``) or ``unpack_block`` (``below``,
    ``eoff``, ``ee``: as it takes them). (``g`` and ``o`` come from the caller: computed here, a
    few instructions of the compiled kernel change their order.)"""
    if MODE.ROWS:
        unpack_rows_block(src, im, g, o, s, io, rio, DIM, MODE, TILE, REM)
    else:
        unpack_block(src, im, g, below, eoff, ee, io, rio, DIM, MODE, TILE, REM)


@triton.jit(do_not_specialize=['T', 'BT', 'NC', 'ws', 'timeout_ns'])
def internode_dispatch_kernel(
    # the node kernel's runtime arguments (node_dispatch_kernel's, in its order)
    x_ptr, xs_ptr, topk_ptr, w_ptr, hist_ptr, peer_ptr, ws, state_ptr, err_ptr, out_x_ptr, out_s_ptr, counts_ptr,
    offsets_ptr, recv_pos_ptr, scratch_ptr, sel_ptr, route_ptr, T, BT, NC, timeout_ns, rows_from_ptr, recv_ids_ptr,
    recv_wts_ptr, recv_src_ptr, num_recv_ptr,
    # the remote peers' and sources'
    send_ptr,          # uint8: the proxy's dispatch send buffer, rows only (host or GPU memory)
    hdr_send_ptr,      # uint8: the proxy's header send region, [R][REM.HDR] (host memory)
    round1_ptr,        # uint8: the round-1 region, [2][R][PCAP * REM.RB] (host or GPU memory)
    overflow_ptr,      # uint8: the overflow region, [2][OVCAP * REM.RB] (host or GPU memory)
    hdr_recv_ptr,      # uint8: the header receive region, [2][R][REM.HDR] (host memory)
    mb_ptr,            # int64: the proxy's mailbox (host memory)
    tally_ptr,         # int32 (RemoteSpec.tally_at): arrive [2R + 2]: programs done with each peer's rows ([R]:
                       # with the headers; [2R + 1]: with overflow window 0), 0 between launches; at REM.OWN
                       # own [EL + 1]: this rank's selections of its own experts, [EL] its tokens for itself (the
                       # send half's); at REM.GOT recv_rows [R]: out, rows received from each remote source
    comb_row_ptr,      # int32 [M, K]: out, combine row index of each token's first selection on a remote rank, else -1
    rpos_ptr,          # int32 [ROWS_CAP, K]: out, layout row of each received (row, k), or -1 (rows: [g, 0] its row)
    rw_ptr,            # float32 [ROWS_CAP, K]: out, its weight (0 where rpos is -1)
    SEND: tl.constexpr, RECV: tl.constexpr,  # the halves this launch does
    NODE: tl.constexpr,  # NodeGroups: the node kernel's OFF, DIM, MODE, TILE
    REM: tl.constexpr,   # Remote: the inter-node sizes
):
    """The send half (``SEND``): headers and rows for remote peers (each peer's bell rung as soon
    as its rows are packed, peers taken from the next node on), then the node peers' stores.

    The receive half (``RECV``): once every source's header is in (the count matrix), the node
    peers' rows (the node kernel, placing them with the count matrix), then each remote source's
    round-1 rows and its part of overflow window 0 as they land; then, where this rank's overflow
    stream needs more windows of ``OVCAP`` rows, window 0 done (``ov_done``, the last program to
    arrive) and the later windows one after another by the last program (each: wait for
    ``ov_ready``, unpack, ``ov_done``; one program, so the interpreter, which runs programs one
    after another, never waits for a program that has not run). ``sel_ptr`` and ``rows_from_ptr``
    hold one copy per program ([P, R, EL], [P, R]).

    Both in one launch (every program resident, ``Tuning.fused_internode``): a program does its
    whole send half, which never waits, before its receive half, as the node kernel orders its
    halves; what its receive half needs from the send half it derives itself (this rank's own
    counts) or waits for with a deadline (the node headers, the proxy's words: the proxy sees a
    bell once every program arrived, which every resident program does before it waits)."""
    DIM: tl.constexpr = NODE.DIM
    MODE: tl.constexpr = NODE.MODE
    TILE: tl.constexpr = NODE.TILE
    ME: tl.constexpr = DIM.NODE0 + DIM.RANK
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    epoch = tl.load(state_ptr + pid) + 1
    own_ptr = tally_ptr + REM.OWN
    if SEND:
        # what the helpers take (named tuples: no code of their own)
        io = DispatchIO(x_ptr=x_ptr, xs_ptr=xs_ptr, topk_ptr=topk_ptr, w_ptr=w_ptr, hist_ptr=hist_ptr,
                        peer_ptr=peer_ptr, ws=ws, err_ptr=err_ptr, out_x_ptr=out_x_ptr, out_s_ptr=out_s_ptr,
                        recv_pos_ptr=recv_pos_ptr, sel_ptr=sel_ptr, route_ptr=route_ptr, rows_from_ptr=rows_from_ptr,
                        recv_ids_ptr=recv_ids_ptr, recv_wts_ptr=recv_wts_ptr, recv_src_ptr=recv_src_ptr, T=T, BT=BT)
        rio = RemoteIO(send_ptr=send_ptr, comb_row_ptr=comb_row_ptr, mb_ptr=mb_ptr, rpos_ptr=0, rw_ptr=0,
                       rtimeout_ns=0, spins=0)
        rr = tl.arange(0, REM.BLOCK_R)
        rmask = rr < DIM.R
        remote = rmask & (rr // DIM.N != ME // DIM.N)
        # Every program derives the count vector and the send buffer's layout (no program waits for
        # another); offsets in 16-byte units (REM.RB is a multiple of 16).
        cnt = rank_counts(topk_ptr, hist_ptr + (DIM.E + DIM.N) * DIM.CMAX, T, NC, DIM, MODE, TILE, REM)
        rows = tl.where(remote, cnt, 0)
        off16 = excl(rows.to(tl.int64) * (REM.RB // 16))
        roff = excl(rows)  # each remote owner's first row in the combine receive region (rank order)
        ee = tl.arange(0, TILE.BLOCK_EL)
        if pid == 0:
            if tl.sum(rows) > REM.MAXROWS:  # the proxy refuses these counts too; nothing is written past the buffer
                record_error(err_ptr, ERR_CAPACITY, -1, PHASE_DISPATCH, epoch, tl.sum(rows))
            mine = local_counts(io, NC, ME, DIM, MODE, TILE)
            tl.store(own_ptr + ee, mine, mask=ee < DIM.EL)
            tl.store(own_ptr + DIM.EL, pick(cnt, rr, ME))
        # Headers first: the receivers place every row with them. Slot d: the count vector and d's
        # selections (this rank's own slot too: the proxy reads its count vector there).
        words = hdr_send_ptr.to(tl.pointer_type(tl.int32))
        for d in range(pid, DIM.R, P):
            hp = words + d * (REM.HDR // 4)
            tl.store(hp + rr, cnt, mask=rmask)
            sel = local_counts(io, NC, d, DIM, MODE, TILE)
            tl.store(hp + DIM.R + ee, sel, mask=ee < DIM.EL)
        arrive_and_ring(tally_ptr + DIM.R, mb_ptr, MB_HDR_BELL, epoch)
        # Rows, peer by peer: the proxy posts a peer's rows while the next one is packed.
        for hop in range(DIM.R - DIM.N):  # (not ``q``: the receive half's loops name a tensor so)
            d = (DIM.NODE0 + DIM.N + hop) % DIM.R
            for c in range(pid, NC, P):
                pack_chunk_for(d, c, hop == 0, pick(off16, rr, d), pick(roff, rr, d), io, rio, DIM, MODE, TILE, REM)
            arrive_and_ring(tally_ptr + d, mb_ptr, rows_bell(DIM.R, d), epoch)
        node_dispatch_kernel(x_ptr, xs_ptr, topk_ptr, w_ptr, hist_ptr, peer_ptr, ws, state_ptr, err_ptr, out_x_ptr,
                             out_s_ptr, counts_ptr, offsets_ptr, recv_pos_ptr, scratch_ptr, sel_ptr, route_ptr, T, BT,
                             NC, timeout_ns, rows_from_ptr, recv_ids_ptr, recv_wts_ptr, recv_src_ptr, num_recv_ptr,
                             SEND=True, RECV=False, OFF=NODE.OFF, DIM=DIM, MODE=MODE, TILE=TILE)
    if RECV:
        rtimeout_ns, spins = proxy_deadline(timeout_ns)
        par = epoch & 1
        REM_SLOT: tl.constexpr = REM.PCAP * REM.RB
        t0_ns = deadline_start(MODE.INTERP)
        ok = wait_word(mb_ptr, MB_HDR_READY, epoch, err_ptr, -1, PHASE_DISPATCH, t0_ns, rtimeout_ns, spins,
                       MODE.INTERP)
        sel_p = sel_ptr + pid * (DIM.R * DIM.EL)
        rf_p = rows_from_ptr + pid * DIM.R
        if SEND:  # one launch: this program's own counts, not program 0's store (no program waits for another)
            count_matrix(hdr_recv_ptr, own_ptr, sel_p, rf_p, ok, par, ME, DIM.R, DIM.EL, REM.HDR, REM.BLOCK_R,
                         TILE.BLOCK_EL, local_counts(io, NC, ME, DIM, MODE, TILE), pick(cnt, rr, ME), True)
        else:
            count_matrix(hdr_recv_ptr, own_ptr, sel_p, rf_p, ok, par, ME, DIM.R, DIM.EL, REM.HDR, REM.BLOCK_R,
                         TILE.BLOCK_EL)
        node_dispatch_kernel(x_ptr, xs_ptr, topk_ptr, w_ptr, hist_ptr, peer_ptr, ws, state_ptr, err_ptr, out_x_ptr,
                             out_s_ptr, counts_ptr, offsets_ptr, recv_pos_ptr, scratch_ptr, sel_p, route_ptr, T, BT,
                             NC, timeout_ns, rf_p, recv_ids_ptr, recv_wts_ptr, recv_src_ptr, num_recv_ptr,
                             SEND=False, RECV=True, OFF=NODE.OFF, DIM=DIM, MODE=MODE, TILE=TILE)
        # Remote sources: rows from each (one per token), where they are, in combine order.
        rr = tl.arange(0, REM.BLOCK_R)
        remote = (rr < DIM.R) & (rr // DIM.N != ME // DIM.N)
        c = tl.where(remote, tl.load(rf_p + rr, mask=rr < DIM.R, other=0), 0)
        n1s = tl.minimum(c, REM.PCAP)
        ovoff = excl(c - n1s)            # each source's first row in this rank's overflow stream
        ov0 = tl.minimum(c - n1s, tl.maximum(REM.OVCAP - ovoff, 0))  # its rows in window 0 (the rest: later windows)
        goff = excl(c)                   # each source's first received row in combine order
        first = excl(tl.load(rf_p + rr, mask=rr < DIM.R, other=0))  # rows layout: each source's first row
        if (tl.sum(c) > REM.ROWS_CAP) & (pid == 0):  # more than the combine send buffer holds (the proxy refuses it)
            record_error(err_ptr, ERR_CAPACITY, -1, PHASE_DISPATCH, epoch, tl.sum(c))
        if pid == 0:
            tl.store(tally_ptr + REM.GOT + rr, c, mask=rr < DIM.R)
        ee = tl.arange(0, TILE.BLOCK_EL)
        em = ee < DIM.EL
        sel_t = tl.load(sel_p + rr[:, None] * DIM.EL + ee[None, :], mask=(rr < DIM.R)[:, None] & em[None, :], other=0)
        tot = tl.sum(sel_t, axis=0)
        if MODE.PACKED:
            eoff = excl((tot + DIM.ALIGN - 1) // DIM.ALIGN * DIM.ALIGN)
        else:
            eoff = ee * DIM.CAP
        r1w = round1_ptr.to(tl.pointer_type(tl.int32))
        ovw = overflow_ptr.to(tl.pointer_type(tl.int32))
        ii = tl.arange(0, REM.BLOCK_RW)
        # what the helpers take (named tuples: no code of their own)
        io = DispatchIO(x_ptr=x_ptr, xs_ptr=xs_ptr, topk_ptr=topk_ptr, w_ptr=w_ptr, hist_ptr=hist_ptr,
                        peer_ptr=peer_ptr, ws=ws, err_ptr=err_ptr, out_x_ptr=out_x_ptr, out_s_ptr=out_s_ptr,
                        recv_pos_ptr=recv_pos_ptr, sel_ptr=sel_p, route_ptr=route_ptr, rows_from_ptr=rf_p,
                        recv_ids_ptr=recv_ids_ptr, recv_wts_ptr=recv_wts_ptr, recv_src_ptr=recv_src_ptr, T=T, BT=BT)
        rio = RemoteIO(send_ptr=0, comb_row_ptr=0, mb_ptr=mb_ptr, rpos_ptr=rpos_ptr, rw_ptr=rw_ptr,
                       rtimeout_ns=rtimeout_ns, spins=spins)
        # Each source's round-1 rows once its ready1 word is up, its round-2 rows once its ready2 is,
        # in whatever order they land (a late source holds no other back): this program's work per
        # source (bit 0: round 1, bit 1: round 2, where it has blocks), the words read as two vectors
        # per look.
        nb1 = tl.cdiv(n1s, REM.BLOCK_RW)
        nb2 = tl.cdiv(ov0, REM.BLOCK_RW)
        todo = tl.where(remote & (pid < nb1), 1, 0) + tl.where(remote & (pid < nb2), 2, 0)
        bad = look_word(mb_ptr + MB_ERR_CODE)
        late = tl.full([], 0, tl.int32)
        looks = 0
        while (tl.max(todo, axis=0) > 0) & (bad == 0) & (late == 0):
            up1 = look_words(mb_ptr + ready1(DIM.R, 0), DIM.R, REM.BLOCK_R) >= epoch
            up2 = look_words(mb_ptr + ready1(DIM.R, 0) + DIM.R, DIM.R, REM.BLOCK_R) >= epoch
            go = tl.where(up1, todo & 1, 0) + tl.where(up2, todo & 2, 0)
            if tl.max(go, axis=0) > 0:
                # one system-scope acquire of each word seen up: what the proxy had received before it
                # raised them is visible to the loads below
                tl.atomic_add(mb_ptr + ready1(DIM.R, rr), 0, mask=(go & 1) > 0, sem="acquire", scope="sys")
                tl.atomic_add(mb_ptr + ready1(DIM.R, rr) + DIM.R, 0, mask=(go & 2) > 0, sem="acquire", scope="sys")
                for s in range(DIM.R):
                    g_s = pick(go, rr, s)
                    if g_s > 0:
                        # rows of each expert from lower sources
                        below = tl.sum(tl.where((rr < s)[:, None], sel_t, 0), axis=0)
                        n = pick(n1s + ov0, rr, s)
                        n1 = pick(n1s, rr, s)
                        for part in tl.static_range(2):
                            if (g_s >> part) & 1:
                                lo = n1 if part == 1 else 0
                                hi = n if part == 1 else n1
                                for b in range(pid, tl.cdiv(hi - lo, REM.BLOCK_RW), P):
                                    i = lo + b * REM.BLOCK_RW + ii
                                    im = i < hi
                                    if part == 1:
                                        w2 = (par * REM.OVCAP * REM.RB +
                                              (pick(ovoff, rr, s) + i - REM.PCAP).to(tl.int64) * REM.RB) // 4
                                        src = ovw + tl.multiple_of(tl.where(im, w2, 0), 4)
                                    else:
                                        w1 = ((par * DIM.R + s) * REM_SLOT + i.to(tl.int64) * REM.RB) // 4
                                        src = r1w + tl.multiple_of(tl.where(im, w1, 0), 4)
                                    unpack_any(src, im, pick(goff, rr, s) + i, pick(first, rr, s) + i, s, below, eoff,
                                               ee, io, rio, DIM, MODE, TILE, REM)
                todo = todo - go
            bad = look_word(mb_ptr + MB_ERR_CODE)
            if MODE.INTERP:  # no clock: the proxy's own deadline ends the wait first; `spins` looks bound it
                looks += 1
                late = (looks >= spins).to(tl.int32)
            else:
                late = ((tl.extra.cuda.globaltimer() - t0_ns) > rtimeout_ns).to(tl.int32)
        if bad != 0:
            record_error(err_ptr, ERR_PROXY, tl.load(mb_ptr + MB_ERR_PEER, volatile=True), PHASE_DISPATCH, epoch, bad)
        elif tl.max(todo, axis=0) > 0:  # the proxy itself stuck: name the first source still awaited
            record_error(err_ptr, ERR_TIMEOUT, tl.min(tl.where(todo > 0, rr, DIM.R), axis=0), PHASE_DISPATCH, epoch, 0)
        # Overflow windows beyond the first (§10 "Round 2 in windows"): window w holds the stream's
        # rows [w * OVCAP, (w + 1) * OVCAP), each source's at its place in the stream.
        o_s = c - n1s
        n_win = window_count(o_s, REM.OVCAP)
        if (n_win > 1) & (bad == 0):
            arrive_and_ring(tally_ptr + 2 * DIM.R + 1, mb_ptr, MB_OV_DONE, ov_window(epoch, 1))
            if pid == P - 1:
                for w in range(1, n_win):
                    lo_s, hi_s = wait_window(mb_ptr, MB_OV_READY, epoch, w, ovoff, o_s, err_ptr, PHASE_DISPATCH,
                                             rtimeout_ns, spins, REM.OVCAP, MODE.INTERP)
                    for s in range(DIM.R):
                        lo = pick(lo_s, rr, s)
                        hi = pick(hi_s, rr, s)
                        if hi > lo:
                            below = tl.sum(tl.where((rr < s)[:, None], sel_t, 0), axis=0)
                            for b in range(0, tl.cdiv(hi - lo, REM.BLOCK_RW)):
                                q = lo + b * REM.BLOCK_RW + ii  # places in the stream
                                im = q < hi
                                i = REM.PCAP + q - pick(ovoff, rr, s)  # rows of s before it: PCAP in round 1
                                w2 = (par * REM.OVCAP * REM.RB + (q - w * REM.OVCAP).to(tl.int64) * REM.RB) // 4
                                src = ovw + tl.multiple_of(tl.where(im, w2, 0), 4)
                                unpack_any(src, im, pick(goff, rr, s) + i, pick(first, rr, s) + i, s, below, eoff, ee,
                                           io, rio, DIM, MODE, TILE, REM)
                    # window w read: the proxy may credit window w + 1 into the same region
                    tl.debug_barrier()
                    tl.atomic_xchg(mb_ptr + MB_OV_DONE, ov_window(epoch, w + 1), sem="release", scope="sys")
        if pid == P - 1:  # this rank's own writes completed: the next dispatch may pack the send buffer again
            # (the last program: under the interpreter, the only one that runs after every window's unpack)
            wait_word(mb_ptr, MB_DISP_READY, epoch, err_ptr, -1, PHASE_DISPATCH, t0_ns, rtimeout_ns, spins, MODE.INTERP)
