"""The training section's schema (`training.*`): the step, the optimizer, precision, remat,
parallel schedules, LoRA, each objective's own section (objectives.py) and the on-policy
objectives' sampling (rollout.py)."""

from __future__ import annotations

import dataclasses
import enum
from typing import List, Optional

from tunix_train.config.fields import _changeable, _fixed
from tunix_train.config.objectives import (
    DistillConfig,
    DpoConfig,
    GrpoConfig,
    KtoConfig,
    Objective,
    PpoConfig,
    ReinforcePpConfig,
    RewardConfig,
    RlooConfig,
)
from tunix_train.config.rollout import RolloutConfig


class MixedPrecision(enum.Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class Remat(enum.Enum):
    none = "none"  # keep every activation for the backward pass
    full = "full"  # recompute each layer in the backward pass
    save_matmul_outputs = "save_matmul_outputs"  # recompute all but matmul outputs
    offload_matmul_outputs = "offload_matmul_outputs"  # matmul outputs wait in host memory


class AttentionImpl(enum.Enum):
    xla = "xla"  # einsums and a softmax, any backend
    cudnn = "cudnn"  # cuDNN's fused flash attention: NVIDIA GPUs, bf16


class ShardingStrategy(enum.Enum):
    """What the fsdp mesh axis shards (the batch is always split over it)."""

    full_shard = "full_shard"  # parameters, gradients and optimizer state (FSDP, ZeRO-3)
    shard_grad_op = "shard_grad_op"  # gradients and optimizer state; parameters replicated (ZeRO-2)
    no_shard = "no_shard"  # nothing: plain data parallelism (DDP)


class LrSchedule(enum.Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class NanPolicy(enum.Enum):
    skip = "skip"  # drop the update of a step with a non-finite loss or gradient, count it, go on
    stop = "stop"  # save the last good state and exit non-zero


class BaseDtype(enum.Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class BaseQuantization(enum.Enum):  # training.lora.base_quantization (docs/objectives/lora.md)
    none = "none"  # the base in base_dtype
    int8 = "int8"  # per output channel, absmax / 127
    nf4 = "nf4"  # QLoRA's 4-bit NormalFloat, blocks of 64 with float32 absmax scales
    gguf = "gguf"  # the blocks of the .gguf file model.init_from names, each tensor in its own type


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # the projections an adapter can attach to
# and in the image tower (model.vision; vision_gate: Gemma 4's)
VISION_LORA_TARGETS = (
    "vision_q",
    "vision_k",
    "vision_v",
    "vision_out",
    "vision_gate",
    "vision_up",
    "vision_down",
)


@dataclasses.dataclass
class LoraConfig:
    """Low-rank adapters: W x + (alpha / rank) B A x on the target projections; the base is frozen."""

    rank: Optional[int] = _fixed(None)  # null: no adapters (every parameter trains)
    alpha: float = _fixed(16.0)
    targets: List[str] = _fixed(factory=lambda: ["q", "k", "v", "o"])  # among (VISION_)LORA_TARGETS
    # how the frozen base is held (and computes, when quantized)
    base_dtype: BaseDtype = _fixed(BaseDtype.fp32)
    # The base's projections (q k v o gate up down) held quantized, each layer dequantized in the step
    base_quantization: BaseQuantization = _fixed(BaseQuantization.none)


@dataclasses.dataclass
class TrainingConfig:
    objective: Objective = _fixed(Objective.lm)
    micro_batch_size: int = _changeable(4)  # examples per data-parallel shard per micro-step
    gradient_accumulation_steps: int = _fixed(1)
    # With a pp mesh axis: each micro-step's batch is split into this many pipeline micro-batches
    # (a multiple of pp that divides micro_batch_size), and each stage holds this many
    # non-adjacent chunks of layers (1: GPipe; more: a circular schedule, a smaller bubble).
    pipeline_microbatches: int = _changeable(1)
    pipeline_repeats: int = _changeable(1)
    mixed_precision: MixedPrecision = _fixed(MixedPrecision.fp32)
    max_steps: int = _changeable(300)
    seed: int = _fixed(0)
    learning_rate: float = _fixed(3e-3)  # peak
    warmup_steps: int = _fixed(30)
    lr_schedule: LrSchedule = _fixed(LrSchedule.cosine)
    min_learning_rate_ratio: float = _fixed(0.1)  # final lr of the decay, as a fraction of the peak
    weight_decay: float = _fixed(0.1)
    adam_b1: float = _fixed(0.9)
    adam_b2: float = _fixed(0.95)
    adam_eps: float = _fixed(1e-8)
    grad_clip_norm: float = _fixed(1.0)  # 0 disables clipping
    remat: Remat = _changeable(Remat.save_matmul_outputs)  # less memory than none (docs/performance.md)
    # Layers per iteration of the scan over layers: faster on some backends, compiles in time with it.
    scan_unroll: int = _changeable(1)
    sharding_strategy: ShardingStrategy = _changeable(ShardingStrategy.full_shard)
    # Logits this many positions at a time (recomputed backward), never [batch, seq, vocab] whole; 0: all.
    loss_chunk_size: int = _changeable(512)
    # Under bf16, gradients are reduced across devices in bf16 (accumulated in float32); false: float32.
    reduce_gradients_in_compute_dtype: bool = _changeable(True)
    # Reduce gradients across data-parallel devices once every k micro-batches (each keeping an unreduced
    # float32 gradient meanwhile): fewer, larger reductions. Must divide gradient_accumulation_steps.
    sync_gradients_every: int = _changeable(1)
    # Keep AdamW's moments in pinned host memory, moved to the devices for the update (same checkpoints).
    offload_optimizer_state: bool = _changeable(False)
    # Under bf16, keep the float32 master weights in pinned host memory too, moved for the cast and update.
    offload_master_weights: bool = _changeable(False)
    # Mixture of experts: weight of the router's load-balancing loss in the loss (MaxText's for Gemma 4
    # 26B-A4B).
    moe_aux_loss_coef: float = _fixed(0.001)
    attention: AttentionImpl = _changeable(AttentionImpl.xla)
    # XLA flags that overlap collectives with computation on NVIDIA GPUs (tunix_train/platform.py).
    xla_gpu_overlap: bool = _changeable(True)
    # XLA:CPU's multi-output fusion (tunix_train/platform.py): fewer passes over memory on CPUs.
    xla_cpu_multi_output_fusion: bool = _changeable(True)
    # Bit-identical runs on NVIDIA GPUs: XLA's deterministic kernels, not atomics (CPUs are either way).
    deterministic: bool = _changeable(True)
    log_every: int = _changeable(10)
    eval_every: int = _changeable(50)  # steps between evaluations on the held-out split; 0 disables
    eval_batches: int = _changeable(4)  # a fixed set of held-out batches per evaluation
    # lm-eval tasks (names, or YAML files) run at the start, every eval_every steps and at the last, their
    # metrics logged as eval_<task>_<metric> (the `eval` extra; tunix_train/evaluate/); a folder of task
    # YAMLs; at most this many examples a task (null: all).
    eval_tasks: List[str] = _changeable(factory=list)
    eval_tasks_include_path: Optional[str] = _changeable(None)
    eval_tasks_limit: Optional[int] = _changeable(None)
    nan_policy: NanPolicy = _changeable(NanPolicy.skip)
    # Every this many steps (and at the first and last), greedy continuations of sample_prompts go to the
    # log, samples.jsonl and TensorBoard; 0: off. Needs text data (a tokenizer).
    sample_every: int = _changeable(0)
    sample_prompts: List[str] = _changeable(factory=lambda: ["ROMEO:", "To be, or not to be,"])
    sample_max_new_tokens: int = _changeable(32)
    # Peak FLOP/s of one device for MFU; null: the table in observe/mfu.py, or measured on CPU.
    peak_flops_per_device: Optional[float] = _changeable(None)
    # Trace profile_steps steps after two warm-up steps, printing each collective's time and bytes.
    profile_communication: bool = _changeable(False)
    profile_steps: int = _changeable(3)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    dpo: DpoConfig = dataclasses.field(default_factory=DpoConfig)
    kto: KtoConfig = dataclasses.field(default_factory=KtoConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    grpo: GrpoConfig = dataclasses.field(default_factory=GrpoConfig)
    rloo: RlooConfig = dataclasses.field(default_factory=RlooConfig)
    reinforce_pp: ReinforcePpConfig = dataclasses.field(default_factory=ReinforcePpConfig)
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    ppo: PpoConfig = dataclasses.field(default_factory=PpoConfig)
