"""moe_ep: expert-parallel dispatch and combine for Mixture-of-Experts layers.

Public API: ``EPGroup``, ``EPBuffer`` (``dispatch`` / ``combine``, ``memory()``), ``DispatchResult``,
``CommTimeoutError``; ``Tuning`` (how a buffer launches its kernels: warps, tiles, chunks, ...);
``memory_plan`` (a ``MemoryPlan``: a buffer's memory per region before anything is allocated);
the pure-torch oracle is ``moe_ep.testing.reference``. ``MoELayer`` is a drop-in expert-parallel MoE block;
``moe_ep.integrations.hf`` puts it into HF transformers models.

The classes are imported on first use (PEP 562), so ``python -m moe_ep.doctor --no-torch`` and
the torch-free tools load without torch (about 50 s on an emulated machine, 2-3 s natively).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .core.errors import BufferBrokenError, CapacityError, CommTimeoutError

if TYPE_CHECKING:
    from .ops.buffer import DispatchResult, EPBuffer
    from .core.group import EPGroup
    from .moe.layer import MoELayer
    from .ops.sizing import MemoryPlan, memory_plan
    from .core.tuning import Tuning

__all__ = ["EPGroup", "EPBuffer", "DispatchResult", "CommTimeoutError", "CapacityError", "BufferBrokenError", "MoELayer",
           "memory_plan", "MemoryPlan", "Tuning"]
__version__ = "0.1.0"

_LAZY = {"EPBuffer": ".ops.buffer", "DispatchResult": ".ops.buffer", "EPGroup": ".core.group", "MoELayer": ".moe.layer",
         "memory_plan": ".ops.sizing", "MemoryPlan": ".ops.sizing", "Tuning": ".core.tuning"}


def __getattr__(name: str):
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
