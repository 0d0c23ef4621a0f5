"""The model's structure, apart from its math: each layer's shapes and window, and how layers of
equal shapes group into stacks that one scan runs (docs/models.md). Everything that needs the
structure (the engine and its cache, the importers, MFU, the parallel schedules) reads it here.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tunix_train.config import (
    LAYER_TYPES,
    ConfigError,
    ImageAttention,
    ModelConfig,
    RopeScaling,
    RopeScalingType,
    VisionEncoder,
)
from tunix_train.config.fields import require_positive

GLOBAL_WINDOW = np.iinfo(np.int32).max  # a global layer's "window" covers every position


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """What decides a layer's parameter shapes and code: layers alike stack into one scan."""

    head_dim: int
    num_kv_heads: int
    k_eq_v: bool  # keys (before their norm) serve as values: no value weights
    shares_kv: bool  # reuses an earlier layer's keys and values: no key/value weights
    mlp_dim: int
    # static type ("sliding_attention"/"full_attention") where the code depends on it; None: the
    # layer's window, an input of the scan, picks its RoPE and mask
    layer_type: str | None = None


def layer_shapes(cfg: ModelConfig) -> list[LayerShape]:
    types = layer_types(cfg)
    first_shared = cfg.num_layers - cfg.gemma4.num_kv_shared_layers
    global_head_dim = cfg.gemma4.global_head_dim or cfg.head_dim
    global_kv_heads = cfg.gemma4.num_global_kv_heads or cfg.num_kv_heads
    static_type = (
        cfg.gemma4.num_kv_shared_layers > 0
        or cfg.gemma4.attention_k_eq_v
        or ((global_head_dim, global_kv_heads) != (cfg.head_dim, cfg.num_kv_heads))
    )
    shapes = []
    for i, kind in enumerate(types):
        is_global, shares = kind == "full_attention", i >= first_shared
        shapes.append(
            LayerShape(
                head_dim=global_head_dim if is_global else cfg.head_dim,
                num_kv_heads=global_kv_heads if is_global else cfg.num_kv_heads,
                k_eq_v=cfg.gemma4.attention_k_eq_v and is_global,
                shares_kv=shares,
                # 0: no dense MLP, the experts in its place
                mlp_dim=0
                if cfg.moe.experts and not cfg.moe.dense_mlp
                else cfg.hidden_dim * (2 if cfg.gemma4.double_wide_mlp and shares else 1),
                layer_type=kind if static_type else None,
            )
        )
    return shapes


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """Layers first .. first + repeats * len(period) - 1: `period` (one shape per position) repeated."""

    first: int
    period: tuple[LayerShape, ...]
    repeats: int

    def layers(self, position: int) -> np.ndarray:
        """The indices of the layers at `position` of the period, one per repeat."""
        return self.first + position + len(self.period) * np.arange(self.repeats)


def one_stack(cfg: ModelConfig) -> bool:
    """Whether every layer has one shape (Gemma 1-3): the parameters are one stack, `layers`."""
    return [len(group.period) for group in layer_groups(cfg)] == [1]


def layer_groups(cfg: ModelConfig) -> tuple[LayerGroup, ...]:
    """The layers cut into periods of p shapes, consecutive equal periods forming a group, with the
    p whose groups compile the fewest layer bodies (the sum of their periods); Gemma 1-3: one group
    of one shape, Gemma 4 E2B: (4 local, 1 global) x 3 then the KV-sharing ones x 4."""
    shapes = layer_shapes(cfg)
    best = None
    for p in range(1, len(shapes) + 1):
        groups: list[LayerGroup] = []
        for first in range(0, len(shapes), p):
            period = tuple(shapes[first : first + p])
            if groups and groups[-1].period == period:
                groups[-1] = dataclasses.replace(groups[-1], repeats=groups[-1].repeats + 1)
            else:
                groups.append(LayerGroup(first, period, 1))
        cost = sum(len(g.period) for g in groups)
        if best is None or cost < best[0]:
            best = (cost, tuple(groups))
    return best[1]


def layer_windows(cfg: ModelConfig) -> np.ndarray:
    """Attention window of each layer: sliding_window for a sliding_attention layer, all else."""
    is_global = np.array([kind == "full_attention" for kind in layer_types(cfg)])
    return np.where(is_global, GLOBAL_WINDOW, cfg.sliding_window or GLOBAL_WINDOW).astype(np.int32)


def kv_sources(cfg: ModelConfig) -> list[int]:
    """The layer whose keys and values each layer reads: its own, or for a KV-sharing layer the last
    earlier one of its type that has keys and values."""
    shapes = layer_shapes(cfg)
    return [
        i
        if not shape.shares_kv
        else max(j for j in range(i) if not shapes[j].shares_kv and shapes[j].layer_type == shape.layer_type)
        for i, shape in enumerate(shapes)
    ]


def layer_types(m: ModelConfig) -> list[str]:
    """Each layer's type: model.layer_types, or local_layers_per_global local layers then a global one."""
    if m.layer_types is not None:
        return list(m.layer_types)
    period = m.local_layers_per_global + 1
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(m.num_layers)]


def validate_model(m: ModelConfig) -> None:
    """The model keys' checks that need no devices (compose.validate asks for them)."""
    keys = ("num_layers", "embed_dim", "hidden_dim", "num_heads", "num_kv_heads", "head_dim", "vocab_size")
    require_positive({f"model.{key}": getattr(m, key) for key in keys})
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"model.num_heads={m.num_heads} must be a multiple of model.num_kv_heads={m.num_kv_heads}"
        )
    if m.local_layers_per_global < 0:
        raise ConfigError(f"model.local_layers_per_global={m.local_layers_per_global} must be >= 0")
    if m.local_layers_per_global and not (m.sliding_window and m.sliding_window > 0):
        raise ConfigError("model.sliding_window must be positive when model.local_layers_per_global > 0")
    _validate_gemma4(m)
    _validate_moe(m)
    validate_rope_scaling(m.rope_scaling, m.gemma4.global_head_dim or m.head_dim)
    if m.vision is not None:
        validate_vision(m)


def validate_vision(m: ModelConfig) -> None:
    """model.vision's sizes: whole patches, a token grid that pools whole blocks of them."""
    v = m.vision
    for key in (
        "image_size",
        "patch_size",
        "num_channels",
        "embed_dim",
        "hidden_dim",
        "num_layers",
        "num_heads",
    ):
        if getattr(v, key) <= 0:
            raise ConfigError(f"model.vision.{key}={getattr(v, key)} must be positive")
    _VALIDATE_ENCODER[v.encoder](m)
    if v.embed_dim % v.num_heads:
        raise ConfigError(
            f"model.vision.embed_dim={v.embed_dim} must be a multiple of model.vision.num_heads={v.num_heads}"
        )
    if not 0 <= v.image_token_id < m.vocab_size:
        raise ConfigError(
            f"model.vision.image_token_id={v.image_token_id} must be a token of the vocabulary "
            f"(model.vocab_size={m.vocab_size})"
        )
    if v.image_attention is ImageAttention.sliding_layers and "sliding_attention" not in layer_types(m):
        raise ConfigError(
            "model.vision.image_attention=sliding_layers needs sliding layers (model.layer_types or "
            "model.local_layers_per_global)"
        )


def _validate_siglip(m: ModelConfig) -> None:
    v = m.vision
    side, tokens = v.patches_per_side, round(v.tokens_per_image**0.5)
    if v.image_size % v.patch_size:
        raise ConfigError(
            f"model.vision.image_size={v.image_size} must be a multiple of patch_size={v.patch_size}"
        )
    if v.tokens_per_image <= 0 or tokens * tokens != v.tokens_per_image or side % tokens:
        raise ConfigError(
            f"model.vision.tokens_per_image={v.tokens_per_image} must be a square whose side divides "
            f"the {side} patches a side"
        )


def _validate_gemma4_vision(m: ModelConfig) -> None:
    v = m.vision
    if v.tokens_per_image <= 0 or v.pooling_kernel <= 0 or v.position_table_size <= 0:
        raise ConfigError(
            "model.vision.tokens_per_image, pooling_kernel and position_table_size must be positive"
        )
    if (v.embed_dim // v.num_heads) % 4:
        raise ConfigError(
            f"model.vision: the head width embed_dim / num_heads = {v.embed_dim // v.num_heads} must be a "
            f"multiple of 4 (gemma4's 2-D RoPE rotates pairs in each half)"
        )


def _validate_gemma4(m: ModelConfig) -> None:
    """Layer types, and model.gemma4: global layers, KV sharing, per-layer inputs."""
    types = layer_types(m)
    if m.layer_types is not None:
        unknown = [x for x in m.layer_types if x not in LAYER_TYPES]
        if unknown:
            raise ConfigError(
                f"model.layer_types: unknown layer type {unknown[0]!r}; choose from {', '.join(LAYER_TYPES)}"
            )
        if len(m.layer_types) != m.num_layers:
            raise ConfigError(
                f"model.layer_types has {len(m.layer_types)} entries for model.num_layers={m.num_layers}"
            )
        if m.local_layers_per_global:
            raise ConfigError(
                "model.layer_types and model.local_layers_per_global both set the layer pattern: "
                "set model.local_layers_per_global=0"
            )
        if "sliding_attention" in types and not (m.sliding_window and m.sliding_window > 0):
            raise ConfigError(
                "model.sliding_window must be positive when model.layer_types has sliding_attention"
            )
    for key in ("global_head_dim", "num_global_kv_heads"):
        if getattr(m.gemma4, key) is not None and getattr(m.gemma4, key) <= 0:
            raise ConfigError(f"model.gemma4.{key}={getattr(m.gemma4, key)} must be positive (or null)")
    if m.gemma4.num_global_kv_heads and m.num_heads % m.gemma4.num_global_kv_heads:
        raise ConfigError(
            f"model.num_heads={m.num_heads} must be a multiple of "
            f"model.gemma4.num_global_kv_heads={m.gemma4.num_global_kv_heads}"
        )
    if not 0.0 <= m.gemma4.rope_partial_factor_global <= 1.0:
        raise ConfigError(
            f"model.gemma4.rope_partial_factor_global={m.gemma4.rope_partial_factor_global} must be in [0, 1]"
        )
    shared = m.gemma4.num_kv_shared_layers
    if not 0 <= shared < m.num_layers:
        raise ConfigError(
            f"model.gemma4.num_kv_shared_layers={shared} must be in [0, model.num_layers={m.num_layers})"
        )
    first_shared = m.num_layers - shared
    for i in range(first_shared, m.num_layers):
        if types[i] not in types[:first_shared]:
            raise ConfigError(
                f"model.gemma4.num_kv_shared_layers={shared}: layer {i} ({types[i]}) would reuse the keys "
                f"and values of an earlier {types[i]} layer, and there is none; lower it"
            )
    if m.gemma4.double_wide_mlp and not shared:
        raise ConfigError(
            "model.gemma4.double_wide_mlp widens the KV-sharing layers' MLP: set "
            "model.gemma4.num_kv_shared_layers"
        )
    if m.gemma4.per_layer_input_dim < 0 or (m.gemma4.per_layer_input_vocab_size or 1) <= 0:
        raise ConfigError(
            "model.gemma4.per_layer_input_dim must be >= 0 and model.gemma4.per_layer_input_vocab_size "
            "positive"
        )


def _validate_moe(m: ModelConfig) -> None:
    """model.moe's checks."""
    if not m.moe.dense_mlp and not m.moe.experts:
        raise ConfigError(
            "model.moe.dense_mlp=false leaves the layers no MLP: it needs model.moe.experts > 0"
        )
    if m.moe.experts:
        E, k = m.moe.experts, m.moe.experts_per_token
        if E < 0 or m.moe.hidden_dim <= 0:
            raise ConfigError(
                f"model.moe.experts={E} and model.moe.hidden_dim={m.moe.hidden_dim} must be positive"
            )
        if not 1 <= k <= E:
            raise ConfigError(f"model.moe.experts_per_token={k} must be between 1 and model.moe.experts={E}")
        if m.moe.capacity_factor <= 0:
            raise ConfigError(f"model.moe.capacity_factor={m.moe.capacity_factor} must be positive")


def validate_rope_scaling(scaling: RopeScaling, rotary_dim: int) -> None:
    """model.rope_scaling's checks."""
    if scaling.type is RopeScalingType.none:
        return
    name = f"model.rope_scaling (type {scaling.type.value})"
    if scaling.original_context <= 0:
        raise ConfigError(
            f"{name}: set original_context, the context the model was pre-trained on "
            f"(config.json's original_max_position_embeddings)"
        )
    if scaling.factor < 1:
        raise ConfigError(f"{name}: factor={scaling.factor} must be >= 1")
    if scaling.type is RopeScalingType.llama3 and not 0 < scaling.low_freq_factor < scaling.high_freq_factor:
        raise ConfigError(
            f"{name}: needs 0 < low_freq_factor ({scaling.low_freq_factor}) < high_freq_factor "
            f"({scaling.high_freq_factor})"
        )
    if scaling.type is RopeScalingType.yarn and not scaling.beta_fast > scaling.beta_slow > 0:
        raise ConfigError(
            f"{name}: needs beta_fast ({scaling.beta_fast}) > beta_slow ({scaling.beta_slow}) > 0"
        )
    pairs = rotary_dim // 2
    factors = (scaling.short_factor, scaling.long_factor)
    if scaling.type is RopeScalingType.longrope and not all(
        len(f) == pairs and all(x > 0 for x in f) for f in factors
    ):
        raise ConfigError(
            f"{name}: short_factor and long_factor need {pairs} positive factors each, one per rotary "
            f"pair (they have {len(scaling.short_factor)} and {len(scaling.long_factor)})"
        )
    if scaling.type is not RopeScalingType.longrope and any(factors):
        raise ConfigError(f"{name}: short_factor and long_factor are longrope's; leave them empty")


# each image tower's own checks of model.vision
_VALIDATE_ENCODER = {VisionEncoder.siglip: _validate_siglip, VisionEncoder.gemma4: _validate_gemma4_vision}
