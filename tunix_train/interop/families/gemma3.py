"""Gemma 3 (text): transformers' Gemma3ForCausalLM (model_type gemma3_text, or gemma3 for the
multimodal checkpoints' text_config), llama.cpp's `gemma3`. Q/K norms, five local layers per
global one, and a RoPE of their own for the local layers."""

from __future__ import annotations

from typing import Any

from tunix_train.config import ModelConfig
from tunix_train.interop.families import gemma_like
from tunix_train.interop.families.family import Family, register
from tunix_train.interop.gguf_gemma import GemmaGguf

FIXED = dict(gemma_like.GEMMA_1_TO_3_FIXED, use_post_attn_norm=True, use_post_ffw_norm=True, use_qk_norm=True)


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    config = {**gemma_like.gemma_to_hf(cfg), **gemma_like.windowed_to_hf(cfg)}
    config["rope_parameters"] = {
        "full_attention": config["rope_parameters"],
        "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_base_local},
    }
    config["rope_local_base_freq"] = cfg.rope_base_local
    return config


FAMILY = register(
    Family(
        "gemma3",
        ("gemma3_text", "gemma3"),
        "Gemma3ForCausalLM",
        gemma_like.gemma_from_hf,
        to_hf,
        FIXED,
        # what Gemma3TextConfig assumes where a GGUF is silent
        gguf=GemmaGguf("gemma3", rope_base=1_000_000.0, local_per_global=5, window=4096, layers_of_27b=62),
        hf_sequence_classifier="Gemma3TextForSequenceClassification",
    )
)
