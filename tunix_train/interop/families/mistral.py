"""Mistral: transformers' MistralForCausalLM. Llama's decoder with grouped-query attention and, in
checkpoints that set config.json's sliding_window (Mistral 7B v0.1), every layer local. llama.cpp
writes it as `llama` (its Q and K rows permuted as Llama's); a file is told apart as Mistral by its
general.basename or, for a windowed model, its llama.attention.sliding_window (written here, not
read by llama.cpp's llama: past the window it attends to every earlier token)."""

from __future__ import annotations

from tunix_train.interop.families import llama_like
from tunix_train.interop.families.family import register

FAMILY = register(
    llama_like.dense(
        "mistral",
        "MistralForCausalLM",
        llama_like.gguf(
            "llama", qk_interleaved=True, rope_dimension_count=True, windowed=True, basename="Mistral"
        ),
        refused=("attention_bias",),
        windowed=True,
    )
)
