"""LoRA adapters in PEFT's format: adapter_config.json and adapter_model.safetensors, which
`peft.PeftModel.from_pretrained` loads onto transformers' Gemma (the base exported by hf.py).

PEFT's adapted projection computes W x + (alpha / r) · lora_B(lora_A(x)), with lora_A.weight [r, in]
and lora_B.weight [out, in]'s row count [out, r]. Ours are A [*in, r] and B [r, *out] in the
weight's own layout (model/weights.py); flattening the input and output dimensions in the order
transformers' weights use (hf.py: q_proj's rows are heads-major) gives lora_A = A.reshape(in, r).T
and lora_B = B.reshape(r, out).T.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from tunix_train.config import LoraConfig, ModelConfig
from tunix_train.files import write_atomically, write_text
from tunix_train.interop import hf

# our adapter -> transformers' module under model.layers.{i}.
_MODULES = {
    "q_lora": "self_attn.q_proj",
    "k_lora": "self_attn.k_proj",
    "v_lora": "self_attn.v_proj",
    "o_lora": "self_attn.o_proj",
    "gate_lora": "mlp.gate_proj",
    "up_lora": "mlp.up_proj",
    "down_lora": "mlp.down_proj",
}


def tensors(adapters: nnx.State, cfg: ModelConfig, lora: LoraConfig) -> dict[str, np.ndarray]:
    """PEFT's tensors (every process gathers them): base_model.model.model.layers.{i}.<module>.lora_A.weight
    [r, in] and .lora_B.weight [out, r], float32."""
    from jax.experimental import multihost_utils

    tensors = {}
    for path, variable in nnx.to_flat_state(adapters):
        *_, adapter, factor = path  # ("layers", "attn", "q_lora", "a") or ("groups", g, j, "attn", ...)
        _, layer_of = hf.stack_layers(".".join(map(str, path)), cfg)
        full = np.asarray(multihost_utils.process_allgather(variable[...], tiled=True), np.float32)
        for layer, ours in ((layer_of(r), row) for r, row in enumerate(full)):
            if factor == "a":
                name, tensor = "lora_A", ours.reshape(-1, lora.rank).T
            else:
                name, tensor = "lora_B", ours.reshape(lora.rank, -1).T
            key = f"base_model.model.model.layers.{layer}.{_MODULES[adapter]}.{name}.weight"
            tensors[key] = np.ascontiguousarray(tensor)
    return tensors


def export(
    adapters: nnx.State, cfg: ModelConfig, lora: LoraConfig, directory: Path, base_model: str = ""
) -> None:
    """Writes the adapters (process 0) in PEFT's format."""
    from safetensors.numpy import save_file

    weights = tensors(adapters, cfg, lora)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(_MODULES[f"{t}_lora"].split(".")[-1] for t in lora.targets),
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    if jax.process_index() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        write_atomically(
            directory / "adapter_model.safetensors",
            lambda partial: save_file(weights, str(partial), metadata={"format": "pt"}),
        )
        write_text(directory / "adapter_config.json", json.dumps(config, indent=2) + "\n")
