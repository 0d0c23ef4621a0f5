"""Qwen 3 (dense): transformers' Qwen3ForCausalLM, llama.cpp's `qwen3`. Q/K norms, no biases."""

from __future__ import annotations

from typing import Any

from tunix_train.config import ModelConfig
from tunix_train.interop.families import llama_like
from tunix_train.interop.families.family import Family, register

FIXED = dict(
    llama_like.LLAMA_DECODER, **llama_like.NO_WINDOWS, use_qk_norm=True, qkv_bias=False, num_experts=0
)


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    llama_like.refuse(hf, "qwen3", {"attention_bias": hf.get("attention_bias")})
    return llama_like.llama_from_hf(hf, "qwen3")


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {**llama_like.llama_to_hf(cfg, "qwen3"), "attention_bias": False, "use_sliding_window": False}


FAMILY = register(
    Family(
        "qwen3",
        ("qwen3",),
        "Qwen3ForCausalLM",
        from_hf,
        to_hf,
        FIXED,
        gguf=llama_like.gguf("qwen3"),
        hf_names=llama_like.HF_NAMES,
    )
)
