"""The model's structure, apart from its math: each layer's shapes and window, and how layers of
equal shapes group into stacks that one scan runs (docs/models.md). Everything that needs the
structure (the sampler and its cache, the importers, MFU, the parallel schedules) reads it here.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tunix_train.config import ModelConfig, layer_types

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
    first_shared = cfg.num_layers - cfg.num_kv_shared_layers
    global_head_dim = cfg.global_head_dim or cfg.head_dim
    global_kv_heads = cfg.num_global_kv_heads or cfg.num_kv_heads
    static_type = cfg.num_kv_shared_layers > 0 or cfg.attention_k_eq_v or (
        (global_head_dim, global_kv_heads) != (cfg.head_dim, cfg.num_kv_heads))
    shapes = []
    for i, kind in enumerate(types):
        is_global, shares = kind == "full_attention", i >= first_shared
        shapes.append(LayerShape(
            head_dim=global_head_dim if is_global else cfg.head_dim,
            num_kv_heads=global_kv_heads if is_global else cfg.num_kv_heads,
            k_eq_v=cfg.attention_k_eq_v and is_global, shares_kv=shares,
            mlp_dim=cfg.hidden_dim * (2 if cfg.double_wide_mlp and shares else 1),
            layer_type=kind if static_type else None))
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
            period = tuple(shapes[first:first + p])
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
    return [i if not shape.shares_kv else max(j for j in range(i) if not shapes[j].shares_kv
                                              and shapes[j].layer_type == shape.layer_type)
            for i, shape in enumerate(shapes)]
