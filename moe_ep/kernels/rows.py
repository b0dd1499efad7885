"""Kernel pieces of the rows layout (``EPBuffer(layout="rows")``; not ``moe_ep/rows.py``, which groups
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
def recv_rows_chunk(v, vs, s, c, ws, hdr, rows_from_ptr, x_ptr, xs_ptr, out_x_ptr, out_s_ptr, ids_ptr, wts_ptr,
                    src_ptr, recv_pos_ptr, err_ptr, epoch, par, t0_ns, timeout_ns, off_dflag: tl.constexpr,
                    off_meta_i: tl.constexpr, off_meta_w: tl.constexpr, off_rows: tl.constexpr,
                    RANK: tl.constexpr, NODE0: tl.constexpr, EL: tl.constexpr, GLOBAL: tl.constexpr,
                    N: tl.constexpr, M: tl.constexpr, K: tl.constexpr, W: tl.constexpr, H: tl.constexpr,
                    NB: tl.constexpr, RB: tl.constexpr, HDR: tl.constexpr, CMAX: tl.constexpr, FP8: tl.constexpr,
                    PREQ: tl.constexpr, OWN_X: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_W: tl.constexpr, BLOCK_TS: tl.constexpr, BLOCK_HS: tl.constexpr, BLOCK_NB: tl.constexpr,
                    STAGES: tl.constexpr, SELF_SYNC: tl.constexpr, INTERP: tl.constexpr,
                    PREFETCH: tl.constexpr):
    """Waits for chunk ``c`` of node source ``s``, then writes each of its tokens that selected an
    expert of this rank as one row: payload (and scales), local ids, weights, source; records the
    row in ``recv_pos[s, t, 0]`` (-1: none) for combine. ``v, vs``: the first tile of this rank's own
    rows (``first_own_tile`` of the chunk's first ``BLOCK_TS`` tokens, loaded by the caller; used when
    ``OWN_X`` and ``s == RANK``). Own rows go in sub-blocks of ``BLOCK_TS`` tokens (tiles of ``BLOCK_HS``
    channels) when the chunk is larger."""
    ok, t, tm, slot = landed_chunk(ws=ws, hdr=hdr, s=s, c=c, err_ptr=err_ptr, epoch=epoch, par=par, t0_ns=t0_ns,
                                   timeout_ns=timeout_ns, off_dflag=off_dflag, RANK=RANK, NODE0=NODE0, N=N, M=M,
                                   HDR=HDR, CMAX=CMAX, BLOCK_T=BLOCK_T, SELF_SYNC=SELF_SYNC, INTERP=INTERP)
    if ok != 0:
        kk = tl.arange(0, BLOCK_K)
        m2 = tm[:, None] & (kk[None, :] < K)
        meta = ptr_at(ws, off_meta_i, tl.int32) + slot * (2 * K)
        lid = tl.load(meta[:, None] + kk[None, :], mask=m2, other=-1)
        pos = tl.load(meta + K, mask=tm, other=0)
        w = tl.load(ptr_at(ws, off_meta_w, tl.float32) + slot[:, None] * K + kk[None, :], mask=m2 & (lid >= 0),
                    other=0.0)
        has = tm & (tl.max((lid >= 0).to(tl.int32), axis=1) > 0)
        # Rows of every source below s come first: the order (source rank, source token).
        base = tl.zeros([], tl.int32)
        if GLOBAL:
            for s2 in range(NODE0 + s):
                base += tl.load(rows_from_ptr + s2)
        else:
            for s2 in range(s):
                base += tl.load(hdr + s2 * HDR + 1 + EL)
        row = tl.where(has, base + pos, -1)
        tl.store(recv_pos_ptr + (s * M + t) * K, row, mask=tm)
        r = row.to(tl.int64)
        hm2 = has[:, None] & (kk[None, :] < K)
        tl.store(ids_ptr + r[:, None] * K + kk[None, :], lid, mask=hm2)
        tl.store(wts_ptr + r[:, None] * K + kk[None, :], w, mask=hm2)
        tl.store(src_ptr + r, (NODE0 + s) * M + t, mask=has)
        if OWN_X and (s == RANK):
            # This rank's own rows come straight from x (quantized here for fp8): the send half
            # stored no payload into this rank's workspace.
            if BLOCK_TS == BLOCK_T:
                store_own_rows(v=v, vs=vs, nt=t, nm=t < 0, x_ptr=x_ptr, xs_ptr=xs_ptr, t=t, tm=has,
                               r=tl.where(kk[None, :] == 0, r[:, None], -1), kk=kk, out_x_ptr=out_x_ptr,
                               out_s_ptr=out_s_ptr, KS=1, H=H, NB=NB, FP8=FP8, PREQ=PREQ, BLOCK_T=BLOCK_T,
                               BLOCK_H=BLOCK_HS, INTERP=INTERP, CM_ROWS=0)
            else:
                own_rows_in_blocks(v=v, vs=vs, s=s, c=c, hdr=hdr, recv_pos_ptr=recv_pos_ptr, x_ptr=x_ptr, xs_ptr=xs_ptr,
                                   kk=kk, out_x_ptr=out_x_ptr, out_s_ptr=out_s_ptr, M=M, K=K, KS=1, H=H, NB=NB, HDR=HDR,
                                   CMAX=CMAX, FP8=FP8, PREQ=PREQ, BLOCK_TS=BLOCK_TS, BLOCK_HS=BLOCK_HS, INTERP=INTERP,
                                   PREFETCH=PREFETCH, CM_ROWS=0)
        else:
            src = ptr_at(ws, off_rows, tl.int32) + slot * (RB // 4)
            for w0 in tl.range(0, W, BLOCK_W, num_stages=STAGES):
                ww = w0 + tl.arange(0, BLOCK_W)
                wm = has[:, None] & (ww[None, :] < W)
                tl.store(out_x_ptr + r[:, None] * W + ww[None, :], tl.load(src[:, None] + ww[None, :], mask=wm),
                         mask=wm)
            if FP8:
                bb = tl.arange(0, BLOCK_NB)
                bm = has[:, None] & (bb[None, :] < NB)
                sv = tl.load(src[:, None].to(tl.pointer_type(tl.float32)) + H // 4 + bb[None, :], mask=bm)
                tl.store(out_s_ptr + r[:, None] * NB + bb[None, :], sv, mask=bm)
