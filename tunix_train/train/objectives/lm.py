"""Next-token cross-entropy: pre-training and supervised fine-tuning (the loss on loss_mask tokens)."""

from __future__ import annotations

import jax.numpy as jnp

from tunix_train.train.objectives.base import Objective

BATCH_DTYPES = {
    "inputs": jnp.int32,
    "targets": jnp.int32,
    "loss_mask": jnp.float32,
    "positions": jnp.int32,
    "segment_ids": jnp.int32,
}  # [A, B, T] each


class LanguageModeling(Objective):
    batch_dtypes = BATCH_DTYPES
    perplexity = True  # exp(eval loss) is the held-out perplexity

    def weight(self, batch):
        return jnp.sum(batch["loss_mask"])

    def loss(self, policy, reference, micro, weight):
        """The token-weighted mean over the whole batch of the masked tokens' losses."""
        return jnp.sum(policy() * micro["loss_mask"]) / weight, {}

    def train_batches(self, data, global_rows: int, rows: range):
        return data.train_batches(global_rows, rows)

    def eval_batches(self, data, global_rows: int, rows: range):
        return data.eval_batches(global_rows, rows)
