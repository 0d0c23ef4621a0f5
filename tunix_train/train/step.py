"""The train step: a pure function (state, batch) -> (state, metrics), compiled once.

A batch is a dict of [A, B, ...] arrays (A accumulation steps of B rows), the fields the objective
names (train/objectives/): for the next-token loss `inputs`, `targets`, `loss_mask`, `positions`,
`segment_ids`. The objective computes each micro-batch's loss from the model's per-token losses;
gradients of the trainable parameters (model/weights.py) accumulate inside the compiled step, over
a scan of the A micro-batches, in float32 and sharded like the parameters. Every step here and
in scoring.py takes the run's Program (program.py) whole: what it traces, built once.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tunix_train.model.moe import load_balancing_loss
from tunix_train.sharding import batch_sharding, data_axes, data_parallel_size, per_shard_shardings
from tunix_train.state import TrainState
from tunix_train.train.forward import Forward, ForwardOptions, in_compute_dtype
from tunix_train.train.init import COMPUTE_DTYPES
from tunix_train.train.objectives.lm import BATCH_DTYPES
from tunix_train.train.program import Program, with_models


def abstract_batch(
    mesh: Mesh, accumulation: int, rows: int, seq_len: int, dtypes: dict[str, Any] = BATCH_DTYPES
) -> dict[str, jax.ShapeDtypeStruct]:
    """The step's input (`dtypes`: the objective's fields, objectives/__init__.py) as sharded
    shapes, for ahead-of-time compilation."""
    shaped = {name: kind if isinstance(kind, tuple) else (kind, ()) for name, kind in dtypes.items()}
    return {
        name: jax.ShapeDtypeStruct((accumulation, rows, seq_len, *more), dtype, sharding=batch_sharding(mesh))
        for name, (dtype, more) in shaped.items()
    }


def forwards(program: Program, params, frozen, micro, models: dict | None = None, *, training: bool = False):
    """Forwards (train/forward.py) of one micro-batch: of the trained model (policy), of the
    reference and of the objective's extra models by name (their parameters `models`; None
    without), the last two without gradient. `training`: as the train step traces them (its
    graph, and no sharding constraints on the parameters under delayed gradient syncs)."""
    objective, weights, graphdef = program.objective, program.weights, program.graphdef
    param_shardings, frozen_shardings = program.param_shardings, program.frozen_shardings
    if training and program.train_graphdef is not None:
        graphdef, param_shardings, frozen_shardings = program.train_graphdef, None, None

    options = ForwardOptions(program.compute_dtype, program.chunk, program.seq_shards, objective.temperature)

    def forward(states, shardings, frozen=False, graphdef=graphdef, options=options):
        return Forward(graphdef, states, micro, options, param_shardings=shardings, frozen=frozen)

    def shardings(compose, **kw):
        return None if param_shardings is None else compose(param_shardings, frozen_shardings, **kw)

    policy = forward(weights.policy(params, frozen), shardings(weights.policy))
    reference = forward(
        weights.reference(params, frozen), shardings(weights.reference, switch_off=lambda s: s), frozen=True
    )
    others, extras = None, program.extras
    if models is not None:  # (the scoring pass reads no extra model)
        others = {  # held in their compute dtype (train/init.py): nothing to cast
            name: forward(
                (models[name],),
                None,
                True,
                extras.graphdefs[name],
                dataclasses.replace(options, compute_dtype=COMPUTE_DTYPES[spec.precision]),
            )
            for name, spec in extras.specs.items()
        }
    return policy, reference, others


def _objective_loss(
    program: Program, params, frozen, micro, weight, models: dict | None = None, *, training: bool = False
):
    """The objective's (loss, metrics) of one micro-batch, from its Forwards (`forwards`). With
    experts, the policy's load-balancing loss times the program's moe_aux_loss_coef (in the train
    step; 0 elsewhere) is added, weighted by the micro-batch's share of the batch, and logged
    (moe_aux_loss; expert_tokens, the copies each expert received)."""
    objective = program.objective
    policy, reference, others = forwards(program, params, frozen, micro, models, training=training)
    if others is None:
        loss, metrics = objective.loss(policy, reference, micro, weight)
    else:
        loss, metrics = objective.loss(policy, reference, micro, weight, models=others)
    if policy.ran and policy.stats:

        def first(w):
            return jax.tree.leaves(w)[0]  # one of the objective's normalizers

        stats, share = policy.stats, first(objective.weight(micro)) / first(weight)
        aux = load_balancing_loss(stats["expert_tokens"], stats["router_probs"]) * share
        loss = loss + (program.moe_aux_loss_coef if training else 0.0) * aux
        metrics = {**metrics, "moe_aux_loss": aux, "expert_tokens": jnp.sum(stats["expert_tokens"], axis=0)}
    return loss, metrics


def train_step(
    program: Program, state: TrainState, batch: dict[str, jax.Array], models: dict | None = None
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One update from the [A, B, ...] batch: gradients accumulated over its A micro-batches, then
    the optimizer's step. The state lives where the plan's `shardings` say between steps and is
    computed with where its `on_device` say (they differ in memory kind for an offloaded part,
    which is moved to the devices and back); `models`: the objective's extra models' parameters."""
    objective, plan = program.objective, program.plan
    batch = program.parallel.reorder(batch) if program.parallel else batch
    # Dividing every micro-batch by the whole batch's weight makes the accumulated loss and
    # gradient exactly those of the mean over the full batch (token-weighted for next-token loss).
    total_weight = jax.tree.map(lambda w: jnp.maximum(w, 1.0), objective.weight(batch))

    def to_device(part):
        return moved(getattr(state, part), getattr(plan.shardings, part), getattr(plan.on_device, part))

    grads, (losses, aux) = _gradients(program, to_device, batch, total_weight, models)
    loss, grad_norm = jnp.sum(losses), optax.tree.norm(grads)
    # A non-finite loss or gradient drops the whole update: parameters and optimizer state stay (as
    # they do for a batch the objective says may not update).
    # A cond, not a select per array: selects would read both states again.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    update = finite & objective.updates(batch)

    def apply_update(params_and_opt_state):
        params, opt_state = params_and_opt_state
        updates, opt_state = program.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params, opt_state = jax.lax.cond(
        update, apply_update, lambda unchanged: unchanged, (to_device("params"), to_device("opt_state"))
    )
    params = moved(params, plan.on_device.params, plan.shardings.params)
    opt_state = moved(opt_state, plan.on_device.opt_state, plan.shardings.opt_state)
    new_state = TrainState(
        step=state.step + 1,
        params=params,
        opt_state=opt_state,
        nonfinite_steps=state.nonfinite_steps + (~finite).astype(jnp.int32),
        frozen=state.frozen,
    )
    aux = reduce_metrics(aux)  # the objective's, over micro-batches
    if "expert_tokens" in aux:  # expert use: the busiest and the idlest expert's tokens over the even share
        tokens_E = aux.pop("expert_tokens")
        load_E = tokens_E / jnp.maximum(jnp.mean(tokens_E), 1.0)
        aux.update(moe_load_max=jnp.max(load_E), moe_load_min=jnp.min(load_E))
    metrics = {
        "loss": loss - program.moe_aux_loss_coef * aux.get("moe_aux_loss", 0.0),
        "grad_norm": grad_norm,
        "learning_rate": program.schedule(state.step),
        "tokens": jnp.sum(batch["loss_mask"]),
        "finite": finite,
        "nonfinite_steps": new_state.nonfinite_steps,
        **aux,
    }
    return new_state, metrics


def _gradients(program: Program, to_device, batch, total_weight, models):
    """The float32 gradients of the batch's loss, summed over its micro-batches, and each
    micro-batch's (loss, metrics)."""
    objective, compute_dtype = program.objective, program.compute_dtype
    param_shardings, grad_shardings = program.plan.on_device.params, program.plan.grad_shardings
    # Differentiating with respect to a compute-dtype copy makes the gradients, and so their
    # reduction across devices, bf16 under mixed precision; they accumulate in float32. With delayed
    # syncs the copy is always made here, outside the per-shard vmap, and what is reduced is the
    # float32 sums.
    delayed_sync = program.sync_every > 1
    wrt = to_device("params")
    if compute_dtype != jnp.float32 and (program.reduce_gradients_in_compute_dtype or delayed_sync):
        wrt = jax.lax.with_sharding_constraint(
            jax.tree.map(lambda p: p.astype(compute_dtype), wrt), param_shardings
        )
    frozen = to_device("frozen")
    extras = program.extras
    models = moved(models, extras.shardings, extras.device_shardings) if extras is not None else models
    if compute_dtype != jnp.float32 and frozen is not None:  # cast once per step, not per micro-batch
        frozen = in_compute_dtype(frozen, compute_dtype, program.plan.on_device.frozen)
    weighted_loss_sum = functools.partial(
        _objective_loss, program, frozen=frozen, weight=total_weight, models=models, training=True
    )

    def add(grads, new):
        return jax.tree.map(lambda g, n: g + n.astype(jnp.float32), grads, new)

    zeros = jax.tree.map(jnp.zeros_like, to_device("params"))  # in device memory, like the gradients
    if delayed_sync:
        return _accumulate_with_delayed_sync(
            weighted_loss_sum, wrt, batch, zeros, add, program.sync_every, grad_shardings
        )

    def accumulate(grads, micro):
        def compute(grads):
            (loss, aux), new = jax.value_and_grad(weighted_loss_sum, has_aux=True)(wrt, micro=micro)
            new = jax.lax.with_sharding_constraint(new, grad_shardings)  # the reduction
            return jax.lax.with_sharding_constraint(add(grads, new), grad_shardings), (loss, aux)

        return unless_empty(compute, grads, micro) if objective.skips_empty_micro_batches else compute(grads)

    return jax.lax.scan(accumulate, zeros, batch)


def unless_empty(compute, carry, micro):
    """compute(carry) -> (carry, out); for a micro-batch without a sequence (segment_ids all 0: a
    packed batch's empty tail) carry and zeros instead, by a cond, so it costs no forward or
    backward. (Under delayed gradient syncs the micro-batches are vmapped, and this is not used:
    an empty micro-batch's loss, metrics and gradient are 0 anyway.)"""
    out = jax.eval_shape(compute, carry)[1]

    def skip(carry):
        return carry, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out)

    return jax.lax.cond(jnp.any(micro["segment_ids"] > 0), compute, skip, carry)


def reduce_metrics(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """An objective's metrics over their leading axis (micro-batches, data shards): a sum, since each
    is already divided by the batch's weight, or a maximum for those whose name ends in `_max`."""
    return {
        name: (jnp.max if name.endswith("_max") else jnp.sum)(value, axis=0)
        for name, value in metrics.items()
    }


def moved(tree: Any, source: Any, target: Any) -> Any:
    """`tree`, laid out by the shardings `source`, put where `target` says (an offloaded part of the
    state between host and device memory); itself where they are the same."""
    return tree if jax.tree.leaves(source) == jax.tree.leaves(target) else jax.device_put(tree, target)


def _accumulate_with_delayed_sync(weighted_loss_sum, wrt, batch, zeros, add, sync_every, grad_shardings):
    """Gradients summed over the A micro-batches, reduced across data shards once per `sync_every`.

    Each micro-batch's rows [B, ...] are viewed as [S, B/S, ...], one slice per data shard, and a
    vmap over S gives each shard's own gradient, so nothing is reduced while a group of
    `sync_every` micro-batches accumulates into the [S, ...] per-shard sums. The model traced
    inside the vmap constrains its activations with per_shard_rules (compile_train_step)."""
    A, B = batch["inputs"].shape[:2]
    mesh = jax.tree.leaves(grad_shardings)[0].mesh
    S = data_parallel_size(mesh)
    local_grad_shardings = per_shard_shardings(grad_shardings, mesh)
    groups = jax.tree.map(lambda x: x.reshape(A // sync_every, sync_every, S, B // S, *x.shape[2:]), batch)
    per_shard = jax.vmap(
        jax.value_and_grad(lambda p, m: weighted_loss_sum(p, micro=m), has_aux=True),
        in_axes=(None, 0),
        spmd_axis_name=data_axes(mesh),
    )
    local_zeros = jax.tree.map(lambda z: jnp.zeros((S, *z.shape), jnp.float32), zeros)

    def accumulate_locally(local, micro):
        losses_S, grads_S = per_shard(wrt, micro)
        return (
            jax.lax.with_sharding_constraint(add(local, grads_S), local_grad_shardings),
            (jnp.sum(losses_S[0]), reduce_metrics(losses_S[1])),
        )

    def sync(grads, group):
        local, losses = jax.lax.scan(accumulate_locally, local_zeros, group)
        # the reduction
        reduced = jax.lax.with_sharding_constraint(
            jax.tree.map(lambda leaf: jnp.sum(leaf, axis=0), local), grad_shardings
        )
        return jax.lax.with_sharding_constraint(add(grads, reduced), grad_shardings), losses

    grads, (losses, aux) = jax.lax.scan(sync, zeros, groups)
    return grads, (losses.reshape(A), jax.tree.map(lambda x: x.reshape(A, *x.shape[2:]), aux))


def compile_train_step(program: Program):
    """jit with explicit in/out shardings; the input state is donated. Call under
    jax.set_mesh(program.plan.mesh). With extra models (program.extras) the step takes their
    parameters as a third argument, which the returned function passes itself."""
    plan = program.plan
    in_shardings = (plan.shardings, batch_sharding(plan.mesh))
    if program.extras is not None:
        in_shardings = (*in_shardings, program.extras.shardings)
    jitted = jax.jit(
        functools.partial(train_step, program),
        in_shardings=in_shardings,
        out_shardings=(plan.shardings, NamedSharding(plan.mesh, P())),
        donate_argnums=0,
    )
    return with_models(jitted, program.extras)


def eval_step(
    program: Program,
    params: nnx.State,
    batch: dict[str, jax.Array],
    frozen: nnx.State | None = None,
    models: dict | None = None,
) -> dict[str, jax.Array]:
    """The objective's summed loss and weight (for the next-token loss: summed token loss and
    token count) of a [1, B, T] held-out batch, and its metrics summed alike (`metric_<name>`);
    `frozen`: the state's frozen weights. An objective with several normalizers (ORPO) gives its
    batch's mean loss, of weight 1, and no metrics."""
    objective, extras = program.objective, program.extras
    models = moved(models, extras.shardings, extras.device_shardings) if extras is not None else models
    micro = jax.tree.map(lambda x: x[0], program.parallel.reorder(batch) if program.parallel else batch)
    weight = objective.weight(micro)
    several = isinstance(weight, dict)
    total = jax.tree.map(lambda w: jnp.maximum(w, 1.0), weight) if several else 1.0
    loss_sum, metrics = _objective_loss(program, params, frozen, micro, total, models)
    if several:
        return {"loss_sum": loss_sum, "weight": jnp.float32(1.0)}
    # the objective's metrics, summed as the loss is (a `..._max` one: the batch's maximum)
    scalars = {f"metric_{k}": v for k, v in metrics.items() if jnp.ndim(v) == 0}
    return {"loss_sum": loss_sum, "weight": weight, **scalars}


def compile_eval_step(program: Program):
    """(params, frozen, batch) -> the eval_step sums."""
    plan = program.plan
    step = functools.partial(eval_step, program)

    def evaluate(params, frozen, batch, models=None):  # offloaded parameters are moved to the devices
        on_device = moved(params, plan.shardings.params, plan.on_device.params)
        return step(on_device, batch, frozen=frozen, models=models)

    in_shardings = (plan.shardings.params, plan.shardings.frozen, batch_sharding(plan.mesh))
    if program.extras is not None:
        in_shardings = (*in_shardings, program.extras.shardings)
    jitted = jax.jit(evaluate, in_shardings=in_shardings, out_shardings=NamedSharding(plan.mesh, P()))
    return with_models(jitted, program.extras)
