"""Kahneman-Tversky optimization (Ethayarajh et al. 2024, eq. 7) on unpaired data: records of a
prompt, a completion and a label (true: desirable), as TRL 1.16's KTOTrainer (loss_type "kto")
computes it. With r(y) = log pi(y|x) - log ref(y|x) a completion's log-ratio summed over its tokens
(and its EOS), and z the reference point, the policy's KL from the reference estimated on
mismatched pairs (each prompt with another record's completion), averaged over the micro-batch,
floored at 0 and held constant (no gradient):

    desirable:   w_d (1 - sig(beta (r(y) - z)))
    undesirable: w_u (1 - sig(beta (z - r(y))))

averaged over the batch's records. A record is two rows, its own ([BOS] prompt completion [EOS])
then its mismatched one (its prompt with the completion of the record before it in the file,
cyclically; TRL rotates the completions within each batch instead), kept on one device like a DPO
pair. The micro-batch's KL estimate spans all its devices, as TRL gathers it across processes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tunix_train.config import Config, ConfigError, KtoConfig
from tunix_train.data.chat import completion_ids, prompt_ids
from tunix_train.data.pipeline import padded_row
from tunix_train.train.objectives.base import GroupedRecords
from tunix_train.train.objectives.lm import BATCH_DTYPES

FIELDS = ("prompt", "completion")  # text or messages; and a label, true or false (read checks it)


def kto_losses(logratio_R, kl_logratio_R, desirable_R, cfg: KtoConfig):
    """(each record's loss, the reference point z, each record's reward beta r(y)) of the records'
    summed log-ratios [R] on their own and on their mismatched completions, and their labels."""
    z = jax.lax.stop_gradient(jnp.maximum(jnp.mean(kl_logratio_R), 0.0))
    desirable = cfg.desirable_weight * (1 - jax.nn.sigmoid(cfg.beta * (logratio_R - z)))
    undesirable = cfg.undesirable_weight * (1 - jax.nn.sigmoid(cfg.beta * (z - logratio_R)))
    return jnp.where(desirable_R, desirable, undesirable), z, cfg.beta * logratio_R


class KahnemanTversky(GroupedRecords):
    batch_dtypes = {**BATCH_DTYPES, "desirable": jnp.float32}
    record_fields = FIELDS
    needs_reference = True
    metric_names = ("kl", "reward_desirable", "reward_undesirable")

    def __init__(self, cfg: Config):
        self.cfg, self.kto = cfg, cfg.training.kto

    def weight(self, batch):
        """The batch's records: half its rows."""
        return jnp.float32(np.prod(batch["loss_mask"].shape[:-1]) // 2)

    def loss(self, policy, reference, micro, weight):
        mask = micro["loss_mask"]

        def record_sums(x_BT):  # [records, (own, mismatched)]
            return jnp.sum(x_BT * mask, axis=-1).reshape(-1, 2)

        logratio_R2 = record_sums(reference()) - record_sums(policy())  # nll is -log p
        desirable_R = micro["desirable"][0::2, 0] > 0
        loss_R, z, reward_R = kto_losses(logratio_R2[:, 0], logratio_R2[:, 1], desirable_R, self.kto)
        records = loss_R.shape[0]

        def mean_where(which):  # over this micro-batch's records of one label; 0 without any
            return jnp.sum(jnp.where(which, reward_R, 0.0)) / jnp.maximum(jnp.sum(which), 1)

        share = records / weight  # so the metrics add up over micro-batches to the batch's mean
        return jnp.sum(loss_R) / weight, {
            "kl": z * share,
            "reward_desirable": mean_where(desirable_R) * share,
            "reward_undesirable": mean_where(~desirable_R) * share,
        }

    def read(self, data) -> None:
        """Tokenizes every record and its mismatched row once, before any device work."""
        self._records = {
            split: self._read_split(data, docs, what)
            for split, docs, what in (
                ("train", data.train_docs, "data.train_files"),
                ("eval", data.eval_docs, "the held-out records"),
            )
        }

    def _read_split(self, data, docs, what: str) -> list[dict]:
        seq_len, tok = self.cfg.data.seq_len, data.tokenizer
        tokenized = []
        for i, doc in enumerate(docs):
            if not isinstance(doc.get("label"), bool):
                raise ConfigError(
                    f"{what}: record {i + 1}'s label is {doc.get('label')!r}: write true (a desirable "
                    f"completion) or false"
                )
            chat = data.chat if isinstance(doc["prompt"], list) else None
            prompt = prompt_ids(doc["prompt"], tok, chat)
            tokenized.append(
                (prompt, completion_ids(doc["prompt"], doc["completion"], tok, chat), doc["label"])
            )
        records = []
        for i, (prompt, completion, label) in enumerate(tokenized):
            mismatched = tokenized[i - 1][1]  # the record before's completion, cyclically
            rows = []
            for which, answer in (("completion", completion), ("mismatched completion", mismatched)):
                if len(prompt) + len(answer) - 1 > seq_len:
                    raise ConfigError(
                        f"{what}: record {i + 1} ({which}) is {len(prompt) + len(answer) - 1} tokens, longer "
                        f"than data.seq_len={seq_len}; raise data.seq_len or shorten it"
                    )
                rows.append(padded_row(prompt, answer, seq_len))
            record = {name: np.stack([r[name] for r in rows]) for name in rows[0]}
            record["desirable"] = np.full((2, seq_len), float(label), np.float32)
            records.append(record)
        return records

    def batches(self, split: str, global_rows: int, rows: range, accumulation: int, seed):
        return self.row_pairs(self._records[split], global_rows, rows, accumulation, seed)
