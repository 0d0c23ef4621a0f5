"""Keeping a draft model close to a policy that moves (training.rollout.draft_distill_every): after
every n-th rollout the draft learns, on the rollout's sequences, the next-token distributions of the
policy parameters of its step, by the forward KL (divergence.generalized_jsd at beta 0) over the
completion positions, one Adam step at a time. The rows run one at a time under jax.checkpoint, so
no [rows, positions, vocab] array exists. The sampler (train/rollout.py) holds it (OnRollouts) and
saves its state in each checkpoint; the engine drafts with the new draft from the next rollout on
(asynchronously: from the next weight install, train/streaming.py)."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from tunix_train.config import ConfigError
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


class OnRollouts:
    """A sampler's draft distillation: the DraftDistiller of its engine's draft (read back from the
    checkpoint the run resumed from, where that one holds it), stepped after every n-th rollout."""

    def __init__(self, sampler, resumed_from):
        from tunix_train.checkpoint import restore_item

        if len(sampler.engines) > 1:
            raise ConfigError("training.rollout.draft_distill_every runs with one engine for now: replicas=1")
        g, engine = sampler.rollout, sampler.engine
        self.sampler, self.every = sampler, g.draft_distill_every
        self.distiller = DraftDistiller(
            engine.draft.graphdef, engine.graphdef, sampler.draft_params[0], g.draft_learning_rate
        )
        saved = None if resumed_from is None else restore_item(resumed_from, "draft", self.distiller.state())
        if saved is not None:
            self.distiller.params, self.distiller.opt_state = saved["params"], saved["opt_state"]
            sampler.draft_params[0] = self.distiller.params
        elif resumed_from is not None:
            logging.getLogger("tunix_train").warning(
                f"warning: checkpoint {resumed_from[0] / str(resumed_from[1])} holds no distilled draft: "
                f"the draft starts again from training.rollout.draft={g.draft}"
            )

    def state(self) -> dict:
        return self.distiller.state()

    def after(self, rollout, index: int, params) -> None:
        """After rollout number `index`, where it is an n-th: one step of the draft toward `params`
        (the policy's of its step, on the engine's mesh) on its sequences; the divergence before the
        step joins the rollout's speculation figures, and the new draft the sampler's draft_params."""
        if (index + 1) % self.every:
            return
        s = self.sampler
        G = s.rollout.num_generations
        prompts = rollout.prompt_ids or [s.prompts[p] for p in rollout.order for _ in range(G)]
        tokens, mask = completion_rows(prompts, rollout.completions, s.cfg.data.seq_len)
        with jax.set_mesh(s.mesh):
            divergence = self.distiller.step(params, tokens, mask)
        s.draft_params[0] = self.distiller.params
        rollout.speculation = {**(rollout.speculation or {}), "draft_divergence": divergence}
