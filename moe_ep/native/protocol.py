"""The inter-node protocol's numbers (docs/ARCHITECTURE.md §10), as csrc/proxy/proxy.h defines
them: the mailbox's words (the bells the kernels ring, the ready words and the error record the
proxy writes), the proxy's error codes, the phases, the immediates' fields, the regions in their
registration order and the header's size. Plain Python: the kernels' host side, the buffer's
sizing and the proxy's bindings read them without loading the library
(``moe_ep.native.proxy.native_mailbox_layout`` checks them against it).
"""
from __future__ import annotations

# Mailbox word indices (int64 words), mirrored from csrc/proxy/proxy.h (kMb*, mb_*); the kernel
# side writes the bells, the proxy the ready words and the error record. Twelve fixed words, then
# four arrays of one word per rank (``mailbox_words(world)`` in all): the rows bell of each peer,
# each source's round-1 and overflow ready words, each source's combine bell.
MAILBOX = {
    "hdr_bell": 0,
    "disp_ready": 1,
    "hdr_ready": 2,
    "comb_ready": 3,
    "err_code": 4,
    "err_peer": 5,
    "err_phase": 6,
    "err_epoch": 7,
    "ov_ready": 8,  # proxy: overflow window w >= 1 of epoch e landed -> ov_window(e, w)
    "ov_done": 9,   # kernel: windows 0..w-1 of epoch e unpacked -> ov_window(e, w)
    "comb_win_done": 10,  # proxy: combine writes of windows 0..w-1 of epoch e completed -> ov_window(e, w)
    "comb_win_bell": 11,  # kernel: combine window w >= 1 of epoch e packed -> ov_window(e, w)
}
MAILBOX_WORDS = 12  # the fixed words
MAILBOX_ARRAYS = ("disp_bell", "ready1", "ready2", "comb_bell")  # after them, one word per rank each


def mailbox_words(world: int) -> int:
    """Words of a mailbox for ``world`` ranks."""
    return MAILBOX_WORDS + len(MAILBOX_ARRAYS) * world


def ov_window(epoch: int, window: int) -> int:
    """The value of the ``ov_ready`` / ``ov_done`` words for ``window`` of ``epoch`` (grows with both)."""
    return (epoch << 32) | window


def mailbox_word(name: str, world: int, rank: int) -> int:
    """Index of the word of ``rank`` in the per-rank array ``name`` (``MAILBOX_ARRAYS``)."""
    return MAILBOX_WORDS + MAILBOX_ARRAYS.index(name) * world + rank


# Error codes (mailbox["err_code"]) and phases (immediate bits 31..29, mailbox["err_phase"]).
PROXY_OK, PROXY_TIMEOUT, PROXY_PEER_LOST, PROXY_CAPACITY, PROXY_INVALID, PROXY_TRANSPORT = 0, 1, 2, 3, 4, 5
# D0: the headers (reported as round 1); CREDIT: a receiver's zero-byte "your part of overflow
# window w may come" (reported as round 2)
PHASE_D1, PHASE_D2, PHASE_C, PHASE_D0, PHASE_CREDIT = 0, 1, 2, 3, 4
PHASE_NAMES = {PHASE_D1: "dispatch", PHASE_D2: "dispatch", PHASE_C: "combine", PHASE_D0: "dispatch",
               PHASE_CREDIT: "dispatch"}
# Registration order. The first five hold rows only (GPU memory where the transport can register
# it); the proxy reads counts from the two header regions, which stay in host memory.
REGION_NAMES = ("disp_send", "round1", "overflow", "comb_send", "comb_recv", "hdr_send", "hdr_recv")
HEADER_REGIONS = ("hdr_send", "hdr_recv")


# Immediate fields (csrc/proxy/proxy.h make_imm, §10): phase in bits 31..29, the source rank in
# bits 28..16 (so at most IMM_MAX_RANKS ranks), the epoch mod 2^16 in bits 15..0.
IMM_SRC_SHIFT, IMM_SRC_BITS = 16, 13
IMM_PHASE_SHIFT = IMM_SRC_SHIFT + IMM_SRC_BITS
IMM_MAX_RANKS = 1 << IMM_SRC_BITS


def make_imm(phase: int, epoch: int, src: int = 0) -> int:
    """The 32-bit immediate a write of (phase, epoch) from rank ``src`` carries: phase in bits
    31..29, ``src`` in bits 28..16, epoch mod 2^16 in bits 15..0."""
    return (phase << IMM_PHASE_SHIFT) | ((src & (IMM_MAX_RANKS - 1)) << IMM_SRC_SHIFT) | (epoch & ((1 << IMM_SRC_SHIFT) - 1))


def hdr_bytes(world: int, num_local_experts: int) -> int:
    """HDR: int32[world] counts + int32[EL] local-expert counts, padded to 16 bytes."""
    return (4 * (world + num_local_experts) + 15) // 16 * 16

