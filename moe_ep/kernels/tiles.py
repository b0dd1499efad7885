"""Register-tile helpers the kernels share: prefix sums, picks and gathers over small register
tensors (registers cannot be indexed; scratch memory would need a barrier between programs), the
routing tile of a block of tokens, and a token's first selection on each rank."""
import triton
import triton.language as tl


@triton.jit
def excl(v):
    """Exclusive prefix sum of a 1-D tensor."""
    return tl.cumsum(v, 0) - v


@triton.jit
def pick(v, rr, i):
    """``v[i]`` of a 1-D register tensor indexed by ``rr`` (a scalar; 0 when out of range)."""
    return tl.sum(tl.where(rr == i, v, 0), axis=0)


@triton.jit
def gather(v, ee, idx):
    """``v[idx]`` for a 2-D index tile into a 1-D register tensor indexed by ``ee`` (0 where idx is
    out of range): a compare-and-sum, since registers cannot be indexed and scratch memory would
    need a barrier between programs."""
    return tl.sum(tl.where(idx[:, :, None] == ee[None, None, :], v[None, None, :], 0), axis=2)


@triton.jit
def chunk_sum(hist_ptr, row, rmask, upto, CMAX: tl.constexpr, BLOCK_C: tl.constexpr):
    """``sum(hist[row, :upto])`` per entry of the 1-D ``row`` (int32)."""
    cc = tl.arange(0, BLOCK_C)
    acc = tl.zeros(row.shape, tl.int32)
    for c0 in range(0, upto, BLOCK_C):
        m = rmask[:, None] & (c0 + cc[None, :] < upto)
        acc += tl.sum(tl.load(hist_ptr + row[:, None] * CMAX + c0 + cc[None, :], mask=m, other=0), axis=1)
    return acc


@triton.jit
def load_routing(topk_ptr, t, tm, E: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """(expert ids [rows, BLOCK_K] with out-of-range ones as -1, count of out-of-range ids) of the
    tokens ``t`` (rows with ``tm`` false, and k >= K, read as -1)."""
    kk = tl.arange(0, BLOCK_K)
    m2 = tm[:, None] & (kk[None, :] < K)
    ids = tl.load(topk_ptr + t[:, None] * K + kk[None, :], mask=m2, other=-1).to(tl.int32)
    bad = tl.sum((m2 & ((ids < -1) | (ids >= E))).to(tl.int32))
    return tl.where(m2 & (ids >= 0) & (ids < E), ids, -1), bad


@triton.jit
def first_on_rank(dst, kk):
    """[T, K] bool: selection k is the token's first on its rank ``dst`` (>= 0): one row per
    (token, destination rank)."""
    dup = tl.max(((dst[:, :, None] == dst[:, None, :]) & (kk[None, None, :] < kk[None, :, None])).to(tl.int32),
                 axis=2) > 0
    return (dst >= 0) & (dup == 0)


@triton.jit
def col(v, kk, k):
    """Column ``k`` of a [rows, BLOCK_K] tile."""
    return tl.sum(tl.where(kk[None, :] == k, v, 0), axis=1)
