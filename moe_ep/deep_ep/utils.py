"""``deep_ep.utils`` on moe_ep: DeepEP's ``EventHandle`` and ``EventOverlap`` (Megatron-core's
``from deep_ep.utils import EventHandle, EventOverlap``)."""
from .event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
