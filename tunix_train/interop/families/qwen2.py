"""Qwen 2.5: transformers' Qwen2ForCausalLM, llama.cpp's `qwen2`. Biases on q, k and v always."""

from __future__ import annotations

from tunix_train.interop.families import llama_like
from tunix_train.interop.families.family import register

FAMILY = register(
    llama_like.dense(
        "qwen2",
        "Qwen2ForCausalLM",
        qkv_bias=True,
        written={"use_sliding_window": False},
    )
)
