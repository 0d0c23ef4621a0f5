"""Keeping a draft model close to a policy that moves (training.rollout.draft_distill_every): after
every n-th rollout the draft learns, on the rollout's sequences, the next-token distributions of the
policy parameters that drew them, by the forward KL (divergence.generalized_jsd at beta 0)
over the completion positions, one Adam step at a time. The rows run one at a time under
jax.checkpoint, so no [rows, positions, vocab] array exists. The sampler (train/rollout.py) holds
it and saves its state in each checkpoint."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from tunix_train.train.divergence import generalized_jsd


def completion_rows(prompts, completions, length: int):
    """Right-padded token rows [N, length] and the mask [N, length] of the positions whose next
    token is a completion token (the positions a draft drafts from)."""
    tokens = np.zeros((len(prompts), length), np.int32)
    mask = np.zeros((len(prompts), length), np.float32)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        row = [*p, *c][:length]
        tokens[i, : len(row)] = row
        mask[i, len(p) - 1 : len(row) - 1] = 1.0
    return tokens, mask


class DraftDistiller:
    """The draft's parameters and Adam state, and a compiled step toward the policy's logits.
    draft_graphdef, policy_graphdef: the engines' (Engine.graphdef of the draft's and the policy's)."""

    def __init__(self, draft_graphdef, policy_graphdef, params, learning_rate: float):
        self.draft_graphdef, self.policy_graphdef = draft_graphdef, policy_graphdef
        self.optimizer = optax.adam(learning_rate)
        self.mesh = jax.tree.leaves(params)[0].sharding.mesh  # the draft's (Speculation.draft_mesh)
        # the Adam state on the draft's mesh (its step count, a scalar, replicated there)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        opt_state = jax.jit(self.optimizer.init)(params)
        self.params = params
        self.opt_state = jax.tree.map(
            lambda x: x if isinstance(x.sharding, NamedSharding) else jax.device_put(x, replicated), opt_state
        )
        self._step = jax.jit(self._update)

    def state(self) -> dict:
        """What a checkpoint keeps: the draft's parameters and Adam state."""
        return {"params": self.params, "opt_state": self.opt_state}

    def loss(self, params, policy_params, tokens_NT, mask_NT):
        """The mean over the masked positions of KL(policy || draft)."""

        def row(inputs):
            tokens_T, mask_T = inputs
            with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
                draft_TV = nnx.merge(self.draft_graphdef, params)(tokens_T[None])[0]
            policy_TV = nnx.merge(self.policy_graphdef, policy_params)(tokens_T[None])[0]
            return jnp.sum(generalized_jsd(draft_TV, jax.lax.stop_gradient(policy_TV), 0.0) * mask_T)

        per_row = jax.lax.map(jax.checkpoint(row), (tokens_NT, mask_NT))
        return jnp.sum(per_row) / jnp.maximum(jnp.sum(mask_NT), 1.0)

    def _update(self, params, opt_state, policy_params, tokens_NT, mask_NT):
        value, grads = jax.value_and_grad(self.loss)(params, policy_params, tokens_NT, mask_NT)
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    def step(self, policy_params, tokens_NT, mask_NT) -> float:
        """One step on a rollout; returns the divergence before it."""
        self.params, self.opt_state, value = self._step(
            self.params, self.opt_state, policy_params, tokens_NT, mask_NT
        )
        return float(value)
