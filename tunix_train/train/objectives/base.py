"""The base of the objectives (see tunix_train.train.objectives for the interface)."""

from __future__ import annotations

import dataclasses

from tunix_train.config import Config, MixedPrecision, ModelConfig


@dataclasses.dataclass(frozen=True)
class ExtraModel:
    """A frozen model an objective reads beside the one it trains (a teacher, a reward model): its
    config (any size; the vocabulary the objective needs), where its weights come from (a Hugging
    Face directory or GGUF file; None: fresh from `seed`) and the dtype it computes in. It is
    sharded by the same rules table on the run's mesh, and never updated or checkpointed."""

    model: ModelConfig
    source: str | None = None
    seed: int = 0
    precision: MixedPrecision = MixedPrecision.fp32


class Objective:
    """The parts an objective may leave as they are."""

    needs_reference = False
    record_fields = None
    perplexity = False
    metric_names: tuple[str, ...] = ()
    temperature = 1.0  # the logits of policy() and reference() are divided by it

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def updates(self, batch):
        """Whether the batch may update the weights (in the compiled step; a non-finite one never does)."""
        return True

    def read(self, data) -> None:
        pass

    def eval_batches(self, data, global_rows: int, rows: range) -> list:
        return []

    def connect(self, run, write_samples) -> None:
        pass

    def prepare(self, batches, state):
        return next(batches)

    def hooks(self) -> list:
        return []

    def extra_models(self) -> dict[str, ExtraModel]:
        """The models its loss reads beside the policy and the reference, by name: loss() then
        gets `models`, a Forward (train/forward.py) of each on the same micro-batch."""
        return {}
