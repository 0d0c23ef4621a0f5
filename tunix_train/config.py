"""The typed configuration's schema: one dataclass per section, each field typed and marked.

Every field says whether a resumed run may change it: `_changeable` (how the run executes, logs
or saves) or `_fixed` (what it computes); `changeable_on_resume` reads the marks.

One file: every section's keys but the objectives' (config_objectives.py), so that a key's type,
default, meaning and mark read in one place.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import typing
from typing import Any, List, Optional

from omegaconf import MISSING

from tunix_train.config_fields import _RESUME, ConfigError, _changeable, _fixed
from tunix_train.config_objectives import (  # noqa: F401  (re-exported: the schema's one import)
    AdvantageEstimator,
    DistillConfig,
    DpoConfig,
    GrpoAggregation,
    GrpoConfig,
    ImportanceLevel,
    KlEstimator,
    Overlong,
    PpoConfig,
    PreferenceLoss,
    RewardConfig,
    RewardNormalization,
    RolloutDtype,
    ScaleRewards,
)


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


class ContextParallelStrategy(enum.Enum):
    """How attention reaches the keys of other cp shards (tunix_train/parallel/context.py)."""

    all_gather = "all_gather"  # gather every layer's keys and values, then attend to them all
    ring = "ring"  # pass key/value blocks round the cp ring, skipping blocks the causal mask hides


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


class Objective(enum.Enum):
    """What training optimizes (tunix_train/train/objectives/)."""

    lm = "lm"  # next-token cross-entropy: pre-training and supervised fine-tuning
    dpo = "dpo"  # direct preference optimization on (prompt, chosen, rejected) pairs
    grpo = "grpo"  # group relative policy optimization: sampled completions scored by reward functions
    distill = "distill"  # the trained model learns a frozen teacher's distributions on the data
    reward = "reward"  # a scalar head learns to score the chosen answer of each pair above the rejected


class MoeDispatch(enum.Enum):
    """How a mixture-of-experts layer sends tokens to their experts (tunix_train/model/moe.py)."""

    dropless = "dropless"  # every token copy through its expert, whatever the group sizes (none dropped)
    capacity = "capacity"  # fixed slots per expert (capacity_factor x the even share); overflow is dropped


class MoeRouter(enum.Enum):
    """How a mixture-of-experts layer scores its experts (tunix_train/model/moe.py)."""

    # Gemma 4: the residual stream normed with a learned scale; the top k renormalised, then each
    # multiplied by its expert's learned scale
    gemma4 = "gemma4"
    # Qwen 3 MoE, Mixtral: a linear gate on the layer's normed input; the top k renormalised where
    # moe_norm_topk_prob
    softmax = "softmax"


class Activation(enum.Enum):
    """The MLP's (and the experts') gate activation: act(gate(x)) * up(x)."""

    gelu_tanh = "gelu_tanh"  # GeGLU with tanh-approximated GELU (transformers' gelu_pytorch_tanh): Gemma
    silu = "silu"  # SwiGLU: Llama, Qwen


class RopeScalingType(enum.Enum):
    """Long-context RoPE frequency schedules (transformers' ROPE_INIT_FUNCTIONS of the same names)."""

    none = "none"
    llama3 = "llama3"  # Llama 3.1+: low frequencies divided by factor, a smooth band between
    yarn = "yarn"  # YaRN (arXiv 2309.00071): per-frequency interpolation ramp and an attention factor


@dataclasses.dataclass
class RopeScaling:
    """model.rope_scaling: how the global layers' rotary frequencies stretch past the context the
    model was pre-trained on (Gemma 3's linear factor is model.rope_scale_global)."""

    type: RopeScalingType = _fixed(RopeScalingType.none)
    factor: float = _fixed(1.0)  # how many times longer the context becomes
    original_context: int = _fixed(0)  # the pre-training context (original_max_position_embeddings)
    low_freq_factor: float = _fixed(1.0)  # llama3
    high_freq_factor: float = _fixed(4.0)  # llama3
    beta_fast: float = _fixed(32.0)  # yarn: the ramp's extrapolation bound, in rotations
    beta_slow: float = _fixed(1.0)  # yarn: the ramp's interpolation bound, in rotations
    attention_factor: Optional[float] = _fixed(None)  # yarn: cos and sin scale; null: 0.1 ln(factor) + 1
    truncate: bool = _fixed(True)  # yarn: the ramp's bounds rounded outward to whole dimensions


class VisionEncoder(enum.Enum):
    """model.vision.encoder: which image tower (docs/vision.md)."""

    siglip = (
        "siglip"  # Gemma 3: SigLIP on a fixed square, average-pooled to tokens_per_image (model/vision.py)
    )
    gemma4 = (
        "gemma4"  # Gemma 4: any aspect ratio up to tokens_per_image tokens, 2-D RoPE (model/gemma4_vision.py)
    )


class ImageAttention(enum.Enum):
    """model.vision.image_attention: where an image's tokens see each other (all later tokens of the
    image too, not only the earlier ones)."""

    all_layers = "all_layers"  # Gemma 3
    sliding_layers = (
        "sliding_layers"  # Gemma 4's use_bidirectional_attention="vision": global layers stay causal
    )
    causal = "causal"  # Gemma 4 without it (the E2B/E4B configs)


@dataclasses.dataclass
class VisionConfig:
    """model.vision: the image tower (tunix_train/model/vision.py, gemma4_vision.py; docs/vision.md);
    the defaults are Gemma 3's (SigLIP so400m at 896 pixels, 14-pixel patches, pooled to 256 tokens
    an image)."""

    image_size: int = _fixed(896)  # siglip: pixels a side; every image is resized to this square
    patch_size: int = _fixed(14)
    num_channels: int = _fixed(3)
    embed_dim: int = _fixed(1152)
    hidden_dim: int = _fixed(4304)  # the encoder layers' MLP width
    num_layers: int = _fixed(27)
    num_heads: int = _fixed(16)
    layer_norm_eps: float = _fixed(1e-6)
    # siglip: the patch grid averaged down to this many (a square); gemma4: the most an image has
    # (transformers' max_soft_tokens: 70, 140, 280, 560 or 1120)
    tokens_per_image: int = _fixed(256)
    image_token_id: int = _fixed(262144)  # the placeholder token an image's embeddings replace
    trainable: bool = _fixed(False)  # false: the tower and its projector stay as loaded
    encoder: VisionEncoder = _fixed(VisionEncoder.siglip)
    image_attention: ImageAttention = _fixed(ImageAttention.all_layers)
    pooling_kernel: int = _fixed(3)  # gemma4: each token averages a k x k block of patches
    position_table_size: int = _fixed(10240)  # gemma4: learned positions per axis
    rope_base: float = _fixed(100.0)  # gemma4: the 2-D RoPE's theta
    standardize: bool = _fixed(False)  # gemma4: (x - bias) * scale after pooling (transformers' std_*)

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def image_shape(self) -> tuple[int, ...]:
        """One image as the model takes it: siglip's pixels [C, H, W]; gemma4's patches [S, C*P*P + 2],
        each patch's pixels (rows y, x, channel) and then its (x, y) place in the patch grid, -1 for
        the padding past an image's own (transformers' pixel_values beside image_position_ids)."""
        if self.encoder is VisionEncoder.gemma4:
            return (
                self.tokens_per_image * self.pooling_kernel**2,
                self.num_channels * self.patch_size**2 + 2,
            )
        return (self.num_channels, self.image_size, self.image_size)


LAYER_TYPES = ("sliding_attention", "full_attention")  # transformers' names, as in layer_types


class BaseDtype(enum.Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class BaseQuantization(enum.Enum):  # training.lora.base_quantization (docs/objectives/lora.md)
    none = "none"  # the base in base_dtype
    int8 = "int8"  # per output channel, absmax / 127
    nf4 = "nf4"  # QLoRA's 4-bit NormalFloat, blocks of 64 with float32 absmax scales
    gguf = "gguf"  # the blocks of the .gguf file model.init_from names, each tensor in its own type


class DataSource(enum.Enum):
    shakespeare = "shakespeare"  # the bundled corpus and tokenizer
    text = "text"  # plain-text files
    jsonl = "jsonl"  # one JSON object per line: a text field, or prompt and completion fields
    # the same records as Parquet rows (a .parquet file is read as Parquet under jsonl too)
    parquet = "parquet"
    array_record = "array_record"  # pre-tokenized documents (scripts/pretokenize.py writes them)
    synthetic = "synthetic"  # learnable random sequences, no tokenizer


class TextUnit(enum.Enum):
    """What one document is in a plain-text file."""

    line = "line"
    paragraph = "paragraph"  # separated by blank lines
    file = "file"


@dataclasses.dataclass
class ModelConfig:
    # The family whose checkpoints this model reads and writes (gemma, gemma2, gemma3, gemma4, or one
    # registered with tunix_train.interop.families): the name interop maps to transformers' model_type
    # and llama.cpp's architecture. The decoder itself reads only the fields below.
    family: str = _fixed(MISSING)
    name: str = _fixed(MISSING)
    # [[sizes...], [axis names...]]; axis names from tunix_train.sharding.MESH_AXES, one size may be -1.
    mesh_shape: Any = _changeable(factory=lambda: [[-1], ["fsdp"]])
    num_layers: int = _fixed(MISSING)
    embed_dim: int = _fixed(MISSING)
    hidden_dim: int = _fixed(MISSING)  # MLP width
    num_heads: int = _fixed(MISSING)
    num_kv_heads: int = _fixed(MISSING)
    head_dim: int = _fixed(MISSING)
    vocab_size: int = _fixed(MISSING)
    # Queries are scaled by query_pre_attn_scalar ** -0.5; null means head_dim.
    query_pre_attn_scalar: Optional[float] = _fixed(None)
    attn_logit_softcap: Optional[float] = _fixed(None)  # Gemma 2
    final_logit_softcap: Optional[float] = _fixed(None)  # Gemma 2
    use_post_attn_norm: bool = _fixed(False)  # Gemma 2 and 3
    use_post_ffw_norm: bool = _fixed(False)  # Gemma 2 and 3
    use_qk_norm: bool = _fixed(False)  # Gemma 3
    # Layers repeat the pattern: this many sliding-window (local) layers, then one global layer.
    # Gemma 1: 0 (all global), Gemma 2: 1, Gemma 3: 5.
    local_layers_per_global: int = _fixed(0)
    sliding_window: Optional[int] = _fixed(None)  # window of local layers, in tokens
    rope_base_global: float = _fixed(10_000.0)
    rope_base_local: float = _fixed(10_000.0)
    rope_scale_global: float = _fixed(1.0)  # linear position scaling of global layers (Gemma 3 4b+)
    rope_scaling: RopeScaling = dataclasses.field(default_factory=RopeScaling)  # global layers: llama3, yarn
    rms_norm_eps: float = _fixed(1e-6)
    tie_embeddings: bool = _fixed(True)  # the output layer is the embedding table; false: its own [V, D]
    scale_embeddings: bool = _fixed(True)  # embeddings multiplied by sqrt(embed_dim), as Gemma does
    qkv_bias: bool = _fixed(False)  # the query, key and value projections add a bias (Qwen 2)
    mlp_activation: Activation = _fixed(Activation.gelu_tanh)
    # Gemma 4 (docs/models.md). Each field off gives Gemma 1-3.
    # Per layer: sliding_attention or full_attention; null: from local_layers_per_global.
    layer_types: Optional[List[str]] = _fixed(None)
    global_head_dim: Optional[int] = _fixed(None)  # head dim of global layers; null: head_dim
    num_global_kv_heads: Optional[int] = _fixed(None)  # key/value heads of global layers; null: num_kv_heads
    attention_k_eq_v: bool = _fixed(False)  # global layers use their keys (before the k norm) as values
    # Global layers rotate only this fraction of the rotary pairs (proportional RoPE); the rest stay put.
    rope_partial_factor_global: float = _fixed(1.0)
    # RMSNorm multiplies by (offset + weight): Gemma 1-3 store w around 0 (offset 1), Gemma 4 around 1
    # (offset 0).
    norm_weight_offset: float = _fixed(1.0)
    use_v_norm: bool = _fixed(False)  # values RMS-normalised, without a weight
    # The last this many layers compute no keys/values: each reuses those of the last earlier
    # layer of its type.
    num_kv_shared_layers: int = _fixed(0)
    double_wide_mlp: bool = _fixed(False)  # the KV-sharing layers' MLP is 2 x hidden_dim wide
    # Per-layer embeddings: a second table and a projection of the embeddings give every layer an
    # input of this width (0: none), gated into the residual after the MLP.
    per_layer_input_dim: int = _fixed(0)
    per_layer_input_vocab_size: Optional[int] = _fixed(None)  # null: vocab_size
    use_layer_scalar: bool = _fixed(False)  # each layer's output is multiplied by a learned scalar
    # Mixture of experts beside the dense MLP in every layer (0 experts: none).
    num_experts: int = _fixed(0)
    num_experts_per_token: int = _fixed(0)  # top-k
    moe_hidden_dim: int = _fixed(0)  # each expert's MLP width
    moe_router: MoeRouter = _fixed(MoeRouter.gemma4)
    moe_norm_topk_prob: bool = _fixed(True)  # moe_router=softmax: the top k weights renormalised to sum to 1
    # Whether a layer with experts keeps its dense MLP beside them (Gemma 4); false: the experts
    # take the MLP's place, reading its normed input (Qwen 3 MoE, Mixtral).
    dense_mlp: bool = _fixed(True)
    moe_dispatch: MoeDispatch = _changeable(MoeDispatch.dropless)
    # moe_dispatch=capacity: slots per expert over the even share
    moe_capacity_factor: float = _changeable(1.25)
    # With a cp mesh axis: how attention reaches the other shards' keys and values.
    context_parallel_strategy: ContextParallelStrategy = _changeable(ContextParallelStrategy.all_gather)
    # The longest sequence (prompt and generated tokens) the model was trained for; null: no limit.
    # The engine refuses longer ones. Training does not read it.
    context_length: Optional[int] = _changeable(None)
    # An image tower before the decoder (Gemma 3 4B and up); null: text only.
    vision: Optional[VisionConfig] = _fixed(None)
    # A scalar head on the final hidden states (a reward model, objective=reward; transformers'
    # ...ForSequenceClassification with one label, its `score`): score_DO [D, 1].
    score_head: bool = _fixed(False)
    # A Hugging Face Gemma checkpoint directory (config.json + safetensors) to start from; its sizes
    # must match this config's.
    init_from: Optional[str] = _fixed(None)


@dataclasses.dataclass
class DataConfig:
    source: DataSource = _fixed(DataSource.shakespeare)
    seq_len: int = _fixed(256)  # tokens per packed row
    train_files: List[str] = _fixed(factory=list)  # paths or globs
    # Held-out files; when empty, a fixed eval_fraction of the training documents is held out.
    eval_files: List[str] = _fixed(factory=list)
    eval_fraction: float = _fixed(0.02)
    # A directory written by datasets' save_to_disk (its train split), read instead of train_files
    # under data.source=jsonl or parquet.
    hf_dataset: Optional[str] = _fixed(None)
    tokenizer: Optional[str] = _fixed(None)  # a SentencePiece model; null: the bundled Shakespeare tokenizer
    text_unit: TextUnit = _fixed(TextUnit.paragraph)
    text_field: str = _fixed("text")
    # Supervised fine-tuning on JSONL: the loss is on completion tokens only.
    prompt_field: Optional[str] = _fixed(None)
    completion_field: Optional[str] = _fixed(None)
    # Conversations on JSONL: the records' messages_field holds [{role, content}], rendered with the
    # chat template (tunix_train/data/chat.py; a Jinja file, null: the tokenizer's, else Gemma's turn
    # format); the loss is on the tokens the messages of train_on_roles wrote.
    messages_field: Optional[str] = _fixed(None)
    train_on_roles: List[str] = _fixed(factory=lambda: ["assistant"])
    chat_template: Optional[str] = _fixed(None)
    # Preference pairs (objective=dpo, reward) packed whole into rows of seq_len, first fit, each
    # answer a segment of its own, instead of two padded rows per pair (TRL's padding_free): a
    # micro-batch then holds as many pairs as its rows fit. A rollout's completions (grpo, its
    # family, ppo, on-policy distillation) packed likewise, with their prompts, into the front
    # micro-batches; the step skips those left empty. The next-token objective always packs.
    padding_free: bool = _fixed(False)
    # With model.vision and conversations: the most images one conversation (one row: rows with
    # images are not packed) holds; a row's images pad to this many.
    images_per_row: int = _fixed(1)
    # Gemma 3's pan-and-scan (model.vision's siglip tower): a long image also gives up to this many
    # crops, each an image of its own after it (transformers' do_pan_and_scan with max_num_crops;
    # crops of at least 256 pixels, images at least 1.2 times longer than wide); 0: off
    pan_and_scan_crops: int = _fixed(0)
    # Conversations whose messages' text may write the template's control tokens (<start_of_turn>,
    # <start_of_image>, BOS ...) and have them read as such; false: such a record is a one-line error
    control_tokens_in_messages: bool = _fixed(False)
    prefetch_batches: int = _changeable(4)  # batches prepared ahead of the train step by a background thread


CHAT_ROLES = ("system", "user", "assistant", "tool")  # the roles a conversation's messages may have

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
    grpo: GrpoConfig = dataclasses.field(default_factory=GrpoConfig)
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    ppo: PpoConfig = dataclasses.field(default_factory=PpoConfig)


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


# Keys that no longer exist, each with the one value a run could have had: a saved run's config
# holding them (.hydra/config.yaml) loads as before.
RETIRED_KEYS = {"training.lora.dropout": 0.0}  # was refused unless 0; adapters take no dropout


def _family_before_it_was_declared(model: dict) -> str:
    """The family of a model saved before model.family existed (every one a Gemma), from its flags."""
    if (
        model.get("use_v_norm")
        or model.get("use_layer_scalar")
        or model.get("norm_weight_offset", 1.0) != 1.0
    ):
        return "gemma4"
    if model.get("use_qk_norm"):
        return "gemma3"
    return "gemma2" if model.get("use_post_attn_norm") or model.get("use_post_ffw_norm") else "gemma"


def without_retired_keys(saved: dict) -> dict:
    """A saved config (nested dicts) without RETIRED_KEYS, and with model.family where it was saved
    before the key existed."""
    saved = copy.deepcopy(saved)
    model = saved.get("model")
    if isinstance(model, dict) and "family" not in model:
        model["family"] = _family_before_it_was_declared(model)
    for key, only_value in RETIRED_KEYS.items():
        *path, last = key.split(".")
        node = saved
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and last in node:
            if node[last] != only_value:
                raise ConfigError(
                    f"the saved config sets {key}={node[last]!r}, a key this version no longer has"
                )
            del node[last]
    return saved
