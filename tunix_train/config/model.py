"""The model section's schema (`model.*`): the decoder's shape and its families' variants, RoPE and
its scaling, experts, the image tower, and how the model lays over the mesh."""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, List, Mapping, Optional

from omegaconf import MISSING

from tunix_train.config.fields import _changeable, _fixed


class ContextParallelStrategy(enum.Enum):
    """How attention reaches the keys of other cp shards (tunix_train/parallel/context.py)."""

    all_gather = "all_gather"  # gather every layer's keys and values, then attend to them all
    ring = "ring"  # pass key/value blocks round the cp ring, skipping blocks the causal mask hides


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
    # norm_topk_prob
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
    # LongRoPE (arXiv 2402.13753; Phi-3's long-context models): each pair's frequency divided by a
    # factor of its own, short_factor or, for a sequence past original_context, long_factor
    longrope = "longrope"


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
    # yarn, longrope: cos and sin scale; null: 0.1 ln(factor) + 1 (yarn), sqrt(1 + ln(factor) /
    # ln(original_context)) (longrope)
    attention_factor: Optional[float] = _fixed(None)
    truncate: bool = _fixed(True)  # yarn: the ramp's bounds rounded outward to whole dimensions
    # longrope: each rotary pair's divisor [head_dim / 2] up to original_context, and past it
    short_factor: List[float] = _fixed(factory=list)
    long_factor: List[float] = _fixed(factory=list)


class VisionEncoder(enum.Enum):
    """model.vision.encoder: which image tower (docs/vision.md)."""

    siglip = (
        "siglip"  # Gemma 3: SigLIP on a fixed square, average-pooled to tokens_per_image (model/vision.py)
    )
    gemma4 = (
        "gemma4"  # Gemma 4: any aspect ratio up to tokens_per_image tokens, 2-D RoPE (model/gemma4_vision.py)
    )


@dataclasses.dataclass(frozen=True)
class EncoderTraits:
    """What code outside an image tower's own modules asks of it (ENCODER_TRAITS: one per encoder;
    its modules: model/vision.py or model/gemma4_vision.py, interop/vision.py's ENCODERS)."""

    # an image enters as its patches and their grid places, at any aspect ratio, and becomes its own
    # number of tokens (at most tokens_per_image); else as a fixed square, always tokens_per_image
    patches: bool
    pan_and_scan: bool  # data.pan_and_scan_crops cuts wide images into crops for it
    gated_mlp: bool  # its MLP has a gate (training.lora.targets' vision_gate)
    # the image's begin, end and soft tokens, what a template writes for it, and the text around it
    markers: tuple[str, str, str, str, str]


ENCODER_TRAITS = {
    VisionEncoder.siglip: EncoderTraits(
        patches=False,
        pan_and_scan=True,
        gated_mlp=False,
        markers=("<start_of_image>", "<end_of_image>", "<image_soft_token>", "<start_of_image>", "\n\n"),
    ),
    VisionEncoder.gemma4: EncoderTraits(
        patches=True,
        pan_and_scan=False,
        gated_mlp=True,
        markers=("<|image>", "<image|>", "<|image|>", "<|image|>", ""),
    ),
}


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
    def traits(self) -> EncoderTraits:
        return ENCODER_TRAITS[self.encoder]

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def image_shape(self) -> tuple[int, ...]:
        """One image as the model takes it: siglip's pixels [C, H, W]; gemma4's patches [S, C*P*P + 2],
        each patch's pixels (rows y, x, channel) and then its (x, y) place in the patch grid, -1 for
        the padding past an image's own (transformers' pixel_values beside image_position_ids)."""
        if self.traits.patches:
            return (
                self.tokens_per_image * self.pooling_kernel**2,
                self.num_channels * self.patch_size**2 + 2,
            )
        return (self.num_channels, self.image_size, self.image_size)


@dataclasses.dataclass
class Gemma4Config:
    """model.gemma4: what only Gemma 4's decoder has (docs/models.md); each field off gives Gemma 1-3."""

    global_head_dim: Optional[int] = _fixed(None)  # head dim of global layers; null: head_dim
    num_global_kv_heads: Optional[int] = _fixed(None)  # key/value heads of global layers; null: num_kv_heads
    attention_k_eq_v: bool = _fixed(False)  # global layers use their keys (before the k norm) as values
    # Global layers rotate only this fraction of the rotary pairs (proportional RoPE); the rest stay put.
    rope_partial_factor_global: float = _fixed(1.0)
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


@dataclasses.dataclass
class MoeConfig:
    """model.moe: a mixture of experts in every layer, beside the dense MLP (Gemma 4) or in its place
    (Qwen 3 MoE, Mixtral); experts 0: none (docs/models.md)."""

    experts: int = _fixed(0)
    experts_per_token: int = _fixed(0)  # top-k
    hidden_dim: int = _fixed(0)  # each expert's MLP width
    router: MoeRouter = _fixed(MoeRouter.gemma4)
    norm_topk_prob: bool = _fixed(True)  # router=softmax: the top k weights renormalised to sum to 1
    # Whether a layer with experts keeps its dense MLP beside them (Gemma 4); false: the experts
    # take the MLP's place, reading its normed input (Qwen 3 MoE, Mixtral).
    dense_mlp: bool = _fixed(True)
    dispatch: MoeDispatch = _changeable(MoeDispatch.dropless)
    capacity_factor: float = _changeable(1.25)  # dispatch=capacity: slots per expert over the even share


LAYER_TYPES = ("sliding_attention", "full_attention")  # transformers' names, as in layer_types


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
    # Per layer: sliding_attention or full_attention; null: from local_layers_per_global.
    layer_types: Optional[List[str]] = _fixed(None)
    # RMSNorm multiplies by (offset + weight): Gemma 1-3 store w around 0 (offset 1), Gemma 4 and
    # Llama's kin around 1 (offset 0).
    norm_weight_offset: float = _fixed(1.0)
    # What only Gemma 4 has (each field off: none of it).
    gemma4: Gemma4Config = dataclasses.field(default_factory=Gemma4Config)
    # A mixture of experts in every layer (model.moe.experts 0: none).
    moe: MoeConfig = dataclasses.field(default_factory=MoeConfig)
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


def field_of(model: ModelConfig, key: str) -> Any:
    """The value of `model` at a key as it is written under model. (moe.experts: a section's field)."""
    return functools.reduce(getattr, key.split("."), model)


def with_fields(model: ModelConfig, fields: Mapping[str, Any]) -> ModelConfig:
    """`model` with `fields` set, each keyed as under model. (a section's field by its dotted key,
    moe.experts; the other fields of that section kept)."""
    flat, sections = {}, {}
    for key, value in fields.items():
        section, dot, name = key.partition(".")
        if dot:
            sections.setdefault(section, {})[name] = value
        else:
            flat[key] = value
    for section, values in sections.items():
        flat[section] = dataclasses.replace(flat.get(section, getattr(model, section)), **values)
    return dataclasses.replace(model, **flat)
