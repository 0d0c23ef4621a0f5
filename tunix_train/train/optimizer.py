"""AdamW with warmup, a decay schedule and global-norm clipping, from TrainingConfig."""

from __future__ import annotations

import jax
import optax
from flax import nnx

from tunix_train.config import LrSchedule, ModelConfig, TrainingConfig


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


STACK_AXES = ("layers", "vision_layers")  # a stack of layers' leading axis


def _decay_mask(params):
    """Decay matrices; not norm scales (one axis besides a stack's axis)."""

    def decays(v: nnx.Variable):
        return v.replace(sum(a not in STACK_AXES for a in v.get_metadata()["axes"]) >= 2)

    return jax.tree.map(decays, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _frozen_tower_labels(params):
    """ "frozen" for the image tower's parameters (model.vision.trainable false), "train" for the rest."""

    def label(path, v: nnx.Variable):
        return v.replace("frozen" if getattr(path[0], "key", None) == "vision" else "train")

    return jax.tree_util.tree_map_with_path(label, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(
    t: TrainingConfig, model: ModelConfig | None = None
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW as training configures it; with `model`'s image tower frozen, its parameters get no
    update and no optimizer state (the model passes them no gradient either)."""
    schedule = learning_rate_schedule(t)
    adamw = optax.adamw(
        schedule, b1=t.adam_b1, b2=t.adam_b2, eps=t.adam_eps, weight_decay=t.weight_decay, mask=_decay_mask
    )
    # (under LoRA only adapters train, the tower's among them when it is targeted)
    if model is not None and model.vision is not None and not model.vision.trainable and t.lora.rank is None:
        adamw = optax.multi_transform({"train": adamw, "frozen": optax.set_to_zero()}, _frozen_tower_labels)
    if t.grad_clip_norm > 0:
        adamw = optax.chain(optax.clip_by_global_norm(t.grad_clip_norm), adamw)
    return adamw, schedule
