"""moe_ep: expert-parallel dispatch and combine for Mixture-of-Experts layers.

Public API: ``EPGroup``, ``EPBuffer`` (``dispatch`` / ``combine``), ``DispatchResult``,
``CommTimeoutError``; the pure-torch oracle is ``moe_ep.reference``.
"""
from .buffer import DispatchResult, EPBuffer
from .errors import BufferBrokenError, CapacityError, CommTimeoutError
from .group import EPGroup

__all__ = ["EPGroup", "EPBuffer", "DispatchResult", "CommTimeoutError", "CapacityError", "BufferBrokenError"]
__version__ = "0.1.0"
