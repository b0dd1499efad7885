"""Host proxy for peers on other nodes (inter-node path).

So far: the native engine (csrc/proxy) behind ``native``: ``ImmCounter`` and the TCP transport
(``Engine`` / ``TcpTransport``). Wiring into dispatch/combine comes next.
"""
from .native import (Completion, Engine, ImmCounter, NativeError, PeerLostError, TcpTransport,
                     CQ_OK, CQ_PEER_LOST, CQ_REMOTE_ACCESS, CQ_TIMEOUT)

__all__ = ["ImmCounter", "Engine", "TcpTransport", "Completion", "NativeError", "PeerLostError",
           "CQ_OK", "CQ_TIMEOUT", "CQ_PEER_LOST", "CQ_REMOTE_ACCESS"]
