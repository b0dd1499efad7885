"""Routing histogram: per chunk of tokens, how many selections each global expert got.

The dispatch send kernel turns these into each selection's position among the selections of
its expert from this rank (an exclusive prefix over chunks plus a rank inside the chunk), so the
receiver can place every row without a scan of its own and the order is deterministic:
(source rank, token, k). For the rows layout it also counts, per chunk, the tokens with a
selection on each node peer (rows ``E + d``), from which the send kernel places whole tokens; with
other nodes, per chunk, the tokens with a selection on each rank (rows ``E + N + r``), from which
the inter-node send half places each remote peer's rows.
"""
import triton
import triton.language as tl

from .common import ERR_BAD_EXPERT, PHASE_DISPATCH, record_error
from .tiles import first_on_rank


@triton.jit(do_not_specialize=['T', 'BT'])
def route_hist_kernel(
    topk_ptr,          # int32/int64 [T, K]
    hist_ptr,          # int32 [E (+ N with ROWS or RANKS) (+ RANKS), CMAX]: hist[e, c] = selections of e in chunk c;
                       # ROWS: hist[E + d, c] = tokens of chunk c with a selection on node peer d;
                       # RANKS: hist[E + N + r, c] = tokens of chunk c with a selection on rank r
    state_ptr,         # int64 [8]: [0] = dispatch epoch
    err_ptr,           # int64 [8] error record
    T, BT,             # tokens, tokens per chunk
    E: tl.constexpr, K: tl.constexpr, CMAX: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    ROWS: tl.constexpr = False, N: tl.constexpr = 1, NODE0: tl.constexpr = 0, EL: tl.constexpr = 1,
    BLOCK_N: tl.constexpr = 2, RANKS: tl.constexpr = 0, BLOCK_RANKS: tl.constexpr = 2,
):
    c = tl.program_id(0)
    t = c * BT + tl.arange(0, BLOCK_T)
    kk = tl.arange(0, BLOCK_K)
    m = (t[:, None] < T) & (t[:, None] < (c + 1) * BT) & (kk[None, :] < K)
    ids = tl.load(topk_ptr + t[:, None] * K + kk[None, :], mask=m, other=-1).to(tl.int32)
    valid = m & (ids >= 0) & (ids < E)
    bad = tl.sum((m & ((ids < -1) | (ids >= E))).to(tl.int32))
    if bad > 0:
        # Out-of-range ids are treated as -1 (no expert) so nothing is written out of bounds;
        # the host raises at its next check.
        record_error(err_ptr, ERR_BAD_EXPERT, -1, PHASE_DISPATCH, tl.load(state_ptr) + 1, bad)
    h = tl.histogram(tl.reshape(tl.where(valid, ids, 0), [BLOCK_T * BLOCK_K]), BLOCK_E,
                     mask=tl.reshape(valid, [BLOCK_T * BLOCK_K]))
    ee = tl.arange(0, BLOCK_E)
    tl.store(hist_ptr + ee * CMAX + c, h, mask=ee < E)
    if ROWS:  # one count per (token, node peer): its first selection on the peer counts
        dst = tl.where(valid, ids // EL - NODE0, -1)
        first = first_on_rank(dst, kk) & (dst < N)
        hn = tl.histogram(tl.reshape(tl.where(first, dst, 0), [BLOCK_T * BLOCK_K]), BLOCK_N,
                          mask=tl.reshape(first, [BLOCK_T * BLOCK_K]))
        nn = tl.arange(0, BLOCK_N)
        tl.store(hist_ptr + (E + nn) * CMAX + c, hn, mask=nn < N)
    if RANKS > 0:  # with other nodes: one count per (token, rank) of all RANKS, after the N node rows
        dst = tl.where(valid, ids // EL, -1)
        first = first_on_rank(dst, kk)
        hr = tl.histogram(tl.reshape(tl.where(first, dst, 0), [BLOCK_T * BLOCK_K]), BLOCK_RANKS,
                          mask=tl.reshape(first, [BLOCK_T * BLOCK_K]))
        rr = tl.arange(0, BLOCK_RANKS)
        tl.store(hist_ptr + (E + N + rr) * CMAX + c, hr, mask=rr < RANKS)
