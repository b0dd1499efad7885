"""Whether the current CUDA stream is being captured into a CUDA graph: the package's one test of it."""
from __future__ import annotations

from typing import Optional

import torch


def capturing(device: Optional[torch.device] = None) -> bool:
    """True while the current CUDA stream is being captured into a CUDA graph. ``device``: the
    caller's device (a ``torch.device``; never capturing unless ``cuda``); None: wherever CUDA is
    (False on a machine without it)."""
    if device is None:
        if not torch.cuda.is_available():
            return False
    elif device.type != "cuda":
        return False
    return torch.cuda.is_current_stream_capturing()
