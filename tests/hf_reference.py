"""Tiny random transformers Gemma checkpoints and their logits: the reference of the parity tests.

`checkpoint_and_logits` computes them in this process when torch and transformers are installed.
Otherwise, when TUNIX_TRAIN_REFERENCE_PYTHON names a Python that has them (CI's Python 3.12 leg
names the first leg's), it runs this file there:

    python tests/hf_reference.py FAMILY CHECKPOINT_DIR TOKENS.npy OUT.npy GREEDY_TOKENS
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

HEADS = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, **HEADS)
# The image towers' tiny sizes (test_vision.py, test_vision_gemma4.py).
TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
WINDOW, SEQ = 5, 16  # sequences longer than the sliding window
FAMILIES = ("gemma", "gemma2", "gemma3")
S, F = "sliding_attention", "full_attention"
# Tiny Gemma 4 text models, each with one feature on (the last with all of them).
GEMMA4 = {
    "gemma4_pattern": dict(num_hidden_layers=6, layer_types=[S] * 5 + [F], global_head_dim=16),
    "gemma4_global": dict(
        num_hidden_layers=5,
        layer_types=[S] * 4 + [F],
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
    ),
    "gemma4_rope": dict(
        num_hidden_layers=4,
        layer_types=[S, F, S, F],
        global_head_dim=16,
        rope_parameters={
            F: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e4, "factor": 2.0},
            S: {"rope_type": "default", "rope_theta": 100.0},
        },
    ),
    "gemma4_kv_shared": dict(
        num_hidden_layers=6, layer_types=[S, S, F] * 2, global_head_dim=32, num_kv_shared_layers=3
    ),
    "gemma4_ple": dict(
        num_hidden_layers=4,
        layer_types=[S, F] * 2,
        global_head_dim=16,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=128,
    ),
    "gemma4_double_wide": dict(
        num_hidden_layers=4,
        layer_types=[S, F] * 2,
        global_head_dim=16,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
    ),
    "gemma4_moe": dict(
        num_hidden_layers=4,
        layer_types=[S, F] * 2,
        global_head_dim=16,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
    ),
    "gemma4_all": dict(
        num_hidden_layers=6,
        layer_types=[S, S, F] * 2,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        num_kv_shared_layers=3,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=128,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
        final_logit_softcapping=30.0,
    ),
}
# Tiny Llama 3 and Qwen 2.5 / 3 models: (transformers' config and model class, config values).
# The rope variants rotate positions past a pre-training context shorter than SEQ.
PHI3_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # Phi3Config's pad id (32000) is past ours
LLAMA_QWEN = {
    "llama": ("Llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 5e5})),
    "llama_tied": ("Llama", dict(tie_word_embeddings=True)),
    "llama_rope": (
        "Llama",
        dict(
            max_position_embeddings=64,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 5e5,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8,
            },
        ),
    ),
    "qwen2": (
        "Qwen2",
        dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    ),
    "qwen3": ("Qwen3", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3_yarn": (
        "Qwen3",
        dict(
            max_position_embeddings=32,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1e6,
                "factor": 4.0,
                "original_max_position_embeddings": 8,
            },
        ),
    ),
    "qwen3_moe": (
        "Qwen3Moe",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    ),
    # every layer local past WINDOW (Mistral 7B v0.1's, Phi-3 mini's sliding_window), or none
    "mistral": (
        "Mistral",
        dict(sliding_window=WINDOW, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    ),
    "mistral_full": ("Mistral", dict(sliding_window=None)),
    "phi3": ("Phi3", dict(sliding_window=WINDOW, **PHI3_IDS)),
    "phi3_full": ("Phi3", dict(sliding_window=None, **PHI3_IDS)),
    # LongRoPE past a pre-training context of 8 (Phi-3-mini-128k's, small): factors of each rotary pair
    "phi3_longrope": (
        "Phi3",
        dict(
            sliding_window=None,
            **PHI3_IDS,
            max_position_embeddings=32,
            original_max_position_embeddings=8,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.5, 1.7],
                "long_factor": [1.0, 1.3, 1.8, 2.6, 4.0, 6.5, 9.0, 12.0],
            },
        ),
    ),
}
REFERENCE_PYTHON = "TUNIX_TRAIN_REFERENCE_PYTHON"


def _config_and_class(family: str, for_gguf: bool = False):
    import transformers

    if for_gguf:  # what GGUF readers assume where a file is silent (a query scale of 256: head_dim 256, as
        # llama.cpp takes it, and transformers' default); MLP rows of whole Q4_K blocks
        sizes = dict(SIZES, intermediate_size=256, max_position_embeddings=64)
        if family != "gemma":
            sizes["head_dim"] = 256
        if family == "gemma":
            return transformers.GemmaConfig(**sizes), transformers.GemmaForCausalLM
        if family == "gemma2":
            return (
                transformers.Gemma2Config(**sizes, sliding_window=WINDOW, query_pre_attn_scalar=256),
                transformers.Gemma2ForCausalLM,
            )
        return (
            transformers.Gemma3TextConfig(
                **dict(sizes, num_hidden_layers=6), sliding_window=WINDOW, query_pre_attn_scalar=256
            ),
            transformers.Gemma3ForCausalLM,
        )
    if family in LLAMA_QWEN:
        prefix, values = LLAMA_QWEN[family]
        config_class = getattr(transformers, f"{prefix}Config")
        return config_class(**SIZES, **values), getattr(transformers, f"{prefix}ForCausalLM")
    if family in GEMMA4:
        return (
            transformers.Gemma4TextConfig(
                **{**SIZES, "hidden_size_per_layer_input": 0, "sliding_window": WINDOW, **GEMMA4[family]}
            ),
            transformers.Gemma4ForCausalLM,
        )
    if family == "gemma":
        return transformers.GemmaConfig(**SIZES), transformers.GemmaForCausalLM
    if family == "gemma2":
        return (
            transformers.Gemma2Config(**SIZES, sliding_window=WINDOW, query_pre_attn_scalar=24),
            transformers.Gemma2ForCausalLM,
        )
    return (
        transformers.Gemma3TextConfig(
            **SIZES,
            sliding_window=WINDOW,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
        transformers.Gemma3ForCausalLM,
    )


def build(family: str, directory: Path, for_gguf: bool = False, **sizes):
    """A seeded random transformers model of `family` (`sizes` overriding its config's), saved into
    `directory` (safetensors)."""
    import torch

    torch.manual_seed(0)
    hf_config, model_class = _config_and_class(family, for_gguf)
    for key, value in sizes.items():
        setattr(hf_config, key, value)
    model = model_class(hf_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms start at zero: make every tensor matter
            p.add_(torch.randn_like(p) * 0.1)
            # Layers that outweigh the tied embedding: greedy decoding then does not repeat a token.
            if "post_" in name or (family == "gemma" and "layernorm" in name):
                p.add_(4.0)
        for name, b in model.named_buffers():  # Gemma 4's per-layer output scalar: a checkpointed buffer
            if name.endswith("layer_scalar"):
                b.copy_(0.8 + 0.4 * torch.rand_like(b))
    model.save_pretrained(directory)
    return model


def logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        # output_hidden_states: transformers 5.23's Gemma 4 otherwise slices the per-layer inputs
        # before its KV-sharing layers, and fails on a model that has none
        return model(torch.tensor(tokens), output_hidden_states=True).logits.numpy()


def greedy(model, prompt: np.ndarray, new_tokens: int) -> np.ndarray:
    """transformers' greedy continuation of the [1, T] prompt, its EOS (if any) dropped."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor(prompt), do_sample=False, max_new_tokens=new_tokens)
    new = out[0, prompt.shape[1] :].numpy()
    return new[:-1] if len(new) and new[-1] == model.generation_config.eos_token_id else new


def _in_process() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("torch", "transformers"))


def checkpoint_and_logits(
    family: str, directory: Path, tokens: np.ndarray, greedy_tokens: int = 0
) -> np.ndarray:
    """Writes `family`'s checkpoint into `directory` and returns transformers' logits for `tokens`
    (with greedy_tokens > 0: instead, its greedy continuation of the one row of `tokens`): in this
    process, or in TUNIX_TRAIN_REFERENCE_PYTHON's; skips the test when neither has torch."""
    if _in_process():
        model = build(family, directory)
        return greedy(model, tokens, greedy_tokens) if greedy_tokens else logits(model, tokens)
    python = os.environ.get(REFERENCE_PYTHON)
    if not python:
        import pytest

        pytest.skip(
            f"needs torch and transformers (pip install -e '.[reference]'), or {REFERENCE_PYTHON} "
            f"naming a Python that has them"
        )
    directory.mkdir(parents=True, exist_ok=True)
    tokens_file, logits_file = (
        directory.parent / f"{family}_tokens.npy",
        directory.parent / f"{family}_logits.npy",
    )
    np.save(tokens_file, tokens)
    subprocess.run(
        [python, __file__, family, str(directory), str(tokens_file), str(logits_file), str(greedy_tokens)],
        check=True,
    )
    return np.load(logits_file)


if __name__ == "__main__":
    family, directory, tokens_file, out_file, greedy_tokens = sys.argv[1:]
    model, tokens, greedy_tokens = build(family, Path(directory)), np.load(tokens_file), int(greedy_tokens)
    np.save(out_file, greedy(model, tokens, greedy_tokens) if greedy_tokens else logits(model, tokens))
