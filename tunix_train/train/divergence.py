"""The divergences of distillation between two models' next-token distributions (GKD's generalized
Jensen-Shannon divergence, objectives/distill.py's docstring), apart from the objectives so that
the rollout's draft distillation (train/draft_distill.py) reads them too."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def generalized_jsd(student_logits, teacher_logits, beta: float, temperature: float = 1.0):
    """Each position's divergence [...] from the two models' logits [..., V] (objectives/distill.py's
    docstring)."""
    s = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
    t = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)
    return jsd_of_log_probs(s, t, beta)


def top_k_jsd(student_logits, teacher_top, top_ids, beta: float, temperature: float = 1.0):
    """generalized_jsd over the k tokens `top_ids` [..., k] of each position: the student's logits
    there [..., V] -> [..., k] and the teacher's `teacher_top` [..., k] (logits or log-probabilities:
    either renormalizes alike) each renormalized over them."""
    student = jnp.take_along_axis(student_logits.astype(jnp.float32), top_ids, axis=-1)
    return generalized_jsd(student, teacher_top, beta, temperature)


def jsd_of_log_probs(s, t, beta: float):
    """The divergence of the module docstring from the student's and teacher's log-probabilities."""

    def kl(p, q):  # KL(p || q) from log-probabilities
        return jnp.sum(jnp.exp(p) * (p - q), axis=-1)

    if beta == 0:
        return kl(t, s)
    if beta == 1:
        return kl(s, t)
    m = jnp.logaddexp(s + jnp.log1p(-beta), t + jnp.log(beta))
    return beta * kl(t, m) + (1 - beta) * kl(s, m)
