"""The base of the objectives (see tunix_train.train.objectives for the interface)."""

from __future__ import annotations

from tunix_train.config import Config


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
