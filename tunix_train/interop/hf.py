"""Hugging Face interop: Gemma, Gemma 2 and Gemma 3 safetensors checkpoints, both directions.

Import reads transformers' tensor names and layouts straight into the sharded parameters: every
array is built with jax.make_array_from_callback, so each process reads from the safetensors files
only the slices its devices hold. Export writes model.safetensors and config.json that
transformers' Gemma*ForCausalLM loads. No pickle is involved: safetensors and JSON only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from tunix_train.config import ConfigError, ModelConfig

# Our parameter path -> (transformers name, [per transformers dim: the sizes it splits into], the
# permutation of that split view giving our layout). Names under model.layers.{i}. are per layer.
# Sizes: D embed, N heads, K kv heads, H head dim, F MLP width, V vocab.
_SPECS = {
    "embedding_VD": ("model.embed_tokens.weight", ("V", "D"), (0, 1)),
    "final_norm.scale": ("model.norm.weight", ("D",), (0,)),
    "layers.pre_attn_norm.scale": ("input_layernorm.weight", ("D",), (0,)),
    "layers.attn.q_DNH": ("self_attn.q_proj.weight", ("NH", "D"), (2, 0, 1)),
    "layers.attn.k_DKH": ("self_attn.k_proj.weight", ("KH", "D"), (2, 0, 1)),
    "layers.attn.v_DKH": ("self_attn.v_proj.weight", ("KH", "D"), (2, 0, 1)),
    "layers.attn.o_NHD": ("self_attn.o_proj.weight", ("D", "NH"), (1, 2, 0)),
    "layers.attn.q_norm.scale": ("self_attn.q_norm.weight", ("H",), (0,)),
    "layers.attn.k_norm.scale": ("self_attn.k_norm.weight", ("H",), (0,)),
    "layers.post_attn_norm.scale": ("post_attention_layernorm.weight", ("D",), (0,)),
    "layers.pre_ffw_norm.scale": ("pre_feedforward_layernorm.weight", ("D",), (0,)),
    "layers.post_ffw_norm.scale": ("post_feedforward_layernorm.weight", ("D",), (0,)),
    "layers.mlp.gate_DF": ("mlp.gate_proj.weight", ("F", "D"), (1, 0)),
    "layers.mlp.up_DF": ("mlp.up_proj.weight", ("F", "D"), (1, 0)),
    "layers.mlp.down_FD": ("mlp.down_proj.weight", ("D", "F"), (1, 0)),
}
_LAYERED = "layers."


def _family(cfg: ModelConfig) -> str:
    if cfg.use_qk_norm:
        return "gemma3_text"
    return "gemma2" if cfg.use_post_attn_norm or cfg.use_post_ffw_norm else "gemma"


def _hf_name(path: str, layer: int | None, cfg: ModelConfig) -> str:
    name = _SPECS[path][0]
    if path == "layers.pre_ffw_norm.scale" and _family(cfg) == "gemma":
        name = "post_attention_layernorm.weight"  # Gemma 1 names its pre-MLP norm this way
    return name if layer is None else f"model.layers.{layer}.{name}"


def _sizes(cfg: ModelConfig) -> dict[str, int]:
    return {"D": cfg.embed_dim, "N": cfg.num_heads, "K": cfg.num_kv_heads, "H": cfg.head_dim,
            "F": cfg.hidden_dim, "V": cfg.vocab_size}


def _split_view(path: str, cfg: ModelConfig) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """Per transformers dimension the sizes it splits into (q_proj's rows are N x H), and the perm."""
    sizes = _sizes(cfg)
    _, dims, perm = _SPECS[path]
    return [tuple(sizes[letter] for letter in dim) for dim in dims], perm


def _to_hf(ours: np.ndarray, path: str, cfg: ModelConfig) -> np.ndarray:
    split, perm = _split_view(path, cfg)
    return ours.transpose(np.argsort(perm)).reshape([math.prod(group) for group in split])


def _hf_slices(path: str, cfg: ModelConfig, ours_index: tuple[slice, ...]) -> tuple[list[slice], list[int]]:
    """The transformers-tensor slice holding our block `ours_index`, and the block's view shape.
    Within a split dimension only the leading part may be sliced (head_dim is never sharded)."""
    split, perm = _split_view(path, cfg)
    view_shape = [s for group in split for s in group]
    view = [slice(None)] * len(view_shape)
    for our_dim, sl in enumerate(ours_index):
        view[perm[our_dim]] = sl
    view = [slice(*sl.indices(size)[:2]) for sl, size in zip(view, view_shape)]
    hf, position = [], 0
    for group in split:
        parts = view[position:position + len(group)]
        inner = math.prod(group[1:])
        if any((p.start, p.stop) != (0, size) for p, size in zip(parts[1:], group[1:])):
            raise ValueError(f"{path}: cannot read a block split inside {group}")
        hf.append(slice(parts[0].start * inner, parts[0].stop * inner))
        position += len(group)
    return hf, [v.stop - v.start for v in view]


class _SafetensorsFiles:
    """Lazy access to the tensors of one checkpoint directory (single file or sharded with an index)."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        index = directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (directory / "model.safetensors").is_file():
            files, weight_map = ["model.safetensors"], None
        else:
            raise ConfigError(f"model.init_from: no model.safetensors(.index.json) in {directory}")
        self._handles = {f: safe_open(str(directory / f), framework="numpy") for f in files}
        self._where = weight_map or {name: files[0] for name in self._handles[files[0]].keys()}

    def has(self, name: str) -> bool:
        return name in self._where

    def read(self, name: str, slices: list[slice]) -> np.ndarray:
        return self._handles[self._where[name]].get_slice(name)[tuple(slices)]


def read_hf_config(directory: Path) -> dict[str, Any]:
    file = directory / "config.json"
    if not file.is_file():
        raise ConfigError(f"model.init_from: no config.json in {directory}")
    hf = json.loads(file.read_text())
    return hf.get("text_config", hf)  # Gemma 3 multimodal checkpoints nest the text decoder


def model_fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields equivalent to a transformers Gemma/Gemma2/Gemma3 config.json."""
    model_type = hf.get("model_type")
    if model_type not in ("gemma", "gemma2", "gemma3_text", "gemma3"):
        raise ConfigError(f"model.init_from: model_type {model_type!r} is not Gemma, Gemma 2 or Gemma 3")
    n_layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types") or ["full_attention"] * n_layers
    local = [t == "sliding_attention" for t in layer_types]
    per_global = local.index(False) if False in local else n_layers
    if local != [(i + 1) % (per_global + 1) != 0 for i in range(n_layers)]:
        raise ConfigError(f"model.init_from: layer_types {layer_types} is not N local layers then a global one")
    rope = hf.get("rope_parameters") or {}
    full, sliding = rope.get("full_attention", rope), rope.get("sliding_attention", rope)
    theta = full.get("rope_theta", hf.get("rope_theta", 10_000.0))
    scaling = full if full.get("rope_type") == "linear" else (hf.get("rope_scaling") or {})
    gemma3 = model_type.startswith("gemma3")
    return {
        "num_layers": n_layers, "embed_dim": hf["hidden_size"], "hidden_dim": hf["intermediate_size"],
        "num_heads": hf["num_attention_heads"], "num_kv_heads": hf["num_key_value_heads"],
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        "vocab_size": hf["vocab_size"],
        "query_pre_attn_scalar": hf.get("query_pre_attn_scalar"),
        "attn_logit_softcap": hf.get("attn_logit_softcapping"),
        "final_logit_softcap": hf.get("final_logit_softcapping"),
        "use_post_attn_norm": model_type != "gemma", "use_post_ffw_norm": model_type != "gemma",
        "use_qk_norm": gemma3,
        "local_layers_per_global": per_global if per_global < n_layers else 0,
        "sliding_window": hf.get("sliding_window") if any(local) else None,
        "rope_base_global": float(theta),
        "rope_base_local": float(sliding.get("rope_theta", hf.get("rope_local_base_freq", theta))),
        "rope_scale_global": float(scaling.get("factor", 1.0)) if scaling.get("rope_type", "linear") == "linear" else 1.0,
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
        "context_length": hf.get("max_position_embeddings"),
    }


def check_matches(cfg: ModelConfig, directory: Path) -> None:
    """A one-line ConfigError naming the first model key that differs from the checkpoint's."""
    for key, value in model_fields_from_hf(read_hf_config(directory)).items():
        ours = getattr(cfg, key)
        if key == "context_length":  # what the sampler allows, not what training computes
            continue
        if ours != value and not (key == "query_pre_attn_scalar" and (ours or cfg.head_dim) == (value or cfg.head_dim)):
            raise ConfigError(f"model.init_from: {directory} has {key}={value!r} but model.{key}={ours!r}; "
                              f"use the matching model config or set model.{key}={value!r}")


def load_params(directory: Path, cfg: ModelConfig, abstract_params: nnx.State) -> nnx.State:
    """Parameters in the shapes and shardings of `abstract_params` (ShapeDtypeStructs with shardings),
    each process reading only its devices' slices of the safetensors files."""
    directory = Path(directory)
    check_matches(cfg, directory)
    return load_params_from(_SafetensorsFiles(directory), cfg, abstract_params, str(directory))


def load_params_from(files: Any, cfg: ModelConfig, abstract_params: nnx.State, source: str) -> nnx.State:
    """Parameters from `files`, anything with has(name) and read(name, slices) over transformers'
    tensor names and layouts (safetensors here, GGUF in interop/gguf.py); `source` names it in errors."""

    def load(key_path, leaf: jax.ShapeDtypeStruct):
        path = jax.tree_util.keystr(key_path, simple=True, separator=".").removesuffix(".value")
        layered = path.startswith(_LAYERED)
        for layer in (range(cfg.num_layers) if layered else [None]):
            if not files.has(_hf_name(path, layer, cfg)):
                raise ConfigError(f"model.init_from: {source} has no tensor {_hf_name(path, layer, cfg)}")

        def block(index):
            layers = range(*index[0].indices(cfg.num_layers)) if layered else [None]
            inner = index[1:] if layered else index
            pieces = []
            for layer in layers:
                hf_slices, view_shape = _hf_slices(path, cfg, inner)
                piece = files.read(_hf_name(path, layer, cfg), hf_slices).astype(np.float32)
                pieces.append(piece.reshape(view_shape).transpose(_SPECS[path][2]))
            return np.stack(pieces) if layered else pieces[0]

        return jax.make_array_from_callback(leaf.shape, leaf.sharding, block)

    return jax.tree_util.tree_map_with_path(load, abstract_params)


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """config.json for transformers' Gemma, Gemma 2 or Gemma 3 text model."""
    family = _family(cfg)
    windows = [(i + 1) % (cfg.local_layers_per_global + 1) != 0 for i in range(cfg.num_layers)]
    types = ["sliding_attention" if local else "full_attention" for local in windows]
    rope_global = {"rope_type": "default", "rope_theta": cfg.rope_base_global}
    if cfg.rope_scale_global != 1.0:
        rope_global = {"rope_type": "linear", "rope_theta": cfg.rope_base_global, "factor": cfg.rope_scale_global}
    config = {
        "architectures": [{"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                           "gemma3_text": "Gemma3ForCausalLM"}[family]],
        "model_type": family, "vocab_size": cfg.vocab_size, "hidden_size": cfg.embed_dim,
        "intermediate_size": cfg.hidden_dim, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True,
        "max_position_embeddings": cfg.context_length or 8192,
        "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "torch_dtype": "float32",
        "rope_theta": cfg.rope_base_global, "rope_parameters": rope_global,
    }
    if family != "gemma":
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim  # transformers 5 takes an int where it is one
        config.update(query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
                      attn_logit_softcapping=cfg.attn_logit_softcap,
                      final_logit_softcapping=cfg.final_logit_softcap,
                      sliding_window=cfg.sliding_window or 4096, layer_types=types)
    if family == "gemma3_text":
        config["rope_parameters"] = {"full_attention": rope_global, "sliding_attention":
                                     {"rope_type": "default", "rope_theta": cfg.rope_base_local}}
        config["rope_local_base_freq"] = cfg.rope_base_local
    elif cfg.rope_base_local != cfg.rope_base_global or cfg.rope_scale_global != 1.0 or (
            family == "gemma" and cfg.local_layers_per_global):
        raise ConfigError(f"{family} checkpoints have no per-layer-type RoPE or sliding windows; "
                          f"this model cannot be exported as {family}")
    return config


def export(params: nnx.State, cfg: ModelConfig, directory: Path) -> None:
    """Writes config.json and model.safetensors (float32) into `directory` (process 0 writes)."""
    from jax.experimental import multihost_utils
    from safetensors.numpy import save_file

    config = hf_config(cfg)
    tensors = {}
    for key_path, array in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = jax.tree_util.keystr(key_path, simple=True, separator=".").removesuffix(".value")
        full = np.asarray(multihost_utils.process_allgather(array, tiled=True), np.float32)
        for layer, ours in (enumerate(full) if path.startswith(_LAYERED) else [(None, full)]):
            tensors[_hf_name(path, layer, cfg)] = np.ascontiguousarray(_to_hf(ours, path, cfg))
    if jax.process_index() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
