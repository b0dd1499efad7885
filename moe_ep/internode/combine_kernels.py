"""The inter-node combine kernel (docs/ARCHITECTURE.md §10), its halves as two launches or, where
every program is resident and ``Tuning.fused_internode`` asks, one: the send half pre-reduces the
rows received from each remote source and rings its combine bell, then stores into node peers;
the receive half waits for the proxy, then sums every owner's partial rows (the node kernel, with
the remote owners' rows through ``XROWS``) and rounds once.

Combine send buffer: per remote source in rank order, one row of ``CRB`` bytes per row received
from it in the dispatch's round 1 and overflow window 0, in the order received; then, where the
dispatch's overflow took more windows, each later window's rows reuse the buffer from row 0, in
the window's order, once the proxy's writes of the one before completed (docs/ARCHITECTURE.md
§10, "Round 2 in windows"). A row: bf16 ``H`` elements, the pre-reduction ``sum_k w * y[rpos]``
rounded once (rows layout: the row of ``y`` as it is, then its K float32 combine weights). Both
halves call the node kernel (``node_combine_kernel``, its constexpr groups handed on from
``NODE``) for the node peers' part; the proxy's combine carries the dispatch epoch
(``state[0, pid]``).
"""
import triton
import triton.language as tl

from ..kernels.args import RemoteIO
from ..kernels.combine import node_combine_kernel
from ..kernels.common import PHASE_COMBINE, deadline_start, pre_reduce
from ..kernels.tiles import excl, pick
from .mailbox import (MB_COMB_READY, MB_COMB_WIN_BELL, MB_COMB_WIN_DONE, arrive_and_ring, comb_bell, ov_window,
                      proxy_deadline, wait_window, wait_word, window_count)


@triton.jit
def send_rows_of(g0, d0, n, pid, P, y_ptr, wy_ptr, rio, DIM: tl.constexpr, MODE: tl.constexpr, TILE: tl.constexpr,
                 REM: tl.constexpr):
    """Blocks ``pid``, ``pid + P``, ... of ``n`` rows received from one source (combine order from
    ``g0``) into the combine send buffer (``rio.send_ptr``) from row ``d0``: masked / packed, one
    pre-reduced bf16 row per received row; rows layout, the row as it is and its combine weights
    (``wy`` [rows, K] with ``WIN``, else 0)."""
    K: tl.constexpr = DIM.K
    H: tl.constexpr = DIM.H
    BLOCK_RW: tl.constexpr = REM.BLOCK_RW
    BLOCK_K: tl.constexpr = TILE.BLOCK_K
    ii = tl.arange(0, BLOCK_RW)
    kk = tl.arange(0, BLOCK_K)
    for b in range(pid, tl.cdiv(n, BLOCK_RW), P):
        g = g0 + b * BLOCK_RW + ii
        gm = b * BLOCK_RW + ii < n
        m2 = gm[:, None] & (kk[None, :] < K)
        r = tl.load(rio.rpos_ptr + g[:, None] * K + kk[None, :], mask=m2, other=-1)
        d = d0 + b * BLOCK_RW + ii
        dst = rio.send_ptr + d.to(tl.int64) * REM.CRB
        if MODE.ROWS:
            row = tl.sum(tl.where(kk[None, :] == 0, r, 0), axis=1).to(tl.int64)
            gm = gm & (row >= 0)  # (-1: a row past a cap, after its CapacityError: nothing read)
            m2 = m2 & gm[:, None]
            if MODE.WIN:
                wv = tl.load(wy_ptr + row[:, None] * K + kk[None, :], mask=m2, other=0.0)
            else:
                wv = tl.zeros((BLOCK_RW, BLOCK_K), tl.float32)
            tl.store((dst + 2 * H).to(tl.pointer_type(tl.float32))[:, None] + kk[None, :], wv, mask=m2)
            for h0 in range(0, H, REM.BLOCK_RH):
                hh = h0 + tl.arange(0, REM.BLOCK_RH)
                hm = gm[:, None] & (hh[None, :] < H)
                tl.store(dst.to(tl.pointer_type(tl.bfloat16))[:, None] + hh[None, :],
                         tl.load(y_ptr + row[:, None] * H + hh[None, :], mask=hm), mask=hm)
        else:
            # Pre-reduction: this rank's experts of the row sum here (float32), one bf16 row goes back.
            w = tl.load(rio.rw_ptr + g[:, None] * K + kk[None, :], mask=m2, other=0.0)
            pre_reduce(y_ptr=y_ptr, r=r, w=w, kk=kk, go=gm, out=rio.send_ptr.to(tl.pointer_type(tl.bfloat16)) +
                       d.to(tl.int64) * (REM.CRB // 2), K=K, H=H, BLOCK_T=BLOCK_RW, BLOCK_H=REM.BLOCK_RH, STAGES=1,
                       INTERP=MODE.INTERP)


@triton.jit(do_not_specialize=['ws', 'timeout_ns', 'T'])
def internode_combine_kernel(
    # the node kernel's runtime arguments (node_combine_kernel's, in its order)
    y_ptr, topk_ptr, out_ptr, ws, peer_ptr, state_ptr, err_ptr, recv_pos_ptr, timeout_ns, T, wy_ptr, wout_ptr,
    cw_ptr, xrows_ptr, xrecv_ptr,
    # the remote sources'
    comb_send_ptr,     # uint8: the proxy's combine send buffer
    mb_ptr,            # int64: the proxy's mailbox
    arrive_ptr,        # int32 [R]: programs done with each source's rows; 0 between launches
    rpos_ptr,          # int32 [ROWS_CAP, K] from the dispatch's receive half
    rw_ptr,            # float32 [ROWS_CAP, K] from the dispatch's receive half
    recv_rows_ptr,     # int32 [R] from the dispatch's receive half
    SEND: tl.constexpr, RECV: tl.constexpr,  # the halves this launch does
    NODE: tl.constexpr,  # NodeGroups: the node kernel's OFF, DIM, MODE, TILE
    REM: tl.constexpr,   # Remote: the inter-node sizes
):
    """The send half (``SEND``): each remote source's round-1 and overflow window-0 rows (from the
    next node on) pre-reduced into the combine send buffer, its bell rung as soon as they are; the
    later overflow windows, if any, by the last program, each once the proxy sent the one before
    (``comb_win_done``; one program, as the dispatch's receive half unpacks them); then the node
    peers' rows.

    The receive half (``RECV``): every remote owner's rows in (the proxy's combine ready word),
    then the node kernel's receive half, which adds them (``XROWS``) to the node owners' and
    rounds once.

    Both in one launch (every program resident, ``Tuning.fused_internode``): a program does its
    whole send half before its receive half, as the dispatch kernel does; its receive half reads
    nothing another program of the launch writes but the node kernel's flags (waited for with a
    deadline) and the proxy's rows (after its ready word)."""
    DIM: tl.constexpr = NODE.DIM
    MODE: tl.constexpr = NODE.MODE
    TILE: tl.constexpr = NODE.TILE
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    depoch = tl.load(state_ptr + pid)  # the dispatch this combine answers (the proxy's combine epoch)
    rtimeout_ns, spins = proxy_deadline(timeout_ns)
    if SEND:
        # what the helpers take (a named tuple: no code of its own)
        rio = RemoteIO(send_ptr=comb_send_ptr, comb_row_ptr=0, mb_ptr=mb_ptr, rpos_ptr=rpos_ptr, rw_ptr=rw_ptr,
                       rtimeout_ns=rtimeout_ns, spins=spins)
        rr = tl.arange(0, REM.BLOCK_R)
        c = tl.load(recv_rows_ptr + rr, mask=rr < DIM.R, other=0)
        goff = excl(c)  # each source's first row in combine order (rank order)
        o_s = c - tl.minimum(c, REM.PCAP)  # each source's overflow rows, at ovoff in this rank's stream
        ovoff = excl(o_s)
        c0 = c - o_s + tl.minimum(o_s, tl.maximum(REM.OVCAP - ovoff, 0))  # its rows of round 1 and window 0
        doff = excl(c0)  # each source's first row in the send buffer (window 0)
        for q in range(DIM.R - DIM.N):
            s = (DIM.NODE0 + DIM.N + q) % DIM.R
            send_rows_of(pick(goff, rr, s), pick(doff, rr, s), pick(c0, rr, s), pid, P, y_ptr, wy_ptr, rio, DIM, MODE,
                         TILE, REM)
            arrive_and_ring(arrive_ptr + s, mb_ptr, comb_bell(DIM.R, s), depoch)
        if (window_count(o_s, REM.OVCAP) > 1) & (pid == P - 1):
            for w in range(1, window_count(o_s, REM.OVCAP)):
                lo_s, hi_s = wait_window(mb_ptr, MB_COMB_WIN_DONE, depoch, w, ovoff, o_s, err_ptr, PHASE_COMBINE,
                                         rtimeout_ns, spins, REM.OVCAP, MODE.INTERP)
                for s in range(DIM.R):
                    lo = pick(lo_s, rr, s)
                    hi = pick(hi_s, rr, s)
                    if hi > lo:
                        send_rows_of(pick(goff, rr, s) + REM.PCAP + lo - pick(ovoff, rr, s), lo - w * REM.OVCAP,
                                     hi - lo, 0, 1, y_ptr, wy_ptr, rio, DIM, MODE, TILE, REM)
                # window w packed: the proxy posts it (system-scope release after this program's stores)
                tl.debug_barrier()
                tl.atomic_xchg(mb_ptr + MB_COMB_WIN_BELL, ov_window(depoch, w), sem="release", scope="sys")
        node_combine_kernel(y_ptr, topk_ptr, out_ptr, ws, peer_ptr, state_ptr, err_ptr, recv_pos_ptr, timeout_ns, T,
                            wy_ptr, wout_ptr, cw_ptr, xrows_ptr, xrecv_ptr, SEND=True, RECV=False, PUSH=False,
                            OFF=NODE.OFF, DIM=DIM, MODE=MODE, TILE=TILE, XCRB=REM.CRB, XMAX=REM.MAXROWS)
    if RECV:
        t0_ns = deadline_start(MODE.INTERP)
        wait_word(mb_ptr, MB_COMB_READY, depoch, err_ptr, -1, PHASE_COMBINE, t0_ns, rtimeout_ns, spins, MODE.INTERP)
        node_combine_kernel(y_ptr, topk_ptr, out_ptr, ws, peer_ptr, state_ptr, err_ptr, recv_pos_ptr, timeout_ns, T,
                            wy_ptr, wout_ptr, cw_ptr, xrows_ptr, xrecv_ptr, SEND=False, RECV=True, PUSH=False,
                            OFF=NODE.OFF, DIM=DIM, MODE=MODE, TILE=TILE, XCRB=REM.CRB, XMAX=REM.MAXROWS)
