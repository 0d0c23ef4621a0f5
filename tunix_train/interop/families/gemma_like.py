"""What the Gemma families share in config.json, as transformers' Gemma, Gemma 2 and Gemma 3 text
configs read and write it: ModelConfig fields from one (`gemma_from_hf`) and the keys all three
write (`gemma_to_hf`); the fields their checkpoints fix; the sizes every transformers text config
names alike. Each family's module (gemma.py, gemma2.py, gemma3.py, gemma4.py) adds its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tunix_train.config import Activation, ConfigError, Gemma4Config, ModelConfig, MoeRouter, RopeScaling

# as transformers' Gemma 4 has them
GEMMA4_FIELDS = {
    "use_qk_norm": True,
    "gemma4.use_v_norm": True,
    "norm_weight_offset": 0.0,
    "query_pre_attn_scalar": 1.0,
    "gemma4.use_layer_scalar": True,
    "use_post_attn_norm": True,
    "use_post_ffw_norm": True,
}


# What each family's checkpoints fix: set on import, checked on export (families.Family.fixed).
GEMMA_FIXED = dict(
    scale_embeddings=True,
    qkv_bias=False,
    mlp_activation=Activation.gelu_tanh,
    rope_scaling=RopeScaling(),
    **{"moe.router": MoeRouter.gemma4, "moe.dense_mlp": True},
)
GEMMA_1_TO_3_FIXED = {
    **GEMMA_FIXED,
    "norm_weight_offset": 1.0,
    "gemma4.use_v_norm": False,
    "gemma4.use_layer_scalar": False,
}


def gemma_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
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
    norm_weight_offset=1.0,
    **{f"gemma4.{f.name}": f.default for f in dataclasses.fields(Gemma4Config)},
    **{"moe.experts": 0, "moe.experts_per_token": 0, "moe.hidden_dim": 0},
)


# Gemma's special tokens and the dtype every exported config.json names
SPECIAL_IDS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "torch_dtype": "float32"}


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


def gemma_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json keys transformers' Gemma, Gemma 2 and Gemma 3 text models all read (after
    their architectures and model_type), RoPE as Gemma 1 and 2 hold it: one for every layer."""
    rope_global = {"rope_type": "default", "rope_theta": cfg.rope_base_global}
    if cfg.rope_scale_global != 1.0:
        rope_global = {
            "rope_type": "linear",
            "rope_theta": cfg.rope_base_global,
            "factor": cfg.rope_scale_global,
        }
    return {
        **hf_sizes(cfg),
        "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.context_length or 8192,
        **SPECIAL_IDS,
        "rope_theta": cfg.rope_base_global,
        "rope_parameters": rope_global,
    }


def windowed_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The keys of Gemma 2 and 3's local layers and attention scale."""
    windows = [(i + 1) % (cfg.local_layers_per_global + 1) != 0 for i in range(cfg.num_layers)]
    scalar = cfg.query_pre_attn_scalar or cfg.head_dim  # transformers 5 takes an int where it is one
    return {
        "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
        "attn_logit_softcapping": cfg.attn_logit_softcap,
        "final_logit_softcapping": cfg.final_logit_softcap,
        "sliding_window": cfg.sliding_window or 4096,
        "layer_types": ["sliding_attention" if local else "full_attention" for local in windows],
    }


def refuse_per_layer_rope(cfg: ModelConfig, name: str, *, windows: bool) -> None:
    """A ConfigError for what a family with one RoPE for every layer (and, without `windows`, no
    local layers) cannot hold."""
    if (
        cfg.rope_base_local != cfg.rope_base_global
        or cfg.rope_scale_global != 1.0
        or (not windows and cfg.local_layers_per_global)
    ):
        raise ConfigError(
            f"{name} checkpoints have no per-layer-type RoPE or sliding windows; "
            f"this model cannot be exported as {name}"
        )
