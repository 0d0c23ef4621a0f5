"""The scoring pass: what an objective computes of a batch, without gradient, before the steps
that train on it (`Objective.score`; PPO's critic values and log-probabilities of a rollout), on
the training mesh with the train step's model, parameters and layout."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from tunix_train.config import ModelConfig, TrainingConfig
from tunix_train.model.weights import FULL_FINE_TUNING, Weights
from tunix_train.parallel import Parallelism
from tunix_train.sharding import batch_sharding
from tunix_train.train.forward import in_compute_dtype
from tunix_train.train.init import StatePlan
from tunix_train.train.step import forwards, moved, pass_settings, unless_empty


def score_step(
    params: nnx.State,
    batch: dict[str, jax.Array],
    *,
    graphdef: nnx.GraphDef,
    compute_dtype: Any,
    chunk: int = 0,
    param_shardings: Any = None,
    frozen: nnx.State | None = None,
    frozen_shardings: Any = None,
    parallel: Parallelism | None = None,
    objective: Any = None,
    weights: Weights = FULL_FINE_TUNING,
) -> dict[str, jax.Array]:
    """objective.score(policy, reference, micro) of each micro-batch of an [A, B, T] batch, without
    gradient: per-token arrays [A, B, T] in the batch's order (what an RL objective computes of a
    rollout before its steps: PPO's values and log-probabilities)."""
    reordered = parallel.reorder(batch) if parallel else batch
    if compute_dtype != jnp.float32 and frozen is not None:
        frozen = in_compute_dtype(frozen, compute_dtype, frozen_shardings)

    def micro_step(carry, micro):
        if objective.skips_empty_micro_batches:
            return unless_empty(functools.partial(figures_of, micro=micro), carry, micro)
        return figures_of(carry, micro)

    def figures_of(carry, micro):
        policy, reference, _ = forwards(
            objective,
            weights,
            graphdef,
            params,
            frozen,
            micro,
            compute_dtype=compute_dtype,
            chunk=chunk,
            param_shardings=param_shardings,
            frozen_shardings=frozen_shardings,
            seq_shards=parallel.seq_shards if parallel else 1,
        )
        return carry, jax.lax.stop_gradient(objective.score(policy, reference, micro))

    _, figures = jax.lax.scan(micro_step, None, reordered)
    if "token_index" in reordered:  # cp: back to each row's order
        inverse = jnp.argsort(reordered["token_index"][0, 0])
        figures = jax.tree.map(lambda x: jnp.take(x, inverse, axis=2), figures)
    return figures


def compile_score_step(
    plan: StatePlan,
    mesh: Mesh,
    *,
    model_cfg: ModelConfig,
    training: TrainingConfig,
    parallel: Parallelism | None = None,
    objective: Any = None,
    weights: Weights = FULL_FINE_TUNING,
):
    """(params, frozen, batch) -> score_step's figures, sharded as the batch."""
    step = functools.partial(
        score_step, **pass_settings(plan, model_cfg, training, parallel, objective, weights)
    )

    def score(params, frozen, batch):  # offloaded parameters are moved to the devices
        return step(moved(params, plan.shardings.params, plan.on_device.params), batch, frozen=frozen)

    return jax.jit(
        score,
        in_shardings=(plan.shardings.params, plan.shardings.frozen, batch_sharding(mesh)),
        out_shardings=batch_sharding(mesh),
    )
