"""Reward modeling (objective=reward): a scalar head on the final hidden states (model.score_head),
trained on (prompt, chosen, rejected) pairs with the Bradley-Terry loss, as TRL's RewardTrainer
computes it:

    loss = -mean over pairs of log sig(r(chosen) - r(rejected) - margin)
           + center_rewards_coefficient * mean((r(chosen) + r(rejected))^2)

r(y) is the head's value at the last token of [BOS] prompt y [EOS], the EOS: where transformers'
...ForSequenceClassification pools (its last token that is not padding). `margin` is the record's
field of that name when it has one (TRL's), else 0; the coefficient's term (Eisenstein et al. 2023)
keeps the rewards centred on zero. Every mean is the whole batch's, so accumulation is exact.

A pair is two rows, chosen then rejected, each unpacked and padded to data.seq_len (the EOS an
input here, unlike a language-model row); a micro-batch holds whole pairs (DPO's batches). With an
image tower (model.vision) both rows carry the prompt's images, as DPO's do.
Evaluation (training.eval_every) reports the held-out pairs' loss and accuracy, the fraction whose
chosen answer scores higher.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tunix_train.config import Config, ConfigError
from tunix_train.data.pipeline import scored_row
from tunix_train.train.objectives.dpo import DirectPreference
from tunix_train.train.objectives.lm import BATCH_DTYPES


def pair_loss(chosen_P, rejected_P, margin_P, center_coefficient: float | None):
    """Each pair's loss: the Bradley-Terry term and TRL's centering term."""
    loss = -jax.nn.log_sigmoid(chosen_P - rejected_P - margin_P)
    if center_coefficient is not None:
        loss = loss + center_coefficient * (chosen_P + rejected_P) ** 2
    return loss


class RewardModeling(DirectPreference):
    batch_dtypes = {**BATCH_DTYPES, "margin": jnp.float32}  # each pair's margin, on its chosen row
    metric_names = ("accuracy", "margin", "reward_chosen", "reward_rejected")
    needs_reference = False
    perplexity = False

    def __init__(self, cfg: Config):
        self.cfg, self.reward = cfg, cfg.training.reward
        if not cfg.model.score_head:
            raise ConfigError(
                "training.objective=reward trains a scalar head: set model.score_head=true (objective=reward "
                "sets it)"
            )

    def weight(self, batch):
        return self.pair_count(batch)

    def loss(self, policy, reference, micro, weight):
        # loss_mask is 1 at each answer's EOS, the position scored; the margin is on the chosen one's first
        held = self.pairs_in(micro)
        rewards_P2 = self.pair_sums(policy.scores() * micro["loss_mask"], micro)
        margin_P = self.pair_sums(micro["margin"], micro)[:, 0]
        chosen, rejected = rewards_P2[:, 0], rewards_P2[:, 1]
        loss = pair_loss(chosen, rejected, margin_P, self.reward.center_rewards_coefficient)

        def mean(x):
            return jnp.sum(jnp.where(held, x, 0.0)) / weight

        return mean(loss), {
            "accuracy": mean((chosen > rejected).astype(jnp.float32)),
            "margin": mean(chosen - rejected),
            "reward_chosen": mean(chosen),
            "reward_rejected": mean(rejected),
        }

    def _positions(self, prompt: list[int], completion: list[int]) -> int:
        return len(prompt) + len(completion)  # the EOS is an input here, where the head is read

    def _row(self, prompt: list[int], completion: list[int]) -> dict[str, np.ndarray]:
        return scored_row([*prompt, *completion], self.cfg.data.seq_len)

    def read_pair(self, data, doc, what: str, index: int):
        margin = doc.get("margin", 0.0)
        if not isinstance(margin, (int, float)) or isinstance(margin, bool):
            raise ConfigError(f"{what}: pair {index + 1}'s margin is {margin!r}, not a number")
        pair = super().read_pair(data, doc, what, index)
        pair["margin"] = np.zeros_like(pair["loss_mask"])
        pair["margin"][0, 0] = margin
        return pair
