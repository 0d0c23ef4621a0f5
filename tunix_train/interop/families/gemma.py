"""Gemma (1): transformers' GemmaForCausalLM, llama.cpp's `gemma`. No norms after attention or the
MLP, no local layers, Gemma 1 names its pre-MLP norm as the later ones name the norm after
attention."""

from __future__ import annotations

from typing import Any

from tunix_train.config import ModelConfig
from tunix_train.interop.families import gemma_like
from tunix_train.interop.families.family import Family, register
from tunix_train.interop.gguf_gemma import GemmaGguf

FIXED = dict(
    gemma_like.GEMMA_1_TO_3_FIXED, use_post_attn_norm=False, use_post_ffw_norm=False, use_qk_norm=False
)


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    gemma_like.refuse_per_layer_rope(cfg, "gemma", windows=False)
    return gemma_like.gemma_to_hf(cfg)


FAMILY = register(
    Family(
        "gemma",
        ("gemma",),
        "GemmaForCausalLM",
        gemma_like.gemma_from_hf,
        to_hf,
        FIXED,
        gguf=GemmaGguf("gemma"),
        hf_names={"layers.pre_ffw_norm.scale": "post_attention_layernorm.weight"},
    )
)
