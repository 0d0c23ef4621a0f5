"""What the families with Llama's decoder share in config.json (Llama 3, Mistral, Qwen 2.5 / 3,
Qwen 3 MoE, Phi-3), both ways: their transformers configs share Llama's keys, and each family's
module adds and refuses its own. What the decoder cannot hold (biases on the output projection or
the MLP, RoPE types other than linear, llama3 and yarn) is refused in one line naming the key.
"""

from __future__ import annotations

import math
from typing import Any

from tunix_train.config import (
    Activation,
    ConfigError,
    ModelConfig,
    RopeScaling,
    RopeScalingType,
)
from tunix_train.interop.families.family import Family
from tunix_train.interop.families.gemma_like import GEMMA4_ONLY_OFF, hf_sizes, sizes_from_hf
from tunix_train.interop.gguf_llama import LlamaGguf

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
)
# every layer global (Llama, Qwen); Mistral and Phi-3 read their window from config.json
NO_WINDOWS = dict(local_layers_per_global=0, sliding_window=None)
_ROPE_KEYS = {  # ours -> transformers' rope_parameters key
    "factor": "factor",
    "original_context": "original_max_position_embeddings",
    "low_freq_factor": "low_freq_factor",
    "high_freq_factor": "high_freq_factor",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "attention_factor": "attention_factor",
    "truncate": "truncate",
    "short_factor": "short_factor",
    "long_factor": "long_factor",
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
    if kind not in ("llama3", "yarn", "longrope"):
        raise ConfigError(
            f"model.init_from: rope_scaling type {kind!r} is not supported (default, linear, llama3, yarn, "
            f"longrope)"
        )
    values = {ours: rope[theirs] for ours, theirs in _ROPE_KEYS.items() if rope.get(theirs) is not None}
    if kind == "longrope":  # Phi-3: the pre-training context beside rope_scaling, the factor their ratio
        values.setdefault("original_context", hf.get("original_max_position_embeddings"))
        if not values.get("original_context"):
            raise ConfigError(
                "model.init_from: longrope needs config.json's original_max_position_embeddings"
            )
        positions = hf.get("max_position_embeddings") or values["original_context"]
        values.setdefault("factor", positions / values["original_context"])
        values["short_factor"], values["long_factor"] = (
            [float(x) for x in rope.get(key) or []] for key in ("short_factor", "long_factor")
        )
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
    keys = ["factor", "original_context"] + {
        RopeScalingType.llama3: ["low_freq_factor", "high_freq_factor"],
        RopeScalingType.yarn: ["beta_fast", "beta_slow", "attention_factor", "truncate"],
        RopeScalingType.longrope: ["attention_factor", "short_factor", "long_factor"],
    }[scaling.type]
    return {
        "rope_type": scaling.type.value,
        "rope_theta": cfg.rope_base_global,
        **{_ROPE_KEYS[k]: getattr(scaling, k) for k in keys if getattr(scaling, k) is not None},
    }


def refuse(hf: dict[str, Any], name: str, refused: dict[str, Any]) -> None:
    """A ConfigError naming the first of `refused` (key -> whether its value is refused) that holds."""
    for key, value in refused.items():
        if value:
            raise ConfigError(
                f"model.init_from: config.json's {key}={hf.get(key)!r} is not supported for {name} "
                f"(the decoder holds every layer alike, biases on q, k and v alone)"
            )


def llama_from_hf(hf: dict[str, Any], name: str) -> dict[str, Any]:
    """ModelConfig fields of a transformers config with Llama's keys (a dense model, every layer
    alike); `name`, the family's, in errors."""
    refuse(hf, name, {"mlp_bias": hf.get("mlp_bias"), "use_sliding_window": hf.get("use_sliding_window")})
    activation = hf.get("hidden_act", "silu")
    if activation != "silu":
        raise ConfigError(f"model.init_from: hidden_act {activation!r} is not supported for {name} (silu)")
    theta, linear, scaling = rope_from_hf(hf)
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
        "moe.norm_topk_prob": True,
        "context_length": hf.get("max_position_embeddings"),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def window_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Every layer local when config.json's sliding_window is set (Mistral, Phi-3), else global.
    transformers stretches every layer's RoPE by rope_scaling, the decoder only its global
    layers': a window with a scaled RoPE is refused."""
    window = hf.get("sliding_window")
    if not window or window >= (hf.get("max_position_embeddings") or math.inf):  # none, or one never reached
        return dict(NO_WINDOWS)
    _, linear, scaling = rope_from_hf(hf)
    if linear != 1.0 or scaling.type is not RopeScalingType.none:
        raise ConfigError(
            f"model.init_from: config.json's sliding_window={window!r} with a scaled RoPE "
            f"({'linear' if linear != 1.0 else scaling.type.value}) is not supported: the decoder "
            f"scales only its global layers' RoPE"
        )
    return {"local_layers_per_global": hf["num_hidden_layers"], "sliding_window": int(window)}


def window_to_hf(cfg: ModelConfig, name: str) -> int | None:
    """config.json's sliding_window: every layer local or none; a ConfigError for a mix."""
    if cfg.local_layers_per_global == 0:
        return None
    if cfg.rope_scale_global != 1.0 or cfg.rope_scaling.type is not RopeScalingType.none:
        raise ConfigError(
            f"model.rope_scaling: {name} checkpoints stretch every layer's RoPE, this model only its "
            f"global layers'; with model.local_layers_per_global set, leave the RoPE unscaled"
        )
    if cfg.local_layers_per_global < cfg.num_layers or cfg.layer_types is not None:
        raise ConfigError(
            f"model.local_layers_per_global={cfg.local_layers_per_global}: {name} checkpoints have "
            f"every layer local or none; set it to 0 or model.num_layers ({cfg.num_layers})"
        )
    return cfg.sliding_window


def llama_to_hf(cfg: ModelConfig, name: str) -> dict[str, Any]:
    """The config.json keys every family with Llama's keys writes (after its architectures and
    model_type)."""
    if cfg.rope_base_local != cfg.rope_base_global:
        raise ConfigError(
            f"model.rope_base_local: {name} checkpoints have one RoPE base; set it to rope_base_global"
        )
    return {
        **hf_sizes(cfg),
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_base_global,
        "rope_parameters": rope_to_hf(cfg),
        "max_position_embeddings": cfg.context_length or 8192,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": "float32",
    }


# Llama names its pre-MLP norm as Gemma 2-4 name the norm after attention
HF_NAMES = {"layers.pre_ffw_norm.scale": "post_attention_layernorm.weight"}


def gguf(architecture: str, **choices) -> LlamaGguf:
    """A family's LlamaGguf conventions (gguf_llama.py), Gemma 4's fields off."""
    return LlamaGguf(architecture, defaults=GEMMA4_ONLY_OFF, **choices)


def dense(
    name: str,
    hf_architecture: str,
    gguf_conventions: LlamaGguf | None = None,
    *,
    use_qk_norm: bool = False,
    qkv_bias: bool = False,
    refused: tuple[str, ...] = (),
    written: dict[str, Any] | None = None,
    windowed: bool = False,
) -> Family:
    """A family whose config.json is Llama's keys and nothing else of its own: LLAMA_DECODER with
    the Q/K norms and q/k/v biases given, no experts; the `refused` keys must be unset; `written`,
    constant keys its config.json adds; windowed: a sliding window both ways (window_from_hf), else
    every layer global. GGUF: llama.cpp's architecture of the family's name unless given."""

    def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
        refuse(hf, name, {key: hf.get(key) for key in refused})
        return {**llama_from_hf(hf, name), **(window_from_hf(hf) if windowed else {})}

    def to_hf(cfg: ModelConfig) -> dict[str, Any]:
        window = {"sliding_window": window_to_hf(cfg, name)} if windowed else {}
        return {**llama_to_hf(cfg, name), **(written or {}), **window}

    fixed = dict(
        LLAMA_DECODER,
        **({} if windowed else NO_WINDOWS),
        use_qk_norm=use_qk_norm,
        qkv_bias=qkv_bias,
        **{"moe.experts": 0},
    )
    return Family(
        name,
        (name,),
        hf_architecture,
        from_hf,
        to_hf,
        fixed,
        gguf=gguf_conventions or gguf(name),
        hf_names=HF_NAMES,
    )
