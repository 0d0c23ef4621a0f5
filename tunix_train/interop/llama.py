"""Llama 3 and Qwen 2.5 / 3 (dense and MoE) config.json, both ways: their transformers configs
share Llama's keys, and each family fixes a few of the decoder's fields (families.py registers
them). What the decoder cannot hold (biases on the output projection or the MLP, sliding windows,
MoE layers between dense ones, RoPE types other than linear, llama3 and yarn) is refused in one
line naming the key.
"""

from __future__ import annotations

from typing import Any

from tunix_train.config import (
    Activation,
    ConfigError,
    ModelConfig,
    MoeRouter,
    RopeScaling,
    RopeScalingType,
)
from tunix_train.interop.gemma import GEMMA4_ONLY_OFF, hf_sizes, sizes_from_hf

# The decoder as Llama has it: pre-norms alone, weights around 1, unscaled embeddings, SwiGLU.
LLAMA_DECODER = dict(
    norm_weight_offset=0.0,
    scale_embeddings=False,
    use_post_attn_norm=False,
    use_post_ffw_norm=False,
    mlp_activation=Activation.silu,
    query_pre_attn_scalar=None,
    attn_logit_softcap=None,
    final_logit_softcap=None,
    local_layers_per_global=0,
    sliding_window=None,
)
FIXED = {
    "llama": dict(LLAMA_DECODER, use_qk_norm=False, qkv_bias=False, num_experts=0),
    "qwen2": dict(LLAMA_DECODER, use_qk_norm=False, qkv_bias=True, num_experts=0),
    "qwen3": dict(LLAMA_DECODER, use_qk_norm=True, qkv_bias=False, num_experts=0),
    "qwen3_moe": dict(
        LLAMA_DECODER, use_qk_norm=True, qkv_bias=False, moe_router=MoeRouter.softmax, dense_mlp=False
    ),
}
_ROPE_KEYS = {  # ours -> transformers' rope_parameters key
    "factor": "factor",
    "original_context": "original_max_position_embeddings",
    "low_freq_factor": "low_freq_factor",
    "high_freq_factor": "high_freq_factor",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "attention_factor": "attention_factor",
    "truncate": "truncate",
}


def rope_from_hf(hf: dict[str, Any]) -> tuple[float, float, RopeScaling]:
    """(rope_theta, a linear factor, RopeScaling) of a config.json: transformers 5's rope_parameters
    or the rope_theta and rope_scaling that published checkpoints carry."""
    rope = dict(hf.get("rope_scaling") or {})
    rope.update(hf.get("rope_parameters") or {})
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, 1.0, RopeScaling()
    if kind == "linear":
        return theta, float(rope["factor"]), RopeScaling()
    if kind not in ("llama3", "yarn"):
        raise ConfigError(
            f"model.init_from: rope_scaling type {kind!r} is not supported (default, linear, llama3, yarn)"
        )
    values = {ours: rope[theirs] for ours, theirs in _ROPE_KEYS.items() if rope.get(theirs) is not None}
    if "original_context" not in values and hf.get("max_position_embeddings") and kind == "yarn":
        values["original_context"] = hf["max_position_embeddings"] // int(values.get("factor", 1))
    return theta, 1.0, RopeScaling(type=RopeScalingType(kind), **values)


def rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """transformers' rope_parameters of cfg."""
    scaling = cfg.rope_scaling
    if scaling.type is RopeScalingType.none:
        if cfg.rope_scale_global != 1.0:
            return {
                "rope_type": "linear",
                "rope_theta": cfg.rope_base_global,
                "factor": cfg.rope_scale_global,
            }
        return {"rope_type": "default", "rope_theta": cfg.rope_base_global}
    keys = ["factor", "original_context"] + (
        ["low_freq_factor", "high_freq_factor"]
        if scaling.type is RopeScalingType.llama3
        else ["beta_fast", "beta_slow", "attention_factor", "truncate"]
    )
    return {
        "rope_type": scaling.type.value,
        "rope_theta": cfg.rope_base_global,
        **{_ROPE_KEYS[k]: getattr(scaling, k) for k in keys if getattr(scaling, k) is not None},
    }


def llama_from_hf(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """ModelConfig fields of a transformers Llama, Qwen 2, Qwen 3 or Qwen 3 MoE config."""
    refused = {
        "attention_bias": family in ("llama", "qwen3", "qwen3_moe") and hf.get("attention_bias"),
        "mlp_bias": hf.get("mlp_bias"),
        "use_sliding_window": hf.get("use_sliding_window"),
        "mlp_only_layers": family == "qwen3_moe" and hf.get("mlp_only_layers"),
        "decoder_sparse_step": family == "qwen3_moe" and hf.get("decoder_sparse_step", 1) != 1,
    }
    for key, value in refused.items():
        if value:
            raise ConfigError(
                f"model.init_from: config.json's {key}={hf.get(key)!r} is not supported for {family} "
                f"(the decoder holds every layer alike, biases on q, k and v alone)"
            )
    activation = hf.get("hidden_act", "silu")
    if activation != "silu":
        raise ConfigError(f"model.init_from: hidden_act {activation!r} is not supported for {family} (silu)")
    theta, linear, scaling = rope_from_hf(hf)
    moe = family == "qwen3_moe"
    return {
        **GEMMA4_ONLY_OFF,
        **sizes_from_hf(
            hf,
            hf["num_hidden_layers"],
            hf.get("num_key_value_heads") or hf["num_attention_heads"],
            hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        ),
        "rope_base_global": theta,
        "rope_base_local": theta,
        "rope_scale_global": linear,
        "rope_scaling": scaling,
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
        # transformers 5 writes num_local_experts; published checkpoints, num_experts
        "num_experts": (hf.get("num_experts") or hf["num_local_experts"]) if moe else 0,
        "num_experts_per_token": hf["num_experts_per_tok"] if moe else 0,
        "moe_hidden_dim": hf["moe_intermediate_size"] if moe else 0,
        "moe_norm_topk_prob": bool(hf.get("norm_topk_prob", True)) if moe else True,
        "context_length": hf.get("max_position_embeddings"),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def llama_to_hf(cfg: ModelConfig, family: str) -> dict[str, Any]:
    """config.json for transformers' model of `family` (after its architectures and model_type)."""
    if cfg.rope_base_local != cfg.rope_base_global:
        raise ConfigError(
            f"model.rope_base_local: {family} checkpoints have one RoPE base; set it to rope_base_global"
        )
    config = {
        **hf_sizes(cfg),
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_base_global,
        "rope_parameters": rope_to_hf(cfg),
        "max_position_embeddings": cfg.context_length or 8192,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": "float32",
    }
    if family != "qwen2":  # Qwen 2's q, k and v always have biases
        config["attention_bias"] = False
    if family == "llama":
        config["mlp_bias"] = False
    else:
        config["use_sliding_window"] = False
    if family == "qwen3_moe":
        config.update(
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_token,
            moe_intermediate_size=cfg.moe_hidden_dim,
            norm_topk_prob=cfg.moe_norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return config
