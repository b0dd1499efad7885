"""Exceptions raised by moe_ep, and the codes of the kernels' error record that the host turns into them."""
from __future__ import annotations

from enum import IntEnum
from typing import Optional


class ErrorCode(IntEnum):
    """Word 0 of an ``EPBuffer``'s error record (int64 ``[8]``: code, peer, phase, epoch, detail, ...),
    as the kernels write it (``moe_ep.kernels.common.record_error``, its ``ERR_*`` constants)."""

    NONE = 0
    TIMEOUT = 1     # a wait for ``peer`` passed its deadline
    BAD_EXPERT = 2  # ``detail`` expert ids outside [-1, E) (treated as -1)
    CAPACITY = 3    # a masked expert block overflowed (packed: the rows passed max_recv_rows): ``peer`` the rank,
                    # ``detail`` expert << 32 | rows (packed: the first expert past the cap, the rows needed)
    PROXY = 4       # the proxy recorded an error (its mailbox has the details)


class Phase(IntEnum):
    """Word 2 of the error record: the op whose wait or check failed (the kernels' ``PHASE_*``)."""

    DISPATCH = 0
    COMBINE = 1

    @classmethod
    def text_of(cls, value: int) -> str:
        """The phase of record value ``value`` as errors name it (``"dispatch"``, ``"combine"``), or
        its digits for a value that is no phase."""
        try:
            return cls(value).name.lower()
        except ValueError:
            return str(value)


class CommTimeoutError(RuntimeError):
    """A wait for a peer passed its deadline.

    Attributes: ``rank`` (this rank), ``peer`` (the rank that did not arrive), ``phase``
    (``"dispatch"`` or ``"combine"``; ``"EPBuffer construction"`` with epoch 0 when a rank did not
    reach the constructor), ``epoch`` (the call number on this buffer, from 1).
    """

    def __init__(self, rank: int, peer: int, phase: str, epoch: int, timeout_s: float,
                 message: Optional[str] = None):
        self.rank, self.peer, self.phase, self.epoch, self.timeout_s = rank, peer, phase, epoch, timeout_s
        super().__init__(message or (
            f"rank {rank}: peer {peer} did not signal {phase} epoch {epoch} within {timeout_s:g} s "
            f"(the peer is stuck, dead, or did not call {phase} on its buffer)"
        ))


class CapacityError(RuntimeError):
    """A batch needed more rows than a fixed-size region holds; nothing was written out of bounds.

    Attributes (None where not known): ``rank`` (the rank raising it), ``peer`` (the rank whose
    region overflowed: this one, a node peer, or, learned from its goodbye, a rank on another
    node), ``phase`` (``"dispatch"`` or ``"combine"``), ``epoch``.
    """

    def __init__(self, message: str, rank: Optional[int] = None, peer: Optional[int] = None,
                 phase: Optional[str] = None, epoch: Optional[int] = None):
        super().__init__(message)
        self.rank, self.peer, self.phase, self.epoch = rank, peer, phase, epoch


class BufferBrokenError(RuntimeError):
    """The buffer saw an earlier error (timeout, bad expert id, overflow) and cannot be used again."""
