"""Backends of the bench CLI, by name (``--backends``)."""
from __future__ import annotations

from .base import Backend, Context, NotAvailable, Runner
from .deepep import DeepEPBackend
from .moe_ep import MoeEpBackend
from .nccl import NcclBackend
from .symm_mem import SymmMemBackend

BACKENDS: dict[str, type[Backend]] = {
    "moe_ep": MoeEpBackend,
    "nccl": NcclBackend,
    "symm_mem": SymmMemBackend,
    "deepep": DeepEPBackend,
}

__all__ = ["BACKENDS", "Backend", "Context", "NotAvailable", "Runner"]
