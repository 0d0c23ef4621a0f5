"""Phi-3: transformers' Phi3ForCausalLM, llama.cpp's `phi3`. Llama's decoder whose checkpoints fuse
q, k and v into one `qkv_proj` and the MLP's gate and up into one `gate_up_proj` (rows one part
after another; llama.cpp's attn_qkv and ffn_up alike), with every layer local where config.json's
sliding_window is set (and reached). Rotary over every head dimension (partial_rotary_factor 1);
the long-context models' LongRoPE (model.rope_scaling type longrope)."""

from __future__ import annotations

from typing import Any

from tunix_train.config import ConfigError, ModelConfig
from tunix_train.interop.families import llama_like
from tunix_train.interop.families.family import Family, register

FIXED = dict(llama_like.LLAMA_DECODER, use_qk_norm=False, qkv_bias=False, **{"moe.experts": 0})


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConfigError(
            f"model.init_from: config.json's partial_rotary_factor={partial!r} is not supported for phi3 "
            f"(the decoder turns every head dimension)"
        )
    return {**llama_like.llama_from_hf(hf, "phi3"), **llama_like.window_from_hf(hf)}


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    config = llama_like.llama_to_hf(cfg, "phi3")
    scaling = cfg.rope_scaling  # LongRoPE's pre-training context sits beside rope_parameters
    return {
        **config,
        "original_max_position_embeddings": scaling.original_context or config["max_position_embeddings"],
        "sliding_window": llama_like.window_to_hf(cfg, "phi3"),
        "pad_token_id": None,  # transformers' default (32000) would sit past a smaller vocabulary
    }


FAMILY = register(
    Family(
        "phi3",
        ("phi3",),
        "Phi3ForCausalLM",
        from_hf,
        to_hf,
        FIXED,
        gguf=llama_like.gguf("phi3", rope_dimension_count=True, windowed=True, original_context=True),
        hf_names=llama_like.HF_NAMES,
        fused={
            "self_attn.qkv_proj.weight": ("layers.attn.q_DNH", "layers.attn.k_DKH", "layers.attn.v_DKH"),
            "mlp.gate_up_proj.weight": ("layers.mlp.gate_DF", "layers.mlp.up_DF"),
        },
    )
)
