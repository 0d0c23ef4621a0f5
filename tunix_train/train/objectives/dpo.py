"""Preference optimization on (prompt, chosen, rejected) pairs: DPO and its relatives, as TRL 1.16
computes them (objective=dpo, ipo, simpo, orpo; training.dpo). With log pi(y) a completion's
log-probability summed over its tokens (and its EOS), |y| its token count, and avg(y) =
log pi(y) / |y|:

- sigmoid (objective=dpo: DPO, Rafailov et al. 2023; TRL's "sigmoid" with cDPO's label smoothing s):
  z = beta [(log pi(c) - log ref(c)) - (log pi(r) - log ref(r))], loss -(1-s) log sig(z) - s log sig(-z);
- ipo (Azar et al. 2023, eq. 17; TRL DPOTrainer "ipo"): the log-ratios per token,
  h = (log pi(c) - log ref(c)) / |c| - (log pi(r) - log ref(r)) / |r|, loss (h - 1 / (2 beta))^2;
- simpo (Meng et al. 2024; TRL CPOTrainer loss_type="simpo", cpo_alpha=0), no reference:
  z = beta (avg(c) - avg(r)) - gamma, loss -(1-s) log sig(z) - s log sig(-z);
- orpo (Hong et al. 2024; TRL ORPOTrainer), no reference: the chosen answers' token-mean NLL over
  the whole batch, minus beta · mean log sig(log odds(c) - log odds(r)), log odds(y) = avg(y) -
  log(1 - exp(avg(y))). TRL's NLL also counts the prompt's tokens; this one is the paper's, the answer's.

A pair is two rows, chosen then rejected, each [BOS] prompt completion [EOS] unpacked and padded
to data.seq_len (a prompt in messages: the chat template's rendering of the prompt with the
generation prompt, then of the answer through its end of turn, data/chat.py); a micro-batch of B rows holds
B/2 whole pairs, and no pair is ever split across
micro-batches or devices (data/pipeline.GroupBatches). With data.padding_free the pairs are packed
whole into the rows instead, each answer a segment (data/pipeline.PackedPairs), and a pair's sums
are taken by segment: a micro-batch then holds as many pairs as fit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tunix_train.config import Config, ConfigError, DpoConfig, PreferenceLoss
from tunix_train.data.chat import completion_ids, prompt_ids
from tunix_train.data.images import has_images
from tunix_train.data.pipeline import PackedPairs, padded_row
from tunix_train.train.objectives.base import GroupedRecords
from tunix_train.train.objectives.lm import BATCH_DTYPES

FIELDS = ("prompt", "chosen", "rejected")


def pair_losses(
    chosen_logp, rejected_logp, ref_chosen_logp, ref_rejected_logp, beta: float, label_smoothing: float
):
    """DPO: the loss of each pair and its implicit rewards beta · (log pi - log ref) of chosen and
    rejected."""
    chosen_reward = beta * (chosen_logp - ref_chosen_logp)
    rejected_reward = beta * (rejected_logp - ref_rejected_logp)
    return _smoothed(chosen_reward - rejected_reward, label_smoothing), chosen_reward, rejected_reward


def _smoothed(z, label_smoothing: float):
    return -(1 - label_smoothing) * jax.nn.log_sigmoid(z) - label_smoothing * jax.nn.log_sigmoid(-z)


def _log1mexp(x):
    """log(1 - exp(x)) for x < 0, switching forms at -log 2 (as TRL's ORPO does)."""
    return jnp.where(x < -0.6931471805599453, jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))


def preference_losses(kind: PreferenceLoss, logp_P2, ref_logp_P2, tokens_P2, cfg: DpoConfig):
    """Each pair's loss (ORPO's NLL apart) and the rewards logged for chosen and rejected, from the
    summed log-probabilities [pairs, (chosen, rejected)] under the policy and the reference (None
    for the losses without one) and the completions' token counts."""
    beta = cfg.beta
    if kind is PreferenceLoss.sigmoid:
        return pair_losses(
            logp_P2[:, 0], logp_P2[:, 1], ref_logp_P2[:, 0], ref_logp_P2[:, 1], beta, cfg.label_smoothing
        )
    if kind is PreferenceLoss.ipo:
        ratio_P2 = logp_P2 - ref_logp_P2
        per_token = ratio_P2 / jnp.maximum(tokens_P2, 1.0)
        loss = (per_token[:, 0] - per_token[:, 1] - 1 / (2 * beta)) ** 2
        return loss, beta * ratio_P2[:, 0], beta * ratio_P2[:, 1]
    avg_P2 = logp_P2 / jnp.maximum(tokens_P2, 1.0)
    if kind is PreferenceLoss.simpo:
        loss = _smoothed(beta * (avg_P2[:, 0] - avg_P2[:, 1]) - cfg.simpo_gamma, cfg.label_smoothing)
    else:  # orpo: the odds-ratio term (the NLL is added by the objective)
        log_odds_P2 = avg_P2 - _log1mexp(avg_P2)
        loss = -beta * jax.nn.log_sigmoid(log_odds_P2[:, 0] - log_odds_P2[:, 1])
    return loss, beta * avg_P2[:, 0], beta * avg_P2[:, 1]


class DirectPreference(GroupedRecords):
    batch_dtypes = BATCH_DTYPES
    record_fields = FIELDS
    metric_names = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")

    def __init__(self, cfg: Config):
        self.cfg, self.dpo, self.kind = cfg, cfg.training.dpo, cfg.training.objective.preference_loss
        self.needs_reference = self.kind in (PreferenceLoss.sigmoid, PreferenceLoss.ipo)
        if self.kind is PreferenceLoss.orpo:
            self.metric_names += ("nll",)

    @property
    def packed(self) -> bool:
        return self.cfg.data.padding_free

    def _chosen(self, batch):
        """1 on the chosen answers' positions: even rows, or packed, odd segments."""
        if self.packed:
            return (batch["segment_ids"] % 2 == 1).astype(jnp.float32)
        shape = batch["loss_mask"].shape
        return jnp.broadcast_to(jnp.arange(shape[-2])[:, None] % 2 == 0, shape)

    def pair_count(self, batch):
        """The batch's pairs: half its rows, or packed, the chosen answers that start in it."""
        if self.packed:
            return jnp.sum(self._chosen(batch) * (batch["positions"] == 0))
        return jnp.float32(np.prod(batch["loss_mask"].shape[:-1]) // 2)

    def weight(self, batch):
        """The number of pairs; under ORPO also the chosen answers' tokens (its NLL's normalizer)."""
        pairs = self.pair_count(batch)
        if self.kind is not PreferenceLoss.orpo:
            return pairs
        return {"pairs": pairs, "chosen_tokens": jnp.sum(batch["loss_mask"] * self._chosen(batch))}

    def pair_sums(self, x_BT, micro):
        """Sums of x over each pair's answers [pair slots, (chosen, rejected)]: a pair is two rows,
        or packed, two segments of a row (data/pipeline.PackedPairs), its row holding T // 2 slots."""
        if not self.packed:
            return jnp.sum(x_BT, axis=-1).reshape(-1, 2)
        segments = micro["segment_ids"]
        B, T = segments.shape
        S = T + T % 2  # answer slots per row
        answer = jnp.where(segments > 0, jnp.arange(B)[:, None] * S + segments - 1, B * S)
        sums = jax.ops.segment_sum(x_BT.reshape(-1), answer.reshape(-1), num_segments=B * S + 1)
        return sums[:-1].reshape(-1, 2)

    def pairs_in(self, micro):
        """Which pair slots hold a pair (all, unpacked)."""
        if not self.packed:
            return jnp.ones(micro["loss_mask"].shape[0] // 2, bool)
        return self.pair_sums((micro["positions"] == 0).astype(jnp.float32), micro)[:, 0] > 0

    def loss(self, policy, reference, micro, weight):
        mask = micro["loss_mask"]
        held = self.pairs_in(micro)[:, None]

        def pair_sums(x_BT, empty=-1.0):  # an empty slot's: a finite stand-in, out of every mean
            return jnp.where(held, self.pair_sums(x_BT * mask, micro), empty)

        nll_BT = policy()
        logp_P2, tokens_P2 = -pair_sums(nll_BT, 1.0), pair_sums(jnp.ones_like(mask), 1.0)
        ref_logp_P2 = -pair_sums(reference(), 1.0) if self.needs_reference else None
        loss_P, chosen_P, rejected_P = preference_losses(self.kind, logp_P2, ref_logp_P2, tokens_P2, self.dpo)
        pairs = weight["pairs"] if isinstance(weight, dict) else weight

        def mean(x):
            return jnp.sum(jnp.where(held[:, 0], x, 0.0)) / pairs

        loss, metrics = mean(loss_P), {}
        if self.kind is PreferenceLoss.orpo:
            metrics["nll"] = -jnp.sum(jnp.where(held[:, 0], logp_P2[:, 0], 0.0)) / weight["chosen_tokens"]
            loss = loss + metrics["nll"]
        return loss, {
            **metrics,
            "reward_chosen": mean(chosen_P),
            "reward_rejected": mean(rejected_P),
            "reward_margin": mean(chosen_P - rejected_P),
            "reward_accuracy": mean((chosen_P > rejected_P).astype(jnp.float32)),
        }

    def read(self, data) -> None:
        """Tokenizes every pair once, before any device work: a pair too long is a ConfigError."""
        self._pairs = {
            split: [self.read_pair(data, doc, what, i) for i, doc in enumerate(docs)]
            for split, docs, what in (
                ("train", data.train_docs, "data.train_files"),
                ("eval", data.eval_docs, "the held-out pairs"),
            )
        }

    def batches(self, split: str, global_rows: int, rows: range, accumulation: int, seed):
        if self.packed:
            return PackedPairs(
                self._pairs[split],
                seq_len=self.cfg.data.seq_len,
                accumulation_steps=accumulation,
                global_micro_batch=global_rows,
                seed=seed,
                rows=rows,
                prefetch=self.cfg.data.prefetch_batches,
            )
        return self.row_pairs(self._pairs[split], global_rows, rows, accumulation, seed)

    def read_pair(self, data, doc, what: str, index: int):
        seq_len, tok = self.cfg.data.seq_len, data.tokenizer
        chat = data.chat if isinstance(doc["prompt"], list) else None
        images = self._images(doc, f"{what}: pair {index + 1}")
        prompt = prompt_ids(doc["prompt"], tok, chat, images)
        rows = []
        for field in ("chosen", "rejected"):
            completion = completion_ids(doc["prompt"], doc[field], tok, chat, images)
            length = self._positions(prompt, completion)
            if self.packed:  # both answers in one row
                length += sum(int((r["segment_ids"] > 0).sum()) for r in rows)
            if length > seq_len:
                raise ConfigError(
                    f"{what}: pair {index + 1} ({field}) is {length} tokens"
                    f"{' with its chosen answer (data.padding_free: one row)' if self.packed else ''}, "
                    f"longer than data.seq_len={seq_len}; raise data.seq_len or shorten it"
                )
            rows.append(self._row(prompt, completion))
        pair = {name: np.stack([r[name] for r in rows]) for name in rows[0]}
        if images is not None:  # both answers see the prompt's images, padded to data.images_per_row
            pair["images"] = np.zeros((2, self.cfg.data.images_per_row, *images.shape[1:]), np.float32)
            pair["images"][:, : len(images)] = images
        return pair

    def _positions(self, prompt: list[int], completion: list[int]) -> int:
        """The positions [BOS] prompt completion [EOS] takes as a row (its inputs and targets)."""
        return len(prompt) + len(completion) - 1

    def _row(self, prompt: list[int], completion: list[int]) -> dict[str, np.ndarray]:
        return padded_row(prompt, completion, self.cfg.data.seq_len)

    def _images(self, doc, where: str):
        """The prompt's images [n, *image_shape] (image-grounded pairs; None without a tower). The
        answers are text: an image in one is a one-line error."""
        from tunix_train.data.images import conversation_pixels

        vision = self.cfg.model.vision
        for field in ("prompt", "chosen", "rejected"):
            if isinstance(doc[field], list) and has_images(doc[field]):
                if field != "prompt" or vision is None:
                    raise ConfigError(
                        f"{where}: an image in its {field}; images belong in the prompt, for a model "
                        f"with model.vision"
                    )
        if vision is None:
            return None
        prompt = doc["prompt"] if isinstance(doc["prompt"], list) else []
        per_row = self.cfg.data.images_per_row
        return conversation_pixels(prompt, doc.get("images") or [], vision, per_row, None, where)
