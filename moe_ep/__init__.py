"""moe_ep: expert-parallel dispatch and combine for Mixture-of-Experts layers.

Public API: ``EPGroup``, ``EPBuffer`` (``dispatch`` / ``combine``), ``DispatchResult``,
``CommTimeoutError``; the pure-torch oracle is ``moe_ep.reference``. ``MoELayer`` is a drop-in
expert-parallel MoE block; ``moe_ep.integrations.hf`` puts it into HF transformers models.
"""
from .buffer import DispatchResult, EPBuffer
from .errors import BufferBrokenError, CapacityError, CommTimeoutError
from .group import EPGroup
from .layer import MoELayer

__all__ = ["EPGroup", "EPBuffer", "DispatchResult", "CommTimeoutError", "CapacityError", "BufferBrokenError", "MoELayer"]
__version__ = "0.1.0"
