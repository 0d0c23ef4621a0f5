"""Llama 3: transformers' LlamaForCausalLM, llama.cpp's `llama` (its Q and K rows permuted to
interleaved rotary pairs, llama3's RoPE schedule as a rope_freqs tensor)."""

from __future__ import annotations

from tunix_train.interop.families import llama_like
from tunix_train.interop.families.family import register

FAMILY = register(
    llama_like.dense(
        "llama",
        "LlamaForCausalLM",
        llama_like.gguf("llama", qk_interleaved=True, rope_dimension_count=True),
        refused=("attention_bias",),
        written={"attention_bias": False, "mlp_bias": False},
    )
)
