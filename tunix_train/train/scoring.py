"""The scoring pass: what an objective computes of a batch, without gradient, before the steps
that train on it (`Objective.score`; PPO's critic values and log-probabilities of a rollout), on
the training mesh with the train step's model, parameters and layout."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_train.sharding import batch_sharding
from tunix_train.train.forward import in_compute_dtype
from tunix_train.train.program import Program
from tunix_train.train.step import forwards, moved, unless_empty


def score_step(
    program: Program, params: nnx.State, batch: dict[str, jax.Array], frozen: nnx.State | None = None
) -> dict[str, jax.Array]:
    """objective.score(policy, reference, micro) of each micro-batch of an [A, B, T] batch, without
    gradient: per-token arrays [A, B, T] in the batch's order (what an RL objective computes of a
    rollout before its steps: PPO's values and log-probabilities)."""
    objective = program.objective
    reordered = program.parallel.reorder(batch) if program.parallel else batch
    if program.compute_dtype != jnp.float32 and frozen is not None:
        frozen = in_compute_dtype(frozen, program.compute_dtype, program.frozen_shardings)

    def micro_step(carry, micro):
        if objective.skips_empty_micro_batches:
            return unless_empty(functools.partial(figures_of, micro=micro), carry, micro)
        return figures_of(carry, micro)

    def figures_of(carry, micro):
        policy, reference, _ = forwards(program, params, frozen, micro)
        return carry, jax.lax.stop_gradient(objective.score(policy, reference, micro))

    _, figures = jax.lax.scan(micro_step, None, reordered)
    if "token_index" in reordered:  # cp: back to each row's order
        inverse = jnp.argsort(reordered["token_index"][0, 0])
        figures = jax.tree.map(lambda x: jnp.take(x, inverse, axis=2), figures)
    return figures


def compile_score_step(program: Program):
    """(params, frozen, batch) -> score_step's figures, sharded as the batch."""
    plan = program.plan
    step = functools.partial(score_step, program)

    def score(params, frozen, batch):  # offloaded parameters are moved to the devices
        return step(moved(params, plan.shardings.params, plan.on_device.params), batch, frozen=frozen)

    return jax.jit(
        score,
        in_shardings=(plan.shardings.params, plan.shardings.frozen, batch_sharding(plan.mesh)),
        out_shardings=batch_sharding(plan.mesh),
    )
