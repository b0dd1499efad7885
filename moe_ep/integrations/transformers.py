"""moe_ep as transformers' expert-parallel implementation: ``DistributedConfig(ep_implementation="moe_ep")``.

Importing this module registers ``"moe_ep"`` (bf16 dispatch) and ``"moe_ep_fp8"`` (fp8 dispatch,
quantized in the kernel per 128 channels) in transformers' ``EPImplementationInterface``;
:func:`register` registers them again, or under another name with other options. transformers
keeps everything else: the model, its router, the sharding and loading of the expert weights
(``grouped_gemm`` / ``ep_dispatch_experts`` plans), FSDP of the rest, and the experts' own
forward (``experts_implementation``), which runs on the rows moe_ep brings.

Per MoE layer call: an ``EPBuffer`` in the rows layout sends every token
once to each rank holding one of its experts; that rank's experts run on the received rows with
their local expert ids (``num_local_experts``, the sentinel the experts skip, where the expert is
elsewhere) and weights, each row coming out already weighted and summed over its selections; the
rows combine sums them back on the token's rank. Differentiable in the tokens, the routing
weights and the experts (``moe_ep.moe.rows_autograd``). Nothing is read back from the device, so it
captures in a CUDA graph; the ranks agree on ``max_tokens`` with one host all-gather of an
integer per call (gloo; skipped with ``register(max_tokens=N)`` and under graph capture).

Layouts: each rank its own batch (``tp_size=1``), or with ``tp_size > 1`` the ranks of a TP group
share a batch and each sends an equal slice of it, the outputs gathered back over TP (one
all-gather of ``[T, H]`` per layer; ``ep_size`` any multiple of ``tp_size`` transformers accepts).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple, Type

import torch
import torch.distributed as dist

from ..core.group import EPGroup
from ..moe.rows_autograd import RowsExchange, rows_moe
from ..core.tuning import Tuning

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, torch.bfloat16: torch.bfloat16,
           "fp8": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn,
           torch.float8_e4m3fn: torch.float8_e4m3fn}
NAMES = ("moe_ep", "moe_ep_fp8")

# One exchange (its buffers) per EP process group and options, shared by every layer and step.
_EXCHANGES: Dict[Tuple, RowsExchange] = {}
_GROUPS: Dict[object, EPGroup] = {}


def _exchange(pg, max_tokens: Optional[int], timeout_s: float, tuning: Optional[Tuning] = None) -> RowsExchange:
    key = (pg, max_tokens, timeout_s, tuning)
    ex = _EXCHANGES.get(key)
    if ex is None:
        group = _GROUPS.get(pg)
        if group is None:
            group = _GROUPS[pg] = EPGroup(pg)  # collective once (every rank reaches its first layer)
        ex = _EXCHANGES[key] = RowsExchange(group, max_tokens=max_tokens, timeout_s=timeout_s, tuning=tuning)
    return ex


def close_all() -> None:
    """Releases every buffer this module made and forgets the groups (a later forward makes them
    again, collectively). Call it on every rank, e.g. before dropping a model."""
    for ex in _EXCHANGES.values():
        ex.close()
    _EXCHANGES.clear()
    _GROUPS.clear()


def check_layout(is_expert_parallel: bool) -> None:
    """Raises where the experts are not sharded by expert (the sentinel ids would then be wrong)."""
    if not is_expert_parallel:
        raise ValueError(
            'ep_implementation="moe_ep": the experts are not sharded by expert (ep_plan needs "grouped_gemm" on '
            "the experts' weights next to \"ep_dispatch_experts\" on the experts module)")


def tp_slice(t: torch.Tensor, tp_mesh) -> torch.Tensor:
    """This TP rank's rows of ``t [T, ...]``, which every rank of the TP group holds alike (the
    ``torch.chunk`` split, uneven or empty pieces included); the gradient gathers back over TP."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor.from_local(t, tp_mesh, [Replicate()], run_check=False).redistribute(tp_mesh, [Shard(0)]).to_local()


def tp_gather(t: torch.Tensor, tp_mesh, num_tokens: int) -> torch.Tensor:
    """Inverse of :func:`tp_slice`: every TP rank's rows ``[T_i, H]`` -> ``[num_tokens, H]`` on each."""
    from torch.distributed.tensor import DTensor, Shard

    H = t.shape[-1]
    return DTensor.from_local(t.contiguous(), tp_mesh, [Shard(0)], shape=(num_tokens, H), stride=(H, 1)).full_tensor()


def _ep_module():
    """transformers' ``expert_parallel`` module (its ``EPImplementation`` registry came in 5.23)."""
    try:
        from transformers.distributed import expert_parallel
        expert_parallel.EPImplementationInterface  # noqa: B018
    except (ImportError, AttributeError) as exc:
        raise ImportError("moe_ep.integrations.transformers needs transformers >= 5.23 (EPImplementationInterface) "
                          "and accelerate: pip install 'moe_ep[hf]'") from exc
    return expert_parallel


def _make_class(name: str, dispatch_dtype: torch.dtype, max_tokens: Optional[int], timeout_s: float,
                tuning: Optional[Tuning] = None) -> Type:
    EPImplementation = _ep_module().EPImplementation  # noqa: N806

    class MoeEpImplementation(EPImplementation):
        """moe_ep's rows dispatch -> this rank's experts -> rows combine (module docstring)."""

        def __init__(self, experts, ep_mesh, tp_mesh):
            super().__init__(experts, ep_mesh, tp_mesh)
            check_layout(bool(getattr(experts, "_is_expert_parallel", False)))
            self.tp_mesh = tp_mesh if tp_mesh.size() > 1 else None
            self.pg = ep_mesh.get_group()
            if dist.get_rank(self.pg) != ep_mesh.get_local_rank():
                raise ValueError(f'ep_implementation="{name}": the expert group\'s ranks are not in mesh order')
            self.ep_size = ep_mesh.size()
            self.num_experts = self.num_local_experts * self.ep_size
            self.dispatch_dtype = dispatch_dtype
            self.options = (max_tokens, timeout_s, tuning)

        def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
            """hidden_states ``[T, H]``, top_k_index ``[T, K]`` global ids, top_k_weights ``[T, K]``
            (this rank's batch) -> ``[T, H]`` in hidden_states' dtype: the weighted expert outputs."""
            ex = _exchange(self.pg, *self.options)
            T = hidden_states.shape[0]
            if self.tp_mesh is not None:  # the TP group shares the batch: each rank sends its slice
                hidden_states, top_k_index, top_k_weights = (tp_slice(t, self.tp_mesh) for t in
                                                             (hidden_states, top_k_index, top_k_weights))
            out = rows_moe(ex, self.experts_forward, hidden_states, top_k_index, top_k_weights,
                           self.num_experts, self.dispatch_dtype, sentinel=self.num_local_experts)
            return out if self.tp_mesh is None else tp_gather(out, self.tp_mesh, T)

    MoeEpImplementation.__name__ = MoeEpImplementation.__qualname__ = f"MoeEp_{name}"
    return MoeEpImplementation


def register(name: str = "moe_ep", dispatch_dtype="bf16", max_tokens: Optional[int] = None,
             timeout_s: float = 30.0, tuning: Optional[Tuning] = None) -> Type:
    """Registers an ``EPImplementation`` under ``name`` for ``DistributedConfig(ep_implementation=name)``.

    Args:
        dispatch_dtype: ``"bf16"`` or ``"fp8"`` (float8_e4m3fn, a float32 scale per 128 channels;
            the backward's gradients always travel in bf16).
        max_tokens: ``None``: the buffers grow to the largest per-rank batch seen (every rank agrees
            each call, one host all-gather); an int: fixed, no agreement (for CUDA graphs), and a
            larger batch raises ``ValueError`` naming ``max_tokens`` on that rank.
        timeout_s: deadline of every wait for a peer (``moe_ep.CommTimeoutError``).
        tuning: how the buffers launch their kernels (``moe_ep.Tuning``); ``None``: the ``MOE_EP_*``
            tuning variables when a buffer is made (``Tuning.from_env()``).
    Returns:
        the registered class.
    """
    EPImplementationInterface = _ep_module().EPImplementationInterface  # noqa: N806
    if dispatch_dtype not in _DTYPES:
        raise ValueError(f"dispatch_dtype: expected 'bf16' or 'fp8', got {dispatch_dtype!r}")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise ValueError(f"max_tokens: expected None or a positive int, got {max_tokens!r}")
    if tuning is not None and not isinstance(tuning, Tuning):
        raise TypeError(f"tuning: expected moe_ep.Tuning or None, got {type(tuning).__name__}")
    cls = _make_class(name, _DTYPES[dispatch_dtype], max_tokens, float(timeout_s), tuning)
    EPImplementationInterface.register(name, cls)
    return cls


def register_defaults() -> None:
    """``"moe_ep"`` (bf16 dispatch) and ``"moe_ep_fp8"`` (fp8 dispatch), growing ``max_tokens``."""
    for name, dtype in zip(NAMES, ("bf16", "fp8")):
        register(name, dtype)


register_defaults()
