"""Exceptions raised by moe_ep."""
from __future__ import annotations

from typing import Optional


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
    """A batch needed more rows than a fixed-size region holds; nothing was written out of bounds."""


class BufferBrokenError(RuntimeError):
    """The buffer saw an earlier error (timeout, bad expert id, overflow) and cannot be used again."""
