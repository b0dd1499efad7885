"""DeepEP V1's ``deep_ep.Buffer`` API on moe_ep: ``import moe_ep.deep_ep as deep_ep`` is the one
change a DeepEP caller makes. See README "Switching from DeepEP" for what differs."""
import torch

from .buffer import Buffer
from .config import Config
from .event import EventOverlap

topk_idx_t = torch.int64  # DeepEP's expert-id dtype

__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t"]
