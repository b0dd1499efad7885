"""The rows a packed or rows-layout dispatch brings this rank, counted between its send and receive
halves, for an ``expert_x`` sized per call (``EPBuffer(max_recv_rows=None)``, docs/ARCHITECTURE.md
§2): one program waits for the headers (the node peers' flags; across nodes the proxy's
header-ready word) and writes, where the host reads it (pinned host memory on a GPU), the total
the receive half will place from the same headers: packed, each local expert's selections summed
over every source, each block padded to ``ALIGN`` (``offsets[-1]``); rows, each source's rows for
this rank summed (``num_recv``)."""
import triton
import triton.language as tl

from ..internode.dispatch_kernels import count_matrix
from ..internode.mailbox import MB_HDR_READY, wait_word
from .common import PHASE_DISPATCH, deadline_start, ptr_at, wait_flag


@triton.jit(do_not_specialize=['ws', 'timeout_ns', 'rtimeout_ns', 'spins'])
def recv_total_kernel(
    ws,                # int: address of this rank's workspace (the node headers)
    state_ptr,         # int64 [2, P]: [0, 0] the dispatch epoch completed (the one counted is the next)
    err_ptr,           # int64 [8] error record (a header that does not come: its peer, timeout)
    need_ptr,          # int64 [1] out: the rows, or -1 when a header did not come (the error is recorded)
    hdr_recv_ptr,      # GLOBAL: uint8, the proxy's header receive region [2][R][REM_HDR] (else unused)
    own_ptr,           # GLOBAL: int32 [EL + 1], this rank's own selections (the send half's)
    sel_ptr,           # GLOBAL: int32 [R, EL], program 0's copy of the count matrix (written here too)
    rows_from_ptr,     # GLOBAL: int32 [R], program 0's copy of each source's rows
    mb_ptr,            # GLOBAL: int64, the proxy's mailbox
    timeout_ns, rtimeout_ns, spins,
    off_hflag: tl.constexpr, off_hdr: tl.constexpr, NODE0: tl.constexpr, ME: tl.constexpr, N: tl.constexpr,
    R: tl.constexpr, EL: tl.constexpr, HDR: tl.constexpr, REM_HDR: tl.constexpr, ALIGN: tl.constexpr,
    GLOBAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_EL: tl.constexpr, INTERP: tl.constexpr,
    ROWS: tl.constexpr,  # the rows layout: one row per (source, token), the headers' rows per source
):
    epoch = tl.load(state_ptr) + 1
    par = epoch & 1
    t0_ns = deadline_start(INTERP)
    ee = tl.arange(0, BLOCK_EL)
    em = ee < EL
    tot = tl.zeros((BLOCK_EL,), tl.int32)
    nrows = tl.zeros([], tl.int32)
    if GLOBAL:  # every source of every node: the count matrix from the proxy's headers and this rank's own
        ok = wait_word(mb_ptr, MB_HDR_READY, epoch, err_ptr, -1, PHASE_DISPATCH, t0_ns, rtimeout_ns, spins, INTERP)
        count_matrix(hdr_recv_ptr, own_ptr, sel_ptr, rows_from_ptr, ok, par, ME, R, EL, REM_HDR, BLOCK_R, BLOCK_EL)
        for s in range(R):
            tot += tl.load(sel_ptr + s * EL + ee, mask=em, other=0)
            nrows += tl.load(rows_from_ptr + s)
    else:
        ok = tl.full([], 1, tl.int32)
        hdr = ptr_at(ws, off_hdr, tl.int32) + par * N * HDR
        for s in range(N):
            ok = ok & wait_flag(ptr_at(ws, off_hflag, tl.int64) + s, epoch, t0_ns, timeout_ns, err_ptr, NODE0 + s,
                                PHASE_DISPATCH, INTERP)
            tot += tl.load(hdr + s * HDR + 1 + ee, mask=em, other=0)
            nrows += tl.load(hdr + s * HDR + 1 + EL)
    if ROWS:
        need = nrows.to(tl.int64)
    else:
        need = tl.sum(tl.where(em, (tot + ALIGN - 1) // ALIGN * ALIGN, 0)).to(tl.int64)
    tl.store(need_ptr, tl.where(ok != 0, need, -1))
