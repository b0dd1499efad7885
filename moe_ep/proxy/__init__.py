"""Host proxy for peers on other nodes (inter-node path; docs/ARCHITECTURE.md §9, §10).

``native``: the native engine (csrc/proxy) through ctypes: ``ImmCounter``, the transports
(``Engine``; ``TcpTransport``, ``VerbsTransport``, ``FabricTransport``: libfabric, EFA through its
``efa`` provider) and the §10 ``Proxy`` driven by mailbox words (``MAILBOX``), which ``EPBuffer``
starts through ``moe_ep.internode.session`` when ``node_size < world_size``. ``nic``: the NIC nearest a GPU. ``identity``: the job identity every
connection is checked against.
"""
from .identity import JobIdentity
from .native import (MAILBOX, MAILBOX_WORDS, Completion, Engine, FabricTransport, ImmCounter, NativeError,
                     PeerLostError, Proxy, Refused, TcpTransport, VerbsTransport, CQ_OK, CQ_PEER_LOST,
                     CQ_REMOTE_ACCESS, CQ_TIMEOUT, make_imm)

__all__ = ["ImmCounter", "Engine", "TcpTransport", "VerbsTransport", "FabricTransport", "Proxy", "MAILBOX",
           "MAILBOX_WORDS", "make_imm", "Completion", "NativeError", "PeerLostError", "CQ_OK", "CQ_TIMEOUT",
           "CQ_PEER_LOST", "CQ_REMOTE_ACCESS", "JobIdentity", "Refused"]
