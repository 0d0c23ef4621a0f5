"""AdamW with warmup, a decay schedule and global-norm clipping, from TrainingConfig."""

from __future__ import annotations

import jax
import optax
from flax import nnx

from tunix_train.config import LrSchedule, TrainingConfig


def learning_rate_schedule(t: TrainingConfig) -> optax.Schedule:
    """Linear warmup to the peak, then cosine or linear decay to min_learning_rate_ratio x peak."""
    peak, final = t.learning_rate, t.learning_rate * t.min_learning_rate_ratio
    warmup = optax.linear_schedule(0.0, peak, max(t.warmup_steps, 1))
    decay_steps = max(t.max_steps - t.warmup_steps, 1)
    decay = {
        LrSchedule.cosine: lambda: optax.cosine_decay_schedule(
            peak, decay_steps, alpha=final / peak if peak else 0.0
        ),
        LrSchedule.linear: lambda: optax.linear_schedule(peak, final, decay_steps),
        LrSchedule.constant: lambda: optax.constant_schedule(peak),
    }[t.lr_schedule]()
    return optax.join_schedules([warmup, decay], [t.warmup_steps])


def _decay_mask(params):
    """Decay matrices; not norm scales (one axis besides the stacked `layers` axis)."""

    def decays(v: nnx.Variable):
        return v.replace(sum(a != "layers" for a in v.get_metadata()["axes"]) >= 2)

    return jax.tree.map(decays, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(t: TrainingConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = learning_rate_schedule(t)
    adamw = optax.adamw(
        schedule, b1=t.adam_b1, b2=t.adam_b2, eps=t.adam_eps, weight_decay=t.weight_decay, mask=_decay_mask
    )
    if t.grad_clip_norm > 0:
        adamw = optax.chain(optax.clip_by_global_norm(t.grad_clip_norm), adamw)
    return adamw, schedule
