"""GRPO's reward models (training.rollout.reward_models): checkpoints with a scalar head
(model.score_head: objective=reward's exports, transformers' ...ForSequenceClassification) that
score each completion after a rollout, beside the reward functions.

Each model is frozen on the rollout's mesh (the training mesh, or training.rollout.mesh_shape's),
sharded by the same rules, and reads [BOS] prompt completion as the trained model does (the same
vocabulary and tokenizer, checked): its head's value at the sequence's last token (the EOS where
the completion stopped) is the reward, as objective=reward trained it and transformers pools it.
A rollout's rows are scored in one batch per model, padded to the mesh's data shards.
"""

from __future__ import annotations

import numpy as np

from tunix_train.config import Config, ConfigError, MixedPrecision
from tunix_train.train.objectives.base import check_tokenizer, checkpoint_model

KEY = "training.rollout.reward_models"


class RewardModels:
    """The run's reward models: read (their configs, checked), then connected to a mesh, then scoring."""

    def __init__(self, cfg: Config):
        self.cfg, self.specs = cfg, {}
        for i, path in enumerate(cfg.training.rollout.reward_models):
            spec = checkpoint_model(cfg, path, KEY, f"reward_model_{i}", MixedPrecision.fp32)
            if not spec.model.score_head:
                raise ConfigError(
                    f"{KEY}: {path} has no scalar head (score.weight; a ...ForSequenceClassification "
                    f"checkpoint, or objective=reward's run); train one with objective=reward"
                )
            if spec.model.vision is not None:
                raise ConfigError(
                    f"{KEY}: {path} has an image tower (a reward model trained on images); GRPO's "
                    f"reward models read the completions' text only: use one without a tower"
                )
            self.specs[spec.model.name] = spec
        self.names = [f"reward_model_{i}" for i in range(len(self.specs))]
        self._frozen = None

    def __len__(self) -> int:
        return len(self.specs)

    def check_tokenizer(self, tokenizer) -> None:
        for spec in self.specs.values():
            check_tokenizer(spec, tokenizer, KEY)

    def connect(self, plan_frozen, mesh) -> None:
        """Plans the models on `mesh` (plan_frozen: train/setup.Connection's); their weights load at
        the first score."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from tunix_train.sharding import data_axes, data_parallel_size
        from tunix_train.train.forward import Forward

        self._frozen = plan_frozen(self.specs, mesh)
        self.shards = data_parallel_size(mesh)
        self._rows = NamedSharding(mesh, P(data_axes(mesh) or None, None))
        graphdefs = self._frozen.graphdefs

        def scores(params, micro):
            out = {}
            for name in graphdefs:
                forward = Forward(graphdefs[name], (params[name],), micro, frozen=True)
                out[name] = jnp.sum(forward.scores() * micro["loss_mask"], axis=-1)
            return out

        self._scores = jax.jit(scores)

    def score(self, sequences: list[list[int]]) -> np.ndarray:
        """[models, rows]: each model's reward of each token sequence ([BOS] prompt completion)."""
        import jax

        from tunix_train.data.pipeline import scored_row

        T = self.cfg.data.seq_len
        rows = [scored_row(ids[:T], T) for ids in sequences]
        rows += [scored_row([0], T)] * (-len(rows) % self.shards)  # padding rows, scored and dropped
        stacked = {
            name: np.stack([r[name] for r in rows])
            for name in ("inputs", "loss_mask", "positions", "segment_ids")
        }
        batch = {  # every process holds the whole rollout: each device takes its rows of it
            name: jax.make_array_from_callback(x.shape, self._rows, lambda index, x=x: x[index])
            for name, x in stacked.items()
        }
        with jax.set_mesh(self._rows.mesh):
            out = jax.device_get(self._scores(self._frozen.params(), batch))
        return np.stack([np.asarray(out[name], np.float64)[: len(sequences)] for name in self.specs])
