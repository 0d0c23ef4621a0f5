"""GGUF conventions of the families with Llama's decoder (Llama 3, Mistral, Qwen 2.5 / 3 and Qwen 3
MoE, Phi-3), as llama.cpp's convert_hf_to_gguf.py writes them (LlamaModel, Qwen2Model, Qwen3Model,
Qwen3MoeModel, Phi3MiniModel) and transformers' GGUF loader reads them back; gguf.py and
gguf_export.py hold what all families share. Each family module holds one LlamaGguf saying which
of these it uses.

- metadata: {arch}.context_length, embedding_length, block_count, feed_forward_length,
  attention.head_count, head_count_kv, key_length, value_length, layer_norm_rms_epsilon,
  rope.freq_base; rope.dimension_count (llama, phi3); expert_count, expert_used_count,
  expert_feed_forward_length (qwen3moe: llama.cpp always renormalizes the chosen experts' weights);
  attention.sliding_window (phi3: 0 for none; Mistral's, which llama.cpp's llama does not read) and
  rope.scaling.original_context_length (phi3);
- RoPE scaling: linear and yarn as rope.scaling.* keys; llama3 as the `rope_freqs.weight` tensor of
  per-frequency divisors (generate_extra_tensors), which the import turns back into the schedule
  and checks;
- Llama's (and Mistral's) Q and K rows are permuted to interleaved rotary pairs (LlamaModel.permute);
  Qwen's and Phi-3's are not; Phi-3's fused qkv and gate/up stay fused (attn_qkv, ffn_up);
- experts as three stacked tensors (ffn_gate_exps, ffn_up_exps [E, M, D]; ffn_down_exps [E, D, M]);
- RMSNorm weights as they are (no 1 + w: these families' norms hold the weight itself).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import numpy as np

from tunix_train.config import ConfigError, ModelConfig, RopeScaling, RopeScalingType

ROPE_FREQS = "rope_freqs.weight"


def permute_qk(rows: np.ndarray, heads: int) -> np.ndarray:
    """transformers' rotate-half Q or K rows [heads * H, ...] as llama.cpp's Llama holds them (each
    head's two halves interleaved: LlamaModel.permute)."""
    return (
        rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def unpermute_qk(rows: np.ndarray, heads: int) -> np.ndarray:
    """permute_qk's inverse."""
    return (
        rows.reshape(heads, rows.shape[0] // heads // 2, 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def qk_heads(hf_name: str, cfg: ModelConfig) -> int | None:
    """The heads a Q or K tensor's rows (or its LoRA B factor's) hold; None for any other tensor."""
    module = hf_name.removesuffix(".weight").removesuffix(".bias")
    if module.endswith(".self_attn.q_proj"):
        return cfg.num_heads
    if module.endswith(".self_attn.k_proj"):
        return cfg.num_kv_heads
    return None


@dataclasses.dataclass(frozen=True)
class LlamaGguf:
    """One family's choices among these conventions (families.GgufConventions)."""

    architecture: str
    qk_interleaved: bool = False
    stacked_experts: bool = False
    rope_dimension_count: bool = False
    windowed: bool = False  # all layers local when {arch}.attention.sliding_window is positive
    original_context: bool = False  # rope.scaling.original_context_length: the pre-training context
    # general.basename, written and recognised (a family that shares its architecture: Mistral)
    basename: str | None = None
    # fields every file of the family implies before its keys say more (Gemma 4's, off)
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def claims(self, file) -> bool:
        """A file of the architecture is this family's when its general.basename starts with ours,
        or it has local layers and we read them."""
        named = str(file.field("general.basename") or "").lower()
        if self.basename and named.startswith(self.basename.lower()):
            return True
        return self.windowed and _window(file) > 0

    def fields(self, file) -> dict[str, Any]:
        """ModelConfig fields of a file from its metadata, its tensors' shapes and names, and its
        rope_freqs tensor."""
        key = file.key
        embed, heads = key("embedding_length"), key("attention.head_count")
        head_dim = key("attention.key_length", embed // heads)
        theta = float(key("rope.freq_base", 10_000.0))
        moe = self.stacked_experts
        fields = {
            **self.defaults,
            "num_layers": key("block_count"),
            "embed_dim": embed,
            "hidden_dim": key("feed_forward_length"),
            "num_heads": heads,
            "num_kv_heads": key("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "vocab_size": int(file.shape("token_embd.weight")[-1]),
            "rope_base_global": theta,
            "rope_base_local": theta,
            "rope_scale_global": 1.0,
            "rope_scaling": _scaling(key, file),
            "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            "context_length": key("context_length"),
            "tie_embeddings": "output.weight" not in file.names,
            "moe.experts": key("expert_count", 0) if moe else 0,
            "moe.experts_per_token": key("expert_used_count", 0) if moe else 0,
            "moe.hidden_dim": key("expert_feed_forward_length", 0) if moe else 0,
            "moe.norm_topk_prob": True,
        }
        if key("rope.scaling.type") == "linear":
            fields["rope_scale_global"] = float(key("rope.scaling.factor", 1.0))
        if ROPE_FREQS in file.names:
            fields["rope_scaling"] = llama3_scaling(
                np.asarray(file.data(ROPE_FREQS), np.float64), theta, head_dim, file.path
            )
        if {"rope_factors_long.weight", "rope_factors_short.weight"} & set(file.names):
            raise ConfigError(
                f"{file.path}: LongRoPE's factor tensors (rope_factors_long, rope_factors_short) are not "
                f"read from a GGUF yet; load the Hugging Face checkpoint instead"
            )
        if self.windowed:
            window = _window(file)
            scaling = fields["rope_scaling"].type
            scaled = fields["rope_scale_global"] != 1.0 or scaling is not RopeScalingType.none
            if window and scaled:  # llama.cpp stretches every layer's RoPE, the decoder its global layers'
                raise ConfigError(
                    f"{file.path}: {file.architecture}.attention.sliding_window={window} with a scaled RoPE "
                    f"is not supported: the decoder scales only its global layers' RoPE"
                )
            fields["local_layers_per_global"] = fields["num_layers"] if window else 0
            fields["sliding_window"] = window or None
        return fields

    def write_metadata(self, writer, cfg: ModelConfig) -> None:
        """The {arch}.* keys the converter writes for this family beyond the sizes every family
        writes (gguf_export._metadata): module docstring."""
        import gguf

        if self.basename:
            writer.add_basename(self.basename)
        if self.rope_dimension_count:
            writer.add_rope_dimension_count(cfg.head_dim)
        if self.original_context:
            writer.add_rope_scaling_orig_ctx_len(cfg.context_length or 4096)
        if self.windowed:
            writer.add_sliding_window(cfg.sliding_window if cfg.local_layers_per_global else 0)
        writer.add_vocab_size(cfg.vocab_size)
        if self.stacked_experts:
            writer.add_expert_count(cfg.moe.experts)
            writer.add_expert_used_count(cfg.moe.experts_per_token)
            writer.add_expert_feed_forward_length(cfg.moe.hidden_dim)
        scaling = cfg.rope_scaling
        if cfg.rope_scale_global == 1.0 and scaling.type is RopeScalingType.yarn:  # linear: written by all
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(scaling.factor)
            writer.add_rope_scaling_orig_ctx_len(scaling.original_context)
            writer.add_rope_scaling_yarn_beta_fast(scaling.beta_fast)
            writer.add_rope_scaling_yarn_beta_slow(scaling.beta_slow)
            if scaling.attention_factor is not None:
                writer.add_rope_scaling_yarn_attn_factor(scaling.attention_factor)

    def extra_tensors(self, cfg: ModelConfig) -> dict[str, np.ndarray]:
        factors = llama3_factors(cfg)
        return {} if factors is None else {ROPE_FREQS: factors}

    def check_exportable(self, cfg: ModelConfig) -> None:
        """What these files cannot say: a ConfigError naming it."""
        if cfg.moe.experts and not cfg.moe.norm_topk_prob:
            raise ConfigError(
                "model.moe.norm_topk_prob=false: llama.cpp's qwen3moe renormalizes the chosen experts' "
                "weights; a GGUF cannot hold this model"
            )
        if cfg.rope_scaling.type is RopeScalingType.yarn and not cfg.rope_scaling.truncate:
            raise ConfigError(
                "model.rope_scaling.truncate=false: llama.cpp's yarn rounds the ramp's bounds outward; "
                "a GGUF cannot hold this model"
            )
        if cfg.rope_scaling.type is RopeScalingType.longrope:
            raise ConfigError(
                "model.rope_scaling longrope: llama.cpp keeps LongRoPE's factors as tensors of its own "
                "(rope_factors_long, rope_factors_short), which this export does not write yet; export to "
                "Hugging Face instead"
            )


def _window(file) -> int:
    """{arch}.attention.sliding_window: 0 (or absent) for none; anything but a count is one line."""
    window = file.key("attention.sliding_window") or 0
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
        raise ConfigError(
            f"{file.path}: {file.architecture}.attention.sliding_window is {window!r}, not a count of "
            f"tokens; the file is damaged"
        )
    return int(window)


def _scaling(key: Callable, file) -> RopeScaling:
    """The yarn schedule the rope.scaling.* keys give (linear is a factor, llama3 a tensor)."""
    kind = key("rope.scaling.type")
    if kind == "yarn":
        if key("rope.scaling.factor") is None or key("rope.scaling.original_context_length") is None:
            raise ConfigError(
                f"{file.path}: yarn RoPE scaling without {file.architecture}.rope.scaling.factor or "
                f"original_context_length; the file is damaged"
            )
        return RopeScaling(
            type=RopeScalingType.yarn,
            factor=float(key("rope.scaling.factor")),
            original_context=int(key("rope.scaling.original_context_length")),
            beta_fast=float(key("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(key("rope.scaling.yarn_beta_slow", 1.0)),
            attention_factor=key("rope.scaling.yarn_attn_factor"),
        )
    if kind not in (None, "none", "linear"):
        raise ConfigError(f"{file.path}: rope.scaling.type {kind!r} is not supported (linear, yarn)")
    return RopeScaling()


def llama3_factors(cfg: ModelConfig) -> np.ndarray | None:
    """The rope_freqs tensor of a llama3 schedule: each rotary pair's frequency divisor, float32."""
    from tunix_train.model.rope import scaled_frequencies

    if cfg.rope_scaling.type is not RopeScalingType.llama3:
        return None
    inv_freq = 1.0 / cfg.rope_base_global ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim)
    return (inv_freq / scaled_frequencies(cfg.rope_base_global, cfg.head_dim, cfg.rope_scaling)[0]).astype(
        np.float32
    )


def llama3_scaling(factors: np.ndarray, base: float, head_dim: int, path) -> RopeScaling:
    """The llama3 schedule whose divisors are `factors`. The largest is its factor; the pairs
    between 1 and the factor (the smooth band) fix the band's wavelengths, which are all that
    matters: written with Llama 3.1's low_freq_factor 1 (and high_freq_factor 4 where the band has
    fewer than two pairs), the original context solved for. One line naming the tensor if no
    llama3 schedule gives `factors`."""
    from tunix_train.model.rope import scaled_frequencies

    if factors.shape != (head_dim // 2,) or not np.all(np.isfinite(factors)) or factors.min() <= 0:
        raise ConfigError(
            f"{path}: its {ROPE_FREQS} holds {factors.size} values, not {head_dim // 2} positive ones "
            f"(one per rotary pair); the file is damaged"
        )
    factor = float(factors.max())
    if np.allclose(factors, 1.0):
        return RopeScaling()
    inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    band = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    smooth = (1 / factors[band] - 1 / factor) / (1 - 1 / factor)  # (context / wavelen - low) / (high - low)
    high = 4.0
    if band.sum() >= 2:  # smooth is linear in 1 / wavelen: its slope and intercept give high and context
        slope, intercept = np.polyfit(1 / wavelen[band], smooth, 1)
        high = float(round(1 - 1 / intercept, 6))
        context = slope * (high - 1)
    elif band.sum() == 1:
        context = wavelen[band][0] * (smooth[0] * (high - 1) + 1)
    else:  # no band: any context with the unscaled pairs below context / 4 and the scaled above it
        lower = high * wavelen[factors <= 1 + 1e-6].max(initial=0.0)
        upper = wavelen[factors >= factor * (1 - 1e-6)].min(initial=math.inf)
        context = 8192 if lower < 8192 < upper else (lower + upper) / 2
    candidate = RopeScaling(
        type=RopeScalingType.llama3,
        factor=factor,
        original_context=int(round(context)),
        low_freq_factor=1.0,
        high_freq_factor=high,
    )
    got = inv_freq / scaled_frequencies(base, head_dim, candidate)[0]
    if not np.allclose(got, factors, rtol=1e-4):
        raise ConfigError(
            f"{path}: its {ROPE_FREQS} follows no llama3 RoPE schedule this package computes; "
            f"load the Hugging Face checkpoint instead"
        )
    return candidate
