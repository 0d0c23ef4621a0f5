"""The train step: a pure function (state, batch) -> (state, metrics), compiled once.

A batch is a dict of [A, B, T] arrays (A accumulation steps of B examples of T tokens):
`inputs`, `targets`, `loss_mask`, `positions`, `segment_ids`. Gradients accumulate inside the
compiled step, over a scan of the A micro-batches, in float32 and sharded like the parameters.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tunix_train.config import MixedPrecision
from tunix_train.sharding import batch_sharding
from tunix_train.train.state import TrainState

COMPUTE_DTYPES = {MixedPrecision.fp32: jnp.float32, MixedPrecision.bf16: jnp.bfloat16}
BATCH_DTYPES = {"inputs": jnp.int32, "targets": jnp.int32, "loss_mask": jnp.float32,
                "positions": jnp.int32, "segment_ids": jnp.int32}  # the step's input: [A, B, T] each


def abstract_batch(mesh: Mesh, accumulation: int, rows: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The step's input as sharded shapes, for ahead-of-time compilation."""
    return {name: jax.ShapeDtypeStruct((accumulation, rows, seq_len), dtype, sharding=batch_sharding(mesh))
            for name, dtype in BATCH_DTYPES.items()}


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Per-token next-token cross-entropy, in float32."""
    logits_BTV = logits_BTV.astype(jnp.float32)
    target_logit_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits_BTV, axis=-1) - target_logit_BT


def forward(graphdef: nnx.GraphDef, params: nnx.State, micro: dict[str, jax.Array],
            compute_dtype=jnp.float32) -> jax.Array:
    """Logits for one micro-batch; parameters are cast to the compute dtype (master copy untouched)."""
    params = jax.tree.map(lambda p: p.astype(compute_dtype), params)
    model = nnx.merge(graphdef, params)
    return model(micro["inputs"], micro["positions"], micro["segment_ids"])


def _weighted_loss_sum(params, micro, graphdef, compute_dtype, total_weight):
    """This micro-batch's share of the token-weighted mean loss over the whole batch."""
    token_loss_BT = cross_entropy(forward(graphdef, params, micro, compute_dtype), micro["targets"])
    return jnp.sum(token_loss_BT * micro["loss_mask"]) / total_weight


def train_step(state: TrainState, batch: dict[str, jax.Array], *, graphdef: nnx.GraphDef,
               optimizer: optax.GradientTransformation, schedule: optax.Schedule,
               compute_dtype: Any, param_shardings: Any) -> tuple[TrainState, dict[str, jax.Array]]:
    # Dividing every micro-batch by the whole batch's weight makes the accumulated loss and
    # gradient exactly those of the token-weighted mean over the full batch.
    total_weight = jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)
    loss_and_grad = jax.value_and_grad(_weighted_loss_sum)

    def accumulate(grads, micro):
        loss, micro_grads = loss_and_grad(state.params, micro, graphdef, compute_dtype, total_weight)
        grads = jax.tree.map(jnp.add, grads, micro_grads)
        return jax.lax.with_sharding_constraint(grads, param_shardings), loss

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    grads, losses = jax.lax.scan(accumulate, zeros, batch)
    loss, grad_norm = jnp.sum(losses), optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # A non-finite loss or gradient drops the whole update: parameters and optimizer state stay.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep_if_finite = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    new_state = TrainState(step=state.step + 1, params=keep_if_finite(params, state.params),
                           opt_state=keep_if_finite(opt_state, state.opt_state),
                           nonfinite_steps=state.nonfinite_steps + (~finite).astype(jnp.int32))
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        "learning_rate": schedule(state.step),
        "tokens": jnp.sum(batch["loss_mask"]),
        "finite": finite,
        "nonfinite_steps": new_state.nonfinite_steps,
    }
    return new_state, metrics


def compile_train_step(state_shardings: Any, mesh: Mesh, *, graphdef: nnx.GraphDef,
                       optimizer: optax.GradientTransformation, schedule: optax.Schedule,
                       mixed_precision: MixedPrecision):
    """jit with explicit in/out shardings; the input state is donated. Call under jax.set_mesh(mesh)."""
    step = functools.partial(train_step, graphdef=graphdef, optimizer=optimizer, schedule=schedule,
                             compute_dtype=COMPUTE_DTYPES[mixed_precision],
                             param_shardings=state_shardings.params)
    return jax.jit(step, in_shardings=(state_shardings, batch_sharding(mesh)),
                   out_shardings=(state_shardings, NamedSharding(mesh, P())), donate_argnums=0)


def eval_step(params: nnx.State, batch: dict[str, jax.Array], *, graphdef: nnx.GraphDef,
              compute_dtype: Any) -> dict[str, jax.Array]:
    """Summed token loss and token weight of a [1, B, T] held-out batch."""
    micro = jax.tree.map(lambda x: x[0], batch)
    token_loss_BT = cross_entropy(forward(graphdef, params, micro, compute_dtype), micro["targets"])
    return {"loss_sum": jnp.sum(token_loss_BT * micro["loss_mask"]), "weight": jnp.sum(micro["loss_mask"])}


def compile_eval_step(state_shardings: Any, mesh: Mesh, *, graphdef: nnx.GraphDef,
                      mixed_precision: MixedPrecision):
    step = functools.partial(eval_step, graphdef=graphdef, compute_dtype=COMPUTE_DTYPES[mixed_precision])
    return jax.jit(step, in_shardings=(state_shardings.params, batch_sharding(mesh)),
                   out_shardings=NamedSharding(mesh, P()))
