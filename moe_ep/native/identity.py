"""The job identity every inter-node connection proves: a 128-bit secret and a session epoch.

Rank 0 draws both when a proxy session is set up (``agree_identity``) and every rank gets them
through the process group, the one channel the transports trust. Each engine is created with
it; every hello (tcp: the first message of each connection; verbs and efa: the hello SEND) carries
it with the connector's rank and world size, and an engine refuses a hello that does not match
(docs/ARCHITECTURE.md §9, "Who gets in"). The secret is never logged or put in an error.
"""
from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not at run time: moe_ep.tools.doctor imports the native package without torch
    from ..core.group import EPGroup

SECRET_BYTES = 16
_U64 = 1 << 64


class JobIdentity:
    """``secret``: 16 bytes; ``session``: the session epoch, an unsigned 64-bit integer (rank 0's
    wall clock in ns when it drew the identity, so a refusal can tell an earlier session apart).
    ``repr`` and ``str`` leave the secret out."""

    __slots__ = ("secret", "session")

    def __init__(self, secret: bytes, session: int):
        if not isinstance(secret, (bytes, bytearray)) or len(secret) != SECRET_BYTES:
            got = f"{len(secret)} bytes" if isinstance(secret, (bytes, bytearray)) else type(secret).__name__
            raise ValueError(f"secret: expected {SECRET_BYTES} bytes, got {got}")
        if isinstance(session, bool) or not isinstance(session, int) or not 0 <= session < _U64:
            raise ValueError(f"session: expected an integer in [0, 2**64), got {session!r}")
        self.secret, self.session = bytes(secret), session

    @classmethod
    def new(cls) -> JobIdentity:
        """128 random bits (``secrets``) and the current wall clock in ns as the session epoch."""
        return cls(secrets.token_bytes(SECRET_BYTES), time.time_ns())

    @classmethod
    def none(cls) -> JobIdentity:
        """The all-zero identity of an engine connected by hand (tests, tools): no secret."""
        return cls(bytes(SECRET_BYTES), 0)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JobIdentity) and (self.secret, self.session) == (other.secret, other.session)

    def __hash__(self) -> int:
        return hash((self.secret, self.session))

    def __repr__(self) -> str:
        return f"JobIdentity(session={self.session}, secret=<{SECRET_BYTES} bytes, not shown>)"

    __str__ = __repr__

    def __reduce__(self):  # pickled only to travel over the process group
        return (JobIdentity, (self.secret, self.session))


def agree_identity(group: EPGroup) -> JobIdentity:
    """Collective: rank 0 draws a new ``JobIdentity`` and every rank of ``group`` returns it."""
    mine = JobIdentity.new() if group.rank == 0 else None
    return group.all_gather_object(mine)[0]
