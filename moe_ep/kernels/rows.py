"""Kernel pieces of the rows layout (``EPBuffer(layout="rows")``; not ``moe_ep/moe/rows.py``, which groups
dispatched rows for MoELayer's experts): one received row per (source rank, source token)
instead of one per selection, in ascending (source rank, source token) order.

The send side is the dispatch kernel's, with the position ``j`` among an expert's selections
replaced by the token's row among this source's rows for the destination (``pos``: tokens of
earlier chunks with a selection there, from the routing histogram's per-peer rows or, at decode
sizes, by counting; plus earlier tokens of the chunk). The header carries the source's rows for
the destination (``hdr[1 + EL]``), so the receiver places row ``pos`` of source ``s`` at
``rows of all sources below s + pos`` without a scan of its own (with other nodes, the count
matrix's rows, ``rows_from``). A rank's own rows skip the workspace: its receive half reads them
from ``x`` (and its combine's from ``expert_y``), which halves the bytes moved at R = 1.
"""
import triton
import triton.language as tl

from .common import landed_chunk, own_rows_in_blocks, ptr_at, store_own_rows


@triton.jit
def on_peer(ids, d, NODE0: tl.constexpr, EL: tl.constexpr):
    """[rows] int32: 1 where the token (a row of the [rows, BLOCK_K] ``ids``, -1 = none) has a
    selection on node peer ``d``."""
    return tl.max(((ids >= 0) & (ids // EL == NODE0 + d)).to(tl.int32), axis=1)


@triton.jit
def tokens_before(topk_ptr, hist_ptr, c, BT, T, d, NODE0: tl.constexpr, E: tl.constexpr, EL: tl.constexpr,
                  K: tl.constexpr, CMAX: tl.constexpr, DIRECT: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tokens of this rank's chunks ``[0, c)`` with a selection on node peer ``d``: counted from the
    ids at decode sizes (``DIRECT``), else summed over row ``E + d`` of the routing histogram."""
    n = tl.zeros([], tl.int32)
    if DIRECT:
        tt = tl.arange(0, 64)
        kk = tl.arange(0, BLOCK_K)
        end = tl.minimum(c * BT, T)
        for t0 in range(0, end, 64):
            t = t0 + tt
            m = (t[:, None] < end) & (kk[None, :] < K)
            ids = tl.load(topk_ptr + t[:, None] * K + kk[None, :], mask=m, other=-1).to(tl.int32)
            ids = tl.where((ids >= 0) & (ids < E), ids, -1)
            n += tl.sum(on_peer(ids, d, NODE0, EL))
    else:  # blocks of 256 counts: at prefill sizes (CMAX = 256) one load, not a loop of dependent ones
        cc = tl.arange(0, 256)
        for c0 in range(0, c, 256):
            n += tl.sum(tl.load(hist_ptr + (E + d) * CMAX + c0 + cc, mask=c0 + cc < c, other=0))
    return n


@triton.jit
def copy_rows(src, m, r, io, DIM: tl.constexpr, MODE: tl.constexpr, TILE: tl.constexpr, STAGES: tl.constexpr):
    """Workspace rows ``src`` (int32 pointers: payload words, then the fp8 scales) where ``m`` to
    rows ``r`` (int64) of ``out_x`` (and ``out_s``); ``STAGES``: the payload loop's pipelining
    (None: the compiler's choice)."""
    for w0 in tl.range(0, DIM.W, TILE.BLOCK_W, num_stages=STAGES):
        ww = w0 + tl.arange(0, TILE.BLOCK_W)
        wm = m[:, None] & (ww[None, :] < DIM.W)
        tl.store(io.out_x_ptr + r[:, None] * DIM.W + ww[None, :], tl.load(src[:, None] + ww[None, :], mask=wm),
                 mask=wm)
    if MODE.FP8:
        bb = tl.arange(0, TILE.BLOCK_NB)
        bm = m[:, None] & (bb[None, :] < DIM.NB)
        sv = tl.load(src[:, None].to(tl.pointer_type(tl.float32)) + DIM.H // 4 + bb[None, :], mask=bm)
        tl.store(io.out_s_ptr + r[:, None] * DIM.NB + bb[None, :], sv, mask=bm)


@triton.jit
def recv_rows_chunk(v, vs, s, c, hdr, io, at, OFF: tl.constexpr, DIM: tl.constexpr, MODE: tl.constexpr,
                    TILE: tl.constexpr, SELF_SYNC: tl.constexpr):
    """Waits for chunk ``c`` of node source ``s``, then writes each of its tokens that selected an
    expert of this rank as one row: payload (and scales), local ids, weights, source; records the
    row in ``recv_pos[s, t, 0]`` (-1: none) for combine. ``v, vs``: the first tile of this rank's own
    rows (``first_own_tile`` of the chunk's first ``BLOCK_TS`` tokens, loaded by the caller; used when
    ``OWN_X`` and ``s == RANK``). Own rows go in sub-blocks of ``BLOCK_TS`` tokens (tiles of ``BLOCK_HS``
    channels) when the chunk is larger."""
    ok, t, tm, slot = landed_chunk(s, c, hdr, io, at, OFF, DIM, MODE, TILE, SELF_SYNC)
    if ok != 0:
        kk = tl.arange(0, TILE.BLOCK_K)
        m2 = tm[:, None] & (kk[None, :] < DIM.K)
        meta = ptr_at(io.ws, OFF.meta_i, tl.int32) + slot * (2 * DIM.K)
        lid = tl.load(meta[:, None] + kk[None, :], mask=m2, other=-1)
        pos = tl.load(meta + DIM.K, mask=tm, other=0)
        w = tl.load(ptr_at(io.ws, OFF.meta_w, tl.float32) + slot[:, None] * DIM.K + kk[None, :], mask=m2 & (lid >= 0),
                    other=0.0)
        has = tm & (tl.max((lid >= 0).to(tl.int32), axis=1) > 0)
        # Rows of every source below s come first: the order (source rank, source token).
        base = tl.zeros([], tl.int32)
        if MODE.GLOBAL:
            for s2 in range(DIM.NODE0 + s):
                base += tl.load(io.rows_from_ptr + s2)
        else:
            for s2 in range(s):
                base += tl.load(hdr + s2 * DIM.HDR + 1 + DIM.EL)
        # (past a cap, max_recv_rows: no row; the count check recorded the CapacityError)
        has = has & (base + pos < DIM.CAP)
        row = tl.where(has, base + pos, -1)
        tl.store(io.recv_pos_ptr + (s * DIM.M + t) * DIM.K, row, mask=tm)
        r = row.to(tl.int64)
        hm2 = has[:, None] & (kk[None, :] < DIM.K)
        tl.store(io.recv_ids_ptr + r[:, None] * DIM.K + kk[None, :], lid, mask=hm2)
        tl.store(io.recv_wts_ptr + r[:, None] * DIM.K + kk[None, :], w, mask=hm2)
        tl.store(io.recv_src_ptr + r, (DIM.NODE0 + s) * DIM.M + t, mask=has)
        if MODE.OWN_X and (s == DIM.RANK):
            # This rank's own rows come straight from x (quantized here for fp8): the send half
            # stored no payload into this rank's workspace.
            if TILE.BLOCK_TS == TILE.BLOCK_T:
                store_own_rows(v=v, vs=vs, nt=t, nm=t < 0, x_ptr=io.x_ptr, xs_ptr=io.xs_ptr, t=t, tm=has,
                               r=tl.where(kk[None, :] == 0, r[:, None], -1), kk=kk, out_x_ptr=io.out_x_ptr,
                               out_s_ptr=io.out_s_ptr, KS=1, H=DIM.H, NB=DIM.NB, FP8=MODE.FP8, PREQ=MODE.PREQ,
                               BLOCK_T=TILE.BLOCK_T, BLOCK_H=TILE.BLOCK_HS, INTERP=MODE.INTERP, CM_ROWS=0)
            else:
                own_rows_in_blocks(v, vs, s, c, hdr, kk, io, DIM, MODE, TILE, KS=1, CM_ROWS=0)
        else:
            src = ptr_at(io.ws, OFF.rows, tl.int32) + slot * (DIM.RB // 4)
            copy_rows(src, has, r, io, DIM, MODE, TILE, STAGES=TILE.STAGES)
