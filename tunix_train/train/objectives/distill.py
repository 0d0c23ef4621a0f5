"""Distillation (objective=distill): the trained model, the student, learns a frozen teacher's
next-token distributions on the data's tokens, over the whole vocabulary in chunks
(Forward.per_token: never a [tokens, vocab] array at once under training.loss_chunk_size).

The divergence of each position is GKD's generalized Jensen-Shannon divergence with beta (Agarwal
et al. 2024, "On-Policy Distillation of Language Models", Eq. 1), at a temperature, as TRL's
GKDTrainer.generalized_jsd_loss computes it: with s and t the student's and the teacher's
log-probabilities and m the mixture (1 - beta) p_s + beta p_t,

    beta = 0:  KL(t || s)  (forward)      beta = 1:  KL(s || t)  (reverse)
    else:      beta KL(t || m) + (1 - beta) KL(s || m)

The loss is its mean over the masked tokens, plus training.distill.ce_weight times the data's
cross-entropy. The teacher is any checkpoint the loader reads (a Hugging Face directory, a .gguf,
a run), frozen, sharded on the run's mesh by the same rules, in float32 or bfloat16; it must share
the student's vocabulary and tokenizer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tunix_train.config import Config, ConfigError, MixedPrecision
from tunix_train.train.objectives.base import ExtraModel
from tunix_train.train.objectives.lm import LanguageModeling

PROBE = "The quick brown fox, 12 + 30 = 42.\nWhat's next?"  # the tokenizers must cut it alike


def generalized_jsd(student_logits, teacher_logits, beta: float, temperature: float = 1.0):
    """Each position's divergence [...] from the two models' logits [..., V] (the module docstring)."""
    s = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
    t = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)

    def kl(p, q):  # KL(p || q) from log-probabilities
        return jnp.sum(jnp.exp(p) * (p - q), axis=-1)

    if beta == 0:
        return kl(t, s)
    if beta == 1:
        return kl(s, t)
    m = jnp.logaddexp(s + jnp.log1p(-beta), t + jnp.log(beta))
    return beta * kl(t, m) + (1 - beta) * kl(s, m)


class Distillation(LanguageModeling):
    perplexity = False  # the eval loss is the divergence, not the cross-entropy

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.distill = cfg.training.distill
        self.metric_names = ("divergence", "ce") if self.distill.ce_weight else ("divergence",)
        self._teacher = None

    def teacher(self):
        """The teacher as an ExtraModel, its config read from its checkpoint, checked against the student."""
        if self._teacher is None:
            from tunix_train.interop import loader

            path = self.distill.teacher
            try:
                source = loader.source(path)
            except ConfigError as err:
                raise ConfigError(f"training.distill.teacher: {err}") from None
            model = dataclasses.replace(
                source.cfg.model, name="teacher", mesh_shape=self.cfg.model.mesh_shape
            )
            if model.vocab_size != self.cfg.model.vocab_size:
                raise ConfigError(
                    f"training.distill.teacher: {path} has vocab_size {model.vocab_size} but the student "
                    f"model.vocab_size={self.cfg.model.vocab_size}: a teacher must share its vocabulary"
                )
            precision = MixedPrecision.bf16 if self.distill.teacher_bf16 else MixedPrecision.fp32
            self._teacher = ExtraModel(model, str(source.path), precision=precision)
        return self._teacher

    def read(self, data) -> None:
        """The teacher's checkpoint and tokenizer, checked before any device work."""
        from tunix_train.data.tokenizer import carries_tokenizer, load_tokenizer

        teacher = self.teacher()
        tokenizer = getattr(data, "tokenizer", None)  # none for pre-tokenized data
        if tokenizer is not None and carries_tokenizer(teacher.source):
            theirs = load_tokenizer(teacher.source, teacher.model.vocab_size, "training.distill.teacher")
            if theirs.encode(PROBE) != tokenizer.encode(PROBE):
                raise ConfigError(
                    f"training.distill.teacher: {teacher.source}'s tokenizer cuts text unlike the run's "
                    f"(data.tokenizer): a teacher must share the student's tokenizer"
                )

    def extra_models(self):
        return {"teacher": self.teacher()}

    def loss(self, policy, reference, micro, weight, models):
        d, mask = self.distill, micro["loss_mask"]
        divergence = policy.per_token(
            lambda s, t: generalized_jsd(s, t, d.beta, d.temperature), models["teacher"]
        )
        divergence = jnp.sum(divergence * mask) / weight
        metrics = {"divergence": divergence}
        loss = divergence
        if d.ce_weight:
            metrics["ce"] = jnp.sum(policy() * mask) / weight
            loss = loss + d.ce_weight * metrics["ce"]
        return loss, metrics
