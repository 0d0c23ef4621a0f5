"""Hugging Face interop: safetensors checkpoints of the registered families (interop/families/),
both directions.

Import reads transformers' tensor names and layouts straight into the sharded parameters: every
array is built with jax.make_array_from_callback, so each process reads from the safetensors files
only the slices its devices hold. Export writes model.safetensors and config.json that
transformers' *ForCausalLM of the model's family loads. No pickle is involved: safetensors and
JSON only. The tensor names and layouts are one table for every family (tensor_names.py); config.json
is the family's (interop/families/).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix_train.config import ConfigError, ModelConfig, field_of
from tunix_train.files import write_atomically, write_text
from tunix_train.interop import families, tensor_names, vision
from tunix_train.interop.config_file import (
    open_safetensors,
    other_towers,
    read_hf_config,
    read_json,
    vision_from_directory,
)
from tunix_train.model.weights import ByLayer
from tunix_train.sharding import layer_sharding


class _SafetensorsFiles:
    """Lazy access to the tensors of one checkpoint directory (single file or sharded with an index)."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        index = directory / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = read_json(index)["weight_map"]
                files = sorted(set(weight_map.values()))
            except (KeyError, TypeError, AttributeError) as err:
                raise ConfigError(f"{index}: not a safetensors index ({type(err).__name__}: {err})") from None
            if outside := [
                f for f in files if not isinstance(f, str) or Path(f).name != f or f in (".", "..")
            ]:
                raise ConfigError(
                    f"{index}: its weight_map names {str(outside[0])[:80]!r}, not a file beside it"
                )
        elif (directory / "model.safetensors").is_file():
            files, weight_map = ["model.safetensors"], None
        else:
            raise ConfigError(f"model.init_from: no model.safetensors(.index.json) in {directory}")
        self._handles = {f: open_safetensors(safe_open, directory / f) for f in files}
        self._where = weight_map or {name: files[0] for name in self._handles[files[0]].keys()}

    def has(self, name: str) -> bool:
        return name in self._where

    def read(self, name: str, slices: list[slice]) -> np.ndarray:
        return self._handles[self._where[name]].get_slice(name)[tuple(slices)]


class _PerExpertFiles:
    """Experts as transformers holds them in memory, `experts.gate_up_proj` [E, 2M, D] and
    `experts.down_proj` [E, D, M], read from checkpoints that store each expert's gate, up and down
    projections as tensors of their own (`experts.{e}.gate_proj.weight` [M, D]; Qwen 3 MoE)."""

    def __init__(self, files: Any, num_experts: int):
        self.files, self.num_experts = files, num_experts

    @staticmethod
    def _parts(name: str) -> tuple[str, tuple[str, ...]] | None:
        base, _, kind = name.rpartition(".")
        return {"gate_up_proj": (base, ("gate_proj", "up_proj")), "down_proj": (base, ("down_proj",))}.get(
            kind
        )

    def has(self, name: str) -> bool:
        parts = self._parts(name)
        return self.files.has(name) or (
            parts is not None and all(self.files.has(f"{parts[0]}.0.{k}.weight") for k in parts[1])
        )

    def read(self, name: str, slices: list[slice]) -> np.ndarray:
        if self.files.has(name):
            return self.files.read(name, slices)
        base, kinds = self._parts(name)
        whole = [slice(None), slice(None)]
        experts = [
            np.concatenate([self.files.read(f"{base}.{e}.{k}.weight", whole) for k in kinds])
            for e in range(*slices[0].indices(self.num_experts))
        ]
        return np.stack(experts)[(slice(None), *slices[1:])]


def per_expert_tensors(name: str, fused: np.ndarray) -> dict[str, np.ndarray]:
    """_PerExpertFiles' inverse: a fused experts tensor as one tensor per expert and projection."""
    base, kinds = _PerExpertFiles._parts(name)
    return {
        f"{base}.{e}.{kind}.weight": np.ascontiguousarray(part)
        for e, expert in enumerate(fused)
        for kind, part in zip(kinds, np.split(expert, len(kinds)))
    }


class _FusedFiles:
    """transformers' per-part tensors (q_proj, gate_proj, ...) read from checkpoints that fuse them
    (Family.fused: Phi-3's qkv_proj holds q's rows, then k's, then v's); where the fused tensor is
    missing, the part's own (a GGUF's ffn_up is the fused gate/up under up's name: the fused one
    is read first)."""

    def __init__(self, files: Any, cfg: ModelConfig, fused: dict[str, tuple[str, ...]]):
        self.files, self.cfg = files, cfg
        self._parts = {  # a part's name -> (the fused name, the parts' paths, this part's place)
            tensor_names.SPECS[spec][0]: (name, specs, i)
            for name, specs in fused.items()
            for i, spec in enumerate(specs)
        }

    def _fused(self, name: str) -> tuple[str, int, int] | None:
        """(the fused tensor's name, this part's first row, its rows) of a part's name."""
        base, _, tail = name.partition(".layers.")
        layer, _, part = tail.partition(".")
        if part not in self._parts or not layer.isdigit():
            return None
        fused, specs, place = self._parts[part]
        rows = [math.prod(tensor_names.split_view(spec, self.cfg, int(layer))[0][0]) for spec in specs]
        return f"{base}.layers.{layer}.{fused}", sum(rows[:place]), rows[place]

    def has(self, name: str) -> bool:
        fused = self._fused(name)
        return self.files.has(name) or (fused is not None and self.files.has(fused[0]))

    def read(self, name: str, slices: list[slice]) -> np.ndarray:
        fused = self._fused(name)
        if fused is None or not self.files.has(fused[0]):
            return self.files.read(name, slices)
        fused_name, first, rows = fused
        start, stop, _ = slices[0].indices(rows)
        return self.files.read(fused_name, [slice(first + start, first + stop), *slices[1:]])


def fuse(tensors: dict[str, np.ndarray], fused: dict[str, tuple[str, ...]]) -> dict[str, np.ndarray]:
    """_FusedFiles' inverse: each layer's parts as the one tensor the family's checkpoints hold."""
    out = dict(tensors)
    for fused_name, specs in fused.items():
        parts = [tensor_names.SPECS[spec][0] for spec in specs]
        for name in [n for n in tensors if n.endswith("." + parts[0])]:
            base = name.removesuffix(parts[0])
            if all(base + part in out for part in parts):
                out[base + fused_name] = np.concatenate([out.pop(base + part) for part in parts])
    return out


def model_fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields equivalent to a transformers config.json (its text_config), by its family."""
    return families.of_hf(hf).fields_from_hf(hf)


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """config.json for transformers' model of cfg.family (with an image tower: its
    Gemma3ForConditionalGeneration, and with a scalar head too, Gemma3ForSequenceClassification)."""
    text = families.named(cfg.family).hf_config(cfg)
    return text if cfg.vision is None else vision.of(cfg.vision).multimodal_config(cfg.vision, text)


def check_matches(cfg: ModelConfig, directory: Path) -> None:
    """A one-line ConfigError naming the first model key that differs from the checkpoint's."""
    if cfg.vision is not None:
        theirs = vision_from_directory(directory)
        if theirs is None:
            raise ConfigError(
                f"model.init_from: {directory} has no image tower but model.vision is set; set "
                f"model.vision=null or start from a multimodal checkpoint"
            )
        for key, value in vars(theirs).items():
            # trainable is the run's; Gemma 4's tokens_per_image is its image processor's budget
            if key == "trainable" or (key == "tokens_per_image" and theirs.traits.patches):
                continue
            if getattr(cfg.vision, key) != value:
                raise ConfigError(
                    f"model.init_from: {directory} has vision {key}={value!r} but "
                    f"model.vision.{key}={getattr(cfg.vision, key)!r}; set model.vision.{key}={value!r}"
                )
    for key, value in model_fields_from_hf(read_hf_config(directory)).items():
        ours = field_of(cfg, key)
        if key == "context_length":  # what the engine allows, not what training computes
            continue
        if key == "rope_scaling" and ours != value:  # a context extension: said, not refused
            if jax.process_index() == 0:
                print(
                    f"model.init_from: {directory} has rope_scaling {value.type.value}; this run uses "
                    f"{ours.type.value} (factor {ours.factor}): a context extension"
                )
            continue
        if ours != value and not (
            key == "query_pre_attn_scalar" and (ours or cfg.head_dim) == (value or cfg.head_dim)
        ):
            raise ConfigError(
                f"model.init_from: {directory} has {key}={value!r} but model.{key}={ours!r}; "
                f"use the matching model config or set model.{key}={value!r}"
            )


def load_params(
    directory: Path, cfg: ModelConfig, abstract_params: nnx.State, by_layer: ByLayer | None = None
) -> nnx.State:
    """Parameters in the shapes and shardings of `abstract_params` (ShapeDtypeStructs with shardings),
    each process reading only its devices' slices of the safetensors files; by_layer: as in
    load_params_from."""
    directory = Path(directory)
    check_matches(cfg, directory)
    towers = [t for t in other_towers(directory) if not (t == "vision_config" and cfg.vision is not None)]
    if towers and jax.process_index() == 0:
        print(
            f"model.init_from: {directory} also holds a "
            f"{' and '.join(t.removesuffix('_config') for t in towers)} "
            f"tower; loading the text decoder, ignoring the rest"
        )
    files = _SafetensorsFiles(directory)
    if cfg.moe.experts:
        files = _PerExpertFiles(files, cfg.moe.experts)
    return load_params_from(files, cfg, abstract_params, str(directory), by_layer)


def load_params_from(
    files: Any, cfg: ModelConfig, abstract_params: nnx.State, source: str, by_layer: ByLayer | None = None
) -> nnx.State:
    """Parameters from `files`, anything with has(name) and read(name, slices) over transformers'
    tensor names and layouts (safetensors here, GGUF in interop/gguf.py); `source` names it in errors.
    by_layer(path, leaf, read_layer) may build a stacked leaf from its layers itself (read_layer(r):
    layer r on the devices, sharded as the leaf along its other axes), or return None."""

    # a multimodal checkpoint keeps its text decoder under model.language_model. (transformers 5's
    # names in memory) or language_model.model. (what transformers 5's save_pretrained writes)
    prefix = next(
        (
            p
            for p in ("model.language_model.", "language_model.model.")
            if files.has(p + "embed_tokens.weight")
        ),
        "model.",
    )

    tower = {}  # the image tower's parameters, read whole (at most a few hundred million)
    if fused := families.named(cfg.family).fused:
        files = _FusedFiles(files, cfg, fused)

    def load_tower_leaf(path: str, leaf: jax.ShapeDtypeStruct):
        if not tower:
            names = vision.of(cfg.vision)
            prefixes = names.tower_prefixes(files.has, source)
            tower.update(names.tower_arrays(cfg.vision, lambda n: files.read(n, [slice(None)]), *prefixes))
        whole = tower[path.removeprefix("vision.")]
        return jax.make_array_from_callback(leaf.shape, leaf.sharding, lambda i: whole[i].astype(leaf.dtype))

    def load(key_path, leaf: jax.ShapeDtypeStruct):
        path = jax.tree_util.keystr(key_path, simple=True, separator=".").removesuffix(".value")
        if path.startswith("vision."):
            return load_tower_leaf(path, leaf)
        spec, layer_of = tensor_names.stack_layers(path, cfg)
        if spec == "score_DO" and not files.has("score.weight"):  # a language model's checkpoint
            if jax.process_index() == 0:
                print(f"model.init_from: {source} has no score.weight; the scalar head starts at zero")
            return jax.jit(lambda: jnp.zeros(leaf.shape, leaf.dtype), out_shardings=leaf.sharding)()
        rows = range(leaf.shape[0]) if layer_of else [None]

        def name(r):
            return tensor_names.hf_name(spec, None if r is None else layer_of(r), cfg, prefix)

        for r in rows:
            if not files.has(name(r)):
                raise ConfigError(f"model.init_from: {source} has no tensor {name(r)}")

        def block(index):
            inner = index[1:] if layer_of else index
            pieces = []
            for r in range(*index[0].indices(leaf.shape[0])) if layer_of else [None]:
                layer = None if r is None else layer_of(r)
                hf_slices, left, read_shape = tensor_names.hf_slices(spec, cfg, layer, inner)
                piece = files.read(name(r), hf_slices).astype(np.float32).reshape(read_shape)[left]
                pieces.append(piece.transpose(tensor_names.SPECS[spec][2]))
            return (np.stack(pieces) if layer_of else pieces[0]).astype(leaf.dtype, copy=False)

        if by_layer is not None and layer_of:

            def read_layer(r):
                return jax.make_array_from_callback(
                    leaf.shape[1:],
                    layer_sharding(leaf.sharding),
                    lambda index: block((slice(r, r + 1), *index))[0],
                )

            built = by_layer(path, leaf, read_layer)
            if built is not None:
                return built
        return jax.make_array_from_callback(leaf.shape, leaf.sharding, block)

    return jax.tree_util.tree_map_with_path(load, abstract_params)


def hf_tensors(
    params: nnx.State, cfg: ModelConfig, split_experts: bool | None = None
) -> dict[str, np.ndarray]:
    """The parameters as transformers names and lays them out, float32, on every process; the experts
    one tensor per expert and projection where the family's checkpoints store them so (or as
    `split_experts` says)."""
    from jax.experimental import multihost_utils

    tensors, tower = {}, {}
    if split_experts is None:
        split_experts = families.named(cfg.family).split_experts
    # with an image tower, the text model is the multimodal checkpoints' language_model
    names = None if cfg.vision is None else vision.of(cfg.vision)
    prefix = "model." if names is None else names.TEXT_PREFIX
    for key_path, array in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = jax.tree_util.keystr(key_path, simple=True, separator=".").removesuffix(".value")
        full = np.asarray(multihost_utils.process_allgather(array, tiled=True), np.float32)
        if path.startswith("vision."):
            tower[path.removeprefix("vision.")] = full
            continue
        spec, layer_of = tensor_names.stack_layers(path, cfg)
        for layer, ours in [(layer_of(r), row) for r, row in enumerate(full)] if layer_of else [(None, full)]:
            name, theirs = (
                tensor_names.hf_name(spec, layer, cfg, prefix),
                tensor_names.to_hf(ours, spec, cfg, layer),
            )
            if names is not None and name == "lm_head.weight":
                name = names.OUTPUT_NAME
            if split_experts and spec in ("layers.moe.gate_up_EDCM", "layers.moe.down_EMD"):
                tensors.update(per_expert_tensors(name, theirs))
            else:
                tensors[name] = np.ascontiguousarray(theirs)
    if tower:
        tensors.update(names.tower_tensors(cfg.vision, tower))
    return fuse(tensors, families.named(cfg.family).fused)


def export(params: nnx.State, cfg: ModelConfig, directory: Path, special_ids: dict | None = None) -> None:
    """Writes config.json and model.safetensors (float32) into `directory` (process 0 writes).
    special_ids (bos_token_id, eos_token_id, pad_token_id: the tokenizer's) fill config.json where
    the family does not fix them (Gemma's are fixed)."""
    from safetensors.numpy import save_file

    config, tensors = hf_config(cfg), hf_tensors(params, cfg)
    for key, value in (special_ids or {}).items():
        config.setdefault(key, value)
    if jax.process_index() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        write_atomically(
            directory / "model.safetensors", lambda p: save_file(tensors, p, metadata={"format": "pt"})
        )
        write_text(directory / "config.json", json.dumps(config, indent=2) + "\n")
