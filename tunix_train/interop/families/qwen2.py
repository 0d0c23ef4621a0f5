"""Qwen 2.5: transformers' Qwen2ForCausalLM, llama.cpp's `qwen2`. Biases on q, k and v always."""

from __future__ import annotations

from typing import Any

from tunix_train.config import ModelConfig
from tunix_train.interop.families import llama_like
from tunix_train.interop.families.family import Family, register

FIXED = dict(
    llama_like.LLAMA_DECODER, **llama_like.NO_WINDOWS, use_qk_norm=False, qkv_bias=True, num_experts=0
)


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    return llama_like.llama_from_hf(hf, "qwen2")


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {**llama_like.llama_to_hf(cfg, "qwen2"), "use_sliding_window": False}


FAMILY = register(
    Family(
        "qwen2",
        ("qwen2",),
        "Qwen2ForCausalLM",
        from_hf,
        to_hf,
        FIXED,
        gguf=llama_like.gguf("qwen2"),
        hf_names=llama_like.HF_NAMES,
    )
)
