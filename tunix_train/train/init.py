"""The train state, initialized straight into its shardings."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from tunix_train.config import MixedPrecision, ModelConfig, ShardingStrategy, TrainingConfig
from tunix_train.model import quant
from tunix_train.model.lora import Adapter
from tunix_train.model.params import abstract_of, model_params
from tunix_train.model.weights import FULL_FINE_TUNING, Weights
from tunix_train.sharding import LOGICAL_RULES, Rules, state_shardings
from tunix_train.state import TrainState

COMPUTE_DTYPES = {MixedPrecision.fp32: jnp.float32, MixedPrecision.bf16: jnp.bfloat16}


def _fresh_state(
    model_params: nnx.State, optimizer: optax.GradientTransformation, weights: Weights
) -> TrainState:
    """Step 0 and a new optimizer state around the trainable part of `model_params`."""
    zero = jnp.zeros((), jnp.int32)
    params, frozen = weights.split(model_params)
    return TrainState(
        step=zero, params=params, opt_state=optimizer.init(params), nonfinite_steps=zero, frozen=frozen
    )


def train_state_initializer(
    model_cfg: ModelConfig, optimizer: optax.GradientTransformation, weights: Weights = FULL_FINE_TUNING
):
    """key -> a fresh TrainState; for jax.eval_shape (shapes only) or a sharded jit."""
    return lambda key: _fresh_state(model_params(model_cfg, key, weights), optimizer, weights)


def _state_around_base(
    base: nnx.State,
    key: jax.Array,
    model_cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    weights: Weights,
) -> TrainState:
    """A fresh state whose base weights are `base` (adapters, if any, new from `key`; the compiler
    drops the unused fresh base)."""
    adapters = nnx.split_state(model_params(model_cfg, key, weights), Adapter, ...)[0]
    return _fresh_state(nnx.merge_state(base, adapters), optimizer, weights)


@dataclasses.dataclass
class StatePlan:
    """A train state's shardings and shapes, before (or instead of) allocating it."""

    mesh: Mesh
    shardings: Any
    grad_shardings: Any  # of the gradient accumulator, like the parameters
    abstract: TrainState  # ShapeDtypeStructs carrying the shardings: what a checkpoint restores into
    rules: Rules  # the logical-axis rules the shardings came from; the model's constraints use them too
    # The same shardings with everything in device memory: where the steps compute. It differs from
    # `shardings` where a part of the state is offloaded (kept in pinned host memory between steps).
    on_device: Any
    base: Any  # the abstract base model's parameters (no adapters): what model.init_from loads into
    _init: Any
    _key: jax.Array
    _from_params: Any

    def create(self) -> TrainState:
        """The initial state, each device computing only its own shards."""
        return self._init(self._key)

    def from_params(self, params: nnx.State) -> TrainState:
        """A fresh state (step 0, new optimizer state) around given, already sharded base parameters."""
        return self._from_params(params, self._key)


def plan_train_state(
    model_cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    seed: int,
    strategy: ShardingStrategy = ShardingStrategy.full_shard,
    rules: Rules = LOGICAL_RULES,
    offload: frozenset[str] = frozenset(),
    weights: Weights = FULL_FINE_TUNING,
) -> StatePlan:
    """Shapes from jax.eval_shape, shardings from the parameters' logical axes and the sharding
    strategy, and an init jitted with those out_shardings, so the whole model never sits on one
    device. The state's parts named in `offload` ("opt_state", "params": the float32 master copy)
    are sharded alike, in pinned host memory (offloaded_parts). Frozen weights are sharded like the
    parameters they stand for."""
    init = train_state_initializer(model_cfg, optimizer, weights)
    key = jax.random.key(seed)
    shapes = jax.eval_shape(init, key)
    sharded = state_shardings(shapes, mesh, rules=rules)
    replicated = state_shardings(shapes, mesh, replicated_over=("fsdp",), rules=rules)
    full = strategy is ShardingStrategy.full_shard
    no_shard = strategy is ShardingStrategy.no_shard
    shardings = sharded.replace(
        params=sharded.params if full else replicated.params,
        opt_state=replicated.opt_state if no_shard else sharded.opt_state,
        frozen=sharded.frozen if full else replicated.frozen,
    )
    grad_shardings = replicated.params if no_shard else sharded.params
    on_device = shardings

    def on_host(tree):
        return jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), tree)

    if "opt_state" in offload:
        shardings = shardings.replace(opt_state=on_host(shardings.opt_state))
    if "params" in offload:
        shardings = shardings.replace(params=on_host(shardings.params))
    abstract = abstract_of(shapes, shardings)
    from_params = functools.partial(
        _state_around_base, model_cfg=model_cfg, optimizer=optimizer, weights=weights
    )
    base_shapes = jax.eval_shape(
        lambda k: weights.as_loaded(nnx.split_state(model_params(model_cfg, k, weights), Adapter, ...)[1]),
        key,
    )
    base_shardings = state_shardings(base_shapes, mesh, () if full else ("fsdp",), rules)
    # a GGUF base loads as the run holds it, its blocks quantized
    base = abstract.frozen if weights.loads_quantized else abstract_of(base_shapes, base_shardings)
    return StatePlan(
        mesh,
        shardings,
        grad_shardings,
        abstract,
        rules,
        on_device,
        base,
        jax.jit(init, out_shardings=shardings),
        key,
        jax.jit(from_params, out_shardings=shardings),
    )


def offloaded_parts(training: TrainingConfig) -> frozenset[str]:
    """The parts of the train state kept in pinned host memory between steps."""
    return frozenset(
        part
        for part, offloaded in (
            ("opt_state", training.offload_optimizer_state),
            ("params", training.offload_master_weights),
        )
        if offloaded
    )


@dataclasses.dataclass
class FrozenModels:
    """An objective's extra models (Objective.extra_models) on the run's mesh: each one's graphdef,
    its parameters' abstract shapes with shardings, and the parameters, loaded when first asked."""

    specs: dict
    graphdefs: dict
    # in each model's compute dtype (loaded once in it, never cast in the step) and in the memory it
    # lives in between steps: pinned host memory for an offloaded one (ExtraModel.offload)
    abstract: dict
    _params: dict | None = None

    @property
    def shardings(self) -> dict:
        return jax.tree.map(lambda x: x.sharding, self.abstract)

    @property
    def device_shardings(self) -> dict:
        """Where a step computes with them: the same shardings in device memory (step.moved copies an
        offloaded model there for the step, and the copy lives only as long as the step needs it)."""
        return jax.tree.map(lambda s: s.with_memory_kind("device"), self.shardings)

    def params(self) -> dict:
        if self._params is None:  # loaded on the devices, then put where they live (offloaded: the host)
            device = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                self.abstract,
                self.device_shardings,
            )
            self._params = jax.device_put(
                {name: _load_frozen(spec, device[name]) for name, spec in self.specs.items()}, self.shardings
            )
        return self._params


def plan_frozen_models(specs: dict, mesh: Mesh, rules: Rules, graphdef_of) -> FrozenModels | None:
    """FrozenModels of `specs` (None when there are none); graphdef_of(model config) -> graphdef."""
    if not specs:
        return None
    abstract = {}
    for name, spec in specs.items():
        shapes = jax.eval_shape(
            lambda k, cfg=spec.model: model_params(cfg, k, FULL_FINE_TUNING), jax.random.key(0)
        )
        dtype, memory = COMPUTE_DTYPES[spec.precision], "pinned_host" if spec.offload else "device"
        abstract[name] = jax.tree.map(
            lambda x, dtype=dtype, memory=memory: jax.ShapeDtypeStruct(
                x.shape, dtype, sharding=x.sharding.with_memory_kind(memory)
            ),
            abstract_of(shapes, state_shardings(shapes, mesh, rules=rules)),
        )
    return FrozenModels(specs, {name: graphdef_of(spec.model) for name, spec in specs.items()}, abstract)


def _load_frozen(spec, abstract) -> nnx.State:
    """An extra model's parameters: its checkpoint's, any format (the one loader), else fresh."""
    dtype, shardings = COMPUTE_DTYPES[spec.precision], jax.tree.map(lambda x: x.sharding, abstract)
    if spec.source is not None:
        from tunix_train.interop import loader  # (it imports this module's neighbours)

        return loader.load_like(spec.source, spec.model, abstract, dtype)
    return jax.jit(
        lambda k: quant.cast(model_params(spec.model, k, FULL_FINE_TUNING), dtype), out_shardings=shardings
    )(jax.random.key(spec.seed))


def create_train_state(
    model_cfg: ModelConfig, optimizer: optax.GradientTransformation, mesh: Mesh, seed: int
) -> tuple[TrainState, Any]:
    """The initialized state and its shardings."""
    plan = plan_train_state(model_cfg, optimizer, mesh, seed)
    return plan.create(), plan.shardings


def count_params(params: nnx.State) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(params, is_leaf=quant.is_quantized))
