"""Hugging Face interop: safetensors checkpoints of the registered families (Gemma 1 to 4 text
decoders; interop/families.py), both directions.

Import reads transformers' tensor names and layouts straight into the sharded parameters: every
array is built with jax.make_array_from_callback, so each process reads from the safetensors files
only the slices its devices hold. Export writes model.safetensors and config.json that
transformers' *ForCausalLM of the model's family loads. No pickle is involved: safetensors and
JSON only. The tensor names and layouts are one table for every family (a family may rename a
tensor: Family.hf_names); config.json is the family's (families.py).
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

from tunix_train.config import ConfigError, ModelConfig, VisionEncoder
from tunix_train.files import write_atomically, write_text
from tunix_train.interop import families, vision
from tunix_train.interop.config_file import (
    open_safetensors,
    other_towers,
    read_hf_config,
    read_json,
    vision_from_directory,
)
from tunix_train.model.layout import layer_groups, layer_shapes
from tunix_train.model.weights import ByLayer
from tunix_train.sharding import layer_sharding

# Our parameter path -> (transformers name, [per transformers dim: the sizes it splits into], the
# permutation of that split view giving our layout). Names under model.layers.{i}. are per layer.
# Sizes: D embed, N heads, K kv heads, H head dim, F MLP width, V vocab; Gemma 4: L layers, P per-layer
# input width, W per-layer vocab, E experts, M expert width, C the 2 of a fused gate/up, O one.
_SPECS = {
    "embedding_VD": ("model.embed_tokens.weight", ("V", "D"), (0, 1)),
    "output_VD": ("lm_head.weight", ("V", "D"), (0, 1)),  # untied output layers only
    "score_DO": ("score.weight", ("O", "D"), (1, 0)),  # a reward model's head (...ForSequenceClassification)
    "final_norm.scale": ("model.norm.weight", ("D",), (0,)),
    "layers.pre_attn_norm.scale": ("input_layernorm.weight", ("D",), (0,)),
    "layers.attn.q_DNH": ("self_attn.q_proj.weight", ("NH", "D"), (2, 0, 1)),
    "layers.attn.k_DKH": ("self_attn.k_proj.weight", ("KH", "D"), (2, 0, 1)),
    "layers.attn.v_DKH": ("self_attn.v_proj.weight", ("KH", "D"), (2, 0, 1)),
    "layers.attn.o_NHD": ("self_attn.o_proj.weight", ("D", "NH"), (1, 2, 0)),
    "layers.attn.q_bias_NH": ("self_attn.q_proj.bias", ("NH",), (0, 1)),  # Qwen 2
    "layers.attn.k_bias_KH": ("self_attn.k_proj.bias", ("KH",), (0, 1)),
    "layers.attn.v_bias_KH": ("self_attn.v_proj.bias", ("KH",), (0, 1)),
    "layers.attn.q_norm.scale": ("self_attn.q_norm.weight", ("H",), (0,)),
    "layers.attn.k_norm.scale": ("self_attn.k_norm.weight", ("H",), (0,)),
    "layers.post_attn_norm.scale": ("post_attention_layernorm.weight", ("D",), (0,)),
    "layers.pre_ffw_norm.scale": ("pre_feedforward_layernorm.weight", ("D",), (0,)),
    "layers.post_ffw_norm.scale": ("post_feedforward_layernorm.weight", ("D",), (0,)),
    "layers.mlp.gate_DF": ("mlp.gate_proj.weight", ("F", "D"), (1, 0)),
    "layers.mlp.up_DF": ("mlp.up_proj.weight", ("F", "D"), (1, 0)),
    "layers.mlp.down_FD": ("mlp.down_proj.weight", ("D", "F"), (1, 0)),
    # Gemma 4
    "layers.layer_scalar": ("layer_scalar", ("O",), (0,)),
    "layers.per_layer_gate_DP": ("per_layer_input_gate.weight", ("P", "D"), (1, 0)),
    "layers.per_layer_proj_PD": ("per_layer_projection.weight", ("D", "P"), (1, 0)),
    "layers.post_per_layer_norm.scale": ("post_per_layer_input_norm.weight", ("D",), (0,)),
    "layers.post_mlp_norm.scale": ("post_feedforward_layernorm_1.weight", ("D",), (0,)),
    "layers.pre_moe_norm.scale": ("pre_feedforward_layernorm_2.weight", ("D",), (0,)),
    "layers.post_moe_norm.scale": ("post_feedforward_layernorm_2.weight", ("D",), (0,)),
    "layers.moe.router_scale": ("router.scale", ("D",), (0,)),
    "layers.moe.router_DE": ("router.proj.weight", ("E", "D"), (1, 0)),
    "layers.moe.expert_scale": ("router.per_expert_scale", ("E",), (0,)),
    "layers.moe.gate_up_EDCM": ("experts.gate_up_proj", ("E", "CM", "D"), (0, 3, 1, 2)),
    "layers.moe.down_EMD": ("experts.down_proj", ("E", "D", "M"), (0, 2, 1)),
    "per_layer_embedding_VLP": ("model.embed_tokens_per_layer.weight", ("W", "LP"), (0, 1, 2)),
    "per_layer_proj_DLP": ("model.per_layer_model_projection.weight", ("LP", "D"), (2, 0, 1)),
    "per_layer_proj_norm.scale": ("model.per_layer_projection_norm.weight", ("P",), (0,)),
}


def _hf_name(path: str, layer: int | None, cfg: ModelConfig, prefix: str = "model.") -> str:
    name = families.named(cfg.family).hf_names.get(path, _SPECS[path][0])
    if layer is None:
        return prefix + name.removeprefix("model.") if name.startswith("model.") else name
    return f"{prefix}layers.{layer}.{name}"


def _sizes(cfg: ModelConfig, layer: int | None) -> dict[str, int]:
    shape = None if layer is None else layer_shapes(cfg)[layer]
    return {
        "D": cfg.embed_dim,
        "N": cfg.num_heads,
        "V": cfg.vocab_size,
        "L": cfg.num_layers,
        "K": cfg.num_kv_heads if shape is None else shape.num_kv_heads,
        "H": cfg.head_dim if shape is None else shape.head_dim,
        "F": cfg.hidden_dim if shape is None else shape.mlp_dim,
        "P": cfg.per_layer_input_dim,
        "W": cfg.per_layer_input_vocab_size or cfg.vocab_size,
        "E": cfg.num_experts,
        "M": cfg.moe_hidden_dim,
        "C": 2,
        "O": 1,
    }


def _split_view(
    spec: str, cfg: ModelConfig, layer: int | None
) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """Per transformers dimension the sizes it splits into (q_proj's rows are N x H), and the perm."""
    sizes = _sizes(cfg, layer)
    _, dims, perm = _SPECS[spec]
    return [tuple(sizes[letter] for letter in dim) for dim in dims], perm


def _to_hf(ours: np.ndarray, spec: str, cfg: ModelConfig, layer: int | None) -> np.ndarray:
    split, perm = _split_view(spec, cfg, layer)
    return ours.transpose(np.argsort(perm)).reshape([math.prod(group) for group in split])


def _hf_slices(spec: str, cfg: ModelConfig, layer: int | None, ours_index: tuple[slice, ...]):
    """The transformers-tensor slice holding our block `ours_index`, the slice of the view (the
    split dimensions) that is left to cut after reading it, and the view's shape as read. A
    dimension split inside (an expert's fused gate/up split over tp) is read whole, then cut."""
    split, perm = _split_view(spec, cfg, layer)
    view_shape = [s for group in split for s in group]
    view = [slice(None)] * len(view_shape)
    for our_dim, sl in enumerate(ours_index):
        view[perm[our_dim]] = sl
    view = [slice(*sl.indices(size)[:2]) for sl, size in zip(view, view_shape)]
    hf, read_shape, left, position = [], [], [], 0
    for group in split:
        parts = view[position : position + len(group)]
        inner = math.prod(group[1:])
        if all((p.start, p.stop) == (0, size) for p, size in zip(parts[1:], group[1:])):
            hf.append(slice(parts[0].start * inner, parts[0].stop * inner))
            read_shape += [parts[0].stop - parts[0].start, *group[1:]]
            left += [slice(None)] * len(group)
        else:
            hf.append(slice(None))
            read_shape += list(group)
            left += parts
        position += len(group)
    return hf, tuple(left), read_shape


def stack_layers(path: str, cfg: ModelConfig):
    """(the _SPECS key, layer index of a stack's row -> layer) of a parameter path: `layers.X` (one
    stack: row r is layer r), `groups.g.j.X` (row r is layer_groups[g].layers(j)[r]), or global."""
    parts = path.split(".")
    if parts[0] == "layers":
        return path, lambda r: r
    if parts[0] == "groups":
        group, position = layer_groups(cfg)[int(parts[1])], int(parts[2])
        return "layers." + ".".join(parts[3:]), lambda r: int(group.layers(position)[r])
    return path, None


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
            if key == "trainable" or (key == "tokens_per_image" and theirs.encoder is VisionEncoder.gemma4):
                continue
            if getattr(cfg.vision, key) != value:
                raise ConfigError(
                    f"model.init_from: {directory} has vision {key}={value!r} but "
                    f"model.vision.{key}={getattr(cfg.vision, key)!r}; set model.vision.{key}={value!r}"
                )
    for key, value in model_fields_from_hf(read_hf_config(directory)).items():
        ours = getattr(cfg, key)
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
    if cfg.num_experts:
        files = _PerExpertFiles(files, cfg.num_experts)
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
        spec, layer_of = stack_layers(path, cfg)
        if spec == "score_DO" and not files.has("score.weight"):  # a language model's checkpoint
            if jax.process_index() == 0:
                print(f"model.init_from: {source} has no score.weight; the scalar head starts at zero")
            return jax.jit(lambda: jnp.zeros(leaf.shape, leaf.dtype), out_shardings=leaf.sharding)()
        rows = range(leaf.shape[0]) if layer_of else [None]

        def name(r):
            return _hf_name(spec, None if r is None else layer_of(r), cfg, prefix)

        for r in rows:
            if not files.has(name(r)):
                raise ConfigError(f"model.init_from: {source} has no tensor {name(r)}")

        def block(index):
            inner = index[1:] if layer_of else index
            pieces = []
            for r in range(*index[0].indices(leaf.shape[0])) if layer_of else [None]:
                layer = None if r is None else layer_of(r)
                hf_slices, left, read_shape = _hf_slices(spec, cfg, layer, inner)
                piece = files.read(name(r), hf_slices).astype(np.float32).reshape(read_shape)[left]
                pieces.append(piece.transpose(_SPECS[spec][2]))
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
        spec, layer_of = stack_layers(path, cfg)
        for layer, ours in [(layer_of(r), row) for r, row in enumerate(full)] if layer_of else [(None, full)]:
            name, theirs = _hf_name(spec, layer, cfg, prefix), _to_hf(ours, spec, cfg, layer)
            if names is not None and name == "lm_head.weight":
                name = names.OUTPUT_NAME
            if split_experts and spec in ("layers.moe.gate_up_EDCM", "layers.moe.down_EMD"):
                tensors.update(per_expert_tensors(name, theirs))
            else:
                tensors[name] = np.ascontiguousarray(theirs)
    if tower:
        tensors.update(names.tower_tensors(cfg.vision, tower))
    return tensors


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
