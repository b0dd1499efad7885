"""DeepEP's API on moe_ep: V1's ``Buffer`` and V2's ``ElasticBuffer``, ``Config``, ``EventOverlap``,
``deep_ep.utils``. ``import moe_ep.deep_ep as deep_ep``, or ``python -m moe_ep.deep_ep.install`` so
that an unedited ``import deep_ep`` loads this. See README "Switching from DeepEP" for what differs."""
import torch

from . import utils
from .buffer import Buffer
from .config import Config
from .elastic import ElasticBuffer, EPHandle
from .event import EventOverlap

topk_idx_t = torch.int64  # DeepEP's expert-id dtype

__all__ = ["Buffer", "ElasticBuffer", "EPHandle", "Config", "EventOverlap", "topk_idx_t", "utils"]
