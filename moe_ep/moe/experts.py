"""The experts of an MoE layer: this rank's routed experts as one grouped GEMM over the dispatched
rows, the shared experts as a dense MLP.

Routed expert weights use the fused layout of HF transformers (v5): ``gate_up_proj [E, 2F, H]``
(gate rows first, then up) and ``down_proj [E, H, F]``; a rank stores only its ``E/R`` experts
but loads and saves the dense ``[E, ...]`` tensors (see :class:`LocalExperts`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}


def check_activation(activation: str):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {sorted(ACTIVATIONS)} (gated: act(x W_gate) * (x W_up)), "
                         f"got {activation!r}")
    return ACTIVATIONS[activation]


@dataclass
class RowGroups:
    """Rows of the dispatched layout seen as consecutive groups, one per local expert.

    ``ends[e]`` (int32, device) is where expert e's group ends (groups start at the previous end);
    a group may hold padding rows (packed alignment, masked capacity): ``valid`` says which rows
    are dispatched rows. ``expert`` is the local expert of every row. ``starts``/``counts`` are the
    host copies the per-expert loop uses (None where reading them would sync the device).
    """

    ends: torch.Tensor
    valid: torch.Tensor
    expert: torch.Tensor
    starts: Optional[List[int]] = None
    counts: Optional[List[int]] = None

    @property
    def num_rows(self) -> int:
        return int(self.valid.shape[0])


def use_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch's grouped GEMM runs on CUDA for bfloat16 operands with 16-byte aligned rows."""
    return (hasattr(F, "grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
            and x.shape[-1] % 8 == 0 and w.shape[-2] % 8 == 0)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, groups: RowGroups, grouped_mm: Optional[bool] = None) -> torch.Tensor:
    """``out[i] = x[i] @ w[expert(i)].T`` for the rows of each group.

    Args:
        x: ``[N, Hin]``. w: ``[EL, Hout, Hin]``, same dtype and device.
        grouped_mm: True: ``torch.nn.functional.grouped_mm`` over ``groups.ends``; False: a loop
            over the experts' valid rows (needs ``groups.starts/counts``); None: grouped_mm where
            :func:`use_grouped_mm` says it runs, else the loop.
    Returns:
        ``[N, Hout]``; rows that are not valid hold zeros (loop) or whatever the GEMM made of them.
    """
    if x.shape[0] == 0:
        return x.new_zeros(0, w.shape[-2])
    if grouped_mm is None:
        grouped_mm = use_grouped_mm(x, w) or groups.starts is None
    if grouped_mm:
        return F.grouped_mm(x, w.transpose(-2, -1), offs=groups.ends)
    if groups.starts is None:
        raise RuntimeError("grouped_linear: the per-expert loop needs the host row counts")
    pieces, row = [], 0
    for e, (s, c) in enumerate(zip(groups.starts, groups.counts)):
        if c == 0:
            continue
        if s > row:
            pieces.append(x.new_zeros(s - row, w.shape[-2]))
        pieces.append(F.linear(x[s:s + c], w[e]))
        row = s + c
    if groups.num_rows > row:
        pieces.append(x.new_zeros(groups.num_rows - row, w.shape[-2]))
    return torch.cat(pieces) if pieces else x.new_zeros(0, w.shape[-2])


def gated_mlp_rows(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, groups: RowGroups, act,
                   grouped_mm: Optional[bool] = None) -> torch.Tensor:
    """``down_e(act(gate_e x) * up_e x)`` for every row; rows that are not valid come out 0."""
    x = torch.where(groups.valid.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=x.device))
    h = grouped_linear(x, gate_up, groups, grouped_mm)
    gate, up = h.chunk(2, dim=-1)
    y = grouped_linear(act(gate) * up, down, groups, grouped_mm)
    return torch.where(groups.valid.unsqueeze(-1), y, torch.zeros((), dtype=y.dtype, device=y.device))


def _all_gather_dim0(t: torch.Tensor, group) -> torch.Tensor:
    """Concatenation along dim 0 of every rank's ``t`` (same shape on all ranks)."""
    if group.pg is None or group.world_size == 1:
        return t.detach().clone()
    t = t.detach().contiguous()
    wire = t.view(torch.uint8).to(group.collective_device)  # every backend gathers bytes; bf16/fp8 are not universal
    outs = [torch.empty_like(wire) for _ in range(group.world_size)]
    dist.all_gather(outs, wire, group=group.pg)
    return torch.cat([o.view(t.dtype).view(t.shape) for o in outs]).to(t.device)


class LocalExperts(nn.Module):
    """This rank's routed experts: ``gate_up_proj [EL, 2F, H]`` and ``down_proj [EL, H, F]``.

    Rank r holds experts ``[r*EL, (r+1)*EL)``. ``state_dict()`` gives the dense ``[E, ...]``
    tensors (gathered from every rank: collective when R > 1, like a full state dict of FSDP);
    ``load_state_dict()`` takes the dense tensors (keeps this rank's slice) or the local shard.
    """

    def __init__(self, group, num_experts: int, hidden: int, ffn_hidden: int, device=None, dtype=None):
        super().__init__()
        self.group = group
        self.num_experts, self.hidden, self.ffn_hidden = num_experts, hidden, ffn_hidden
        self.num_local_experts = num_experts // group.world_size
        self.first_expert = group.rank * self.num_local_experts
        EL = self.num_local_experts
        self.gate_up_proj = nn.Parameter(torch.empty(EL, 2 * ffn_hidden, hidden, device=device, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(EL, hidden, ffn_hidden, device=device, dtype=dtype))
        with torch.no_grad():
            self.gate_up_proj.normal_(std=hidden ** -0.5)
            self.down_proj.normal_(std=ffn_hidden ** -0.5)

    def extra_repr(self) -> str:
        return (f"experts {self.first_expert}..{self.first_expert + self.num_local_experts - 1} of "
                f"{self.num_experts}, hidden={self.hidden}, ffn_hidden={self.ffn_hidden}")

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name, p in self._parameters.items():
            destination[prefix + name] = _all_gather_dim0(p, self.group)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        EL, lo = self.num_local_experts, self.first_expert
        local = dict(state_dict)
        for name, p in self._parameters.items():
            v = local.get(prefix + name)
            if isinstance(v, torch.Tensor) and v.dim() == p.dim() and v.shape[0] == self.num_experts \
                    and tuple(v.shape[1:]) == tuple(p.shape[1:]):
                local[prefix + name] = v[lo:lo + EL]
        super()._load_from_state_dict(local, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


class SharedExperts(nn.Module):
    """The shared experts: one dense gated MLP that every token goes through (HF ``DeepseekV3MLP`` layout)."""

    def __init__(self, hidden: int, ffn_hidden: int, act, device=None, dtype=None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn_hidden, bias=False, device=device, dtype=dtype)
        self.up_proj = nn.Linear(hidden, ffn_hidden, bias=False, device=device, dtype=dtype)
        self.down_proj = nn.Linear(ffn_hidden, hidden, bias=False, device=device, dtype=dtype)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, H]`` -> ``[T, H]``."""
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
