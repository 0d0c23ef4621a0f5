"""Distillation (objective=distill): the trained model, the student, learns a frozen teacher's
next-token distributions on the data's tokens, over the whole vocabulary in chunks
(Forward.per_token: never a [tokens, vocab] array at once under training.loss_chunk_size).

The divergence of each position is GKD's generalized Jensen-Shannon divergence with beta (Agarwal
et al. 2024, "On-Policy Distillation of Language Models", Eq. 1), at a temperature, as TRL's
GKDTrainer.generalized_jsd_loss computes it: with s and t the student's and the teacher's
log-probabilities and m the mixture (1 - beta) p_s + beta p_t,

    beta = 0:  KL(t || s)  (forward)      beta = 1:  KL(s || t)  (reverse)
    else:      beta KL(t || m) + (1 - beta) KL(s || m)

With training.distill.top_k = k, the divergence is of the two distributions over the teacher's k
likeliest tokens of each position, each renormalized over them (k-way distributions: any beta
stays a divergence); the student's logits are gathered there from its whole row.

The loss is its mean over the masked tokens, plus training.distill.ce_weight times the data's
cross-entropy. The teacher is any checkpoint the loader reads (a Hugging Face directory, a .gguf,
a run), frozen, sharded on the run's mesh by the same rules, in float32 or bfloat16; it must share
the student's vocabulary and tokenizer.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp

from tunix_train.config import Config, ConfigError, MixedPrecision
from tunix_train.data import teacher_logits
from tunix_train.train.divergence import generalized_jsd, top_k_jsd
from tunix_train.train.objectives.base import PROBE, ExtraModel, check_tokenizer, checkpoint_model
from tunix_train.train.objectives.lm import LanguageModeling


def divergence(student, teacher, d) -> jnp.ndarray:
    """Each position's divergence of training.distill `d` from the two models' logits (over the
    teacher's top k if set)."""
    if not d.top_k:
        return generalized_jsd(student, teacher, d.beta, d.temperature)
    teacher_top, top_ids = jax.lax.top_k(teacher, d.top_k)
    return top_k_jsd(student, teacher_top, top_ids, d.beta, d.temperature)


def teacher_model(cfg: Config) -> ExtraModel:
    """training.distill.teacher as an ExtraModel on the run's mesh (base.checkpoint_model)."""
    precision = MixedPrecision.bf16 if cfg.training.distill.teacher_bf16 else MixedPrecision.fp32
    distill = cfg.training.distill
    return checkpoint_model(
        cfg, distill.teacher, "training.distill.teacher", "teacher", precision, distill.teacher_offload
    )


class Distillation(LanguageModeling):
    perplexity = False  # the eval loss is the divergence, not the cross-entropy

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.distill = d = cfg.training.distill
        self.metric_names = ("divergence", "ce") if d.ce_weight else ("divergence",)
        self.stored = None if d.teacher_logits is None else teacher_logits.read_meta(d.teacher_logits)
        if self.stored is not None:  # the batches come with the teacher's top k
            self.top_k = self._stored_k()
            k = self.stored["top_k"]
            self.batch_dtypes = {
                **self.batch_dtypes,
                "top_ids": (jnp.int32, (k,)),
                "top_log_probs": (jnp.float32, (k,)),
            }

    @functools.cached_property
    def teacher(self) -> ExtraModel:
        """The teacher as an ExtraModel (teacher_model), read once."""
        return teacher_model(self.cfg)

    def _stored_k(self) -> int:
        """The k of the divergence over stored top-k log-probabilities, checked against the run."""
        meta, c, key = self.stored, self.cfg, teacher_logits.KEY
        want = {
            "vocab_size": c.model.vocab_size,
            "seq_len": c.data.seq_len,
            "accumulation_steps": c.training.gradient_accumulation_steps,
        }
        for name, value in want.items():
            if meta[name] != value:
                raise ConfigError(
                    f"{key}: {self.distill.teacher_logits} was written with {name}={meta[name]} but "
                    f"this run has {value}; rewrite it with scripts/teacher_logits.py for this run"
                )
        if meta["steps"] < c.training.max_steps:
            raise ConfigError(
                f"{key}: {self.distill.teacher_logits} holds {meta['steps']} steps, fewer than "
                f"training.max_steps={c.training.max_steps}"
            )
        if self.distill.top_k > meta["top_k"]:
            raise ConfigError(
                f"training.distill.top_k={self.distill.top_k} is more than the {meta['top_k']} "
                f"log-probabilities per token {self.distill.teacher_logits} holds"
            )
        return self.distill.top_k or meta["top_k"]  # the stored k, sorted: the first top_k of them

    def read(self, data) -> None:
        """The teacher's checkpoint and tokenizer (or the stored log-probabilities' tokenizer),
        checked before any device work."""
        tokenizer = getattr(data, "tokenizer", None)  # none for pre-tokenized data
        if self.stored is not None:
            probe = self.stored.get("probe")
            if tokenizer is not None and probe is not None and tokenizer.encode(PROBE) != probe:
                raise ConfigError(
                    f"{teacher_logits.KEY}: {self.distill.teacher_logits} was written with another "
                    f"tokenizer than the run's (data.tokenizer)"
                )
            return
        check_tokenizer(self.teacher, tokenizer, "training.distill.teacher")

    def extra_models(self):
        return {} if self.stored is not None else {"teacher": self.teacher}

    def _stored_batches(self, split: str, global_rows: int, rows: range):
        if self.stored["global_micro_batch"] != global_rows:
            raise ConfigError(
                f"{teacher_logits.KEY}: {self.distill.teacher_logits} holds batches of "
                f"{self.stored['global_micro_batch']} rows per micro-step but this run takes {global_rows} "
                f"(training.micro_batch_size times the data-parallel shards)"
            )
        return teacher_logits.StoredBatches(self.distill.teacher_logits, split, rows, self.stored)

    def train_batches(self, data, global_rows: int, rows: range):
        if self.stored is None:
            return super().train_batches(data, global_rows, rows)
        return self._stored_batches("train", global_rows, rows)

    def eval_batches(self, data, global_rows: int, rows: range):
        if self.stored is None:
            return super().eval_batches(data, global_rows, rows)
        wanted = self.cfg.training.eval_batches
        if self.stored["eval_batches"] < wanted:
            raise ConfigError(
                f"{teacher_logits.KEY}: {self.distill.teacher_logits} holds {self.stored['eval_batches']} "
                f"evaluation batches, fewer than training.eval_batches={wanted}"
            )
        return list(itertools.islice(self._stored_batches("eval", global_rows, rows), wanted))

    def loss(self, policy, reference, micro, weight, models=None):
        d, mask = self.distill, micro["loss_mask"]
        if self.stored is None:
            per_token = policy.per_token(lambda s, t: divergence(s, t, d), models["teacher"])
        else:
            k = self.top_k
            per_token = policy.per_token(
                lambda s, log_probs, ids: top_k_jsd(
                    s, log_probs[..., :k], ids[..., :k], d.beta, d.temperature
                ),
                fields=("top_log_probs", "top_ids"),
            )
        mean = jnp.sum(per_token * mask) / weight
        metrics = {"divergence": mean}
        loss = mean
        if d.ce_weight:
            metrics["ce"] = jnp.sum(policy() * mask) / weight
            loss = loss + d.ce_weight * metrics["ce"]
        return loss, metrics
