"""Direct preference optimization (Rafailov et al. 2023) on (prompt, chosen, rejected) pairs.

With z = beta · [(log pi(c) - log ref(c)) - (log pi(r) - log ref(r))], the log-probabilities of
a completion summed over its tokens (and its EOS), the loss of a pair is
-(1 - s) · log sigmoid(z) - s · log sigmoid(-z) for label smoothing s (cDPO; TRL's "sigmoid" loss).

A pair is two rows, chosen then rejected, each [BOS] prompt completion [EOS] unpacked and padded
to data.seq_len (a prompt in messages: the chat template's rendering of the prompt with the
generation prompt, then of the answer through its end of turn, data/chat.py); a micro-batch of B rows holds B/2 whole pairs, and no pair is ever split across
micro-batches or devices (data/pipeline.GroupBatches).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tunix_train.config import Config, ConfigError
from tunix_train.data.chat import completion_ids, prompt_ids
from tunix_train.data.pipeline import GroupBatches, padded_row
from tunix_train.train.objectives.base import Objective
from tunix_train.train.objectives.lm import BATCH_DTYPES

FIELDS = ("prompt", "chosen", "rejected")


def pair_losses(chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, beta: float, label_smoothing: float):
    """The loss of each pair and its implicit rewards beta · (log pi - log ref) of chosen and rejected."""
    chosen_reward = beta * (chosen_logp - ref_chosen_logp)
    rejected_reward = beta * (rejected_logp - ref_rejected_logp)
    z = chosen_reward - rejected_reward
    loss = -(1 - label_smoothing) * jax.nn.log_sigmoid(z) - label_smoothing * jax.nn.log_sigmoid(-z)
    return loss, chosen_reward, rejected_reward


class DirectPreference(Objective):
    batch_dtypes = BATCH_DTYPES
    needs_reference = True
    record_fields = FIELDS
    metric_names = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")

    def __init__(self, cfg: Config):
        self.cfg, self.beta, self.label_smoothing = cfg, cfg.training.dpo.beta, cfg.training.dpo.label_smoothing

    def weight(self, batch):
        """The number of pairs."""
        return jnp.float32(np.prod(batch["inputs"].shape[:-1]) // 2)

    def loss(self, policy, reference, micro, weight):
        def pair_logps(token_nll_BT):
            return (-jnp.sum(token_nll_BT * micro["loss_mask"], axis=-1)).reshape(-1, 2)

        logp_P2, ref_logp_P2 = pair_logps(policy()), pair_logps(reference())
        loss_P, chosen_P, rejected_P = pair_losses(logp_P2[:, 0], logp_P2[:, 1], ref_logp_P2[:, 0],
                                                   ref_logp_P2[:, 1], self.beta, self.label_smoothing)
        mean = lambda x: jnp.sum(x) / weight
        return mean(loss_P), {"reward_chosen": mean(chosen_P), "reward_rejected": mean(rejected_P),
                              "reward_margin": mean(chosen_P - rejected_P),
                              "reward_accuracy": mean((chosen_P > rejected_P).astype(jnp.float32))}

    def read(self, data) -> None:
        """Tokenizes every pair once, before any device work: a pair too long is a ConfigError."""
        self._pairs = {split: [self._pair(data, doc, what, i) for i, doc in enumerate(docs)]
                       for split, docs, what in (("train", data.train_docs, "data.train_files"),
                                                 ("eval", data.eval_docs, "the held-out pairs"))}

    def _batches(self, split: str, global_rows: int, rows: range, accumulation: int, seed):
        return GroupBatches(self._pairs[split], accumulation_steps=accumulation, groups_per_micro_batch=global_rows // 2,
                            seed=seed, slots=range(rows.start // 2, rows.stop // 2),
                            prefetch=self.cfg.data.prefetch_batches)

    def _pair(self, data, doc, what: str, index: int):
        seq_len, tok = self.cfg.data.seq_len, data.tokenizer
        chat = data.chat if isinstance(doc["prompt"], list) else None
        prompt = prompt_ids(doc["prompt"], tok, chat)
        rows = []
        for field in ("chosen", "rejected"):
            completion = completion_ids(doc["prompt"], doc[field], tok, chat)
            if len(prompt) + len(completion) - 1 > seq_len:
                raise ConfigError(f"{what}: pair {index + 1} ({field}) is {len(prompt) + len(completion) - 1} tokens, "
                                  f"longer than data.seq_len={seq_len}; raise data.seq_len or shorten it")
            rows.append(padded_row(prompt, completion, seq_len))
        return {name: np.stack([r[name] for r in rows]) for name in rows[0]}

    def train_batches(self, data, global_rows: int, rows: range):
        t = self.cfg.training
        return self._batches("train", global_rows, rows, t.gradient_accumulation_steps, t.seed)

    def eval_batches(self, data, global_rows: int, rows: range):
        batches = self._batches("eval", global_rows, rows, 1, None)
        try:
            return [next(batches) for _ in range(self.cfg.training.eval_batches)]
        finally:
            batches.close()
