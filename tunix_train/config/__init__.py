"""The typed configuration's schema: one dataclass per section, each field typed and marked.

Every field says whether a resumed run may change it: `_changeable` (how the run executes, logs
or saves) or `_fixed` (what it computes); `changeable_on_resume` reads the marks.

A package by section: model.py, data.py, training.py (with objectives.py, the objectives' own
sections) and here the run's: the checkpoints, distribution and the whole Config. Every name is
importable from tunix_train.config; fields.py holds the marks and ConfigError.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Optional

from tunix_train.config.data import (  # noqa: F401  (re-exported)
    CHAT_ROLES,
    DataConfig,
    DataSource,
    ReasoningGymConfig,
    TextUnit,
)
from tunix_train.config.deprecated import RETIRED_KEYS, upgraded  # noqa: F401
from tunix_train.config.fields import _RESUME, ConfigError, _changeable, _fixed  # noqa: F401
from tunix_train.config.model import (  # noqa: F401  (re-exported)
    LAYER_TYPES,
    Activation,
    ContextParallelStrategy,
    EncoderTraits,
    Gemma4Config,
    ImageAttention,
    ModelConfig,
    MoeConfig,
    MoeDispatch,
    MoeRouter,
    RopeScaling,
    RopeScalingType,
    VisionConfig,
    VisionEncoder,
    field_of,
    with_fields,
)
from tunix_train.config.objectives import (  # noqa: F401  (re-exported: the schema's one import)
    AdvantageEstimator,
    DistillConfig,
    DpoConfig,
    GrpoAggregation,
    GrpoConfig,
    ImportanceLevel,
    KlEstimator,
    KtoConfig,
    Objective,
    OffPolicyCorrection,
    PolicyLoss,
    PpoConfig,
    PreferenceLoss,
    ReinforcePpConfig,
    RewardConfig,
    RewardNormalization,
    RlooConfig,
    ScaleRewards,
)
from tunix_train.config.rollout import OpenEnvConfig, Overlong, RolloutConfig, RolloutDtype  # noqa: F401
from tunix_train.config.training import (  # noqa: F401  (re-exported)
    LORA_TARGETS,
    VISION_LORA_TARGETS,
    AttentionImpl,
    BaseDtype,
    BaseQuantization,
    LoraConfig,
    LrSchedule,
    MixedPrecision,
    NanPolicy,
    Remat,
    ShardingStrategy,
    TrainingConfig,
)


@dataclasses.dataclass
class CheckpointConfig:
    every_steps: int = _changeable(100)  # 0: only at the end and on preemption
    # Also save when this much time has passed since the last save; 0: off.
    every_seconds: float = _changeable(0.0)
    keep: int = _changeable(3)  # the most recent checkpoints kept
    # Start from this checkpoint (a run directory, its checkpoints/ folder, or one step's folder)
    # instead of the run directory's own latest one.
    resume_from: Optional[str] = _changeable(None)
    # A run directory whose every checkpoint is damaged is an error (a run never silently starts over
    # beside them); true: start over, the damaged ones kept as checkpoints/unreadable-<step>.
    start_over_if_unreadable: bool = _changeable(False)


@dataclasses.dataclass
class DistributedConfig:
    """Multi-process runs; see tunix_train/launch/distributed.py for how each source is tried."""

    coordinator_address: Optional[str] = _changeable(None)  # host:port of process 0
    num_processes: Optional[int] = _changeable(None)
    process_id: Optional[int] = _changeable(None)
    initialization_timeout_s: int = _changeable(300)  # give up reaching the coordinator after this long
    # A process silent this long is declared dead by the coordinator.
    heartbeat_timeout_s: int = _changeable(100)


@dataclasses.dataclass
class Config:
    experiment: str = _fixed("default")
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)


def changeable_on_resume(schema: type | None = None, prefix: str = "") -> dict[str, bool]:
    """Every dotted key of `schema` (default: Config) -> whether a resumed run may change it, from
    the fields' marks. Raises TypeError naming a field that has no mark."""
    schema = schema or Config
    marks, types = {}, typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        key = f"{prefix}{field.name}"
        if dataclasses.is_dataclass(types[field.name]):
            marks.update(changeable_on_resume(types[field.name], f"{key}."))
        elif _RESUME in field.metadata:
            marks[key] = field.metadata[_RESUME]
        else:
            raise TypeError(
                f"config field {key} says neither _changeable nor _fixed: mark whether a resumed "
                f"run may change it"
            )
    return marks


def reads_text(data: DataConfig) -> bool:
    """Whether the run's data comes through a tokenizer (not synthetic, nor pre-tokenized without one)."""
    return not (
        data.source is DataSource.synthetic or (data.source is DataSource.array_record and not data.tokenizer)
    )
