"""Qwen 3 (dense): transformers' Qwen3ForCausalLM, llama.cpp's `qwen3`. Q/K norms, no biases."""

from __future__ import annotations

from tunix_train.interop.families import llama_like
from tunix_train.interop.families.family import register

FAMILY = register(
    llama_like.dense(
        "qwen3",
        "Qwen3ForCausalLM",
        use_qk_norm=True,
        refused=("attention_bias",),
        written={"attention_bias": False, "use_sliding_window": False},
    )
)
