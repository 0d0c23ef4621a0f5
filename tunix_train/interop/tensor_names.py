"""Tensor names and layouts both ways: our parameter paths, transformers' tensor names (a family may
rename one: Family.hf_names) and the split view and permutation between their layouts. The Hugging
Face reader and writer (hf.py), PEFT (peft.py) and the GGUF code (gguf.py, whose names derive from
transformers') all read this one table."""

from __future__ import annotations

import math

import numpy as np

from tunix_train.config import ModelConfig
from tunix_train.interop import families
from tunix_train.model.layout import layer_groups, layer_shapes

# Our parameter path -> (transformers name, [per transformers dim: the sizes it splits into], the
# permutation of that split view giving our layout). Names under model.layers.{i}. are per layer.
# Sizes: D embed, N heads, K kv heads, H head dim, F MLP width, V vocab; Gemma 4: L layers, P per-layer
# input width, W per-layer vocab, E experts, M expert width, C the 2 of a fused gate/up, O one.
SPECS = {
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


def hf_name(path: str, layer: int | None, cfg: ModelConfig, prefix: str = "model.") -> str:
    name = families.named(cfg.family).hf_names.get(path, SPECS[path][0])
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
        "P": cfg.gemma4.per_layer_input_dim,
        "W": cfg.gemma4.per_layer_input_vocab_size or cfg.vocab_size,
        "E": cfg.moe.experts,
        "M": cfg.moe.hidden_dim,
        "C": 2,
        "O": 1,
    }


def split_view(
    spec: str, cfg: ModelConfig, layer: int | None
) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """Per transformers dimension the sizes it splits into (q_proj's rows are N x H), and the perm."""
    sizes = _sizes(cfg, layer)
    _, dims, perm = SPECS[spec]
    return [tuple(sizes[letter] for letter in dim) for dim in dims], perm


def to_hf(ours: np.ndarray, spec: str, cfg: ModelConfig, layer: int | None) -> np.ndarray:
    split, perm = split_view(spec, cfg, layer)
    return ours.transpose(np.argsort(perm)).reshape([math.prod(group) for group in split])


def hf_slices(spec: str, cfg: ModelConfig, layer: int | None, ours_index: tuple[slice, ...]):
    """The transformers-tensor slice holding our block `ours_index`, the slice of the view (the
    split dimensions) that is left to cut after reading it, and the view's shape as read. A
    dimension split inside (an expert's fused gate/up split over tp) is read whole, then cut."""
    split, perm = split_view(spec, cfg, layer)
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
    """(the SPECS key, layer index of a stack's row -> layer) of a parameter path: `layers.X` (one
    stack: row r is layer r), `groups.g.j.X` (row r is layer_groups[g].layers(j)[r]), or global."""
    parts = path.split(".")
    if parts[0] == "layers":
        return path, lambda r: r
    if parts[0] == "groups":
        group, position = layer_groups(cfg)[int(parts[1])], int(parts[2])
        return "layers." + ".".join(parts[3:]), lambda r: int(group.layers(position)[r])
    return path, None
