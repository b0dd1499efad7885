"""The kernel side of the proxy's mailbox (docs/ARCHITECTURE.md §10): ring a doorbell, wait for a
ready word. The mailbox is host memory the GPU maps (pinned), so the proxy thread polls the
doorbells the kernels write, and the kernels poll the ready words the proxy writes: no host call
sits between the launches, and a CUDA graph replays the whole exchange.

Mailbox words (int64, ``moe_ep.proxy.native.MAILBOX``): 0 dispatch doorbell, 1 dispatch ready,
2 combine doorbell, 3 combine ready, 4 error code, 5 its peer.
"""
import triton
import triton.language as tl

from ..kernels.common import ERR_PROXY, ERR_TIMEOUT, deadline_start, record_error

MB_ERR_CODE = tl.constexpr(4)
MB_ERR_PEER = tl.constexpr(5)


@triton.jit
def ring_kernel(mb_ptr, epoch_ptr, WORD: tl.constexpr):
    """``mailbox[WORD] = epoch`` (one program, after the launch that packed the send buffer).

    The store is a system-scope release: the packing launch's writes, ordered before this one by
    the stream, reach host memory before the proxy can see the doorbell."""
    e = tl.load(epoch_ptr)
    tl.atomic_xchg(mb_ptr + WORD, e, sem="release", scope="sys")


@triton.jit
def wait_ready_kernel(mb_ptr, epoch_ptr, err_ptr, timeout_ns, WORD: tl.constexpr, PHASE: tl.constexpr,
                      INTERP: tl.constexpr):
    """Spins (one program) until ``mailbox[WORD] >= epoch``, the proxy records an error, or
    ``timeout_ns`` passes; the launches after it in the stream then read what the proxy received.

    A proxy error is copied into the error record (code ``ERR_PROXY``, the proxy's peer) for the
    host to raise the proxy's own exception; a timeout with no proxy error (the proxy thread
    itself stuck) records ``ERR_TIMEOUT`` with peer -1. Under the interpreter the host has already
    waited for the ready word, so one look suffices. Plain volatile loads while spinning (one
    PCIe read each), one acquire at the end."""
    e = tl.load(epoch_ptr)
    t0 = deadline_start(INTERP)
    v = tl.load(mb_ptr + WORD, volatile=True)
    bad = tl.load(mb_ptr + MB_ERR_CODE, volatile=True)
    if not INTERP:
        late = tl.full([], 0, tl.int32)
        while (v < e) & (bad == 0) & (late == 0):
            v = tl.load(mb_ptr + WORD, volatile=True)
            bad = tl.load(mb_ptr + MB_ERR_CODE, volatile=True)
            late = ((tl.extra.cuda.globaltimer() - t0) > timeout_ns).to(tl.int32)
    v = tl.atomic_add(mb_ptr + WORD, 0, sem="acquire", scope="sys")
    if bad != 0:
        record_error(err_ptr, ERR_PROXY, tl.load(mb_ptr + MB_ERR_PEER, volatile=True), PHASE, e, bad)
    elif v < e:
        record_error(err_ptr, ERR_TIMEOUT, -1, PHASE, e, 0)
