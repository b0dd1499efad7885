"""Routing histogram: per chunk of tokens, how many selections each global expert got.

The dispatch send kernel turns these into each selection's position among the selections of
its expert from this rank (an exclusive prefix over chunks plus a rank inside the chunk), so the
receiver can place every row without a scan of its own and the order is deterministic:
(source rank, token, k).
"""
import triton
import triton.language as tl

from .common import ERR_BAD_EXPERT, PHASE_DISPATCH, record_error


@triton.jit(do_not_specialize=['T', 'BT'])
def route_hist_kernel(
    topk_ptr,          # int32/int64 [T, K]
    hist_ptr,          # int32 [E, CMAX]: hist[e, c] = selections of e in chunk c
    state_ptr,         # int64 [8]: [0] = dispatch epoch
    err_ptr,           # int64 [8] error record
    T, BT,             # tokens, tokens per chunk
    E: tl.constexpr, K: tl.constexpr, CMAX: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
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
