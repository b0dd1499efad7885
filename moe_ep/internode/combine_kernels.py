"""The inter-node combine in two launches (docs/ARCHITECTURE.md §10): the send half pre-reduces the
rows received from each remote source and rings its combine bell, then stores into node peers;
the receive half waits for the proxy, then sums every owner's partial rows (the node kernel, with
the remote owners' rows through ``XROWS``) and rounds once.

Combine send buffer: per remote source in rank order, one row of ``CRB`` bytes per row received
from it in the dispatch's round 1 and overflow window 0, in the order received; then, where the
dispatch's overflow took more windows, each later window's rows reuse the buffer from row 0, in
the window's order, once the proxy's writes of the one before completed (docs/ARCHITECTURE.md
§10, "Round 2 in windows"). A row: bf16 ``H``
elements, the pre-reduction ``sum_k w * y[rpos]`` rounded once (rows layout: the row of ``y`` as
it is, then its K float32 combine weights). Both kernels call the node kernel (``combine_kernel``)
for the node peers' part; the proxy's combine carries the dispatch epoch (``state[0, pid]``).
"""
import triton
import triton.language as tl

from ..kernels.combine import combine_kernel
from ..kernels.common import PHASE_COMBINE, deadline_start, pre_reduce
from ..kernels.tiles import excl, pick
from .mailbox import (MB_COMB_READY, MB_COMB_WIN_BELL, MB_COMB_WIN_DONE, arrive_and_ring, comb_bell, ov_window,
                      wait_window, wait_word, window_count)


@triton.jit
def send_rows_of(g0, d0, n, pid, P, y_ptr, rpos_ptr, rw_ptr, wy_ptr, comb_send_ptr, K: tl.constexpr, H: tl.constexpr,
                 CRB: tl.constexpr, ROWS: tl.constexpr, WIN: tl.constexpr, BLOCK_RW: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, INTERP: tl.constexpr):
    """Blocks ``pid``, ``pid + P``, ... of ``n`` rows received from one source (combine order from
    ``g0``) into the combine send buffer from row ``d0``: masked / packed, one pre-reduced bf16 row
    per received row; rows layout, the row as it is and its combine weights (``wy`` [rows, K] with
    ``WIN``, else 0)."""
    ii = tl.arange(0, BLOCK_RW)
    kk = tl.arange(0, BLOCK_K)
    for b in range(pid, tl.cdiv(n, BLOCK_RW), P):
        g = g0 + b * BLOCK_RW + ii
        gm = b * BLOCK_RW + ii < n
        m2 = gm[:, None] & (kk[None, :] < K)
        r = tl.load(rpos_ptr + g[:, None] * K + kk[None, :], mask=m2, other=-1)
        d = d0 + b * BLOCK_RW + ii
        dst = comb_send_ptr + d.to(tl.int64) * CRB
        if ROWS:
            row = tl.sum(tl.where(kk[None, :] == 0, r, 0), axis=1).to(tl.int64)
            gm = gm & (row >= 0)  # (-1: a row past a cap, after its CapacityError: nothing read)
            m2 = m2 & gm[:, None]
            if WIN:
                wv = tl.load(wy_ptr + row[:, None] * K + kk[None, :], mask=m2, other=0.0)
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
            pre_reduce(y_ptr=y_ptr, r=r, w=w, kk=kk, go=gm, out=comb_send_ptr.to(tl.pointer_type(tl.bfloat16)) +
                       d.to(tl.int64) * (CRB // 2), K=K, H=H, BLOCK_T=BLOCK_RW, BLOCK_H=BLOCK_H, STAGES=1,
                       INTERP=INTERP)


@triton.jit(do_not_specialize=['ws', 'timeout_ns', 'T', 'rtimeout_ns', 'spins'])
def internode_combine_send_kernel(
    # the node kernel's runtime arguments (combine_kernel)
    y_ptr, topk_ptr, out_ptr, ws, peer_ptr, state_ptr, err_ptr, recv_pos_ptr, timeout_ns, T, wy_ptr, wout_ptr,
    cw_ptr, xrows_ptr, xrecv_ptr,
    # the remote sources'
    comb_send_ptr,     # uint8: the proxy's combine send buffer
    mb_ptr,            # int64: the proxy's mailbox
    arrive_ptr,        # int32 [R]: programs done with each source's rows; 0 between launches
    rpos_ptr,          # int32 [ROWS_CAP, K] from the dispatch's receive half
    rw_ptr,            # float32 [ROWS_CAP, K] from the dispatch's receive half
    recv_rows_ptr,     # int32 [R] from the dispatch's receive half
    rtimeout_ns,       # the deadline of the waits for the proxy (its own deadline, which names the peer, is shorter)
    spins,             # the interpreter's bound on looks per wait (it has no clock)
    # the node kernel's constexprs
    off_cflag: tl.constexpr, off_wflag: tl.constexpr, off_hdr: tl.constexpr, off_meta_w: tl.constexpr,
    off_comb: tl.constexpr,
    RANK: tl.constexpr, NODE0: tl.constexpr, N: tl.constexpr, M: tl.constexpr, K: tl.constexpr, E: tl.constexpr,
    EL: tl.constexpr, H: tl.constexpr, HDR: tl.constexpr, CMAX: tl.constexpr, BASE_F32: tl.constexpr,
    WEIGHTS: tl.constexpr, PUSH: tl.constexpr, SEND: tl.constexpr, RECV: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HR: tl.constexpr,
    BLOCK_TR: tl.constexpr,
    STAGES: tl.constexpr, INTERP: tl.constexpr, ROWS: tl.constexpr, OWN_Y: tl.constexpr, WIN: tl.constexpr,
    WOUT: tl.constexpr, off_comb_w: tl.constexpr, XROWS: tl.constexpr, XCRB: tl.constexpr, XMAX: tl.constexpr,
    # the remote sources'
    R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_RW: tl.constexpr, BLOCK_RH: tl.constexpr, PCAP: tl.constexpr,
    OVCAP: tl.constexpr,
):
    """The send half: each remote source's round-1 and overflow window-0 rows (from the next node
    on) pre-reduced into the combine send buffer, its bell rung as soon as they are; the later
    overflow windows, if any, by the last program, each once the proxy sent the one before
    (``comb_win_done``; one program, as the dispatch's receive half unpacks them); then the node
    peers' rows."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    depoch = tl.load(state_ptr + pid)  # the dispatch this combine answers (the proxy's combine epoch)
    rr = tl.arange(0, BLOCK_R)
    c = tl.load(recv_rows_ptr + rr, mask=rr < R, other=0)
    goff = excl(c)  # each source's first row in combine order (rank order)
    o_s = c - tl.minimum(c, PCAP)  # each source's overflow rows, at ovoff in this rank's stream
    ovoff = excl(o_s)
    c0 = c - o_s + tl.minimum(o_s, tl.maximum(OVCAP - ovoff, 0))  # its rows of round 1 and window 0
    doff = excl(c0)  # each source's first row in the send buffer (window 0)
    for q in range(R - N):
        s = (NODE0 + N + q) % R
        send_rows_of(g0=pick(goff, rr, s), d0=pick(doff, rr, s), n=pick(c0, rr, s), pid=pid, P=P, y_ptr=y_ptr,
                     rpos_ptr=rpos_ptr, rw_ptr=rw_ptr, wy_ptr=wy_ptr, comb_send_ptr=comb_send_ptr, K=K, H=H, CRB=XCRB,
                     ROWS=ROWS, WIN=WIN, BLOCK_RW=BLOCK_RW, BLOCK_K=BLOCK_K, BLOCK_H=BLOCK_RH, INTERP=INTERP)
        arrive_and_ring(arrive_ptr + s, mb_ptr, comb_bell(R, s), depoch)
    if (window_count(o_s, OVCAP) > 1) & (pid == P - 1):
        for w in range(1, window_count(o_s, OVCAP)):
            lo_s, hi_s = wait_window(mb_ptr, MB_COMB_WIN_DONE, depoch, w, ovoff, o_s, err_ptr, PHASE_COMBINE,
                                     rtimeout_ns, spins, OVCAP, INTERP)
            for s in range(R):
                lo = pick(lo_s, rr, s)
                hi = pick(hi_s, rr, s)
                if hi > lo:
                    send_rows_of(g0=pick(goff, rr, s) + PCAP + lo - pick(ovoff, rr, s), d0=lo - w * OVCAP, n=hi - lo,
                                 pid=0, P=1, y_ptr=y_ptr, rpos_ptr=rpos_ptr, rw_ptr=rw_ptr, wy_ptr=wy_ptr,
                                 comb_send_ptr=comb_send_ptr, K=K, H=H, CRB=XCRB, ROWS=ROWS, WIN=WIN,
                                 BLOCK_RW=BLOCK_RW, BLOCK_K=BLOCK_K, BLOCK_H=BLOCK_RH, INTERP=INTERP)
            # window w packed: the proxy posts it (system-scope release after this program's stores)
            tl.debug_barrier()
            tl.atomic_xchg(mb_ptr + MB_COMB_WIN_BELL, ov_window(depoch, w), sem="release", scope="sys")
    combine_kernel(
        y_ptr=y_ptr, topk_ptr=topk_ptr, out_ptr=out_ptr, ws=ws, peer_ptr=peer_ptr, state_ptr=state_ptr,
        err_ptr=err_ptr, recv_pos_ptr=recv_pos_ptr, timeout_ns=timeout_ns, T=T, wy_ptr=wy_ptr, wout_ptr=wout_ptr,
        cw_ptr=cw_ptr, xrows_ptr=xrows_ptr, xrecv_ptr=xrecv_ptr, off_cflag=off_cflag, off_wflag=off_wflag,
        off_hdr=off_hdr, off_meta_w=off_meta_w, off_comb=off_comb, RANK=RANK, NODE0=NODE0, N=N, M=M, K=K, E=E,
        EL=EL, H=H, HDR=HDR, CMAX=CMAX, BASE_F32=BASE_F32, WEIGHTS=WEIGHTS, PUSH=PUSH, SEND=True, RECV=False,
        BLOCK_T=BLOCK_T, BLOCK_K=BLOCK_K, BLOCK_H=BLOCK_H, BLOCK_HR=BLOCK_HR, BLOCK_TR=BLOCK_TR, STAGES=STAGES,
        INTERP=INTERP, ROWS=ROWS, OWN_Y=OWN_Y, WIN=WIN, WOUT=WOUT, off_comb_w=off_comb_w, XROWS=XROWS, XCRB=XCRB,
        XMAX=XMAX)


@triton.jit(do_not_specialize=['ws', 'timeout_ns', 'T', 'rtimeout_ns', 'spins'])
def internode_combine_recv_kernel(
    # the node kernel's runtime arguments (combine_kernel)
    y_ptr, topk_ptr, out_ptr, ws, peer_ptr, state_ptr, err_ptr, recv_pos_ptr, timeout_ns, T, wy_ptr, wout_ptr,
    cw_ptr, xrows_ptr, xrecv_ptr,
    # the proxy's
    mb_ptr,            # int64: the proxy's mailbox
    rtimeout_ns,       # the deadline of the wait for the proxy (its own deadline, which names the peer, is shorter)
    spins,             # the interpreter's bound on looks (it has no clock)
    # the node kernel's constexprs
    off_cflag: tl.constexpr, off_wflag: tl.constexpr, off_hdr: tl.constexpr, off_meta_w: tl.constexpr,
    off_comb: tl.constexpr,
    RANK: tl.constexpr, NODE0: tl.constexpr, N: tl.constexpr, M: tl.constexpr, K: tl.constexpr, E: tl.constexpr,
    EL: tl.constexpr, H: tl.constexpr, HDR: tl.constexpr, CMAX: tl.constexpr, BASE_F32: tl.constexpr,
    WEIGHTS: tl.constexpr, PUSH: tl.constexpr, SEND: tl.constexpr, RECV: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HR: tl.constexpr,
    BLOCK_TR: tl.constexpr,
    STAGES: tl.constexpr, INTERP: tl.constexpr, ROWS: tl.constexpr, OWN_Y: tl.constexpr, WIN: tl.constexpr,
    WOUT: tl.constexpr, off_comb_w: tl.constexpr, XROWS: tl.constexpr, XCRB: tl.constexpr, XMAX: tl.constexpr,
):
    """The receive half: every remote owner's rows in (the proxy's combine ready word), then the
    node kernel's receive half, which adds them (``XROWS``) to the node owners' and rounds once."""
    depoch = tl.load(state_ptr + tl.program_id(0))
    t0_ns = deadline_start(INTERP)
    wait_word(mb_ptr, MB_COMB_READY, depoch, err_ptr, -1, PHASE_COMBINE, t0_ns, rtimeout_ns, spins, INTERP)
    combine_kernel(
        y_ptr=y_ptr, topk_ptr=topk_ptr, out_ptr=out_ptr, ws=ws, peer_ptr=peer_ptr, state_ptr=state_ptr,
        err_ptr=err_ptr, recv_pos_ptr=recv_pos_ptr, timeout_ns=timeout_ns, T=T, wy_ptr=wy_ptr, wout_ptr=wout_ptr,
        cw_ptr=cw_ptr, xrows_ptr=xrows_ptr, xrecv_ptr=xrecv_ptr, off_cflag=off_cflag, off_wflag=off_wflag,
        off_hdr=off_hdr, off_meta_w=off_meta_w, off_comb=off_comb, RANK=RANK, NODE0=NODE0, N=N, M=M, K=K, E=E,
        EL=EL, H=H, HDR=HDR, CMAX=CMAX, BASE_F32=BASE_F32, WEIGHTS=WEIGHTS, PUSH=PUSH, SEND=False, RECV=True,
        BLOCK_T=BLOCK_T, BLOCK_K=BLOCK_K, BLOCK_H=BLOCK_H, BLOCK_HR=BLOCK_HR, BLOCK_TR=BLOCK_TR, STAGES=STAGES,
        INTERP=INTERP, ROWS=ROWS, OWN_Y=OWN_Y, WIN=WIN, WOUT=WOUT, off_comb_w=off_comb_w, XROWS=XROWS, XCRB=XCRB,
        XMAX=XMAX)
