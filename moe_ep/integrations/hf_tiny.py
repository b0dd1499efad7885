"""Tiny randomly initialised HF transformers MoE models, built from configs (no downloads), for
examples, smoke runs and tests.

Each has one MoE block placed so that its router sees exactly the input of the unmodified
model's router (Mixtral: one layer; Qwen3-MoE and DeepSeek-V3: a dense layer, then the MoE
layer), and router/expert weights with enough spread that routing is decisive.
"""
from __future__ import annotations

import torch

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")
VOCAB = 96


def tiny_model(family: str, seed: int = 0, hidden: int = 128):
    """A ``*ForCausalLM`` of ``family`` (one of :data:`FAMILIES`), float32, the same for the same seed."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=hidden, num_attention_heads=4, max_position_embeddings=64,
                  num_experts_per_tok=2)
    if family == "mixtral":
        cfg = tf.MixtralConfig(**common, intermediate_size=64, num_hidden_layers=1, num_key_value_heads=2,
                               num_local_experts=4)
        cls = tf.MixtralForCausalLM
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=64, num_hidden_layers=2,
                                num_key_value_heads=2, head_dim=hidden // 4, num_experts=8, norm_topk_prob=True,
                                mlp_only_layers=[0])
        cls = tf.Qwen3MoeForCausalLM
    elif family == "deepseek_v3":
        cfg = tf.DeepseekV3Config(**common, intermediate_size=96, moe_intermediate_size=64, num_hidden_layers=2,
                                  num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, n_group=4,
                                  topk_group=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
                                  qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, routed_scaling_factor=2.5)
        cls = tf.DeepseekV3ForCausalLM
    else:
        raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")
    torch.manual_seed(seed)
    model = cls(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".mlp.gate." in name or ".mlp.experts." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    return model
