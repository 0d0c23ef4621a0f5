"""Gemma 4 (text): transformers' Gemma4ForCausalLM (model_type gemma4_text, or gemma4 for the
multimodal checkpoints' text_config). Its own layer types, a wider global head, keys that are
values, per-layer inputs, shared KV layers and experts beside the MLP; no GGUF here yet."""

from __future__ import annotations

from typing import Any

from tunix_train.config import ConfigError, ModelConfig
from tunix_train.interop.families import gemma_like
from tunix_train.interop.families.family import Family, register
from tunix_train.model.layout import layer_types

FIXED = dict(gemma_like.GEMMA4_FIELDS, **gemma_like.GEMMA_FIXED)


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields of a transformers Gemma 4 text config (as Gemma4TextConfig reads it)."""
    n_layers = hf["num_hidden_layers"]
    types = list(
        hf.get("layer_types")
        or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layers)]
    )
    types[-1] = "full_attention"  # transformers forces it
    k_eq_v = bool(hf.get("attention_k_eq_v", False))
    per_layer = hf.get("per_layer_config")  # what save_pretrained writes instead of global_head_dim
    if per_layer is not None:  # only what differs from the text config's sizes
        first_global = per_layer.get(str(types.index("full_attention")), {})
        global_head_dim = first_global.get("head_dim", hf.get("head_dim", 256))
        global_kv_heads = first_global.get("num_key_value_heads")
    else:
        global_head_dim = hf.get("global_head_dim", 512)
        global_kv_heads = hf.get("num_global_key_value_heads") if k_eq_v else None
    rope = hf.get("rope_parameters") or {}
    full = rope.get(
        "full_attention", {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}
    )
    sliding = rope.get("sliding_attention", {"rope_theta": 10_000.0})
    if full.get("rope_type", "default") not in ("default", "proportional", "linear"):
        raise ConfigError(f"model.init_from: global RoPE type {full.get('rope_type')!r} is not supported")
    if hf.get("use_bidirectional_attention") not in (None, "vision"):  # "vision": model.vision's
        raise ConfigError(
            f"model.init_from: use_bidirectional_attention={hf['use_bidirectional_attention']!r} makes "
            f"text attend ahead; this trainer's decoder is causal"
        )
    ple = hf.get("hidden_size_per_layer_input", 256) or 0
    moe = bool(hf.get("enable_moe_block"))
    return {
        **gemma_like.sizes_from_hf(hf, n_layers, hf["num_key_value_heads"], hf.get("head_dim", 256)),
        "attn_logit_softcap": None,
        "final_logit_softcap": hf.get("final_logit_softcapping"),
        "local_layers_per_global": 0,
        "layer_types": types,
        "sliding_window": hf.get("sliding_window", 512) if "sliding_attention" in types else None,
        "gemma4.global_head_dim": global_head_dim,
        "gemma4.num_global_kv_heads": global_kv_heads,
        "gemma4.attention_k_eq_v": k_eq_v,
        "rope_base_global": float(full.get("rope_theta", 1e6)),
        "rope_base_local": float(sliding.get("rope_theta", 10_000.0)),
        "rope_scale_global": float(full.get("factor", 1.0)),
        "gemma4.rope_partial_factor_global": float(full.get("partial_rotary_factor", 1.0))
        if full.get("rope_type") == "proportional"
        else 1.0,
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
        "gemma4.num_kv_shared_layers": hf.get("num_kv_shared_layers", 0),
        "gemma4.double_wide_mlp": bool(hf.get("use_double_wide_mlp"))
        and hf.get("num_kv_shared_layers", 0) > 0,
        "gemma4.per_layer_input_dim": ple,
        "gemma4.per_layer_input_vocab_size": hf.get("vocab_size_per_layer_input", 262_144) if ple else None,
        "moe.experts": hf.get("num_experts") or 0 if moe else 0,
        "moe.experts_per_token": hf.get("top_k_experts") or 0 if moe else 0,
        "moe.hidden_dim": hf.get("moe_intermediate_size") or 0 if moe else 0,
        "context_length": hf.get("max_position_embeddings"),
        "tie_embeddings": hf.get("tie_word_embeddings", True),
    }


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """config.json for transformers' Gemma4ForCausalLM (after its architectures and model_type), or a
    ConfigError naming what it cannot hold."""
    types = layer_types(cfg)
    if cfg.attn_logit_softcap is not None:
        raise ConfigError(
            "model.attn_logit_softcap: transformers' Gemma 4 has no attention soft-cap; this model "
            "cannot be exported as gemma4"
        )
    if types[-1] != "full_attention":
        raise ConfigError(
            "model.layer_types: transformers' Gemma 4 makes the last layer full_attention; this model "
            "cannot be exported as gemma4"
        )
    if cfg.gemma4.num_global_kv_heads not in (None, cfg.num_kv_heads) and not cfg.gemma4.attention_k_eq_v:
        raise ConfigError(
            "model.gemma4.num_global_kv_heads: transformers' Gemma 4 reads it only with attention_k_eq_v"
        )
    full = {
        "rope_type": "proportional",
        "partial_rotary_factor": cfg.gemma4.rope_partial_factor_global,
        "rope_theta": cfg.rope_base_global,
        "factor": cfg.rope_scale_global,
    }
    return {
        **gemma_like.hf_sizes(cfg),
        "global_head_dim": cfg.gemma4.global_head_dim or cfg.head_dim,
        "num_global_key_value_heads": cfg.gemma4.num_global_kv_heads,
        "attention_k_eq_v": cfg.gemma4.attention_k_eq_v,
        "layer_types": types,
        "sliding_window": cfg.sliding_window or 512,
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_base_local},
        },
        "final_logit_softcapping": cfg.final_logit_softcap,
        "rms_norm_eps": cfg.rms_norm_eps,
        "num_kv_shared_layers": cfg.gemma4.num_kv_shared_layers,
        "use_double_wide_mlp": cfg.gemma4.double_wide_mlp,
        "hidden_size_per_layer_input": cfg.gemma4.per_layer_input_dim,
        "vocab_size_per_layer_input": cfg.gemma4.per_layer_input_vocab_size or cfg.vocab_size,
        "enable_moe_block": bool(cfg.moe.experts),
        "num_experts": cfg.moe.experts or None,
        "top_k_experts": cfg.moe.experts_per_token or None,
        "moe_intermediate_size": cfg.moe.hidden_dim or None,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.context_length or 8192,
        **gemma_like.SPECIAL_IDS,
    }


FAMILY = register(
    Family(
        "gemma4",
        ("gemma4_text", "gemma4"),
        "Gemma4ForCausalLM",
        from_hf,
        to_hf,
        FIXED,
        hf_sequence_classifier=None,
    )
)
