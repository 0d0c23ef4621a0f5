"""LoRA adapters in PEFT's format: adapter_config.json and adapter_model.safetensors, which
`peft.PeftModel.from_pretrained` loads onto transformers' Gemma (the base exported by hf.py); a
reward model's head, trained whole beside the adapters, as PEFT's modules_to_save.

PEFT's adapted projection computes W x + (alpha / r) · lora_B(lora_A(x)), with lora_A.weight [r, in]
and lora_B.weight [out, in]'s row count [out, r]. Ours are A [*in, r] and B [r, *out] in the
weight's own layout (model/weights.py); flattening the input and output dimensions in the order
transformers' weights use (hf.py: q_proj's rows are heads-major) gives lora_A = A.reshape(in, r).T
and lora_B = B.reshape(r, out).T.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from tunix_train.config import LoraConfig, ModelConfig, VisionEncoder
from tunix_train.files import write_atomically, write_text
from tunix_train.interop import families, tensor_names

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


HEAD = "score"  # a reward model's (or critic's) head in transformers' ...ForSequenceClassification

# the image tower's adapters -> transformers' modules under its encoder layers, per tower
_TOWER_MODULES = {
    VisionEncoder.siglip: (
        "model.vision_tower.encoder.layers",  # transformers 5's names in memory, which PEFT reads
        {"q_lora": "self_attn.q_proj", "k_lora": "self_attn.k_proj", "v_lora": "self_attn.v_proj",
         "out_lora": "self_attn.out_proj", "up_lora": "mlp.fc1", "down_lora": "mlp.fc2"},
    ),
    VisionEncoder.gemma4: (
        "model.vision_tower.encoder.layers",
        {"q_lora": "self_attn.q_proj.linear", "k_lora": "self_attn.k_proj.linear",
         "v_lora": "self_attn.v_proj.linear", "out_lora": "self_attn.o_proj.linear",
         "gate_lora": "mlp.gate_proj.linear", "up_lora": "mlp.up_proj.linear",
         "down_lora": "mlp.down_proj.linear"},
    ),
}  # fmt: skip


def _text_layers(cfg: ModelConfig) -> str:
    """Where transformers keeps the text model's layers: under language_model in a multimodal model."""
    return "model.layers" if cfg.vision is None else "model.language_model.layers"


def _modules(path: tuple, cfg: ModelConfig, layers: int) -> list[str]:
    """Each layer's transformers module for the adapter at `path` (a stacked leaf of `layers` rows)."""
    *_, adapter, _factor = path  # ("layers", "attn", "q_lora", "a"), ("groups", g, j, ...) or ("vision", ...)
    if path[0] == "vision":
        prefix, names = _TOWER_MODULES[cfg.vision.encoder]
        return [f"{prefix}.{i}.{names[adapter]}" for i in range(layers)]
    _, layer_of = tensor_names.stack_layers(".".join(map(str, path)), cfg)
    return [f"{_text_layers(cfg)}.{layer_of(r)}.{_MODULES[adapter]}" for r in range(layers)]


def tensors(adapters: nnx.State, cfg: ModelConfig, lora: LoraConfig) -> dict[str, np.ndarray]:
    """PEFT's tensors (every process gathers them): base_model.model.<module>.lora_A.weight [r, in]
    and .lora_B.weight [out, r], float32, for each adapted module (model.layers.{i}.self_attn.q_proj,
    ...; in a multimodal model model.language_model.layers.{i}... and the tower's)."""
    from jax.experimental import multihost_utils

    tensors = {}
    for path, variable in nnx.to_flat_state(adapters):
        full = np.asarray(multihost_utils.process_allgather(variable[...], tiled=True), np.float32)
        if path == ("score_DO",):  # a scalar head trained beside the adapters: PEFT's modules_to_save
            tensors[f"base_model.model.{HEAD}.weight"] = np.ascontiguousarray(full.T)  # [1, D]
            continue
        for module, ours in zip(_modules(path, cfg, len(full)), full):
            if path[-1] == "a":
                name, tensor = "lora_A", ours.reshape(-1, lora.rank).T
            else:
                name, tensor = "lora_B", ours.reshape(lora.rank, -1).T
            tensors[f"base_model.model.{module}.{name}.weight"] = np.ascontiguousarray(tensor)
    return tensors


def fused_tensors(
    tensors: dict[str, np.ndarray], cfg: ModelConfig, lora: LoraConfig
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """(the adapters of the parts a family's checkpoints fuse (Family.fused: Phi-3's q, k and v in
    qkv_proj) as one adapter of the fused module, each fused module's rank). The parts share their
    input, so stacking their lora_A ([r, in] each) and placing each lora_B in its own rows and
    columns of one [out, n r] lora_B is the same update: of rank n r, with alpha n alpha keeping
    the scale alpha / r. An untargeted part's rows stay zero."""
    fused, ranks = families.named(cfg.family).fused, {}
    out = dict(tensors)
    for fused_name, specs in fused.items():
        parts = [tensor_names.SPECS[spec][0].removesuffix(".weight") for spec in specs]
        module = fused_name.removesuffix(".weight")
        for name in [
            n for n in tensors if n.endswith(".lora_A.weight") and any(f".{p}.lora_A" in n for p in parts)
        ]:
            base = name[: name.index(".layers.") + len(".layers.")]
            layer = int(name[len(base) :].split(".")[0])
            prefix = f"{base}{layer}."
            if prefix + module + ".lora_A.weight" in out:
                continue
            rows = [math.prod(tensor_names.split_view(spec, cfg, layer)[0][0]) for spec in specs]
            present = [i for i, p in enumerate(parts) if f"{prefix}{p}.lora_A.weight" in out]
            a = np.concatenate([out.pop(f"{prefix}{parts[i]}.lora_A.weight") for i in present])
            b = np.zeros((sum(rows), len(present) * lora.rank), np.float32)
            for column, i in enumerate(present):
                first = sum(rows[:i])
                b[first : first + rows[i], column * lora.rank : (column + 1) * lora.rank] = out.pop(
                    f"{prefix}{parts[i]}.lora_B.weight"
                )
            out[f"{prefix}{module}.lora_A.weight"], out[f"{prefix}{module}.lora_B.weight"] = a, b
            ranks[module.split(".")[-1]] = a.shape[0]
    return out, ranks


def target_modules(cfg: ModelConfig, lora: LoraConfig):
    """adapter_config.json's target_modules: the modules' last names, or in a multimodal model (whose
    tower has modules of the same names) a regular expression PEFT matches whole against each name."""
    text = [_MODULES[f"{t}_lora"] for t in lora.targets if not t.startswith("vision_")]
    for fused_name, specs in families.named(cfg.family).fused.items():  # Phi-3's qkv_proj, gate_up_proj
        parts = {tensor_names.SPECS[spec][0].removesuffix(".weight") for spec in specs}
        if parts & set(text):
            text = [m for m in text if m not in parts] + [fused_name.removesuffix(".weight")]
    if cfg.vision is None:
        return sorted(m.split(".")[-1] for m in text)
    prefix, names = _TOWER_MODULES[cfg.vision.encoder]
    tower = [names[f"{t.removeprefix('vision_')}_lora"] for t in lora.targets if t.startswith("vision_")]
    alternatives = [
        rf"{re.escape(p)}\.\d+\.({'|'.join(re.escape(m) for m in ms)})"
        for p, ms in ((_text_layers(cfg), text), (prefix, tower))
        if ms
    ]
    return "|".join(f"(?:{a})" for a in alternatives)


def export(
    adapters: nnx.State, cfg: ModelConfig, lora: LoraConfig, directory: Path, base_model: str = ""
) -> None:
    """Writes the adapters (process 0) in PEFT's format; with a scalar head (a reward model's), for
    a ...ForSequenceClassification of one label: task SEQ_CLS, the head whole in modules_to_save."""
    from safetensors.numpy import save_file

    weights, ranks = fused_tensors(tensors(adapters, cfg, lora), cfg, lora)
    head = "score_DO" in adapters
    config = {
        "peft_type": "LORA",
        "task_type": "SEQ_CLS" if head else "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": target_modules(cfg, lora),
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": [HEAD] if head else None,
        # fused modules: their parts' adapters side by side (fused_tensors)
        "rank_pattern": ranks,
        "alpha_pattern": {m: lora.alpha * rank / lora.rank for m, rank in ranks.items()},
    }
    if jax.process_index() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        write_atomically(
            directory / "adapter_model.safetensors",
            lambda partial: save_file(weights, str(partial), metadata={"format": "pt"}),
        )
        write_text(directory / "adapter_config.json", json.dumps(config, indent=2) + "\n")
