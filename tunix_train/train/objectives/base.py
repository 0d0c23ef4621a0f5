"""The base of the objectives (see tunix_train.train.objectives for the interface)."""

from __future__ import annotations

import dataclasses

from tunix_train.config import Config, ConfigError, MixedPrecision, ModelConfig
from tunix_train.data.pipeline import GroupBatches


@dataclasses.dataclass(frozen=True)
class ExtraModel:
    """A frozen model an objective reads beside the one it trains (a teacher, a reward model): its
    config (any size; the vocabulary the objective needs), where its weights come from (a Hugging
    Face directory, a GGUF file or a run; None: fresh from `seed`), the dtype it computes in, and
    whether it waits in pinned host memory between the steps that use it (offload). It is sharded by
    the same rules table on the run's mesh, and never updated or checkpointed."""

    model: ModelConfig
    source: str | None = None
    seed: int = 0
    precision: MixedPrecision = MixedPrecision.fp32
    offload: bool = False


PROBE = "The quick brown fox, 12 + 30 = 42.\nWhat's next?"  # tokenizers that must agree cut it alike


def checkpoint_model(
    cfg: Config,
    path: str,
    key: str,
    name: str,
    precision: MixedPrecision = MixedPrecision.fp32,
    offload: bool = False,
) -> ExtraModel:
    """The checkpoint at `path` (config key `key`) as an ExtraModel named `name` on the run's mesh,
    its config read from the checkpoint; a one-line error when it cannot be read or has another
    vocabulary than the trained model."""
    from tunix_train.interop import loader

    try:
        source = loader.source(path)
    except ConfigError as err:
        raise ConfigError(f"{key}: {err}") from None
    model = dataclasses.replace(source.cfg.model, name=name, mesh_shape=cfg.model.mesh_shape)
    if model.vocab_size != cfg.model.vocab_size:
        raise ConfigError(
            f"{key}: {path} has vocab_size {model.vocab_size} but the trained model's "
            f"model.vocab_size={cfg.model.vocab_size}: it must share its vocabulary"
        )
    return ExtraModel(model, str(source.path), precision=precision, offload=offload)


def check_tokenizer(model: ExtraModel, tokenizer, key: str) -> None:
    """A one-line error when `model` carries a tokenizer that cuts text unlike the run's."""
    from tunix_train.data.tokenizer import carries_tokenizer, load_tokenizer

    if tokenizer is not None and carries_tokenizer(model.source):
        theirs = load_tokenizer(model.source, model.model.vocab_size, key)
        if theirs.encode(PROBE) != tokenizer.encode(PROBE):
            raise ConfigError(
                f"{key}: {model.source}'s tokenizer cuts text unlike the run's (data.tokenizer): it "
                f"must share the trained model's tokenizer"
            )


class Objective:
    """The parts an objective may leave as they are."""

    needs_reference = False
    record_fields = None
    perplexity = False
    metric_names: tuple[str, ...] = ()
    temperature = 1.0  # the logits of policy() and reference() are divided by it
    skips_empty_micro_batches = False
    scores = False  # whether it has a scoring pass (score(); PPO's critic)

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def updates(self, batch):
        """Whether the batch may update the weights (in the compiled step; a non-finite one never does)."""
        return True

    def read(self, data) -> None:
        pass

    def eval_batches(self, data, global_rows: int, rows: range) -> list:
        return []

    def connect(self, link) -> None:
        """What it needs of the run once set up (train/setup.Connection): GRPO's engine, PPO's scoring."""

    def prepare(self, batches, state):
        return next(batches)

    def checkpoint_items(self) -> dict:
        """Trees of arrays a checkpoint keeps beside the state (name: tree), read back through
        Connection.resumed_from (GRPO's distilled draft)."""
        return {}

    def hooks(self) -> list:
        return []

    def score(self, policy, reference, micro) -> dict:
        """Per-token figures [B, T] of a micro-batch for the scoring pass (objectives/__init__.py)."""
        raise NotImplementedError(f"{type(self).__name__} has no scoring pass")

    def extra_models(self) -> dict[str, ExtraModel]:
        """The models its loss reads beside the policy and the reference, by name: loss() then
        gets `models`, a Forward (train/forward.py) of each on the same micro-batch."""
        return {}


class GroupedRecords(Objective):
    """An objective whose records are groups of rows it read itself (DPO's pairs, KTO's record and
    its mismatched row), batched by `batches(split, global_rows, rows, accumulation, seed)`."""

    def batches(self, split: str, global_rows: int, rows: range, accumulation: int, seed):
        raise NotImplementedError

    def row_pairs(self, groups: list, global_rows: int, rows: range, accumulation: int, seed):
        """Batches of `groups` of two rows each, a group never split across devices."""
        return GroupBatches(
            groups,
            accumulation_steps=accumulation,
            groups_per_micro_batch=global_rows // 2,
            seed=seed,
            slots=range(rows.start // 2, rows.stop // 2),
            prefetch=self.cfg.data.prefetch_batches,
        )

    def train_batches(self, data, global_rows: int, rows: range):
        t = self.cfg.training
        return self.batches("train", global_rows, rows, t.gradient_accumulation_steps, t.seed)

    def eval_batches(self, data, global_rows: int, rows: range):
        batches = self.batches("eval", global_rows, rows, 1, None)
        try:
            return [next(batches) for _ in range(self.cfg.training.eval_batches)]
        finally:
            batches.close()
