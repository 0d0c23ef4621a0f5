"""A model's parameters on a mesh, planned before anything is allocated: their shapes (from
jax.eval_shape of the model the factory builds), their shardings (from their logical axes), and
which part is trainable under the run's Weights (model/weights.py). What loading a model for
inference needs (ParamsPlan); training's whole state plan builds on it (train/init.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from tunix_train.config import ModelConfig
from tunix_train.model.factory import build_model
from tunix_train.model.lora import Adapter
from tunix_train.model.weights import FULL_FINE_TUNING, Weights
from tunix_train.sharding import LOGICAL_RULES, Rules, state_shardings


def model_params(model_cfg: ModelConfig, key: jax.Array, weights: Weights = FULL_FINE_TUNING) -> nnx.State:
    """Fresh parameters of the model (with LoRA's adapters under `weights`), from `key`."""
    return nnx.state(build_model(model_cfg, nnx.Rngs(key), lora=weights.lora), nnx.Param)


@dataclasses.dataclass
class ParamsPlan:
    """A model's parameters alone, sharded over a mesh: what loading a model for inference needs
    (no optimizer state, no training plan)."""

    abstract: Any  # every parameter, adapters included: ShapeDtypeStructs carrying their shardings
    trainable: Any  # the part a checkpoint's `params` holds: all of `abstract`, or LoRA's adapters
    base: Any  # the base alone (no adapters): what a Hugging Face or GGUF checkpoint loads into
    _fresh_frozen: Any
    _key: jax.Array

    def fresh_frozen(self) -> nnx.State:
        """LoRA's frozen base as a run without model.init_from starts it (from training.seed)."""
        return self._fresh_frozen(self._key)


def plan_params(
    model_cfg: ModelConfig,
    mesh: Mesh,
    seed: int,
    weights: Weights = FULL_FINE_TUNING,
    rules: Rules = LOGICAL_RULES,
) -> ParamsPlan:
    """Shapes from jax.eval_shape and shardings from the parameters' logical axes (fsdp-sharded),
    nothing allocated."""
    key = jax.random.key(seed)

    def with_shardings(shapes):
        return abstract_of(shapes, state_shardings(shapes, mesh, rules=rules))

    def model(k):
        return model_params(model_cfg, k, weights)

    shapes = jax.eval_shape(model, key)  # traced once; its parts split from it
    abstract = with_shardings(shapes)
    adapters, base = (with_shardings(part) for part in nnx.split_state(shapes, Adapter, ...))
    trainable = abstract if weights.lora is None else adapters

    def frozen(k):
        return weights.split(model(k))[1]

    frozen_shapes = jax.eval_shape(frozen, key)
    frozen_shardings = state_shardings(frozen_shapes, mesh, rules=rules)
    if weights.loads_quantized:  # a GGUF base loads as the run holds it, its blocks quantized
        base = abstract_of(frozen_shapes, frozen_shardings)
    return ParamsPlan(abstract, trainable, base, jax.jit(frozen, out_shardings=frozen_shardings), key)


def abstract_of(shapes, shardings):
    """ShapeDtypeStructs of `shapes` carrying `shardings` (a prefix tree of them)."""
    return jax.tree.map(
        lambda sharding, subtree: jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), subtree
        ),
        shardings,
        shapes,
    )
