"""What every backend of the bench CLI provides: a Backend per library, a Runner per sweep point."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch

from ..workloads import Inputs, Workload


class NotAvailable(Exception):
    """This backend (or one of its variants) cannot run here; the message says why."""


# Process-wide resources that backends cannot share within one launch: torch symmetric memory has
# one allocation backend per process (moe_ep: CUDA, symm_mem: NVSHMEM), and NVSHMEM is initialised
# once per process (by torch for symm_mem, by DeepEP for its low-latency mode).
_CLAIMS: dict[str, tuple[str, str]] = {}
_RESOURCE_TEXT = {"symm_mem_backend": "torch symmetric memory's allocation backend",
                  "nvshmem": "the NVSHMEM runtime"}


def claim(resource: str, value: str, user: str) -> Optional[str]:
    """Takes ``resource`` (as ``value``) for ``user``; returns why not if another user holds it differently."""
    held = _CLAIMS.setdefault(resource, (value, user))
    if held[0] == value:
        return None
    return (f"{_RESOURCE_TEXT.get(resource, resource)} is already set to {held[0]} by {held[1]} in this process; "
            f"run {user} in its own launch (the repository's scripts/compare.sh does)")


@dataclass
class Context:
    """What a backend may use: the process group wrapper, the device and the CLI's knobs."""

    group: object                 # moe_ep.EPGroup over WORLD (default node size)
    device: torch.device
    rank: int
    world_size: int
    num_sms: Optional[int]        # --num-sms: SMs / Triton programs, where a backend lets us choose
    node_size: Optional[int]      # --node-size: moe_ep's ranks per node (None: the real hosts)
    tokens: list[int]             # the sweep's token counts (buffers kept across points are sized for them)
    timeout_s: float
    shared_gpus: bool = False     # ranks share GPUs (time-sliced): no GB/s, nothing crosses NVLink


def needs_own_gpus(ctx: Context, library: str) -> Optional[str]:
    """Why ``library`` (NCCL or NVSHMEM based) cannot run when ranks share GPUs, else None."""
    if ctx.shared_gpus:
        return f"needs a GPU per rank ({library} refuses two ranks on one GPU; these ranks share GPUs)"
    return None


class Runner(ABC):
    """One backend variant bound to one point's inputs.

    The harness calls ``dispatch()`` once, then ``make_expert_output()`` (fake experts on what was
    received, in the layout this backend's combine takes), then ``combine()``; afterwards any number
    of ``dispatch()``/``combine()`` pairs on the same inputs. ``output()`` is the latest combine's
    ``[T, H]`` result.
    """

    sms: Optional[int] = None     # SMs (or programs) the backend's kernels use; None: not controlled/known
    graphable: bool = False       # dispatch and combine may be captured into CUDA graphs
    own_fp8: bool = False         # quantizes fp8 with its own rounding (pre-check: CHECK_TOL_OWN_FP8)
    out: Optional[torch.Tensor] = None  # set by combine()

    @abstractmethod
    def dispatch(self) -> None: ...

    @abstractmethod
    def make_expert_output(self) -> None: ...

    @abstractmethod
    def combine(self) -> None: ...

    def output(self) -> Optional[torch.Tensor]:
        return self.out

    def close(self) -> None:
        """Releases what ``open`` allocated for this point (buffers kept across points stay)."""


class Backend(ABC):
    """A library under test. ``variants`` are its modes (``("",)`` when it has one)."""

    name: str = ""
    variants: tuple[str, ...] = ("",)
    graphable: bool = False       # also timed as CUDA graphs (--graph)

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def unavailable(self) -> Optional[str]:
        """Why nothing of this backend can run here (checked once, before the sweep); None if it can."""
        return None

    @abstractmethod
    def open(self, variant: str, wl: Workload, inputs: Inputs) -> Runner:
        """A runner for ``variant`` on this point; raises ``NotAvailable`` with the reason if it cannot run."""

    def close(self) -> None:
        """Releases buffers kept across points."""


def fake_expert_rows(rows_q: torch.Tensor, rows_scales: Optional[torch.Tensor], factor: torch.Tensor) -> torch.Tensor:
    """bf16 ``dequant(rows) * factor`` with ``factor`` broadcast over the rows' leading dims."""
    from ..intranode import dequant

    return (dequant(rows_q, rows_scales) * factor).to(torch.bfloat16)
