"""Expert parallelism for HF transformers MoE models (Mixtral, Qwen3-MoE, DeepSeek-V3) with dense weights replicated.

For every MoE family, FSDP and training, transformers' own expert parallelism with moe_ep's
dispatch is ``moe_ep.integrations.transformers`` (``ep_implementation="moe_ep"``); this adapter
stays for what that cannot do: the dense weights replicated on every rank (transformers' EP
FSDP-shards them), models loaded without a ``distributed_config``, and ``MoELayer``'s own layouts.

``apply_expert_parallel(model)`` replaces every MoE block of the model in place by a
``moe_ep.MoELayer`` with the same router and weights (each rank keeps its experts). The layer
uses the blocks' own parameter names, so ``model.state_dict()`` keeps its keys and dense shapes
(gathered from the ranks: collective). Needs transformers 5 (fused ``gate_up_proj`` experts).

The blocks' own router modules are kept (``keep_router``), so HF's recording of router logits
for the auxiliary load-balancing loss still works. Not carried over: Mixtral's router jitter
noise (refused when set).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

from ..core.group import EPGroup
from ..moe.layer import MoELayer, _as_group


def _common(block: nn.Module) -> dict:
    gate, experts = block.gate, block.experts
    return dict(hidden=gate.weight.shape[1], ffn_hidden=experts.down_proj.shape[2],
                num_experts=gate.weight.shape[0], topk=gate.top_k)


def _mixtral(block: nn.Module) -> dict:
    if getattr(block, "jitter_noise", 0):
        raise ValueError("model: Mixtral router_jitter_noise > 0 is not supported by moe_ep.MoELayer")
    return dict(_common(block), router="softmax", norm_topk_prob=True)


def _qwen3_moe(block: nn.Module) -> dict:
    return dict(_common(block), router="softmax", norm_topk_prob=bool(block.gate.norm_topk_prob))


def _deepseek_v3(block: nn.Module) -> dict:
    gate = block.gate
    return dict(_common(block), router="sigmoid", n_group=gate.num_group, topk_group=gate.topk_group,
                norm_topk_prob=bool(gate.norm_topk_prob), routed_scaling_factor=float(gate.routed_scaling_factor),
                shared_experts=1, shared_ffn_hidden=block.shared_experts.gate_proj.out_features)


BLOCKS: Dict[str, Callable[[nn.Module], dict]] = {
    "MixtralSparseMoeBlock": _mixtral,
    "Qwen3MoeSparseMoeBlock": _qwen3_moe,
    "DeepseekV3MoE": _deepseek_v3,
}


def _activation(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    act = getattr(config, "hidden_act", "silu")
    return "silu" if act in ("silu", "swish") else act


def find_moe_blocks(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``(qualified name, block)`` of every MoE block moe_ep knows how to replace."""
    return [(name, m) for name, m in model.named_modules() if type(m).__name__ in BLOCKS]


def apply_expert_parallel(model: nn.Module, group=None, keep_router: bool = True, **kw) -> nn.Module:
    """Replaces the model's MoE blocks in place by ``MoELayer``s holding the same weights.

    Args:
        model: an HF transformers Mixtral, Qwen3-MoE or DeepSeek-V3 model (any head), with the
            same weights on every rank (e.g. the same checkpoint, or the same seed).
        group: ``None`` (WORLD, or a single rank), an ``EPGroup`` or a ``ProcessGroup``.
        keep_router: the layer routes with the block's own router module (its output contract,
            ``(logits, weights, ids)``, is the one of ``moe_ep.moe.router.Router``), so routing is
            bit-identical and HF's recording of router logits (``output_router_logits``, the
            auxiliary loss) keeps working; False: ``moe_ep.moe.router.Router`` with the same weights.
        **kw: passed to every ``MoELayer`` (``dispatch_dtype``, ``layout``, ``max_tokens``, ...).
    Returns:
        ``model``, whose MoE blocks now run on ``group.device`` with expert parallelism; move
        the rest of the model there too. Every rank must run the same forwards (and backwards).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    blocks = find_moe_blocks(model)
    if not blocks:
        raise ValueError(f"model: no MoE block found (known: {', '.join(BLOCKS)})")
    group: EPGroup = _as_group(group)
    activation = _activation(model)
    for name, block in blocks:
        spec = BLOCKS[type(block).__name__](block)
        dtype = block.gate.weight.dtype if "dtype" not in kw else kw["dtype"]
        layer = MoELayer(**spec, group=group, activation=activation, **{"dtype": dtype, **kw})
        layer.load_state_dict(block.state_dict())
        if keep_router:
            layer.gate = block.gate.to(device=layer.gate.weight.device)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer)
        del block
    return model
