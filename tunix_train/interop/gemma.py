"""The Gemma families' config.json, as transformers' Gemma, Gemma 2, Gemma 3 and Gemma 4 text
configs read and write it: ModelConfig fields from one (`*_from_hf`) and one from ModelConfig
(`*_to_hf`, everything after its architectures and model_type). families.py registers them.
"""

from __future__ import annotations

from typing import Any

from tunix_train.config import Activation, ConfigError, ModelConfig, MoeRouter, RopeScaling
from tunix_train.model.layout import layer_types

# as transformers' Gemma 4 has them
GEMMA4_FIELDS = dict(
    use_qk_norm=True,
    use_v_norm=True,
    norm_weight_offset=0.0,
    query_pre_attn_scalar=1.0,
    use_layer_scalar=True,
    use_post_attn_norm=True,
    use_post_ffw_norm=True,
)


# What each family's checkpoints fix: set on import, checked on export (families.Family.fixed).
GEMMA_FIXED = dict(
    scale_embeddings=True,
    qkv_bias=False,
    mlp_activation=Activation.gelu_tanh,
    rope_scaling=RopeScaling(),
    moe_router=MoeRouter.gemma4,
    dense_mlp=True,
)
GEMMA_1_TO_3_FIXED = dict(GEMMA_FIXED, norm_weight_offset=1.0, use_v_norm=False, use_layer_scalar=False)
FIXED = {
    "gemma": dict(GEMMA_1_TO_3_FIXED, use_post_attn_norm=False, use_post_ffw_norm=False, use_qk_norm=False),
    "gemma2": dict(GEMMA_1_TO_3_FIXED, use_post_attn_norm=True, use_post_ffw_norm=True, use_qk_norm=False),
    "gemma3": dict(GEMMA_1_TO_3_FIXED, use_post_attn_norm=True, use_post_ffw_norm=True, use_qk_norm=True),
    "gemma4": dict(GEMMA4_FIELDS, **GEMMA_FIXED),
}


def gemma_from_hf(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """ModelConfig fields of a transformers Gemma, Gemma 2 or Gemma 3 text config."""
    n_layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types") or ["full_attention"] * n_layers
    local = [t == "sliding_attention" for t in layer_types]
    per_global = local.index(False) if False in local else n_layers
    if local != [(i + 1) % (per_global + 1) != 0 for i in range(n_layers)]:
        raise ConfigError(
            f"model.init_from: layer_types {layer_types} is not N local layers then a global one"
        )
    rope = hf.get("rope_parameters") or {}
    full, sliding = rope.get("full_attention", rope), rope.get("sliding_attention", rope)
    theta = full.get("rope_theta", hf.get("rope_theta", 10_000.0))
    scaling = full if full.get("rope_type") == "linear" else (hf.get("rope_scaling") or {})
    return {
        **sizes_from_hf(
            hf,
            n_layers,
            hf["num_key_value_heads"],
            hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        ),
        "query_pre_attn_scalar": hf.get("query_pre_attn_scalar"),
        "attn_logit_softcap": hf.get("attn_logit_softcapping"),
        "final_logit_softcap": hf.get("final_logit_softcapping"),
        # every layer local (a model shorter than one period): as many local per global as layers
        "local_layers_per_global": per_global,
        "sliding_window": hf.get("sliding_window") if any(local) else None,
        "rope_base_global": float(theta),
        "rope_base_local": float(sliding.get("rope_theta", hf.get("rope_local_base_freq", theta))),
        "rope_scale_global": float(scaling.get("factor", 1.0))
        if scaling.get("rope_type", "linear") == "linear"
        else 1.0,
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
        "context_length": hf.get("max_position_embeddings"),
        "tie_embeddings": hf.get("tie_word_embeddings", True),
        **GEMMA4_ONLY_OFF,
    }


# Gemma 4's fields as Gemma 1-3 have them: a config that sets one cannot load a Gemma 1-3 checkpoint
GEMMA4_ONLY_OFF = dict(
    layer_types=None,
    global_head_dim=None,
    num_global_kv_heads=None,
    attention_k_eq_v=False,
    rope_partial_factor_global=1.0,
    norm_weight_offset=1.0,
    use_v_norm=False,
    num_kv_shared_layers=0,
    double_wide_mlp=False,
    per_layer_input_dim=0,
    per_layer_input_vocab_size=None,
    use_layer_scalar=False,
    num_experts=0,
    num_experts_per_token=0,
    moe_hidden_dim=0,
)


def gemma4_from_hf(hf: dict[str, Any], family: str = "gemma4") -> dict[str, Any]:
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
        **sizes_from_hf(hf, n_layers, hf["num_key_value_heads"], hf.get("head_dim", 256)),
        "attn_logit_softcap": None,
        "final_logit_softcap": hf.get("final_logit_softcapping"),
        "local_layers_per_global": 0,
        "layer_types": types,
        "sliding_window": hf.get("sliding_window", 512) if "sliding_attention" in types else None,
        "global_head_dim": global_head_dim,
        "num_global_kv_heads": global_kv_heads,
        "attention_k_eq_v": k_eq_v,
        "rope_base_global": float(full.get("rope_theta", 1e6)),
        "rope_base_local": float(sliding.get("rope_theta", 10_000.0)),
        "rope_scale_global": float(full.get("factor", 1.0)),
        "rope_partial_factor_global": float(full.get("partial_rotary_factor", 1.0))
        if full.get("rope_type") == "proportional"
        else 1.0,
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
        "num_kv_shared_layers": hf.get("num_kv_shared_layers", 0),
        "double_wide_mlp": bool(hf.get("use_double_wide_mlp")) and hf.get("num_kv_shared_layers", 0) > 0,
        "per_layer_input_dim": ple,
        "per_layer_input_vocab_size": hf.get("vocab_size_per_layer_input", 262_144) if ple else None,
        "num_experts": hf.get("num_experts") or 0 if moe else 0,
        "num_experts_per_token": hf.get("top_k_experts") or 0 if moe else 0,
        "moe_hidden_dim": hf.get("moe_intermediate_size") or 0 if moe else 0,
        "context_length": hf.get("max_position_embeddings"),
        "tie_embeddings": hf.get("tie_word_embeddings", True),
    }


# Gemma's special tokens and the dtype every exported config.json names
_SPECIAL_IDS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "torch_dtype": "float32"}


def sizes_from_hf(hf: dict[str, Any], layers: int, kv_heads: int, head_dim: int) -> dict[str, int]:
    """hf_sizes's inverse: the dimensions every transformers text config names alike (the layers,
    key/value heads and head dim as the family reads them)."""
    return {
        "num_layers": layers,
        "embed_dim": hf["hidden_size"],
        "hidden_dim": hf["intermediate_size"],
        "num_heads": hf["num_attention_heads"],
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": hf["vocab_size"],
    }


def hf_sizes(cfg: ModelConfig) -> dict[str, int]:
    """The dimensions every transformers text config names alike."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.embed_dim,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
    }


def gemma4_to_hf(cfg: ModelConfig, family: str = "gemma4") -> dict[str, Any]:
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
    if cfg.num_global_kv_heads not in (None, cfg.num_kv_heads) and not cfg.attention_k_eq_v:
        raise ConfigError(
            "model.num_global_kv_heads: transformers' Gemma 4 reads it only with attention_k_eq_v"
        )
    full = {
        "rope_type": "proportional",
        "partial_rotary_factor": cfg.rope_partial_factor_global,
        "rope_theta": cfg.rope_base_global,
        "factor": cfg.rope_scale_global,
    }
    return {
        **hf_sizes(cfg),
        "global_head_dim": cfg.global_head_dim or cfg.head_dim,
        "num_global_key_value_heads": cfg.num_global_kv_heads,
        "attention_k_eq_v": cfg.attention_k_eq_v,
        "layer_types": types,
        "sliding_window": cfg.sliding_window or 512,
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_base_local},
        },
        "final_logit_softcapping": cfg.final_logit_softcap,
        "rms_norm_eps": cfg.rms_norm_eps,
        "num_kv_shared_layers": cfg.num_kv_shared_layers,
        "use_double_wide_mlp": cfg.double_wide_mlp,
        "hidden_size_per_layer_input": cfg.per_layer_input_dim,
        "vocab_size_per_layer_input": cfg.per_layer_input_vocab_size or cfg.vocab_size,
        "enable_moe_block": bool(cfg.num_experts),
        "num_experts": cfg.num_experts or None,
        "top_k_experts": cfg.num_experts_per_token or None,
        "moe_intermediate_size": cfg.moe_hidden_dim or None,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.context_length or 8192,
        **_SPECIAL_IDS,
    }


def gemma_to_hf(cfg: ModelConfig, family: str) -> dict[str, Any]:
    """config.json for transformers' Gemma, Gemma 2 or Gemma 3 text model (after its architectures
    and model_type)."""
    windows = [(i + 1) % (cfg.local_layers_per_global + 1) != 0 for i in range(cfg.num_layers)]
    types = ["sliding_attention" if local else "full_attention" for local in windows]
    rope_global = {"rope_type": "default", "rope_theta": cfg.rope_base_global}
    if cfg.rope_scale_global != 1.0:
        rope_global = {
            "rope_type": "linear",
            "rope_theta": cfg.rope_base_global,
            "factor": cfg.rope_scale_global,
        }
    config = {
        **hf_sizes(cfg),
        "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.context_length or 8192,
        **_SPECIAL_IDS,
        "rope_theta": cfg.rope_base_global,
        "rope_parameters": rope_global,
    }
    if family != "gemma":
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim  # transformers 5 takes an int where it is one
        config.update(
            query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
            attn_logit_softcapping=cfg.attn_logit_softcap,
            final_logit_softcapping=cfg.final_logit_softcap,
            sliding_window=cfg.sliding_window or 4096,
            layer_types=types,
        )
    if family == "gemma3":
        config["rope_parameters"] = {
            "full_attention": rope_global,
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_base_local},
        }
        config["rope_local_base_freq"] = cfg.rope_base_local
    elif (
        cfg.rope_base_local != cfg.rope_base_global
        or cfg.rope_scale_global != 1.0
        or (family == "gemma" and cfg.local_layers_per_global)
    ):
        raise ConfigError(
            f"{family} checkpoints have no per-layer-type RoPE or sliding windows; "
            f"this model cannot be exported as {family}"
        )
    return config
