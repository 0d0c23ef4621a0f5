"""Mistral: transformers' MistralForCausalLM. Llama's decoder with grouped-query attention and, in
checkpoints that set config.json's sliding_window (Mistral 7B v0.1), every layer local. llama.cpp
writes it as `llama` (its Q and K rows permuted as Llama's); a file is told apart as Mistral by its
general.basename or, for a windowed model, its llama.attention.sliding_window (written here, not
read by llama.cpp's llama: past the window it attends to every earlier token)."""

from __future__ import annotations

from typing import Any

from tunix_train.config import ModelConfig
from tunix_train.interop.families import llama_like
from tunix_train.interop.families.family import Family, register

FIXED = dict(llama_like.LLAMA_DECODER, use_qk_norm=False, qkv_bias=False, num_experts=0)


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    llama_like.refuse(hf, "mistral", {"attention_bias": hf.get("attention_bias")})
    return {**llama_like.llama_from_hf(hf, "mistral"), **llama_like.window_from_hf(hf)}


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **llama_like.llama_to_hf(cfg, "mistral"),
        "sliding_window": llama_like.window_to_hf(cfg, "mistral"),
    }


FAMILY = register(
    Family(
        "mistral",
        ("mistral",),
        "MistralForCausalLM",
        from_hf,
        to_hf,
        FIXED,
        gguf=llama_like.gguf(
            "llama", qk_interleaved=True, rope_dimension_count=True, windowed=True, basename="Mistral"
        ),
        hf_names=llama_like.HF_NAMES,
    )
)
