"""The kernel side of the proxy's mailbox (docs/ARCHITECTURE.md §10): bells the kernels ring, ready
words they wait for. The mailbox is host memory the GPU maps (pinned), so the proxy thread polls
the bells and the kernels poll the ready words: no host call sits between the launches, and a
CUDA graph replays the whole exchange.

Mailbox words (int64, ``moe_ep.native.protocol.MAILBOX``): 0 header bell, 1 dispatch ready, 2 header
ready, 3 combine ready, 4 error code, 5 its peer, 6 phase, 7 epoch, 8 overflow window ready, 9
overflow window done, 10 combine window done, 11 combine window bell (all four valued
``ov_window(e, w)``); then one word per rank in
each of four arrays: the rows bell of each peer, the round-1 and overflow ready words of each
source, the combine bell of each source (``MAILBOX_ARRAYS``).
"""
import triton
import triton.language as tl

from ..kernels.common import ERR_PROXY, ERR_TIMEOUT, deadline_start, record_error

MB_HDR_BELL = tl.constexpr(0)
MB_DISP_READY = tl.constexpr(1)
MB_HDR_READY = tl.constexpr(2)
MB_COMB_READY = tl.constexpr(3)
MB_ERR_CODE = tl.constexpr(4)
MB_ERR_PEER = tl.constexpr(5)
MB_OV_READY = tl.constexpr(8)   # proxy: overflow window w >= 1 landed -> ov_window(e, w)
MB_OV_DONE = tl.constexpr(9)    # kernel: windows 0..w-1 unpacked -> ov_window(e, w)
MB_COMB_WIN_DONE = tl.constexpr(10)  # proxy: combine writes of windows 0..w-1 completed -> ov_window(e, w)
MB_COMB_WIN_BELL = tl.constexpr(11)  # kernel: combine window w >= 1 packed -> ov_window(e, w)
MB_FIXED = tl.constexpr(12)  # the fixed words; the per-rank arrays follow
# The kernels' waits for the proxy end this long after the buffer's deadline (the proxy's own,
# which names the peer, runs out first); the interpreter, which has no clock, bounds its looks per
# wait instead, one per LOOK_NS of that (each costs far more there).
PROXY_GRACE_NS = tl.constexpr(5_000_000_000)
LOOK_NS = tl.constexpr(1000)
# Lanes of a look at the mailbox: at least the threads of a program (1024 at most), so each word is
# one lane held by one thread. A scalar or small-vector load is replicated on every warp, and each
# copy is a read across PCIe: 66 programs of 16 warps spinning so cut the GPU's copies to and from
# pinned host memory from 47 to 0.34 GB/s on an H100, one thread per program kept 7 GB/s
# (moe_ep.bench.host_poll; docs/performance-log/gpu.md, "Twenty-fifth pass").
LOOK_LANES = tl.constexpr(1024)


@triton.jit
def look_words(ptr, n, BLOCK: tl.constexpr):
    """``ptr[0:n]`` (host words, ``n <= BLOCK``; 0 beyond), each loaded by one thread of the
    program, as a ``[BLOCK]`` vector every thread holds (a reduction hands the lanes round)."""
    lanes = tl.arange(0, LOOK_LANES)
    v = tl.load(ptr + lanes, mask=lanes < n, other=0, volatile=True)
    return tl.sum(tl.reshape(v, [LOOK_LANES // BLOCK, BLOCK]), axis=0)  # lanes >= n are 0


@triton.jit
def look_word(ptr):
    """``ptr[0]`` (a host word), loaded by one thread of the program, as a scalar every thread holds."""
    lanes = tl.arange(0, LOOK_LANES)
    return tl.sum(tl.load(ptr + lanes, mask=lanes == 0, other=0, volatile=True), axis=0)


@triton.jit
def proxy_deadline(timeout_ns):
    """``(rtimeout_ns, spins)`` of the waits for the proxy from the buffer's ``timeout_ns``: their
    deadline and the interpreter's bound on looks per wait (``RemotePath.rtimeout_ns``, ``.spins``)."""
    rtimeout_ns = timeout_ns + PROXY_GRACE_NS
    return rtimeout_ns, rtimeout_ns // LOOK_NS


@triton.jit
def ov_window(epoch, w):
    """The value of the overflow window words for window ``w`` of ``epoch`` (grows with both)."""
    return (epoch.to(tl.int64) << 32) | w


@triton.jit
def rows_bell(R: tl.constexpr, p):
    """Word of peer ``p``'s rows bell."""
    return MB_FIXED + p


@triton.jit
def ready1(R: tl.constexpr, s):
    """Word of source ``s``'s round-1 ready word (its overflow ready word is ``R`` words on)."""
    return MB_FIXED + R + s


@triton.jit
def comb_bell(R: tl.constexpr, s):
    """Word of source ``s``'s combine bell."""
    return MB_FIXED + 3 * R + s


@triton.jit
def arrive_and_ring(count_ptr, mb_ptr, word, epoch):
    """This program is done with its part of what bell ``word`` announces: the last of the
    launch's programs to arrive (on the int32 counter ``count_ptr``) resets the counter for the
    next launch and rings the bell (``mailbox[word] = epoch``). No program waits for another.

    Why it is safe: each program's stores come before its arrival (a CTA barrier, then a
    system-scope release), the last arrival acquires every earlier one, and its bell is a
    system-scope release: the proxy that sees the bell sees every program's stores."""
    tl.debug_barrier()
    old = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="sys")
    if old == tl.num_programs(0) - 1:
        tl.store(count_ptr, 0)
        tl.atomic_xchg(mb_ptr + word, epoch, sem="release", scope="sys")


@triton.jit
def window_count(o_s, OVCAP: tl.constexpr):
    """Windows of ``OVCAP`` rows the overflow stream of ``sum(o_s)`` rows takes (a region of no
    rows: one per row; the proxy refused such a batch, its error is recorded)."""
    OV1: tl.constexpr = OVCAP + (OVCAP == 0)
    return tl.cdiv(tl.sum(o_s), OV1)


@triton.jit
def wait_window(mb_ptr, word, epoch, w, ovoff, o_s, err_ptr, phase, timeout_ns, spins, OVCAP: tl.constexpr,
                INTERP: tl.constexpr):
    """Waits for ``mailbox[word] >= ov_window(epoch, w)`` (its own deadline from now); returns each
    source's rows ``[lo, hi)`` of window ``w`` of the stream (each source's from ``ovoff``, ``o_s``
    of them; empty ranges where the wait failed, its error recorded)."""
    up = wait_value(mb_ptr, word, ov_window(epoch, w), epoch, err_ptr, -1, phase, deadline_start(INTERP), timeout_ns,
                    spins, INTERP)
    lo = tl.maximum(ovoff, w * OVCAP)
    return lo, tl.where(up != 0, tl.minimum(ovoff + o_s, (w + 1) * OVCAP), lo)


@triton.jit
def wait_word(mb_ptr, word, epoch, err_ptr, peer, phase, t0_ns, timeout_ns, spins, INTERP: tl.constexpr):
    """``wait_value`` for ``mailbox[word] >= epoch``."""
    return wait_value(mb_ptr, word, epoch, epoch, err_ptr, peer, phase, t0_ns, timeout_ns, spins, INTERP)


@triton.jit
def wait_value(mb_ptr, word, value, epoch, err_ptr, peer, phase, t0_ns, timeout_ns, spins, INTERP: tl.constexpr):
    """Waits until ``mailbox[word] >= value`` (the proxy's ready word of ``epoch``), the proxy records an error,
    or the deadline; returns 1 when the word is up (then one system-scope acquire: what the proxy
    received is visible to the loads after this), else 0 with the error record written: the
    proxy's error as ``ERR_PROXY`` with its peer (the host raises the proxy's own exception), or
    ``ERR_TIMEOUT`` naming ``peer`` when the proxy itself is stuck.

    On a GPU the deadline is ``timeout_ns`` after ``t0_ns`` (``globaltimer``). The interpreter has
    no clock: there the proxy's own deadline (shorter) always ends the wait with its error, and
    ``spins`` looks bound it besides (each look costs far more than a microsecond there)."""
    v = look_word(mb_ptr + word)
    bad = look_word(mb_ptr + MB_ERR_CODE)
    if INTERP:
        n = 0
        while (v < value) & (bad == 0) & (n < spins):
            v = look_word(mb_ptr + word)
            bad = look_word(mb_ptr + MB_ERR_CODE)
            n += 1
    else:
        late = tl.full([], 0, tl.int32)
        while (v < value) & (bad == 0) & (late == 0):
            v = look_word(mb_ptr + word)
            bad = look_word(mb_ptr + MB_ERR_CODE)
            late = ((tl.extra.cuda.globaltimer() - t0_ns) > timeout_ns).to(tl.int32)
    v = tl.atomic_add(mb_ptr + word, 0, sem="acquire", scope="sys")
    ok = (v >= value).to(tl.int32)
    if bad != 0:
        record_error(err_ptr, ERR_PROXY, tl.load(mb_ptr + MB_ERR_PEER, volatile=True), phase, epoch, bad)
        ok = ok * 0
    elif ok == 0:
        record_error(err_ptr, ERR_TIMEOUT, peer, phase, epoch, 0)
    return ok
