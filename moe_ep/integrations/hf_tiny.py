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


# ---------------------------------------------------------------------------------------------
# Models for transformers' own expert parallelism (``ep_implementation="moe_ep"``): two decoder
# layers, both MoE, 8 experts (EP = 2 and 4 hold whole experts), top-2 (Qwen2-MoE top-4, OLMoE top-6:
# more picks than a rank holds experts at EP = 4 and 2).

EP_FAMILIES = ("gpt_oss", "deepseek_v3", "qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "olmoe", "qwen3_next",
               "minimax")
EP_HIDDEN, EP_EXPERTS = 64, 8


def tiny_ep_config(family: str):
    """The config of a two-layer ``family`` model (H=64, 8 experts, top-2 but for Qwen2-MoE and OLMoE)."""
    import transformers as tf

    H = EP_HIDDEN
    common = dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, num_experts_per_tok=2, tie_word_embeddings=False, bos_token_id=0,
                  eos_token_id=None, pad_token_id=0)
    if family == "gpt_oss":
        return tf.GptOssConfig(**common, intermediate_size=32, head_dim=16, num_local_experts=EP_EXPERTS,
                               sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(**dict(common, num_key_value_heads=4), intermediate_size=96,
                                   moe_intermediate_size=32, n_routed_experts=EP_EXPERTS, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=0,
                                   kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16,
                                   v_head_dim=16, routed_scaling_factor=2.5)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32, head_dim=16,
                                 num_experts=EP_EXPERTS, norm_topk_prob=True)
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(**dict(common, num_experts_per_tok=4), intermediate_size=96, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=48, num_experts=EP_EXPERTS)
    if family == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=32, num_local_experts=EP_EXPERTS)
    if family == "glm4_moe":
        return tf.Glm4MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=EP_EXPERTS,
                                n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1,
                                routed_scaling_factor=1.5, head_dim=16)
    if family == "olmoe":
        return tf.OlmoeConfig(**dict(common, num_experts_per_tok=6), intermediate_size=32, num_experts=EP_EXPERTS)
    if family == "qwen3_next":
        return tf.Qwen3NextConfig(**common, intermediate_size=96, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=48, num_experts=EP_EXPERTS, head_dim=16,
                                  linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                                  linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"])
    if family == "minimax":
        return tf.MiniMaxConfig(**common, intermediate_size=32, head_dim=16, num_local_experts=EP_EXPERTS,
                                block_size=4, layer_types=["linear_attention", "full_attention"])
    raise ValueError(f"family: expected one of {EP_FAMILIES}, got {family!r}")


def tiny_ep_model(family: str, seed: int = 0):
    """A random ``*ForCausalLM`` of ``family`` (float32, the same for the same seed) whose MoE
    layers matter: embeddings of unit scale, routers and experts at ``1/sqrt(fan_in)``, so a
    layer's experts move the residual stream by about its own size; the first layer's experts by
    1% of it, so the last layer's routers see inputs that an expert-parallel run (bf16 on the
    wire) perturbs by ~1e-5 relative, far from flipping a top-k choice."""
    import transformers as tf

    cfg = tiny_ep_config(family)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(generator=g)
        for name, p in sorted(model.named_parameters()):
            if ".mlp.gate." in name or ".mlp.router." in name or ".mlp.experts." in name:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.copy_(torch.randn(p.shape, generator=g) * (fan_in ** -0.5 if p.dim() > 1 else 0.1))
                if ".layers.0." in name and ".experts.down_proj" in name:
                    p.mul_(0.01)
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    return model
