"""Llama 3: transformers' LlamaForCausalLM, llama.cpp's `llama` (its Q and K rows permuted to
interleaved rotary pairs, llama3's RoPE schedule as a rope_freqs tensor)."""

from __future__ import annotations

from typing import Any

from tunix_train.config import ModelConfig
from tunix_train.interop.families import llama_like
from tunix_train.interop.families.family import Family, register

FIXED = dict(
    llama_like.LLAMA_DECODER, **llama_like.NO_WINDOWS, use_qk_norm=False, qkv_bias=False, num_experts=0
)


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    llama_like.refuse(hf, "llama", {"attention_bias": hf.get("attention_bias")})
    return llama_like.llama_from_hf(hf, "llama")


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {**llama_like.llama_to_hf(cfg, "llama"), "attention_bias": False, "mlp_bias": False}


FAMILY = register(
    Family(
        "llama",
        ("llama",),
        "LlamaForCausalLM",
        from_hf,
        to_hf,
        FIXED,
        gguf=llama_like.gguf("llama", qk_interleaved=True, rope_dimension_count=True),
        hf_names=llama_like.HF_NAMES,
    )
)
