"""What a run's steps are traced with: one value, a `Program`, built once by the run's set-up
(`program_for`). The train step (step.py), the evaluation and the scoring pass (scoring.py) each
take it whole and read what they need; nothing else is passed to them but arrays."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import optax
from flax import nnx

from tunix_train.config import ModelConfig, TrainingConfig
from tunix_train.model.weights import FULL_FINE_TUNING, Weights
from tunix_train.parallel import Parallelism, model_graphdef
from tunix_train.sharding import data_parallel_size, per_shard_rules
from tunix_train.train.init import COMPUTE_DTYPES, FrozenModels, StatePlan
from tunix_train.train.objectives.lm import LanguageModeling


@dataclasses.dataclass(frozen=True)
class Program:
    """The model, the objective and the layout every step traces, and the train step's update."""

    graphdef: nnx.GraphDef  # the model as passes without gradient trace it (remat, attention, adapters)
    compute_dtype: Any = jnp.float32
    chunk: int = 0  # logits this many positions at a time (training.loss_chunk_size); 0: all at once
    objective: Any = dataclasses.field(default_factory=lambda: LanguageModeling(None))
    weights: Weights = FULL_FINE_TUNING  # which parameters train and what is frozen
    parallel: Parallelism | None = None  # the layer stack's pp/cp layout, which may reorder a batch
    plan: StatePlan | None = None  # the state's shardings; None: a pass over unsharded parameters
    extras: FrozenModels | None = None  # the objective's extra models (a teacher, ...)
    # The train step's (None for a program that only evaluates and scores):
    optimizer: optax.GradientTransformation | None = None
    schedule: optax.Schedule | None = None
    train_graphdef: nnx.GraphDef | None = None  # per-shard constraints under delayed syncs; None: graphdef
    sync_every: int = 1  # micro-batches between gradient reductions across data shards
    reduce_gradients_in_compute_dtype: bool = True
    moe_aux_loss_coef: float = 0.0  # the weight of the experts' load-balancing loss in the train step

    @property
    def seq_shards(self) -> int:
        return self.parallel.seq_shards if self.parallel else 1

    @property
    def param_shardings(self) -> Any:
        """Where the steps compute with the parameters (device memory); None without a plan."""
        return None if self.plan is None else self.plan.on_device.params

    @property
    def frozen_shardings(self) -> Any:
        return None if self.plan is None else self.plan.on_device.frozen


def program_for(
    plan: StatePlan,
    model_cfg: ModelConfig,
    training: TrainingConfig,
    optimizer: tuple[optax.GradientTransformation, optax.Schedule] | None = None,
    *,
    parallel: Parallelism | None = None,
    objective: Any = None,
    weights: Weights = FULL_FINE_TUNING,
    extras: FrozenModels | None = None,
) -> Program:
    """The program of a run planned as `plan`: `optimizer` is make_optimizer's (transformation,
    schedule), None for one that only evaluates and scores. Under delayed gradient syncs the train
    step traces the model with per-shard constraints (step.py)."""
    sync_every = training.sync_gradients_every if data_parallel_size(plan.mesh) > 1 else 1

    def graphdef(rules):
        return model_graphdef(
            model_cfg, training.remat, training.scan_unroll, training.attention, rules, parallel, weights.lora
        )

    transform, schedule = optimizer or (None, None)
    return Program(
        graphdef=graphdef(plan.rules),
        compute_dtype=COMPUTE_DTYPES[training.mixed_precision],
        chunk=training.loss_chunk_size,
        objective=objective or LanguageModeling(None),
        weights=weights,
        parallel=parallel,
        plan=plan,
        extras=extras,
        optimizer=transform,
        schedule=schedule,
        train_graphdef=graphdef(per_shard_rules(plan.rules)) if sync_every > 1 else None,
        sync_every=sync_every,
        reduce_gradients_in_compute_dtype=training.reduce_gradients_in_compute_dtype,
        moe_aux_loss_coef=training.moe_aux_loss_coef,
    )


def with_models(jitted, extras: FrozenModels | None):
    """A jitted step, which passes the extra models' parameters as its last argument itself."""
    return jitted if extras is None else WithModels(jitted, extras)


class WithModels:
    """A jitted step whose last argument, the objective's extra models' parameters, it passes
    itself: called and lowered as the step without them is."""

    def __init__(self, jitted, extras: FrozenModels):
        self.jitted, self.extras = jitted, extras

    def __call__(self, *args):
        return self.jitted(*args, self.extras.params())

    def lower(self, *args):
        return _WithModels(self.jitted.lower(*args, self.extras.abstract), self.extras)


class _WithModels:
    """A lowered or compiled step (what it wraps answers the rest: as_text, memory_analysis, ...)
    whose compile() and call pass the extra models' parameters as WithModels does."""

    def __init__(self, wrapped, extras: FrozenModels):
        self.wrapped, self.extras = wrapped, extras

    def compile(self, *args, **kwargs):
        return _WithModels(self.wrapped.compile(*args, **kwargs), self.extras)

    def __call__(self, *args):
        return self.wrapped(*args, self.extras.params())

    def __getattr__(self, name):
        return getattr(self.wrapped, name)
