"""Host proxy for peers on other nodes (inter-node path).

So far: the native engine (csrc/proxy) behind ``native``: ``ImmCounter``, the TCP transport
(``Engine`` / ``TcpTransport``) and the §10 ``Proxy`` driven by mailbox words (``MAILBOX``).
Wiring into dispatch/combine comes next.
"""
from .identity import JobIdentity
from .native import (MAILBOX, MAILBOX_WORDS, Completion, Engine, ImmCounter, NativeError, PeerLostError, Proxy,
                     Refused, TcpTransport, CQ_OK, CQ_PEER_LOST, CQ_REMOTE_ACCESS, CQ_TIMEOUT, make_imm)

__all__ = ["ImmCounter", "Engine", "TcpTransport", "Proxy", "MAILBOX", "MAILBOX_WORDS", "make_imm", "Completion", "NativeError", "PeerLostError",
           "CQ_OK", "CQ_TIMEOUT", "CQ_PEER_LOST", "CQ_REMOTE_ACCESS", "JobIdentity", "Refused"]
