"""Gemma 2: transformers' Gemma2ForCausalLM, llama.cpp's `gemma2`. Norms after attention and the
MLP, local layers between global ones, attention and final soft-caps."""

from __future__ import annotations

from typing import Any

from tunix_train.config import ModelConfig
from tunix_train.interop.families import gemma_like
from tunix_train.interop.families.family import Family, register
from tunix_train.interop.gguf_gemma import GemmaGguf

FIXED = dict(
    gemma_like.GEMMA_1_TO_3_FIXED, use_post_attn_norm=True, use_post_ffw_norm=True, use_qk_norm=False
)


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    gemma_like.refuse_per_layer_rope(cfg, "gemma2", windows=True)
    return {**gemma_like.gemma_to_hf(cfg), **gemma_like.windowed_to_hf(cfg)}


FAMILY = register(
    Family(
        "gemma2",
        ("gemma2",),
        "Gemma2ForCausalLM",
        gemma_like.gemma_from_hf,
        to_hf,
        FIXED,
        # what Gemma2Config assumes where a GGUF is silent
        gguf=GemmaGguf(
            "gemma2", attn_softcap=50.0, final_softcap=30.0, local_per_global=1, window=4096, layers_of_27b=46
        ),
    )
)
