"""GGUF conventions of the Llama 3 and Qwen 2.5 / 3 families (llama, qwen2, qwen3, qwen3moe), as
llama.cpp's convert_hf_to_gguf.py writes them (LlamaModel, Qwen2Model, Qwen3Model, Qwen3MoeModel)
and transformers' GGUF loader reads them back; gguf.py and gguf_export.py hold what all families
share.

- metadata: {arch}.context_length, embedding_length, block_count, feed_forward_length,
  attention.head_count, head_count_kv, key_length, value_length, layer_norm_rms_epsilon,
  rope.freq_base; llama: rope.dimension_count; qwen3moe: expert_count, expert_used_count,
  expert_feed_forward_length (llama.cpp always renormalizes the chosen experts' weights);
- RoPE scaling: linear and yarn as rope.scaling.* keys; llama3 as the `rope_freqs.weight` tensor of
  per-frequency divisors (generate_extra_tensors), which the import turns back into the schedule
  and checks;
- Llama's Q and K rows are permuted to interleaved rotary pairs (LlamaModel.permute); Qwen's are not;
- experts as three stacked tensors (ffn_gate_exps, ffn_up_exps [E, M, D]; ffn_down_exps [E, D, M]);
- RMSNorm weights as they are (no 1 + w: these families' norms hold the weight itself).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from tunix_train.config import ConfigError, ModelConfig, RopeScaling, RopeScalingType
from tunix_train.interop import families

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
    """The heads a Llama Q or K tensor (or its LoRA B factor) is permuted over; None for any other."""
    if not families.named(cfg.family).gguf_qk_interleaved:
        return None
    module = hf_name.removesuffix(".weight").removesuffix(".bias")
    if module.endswith(".self_attn.q_proj"):
        return cfg.num_heads
    if module.endswith(".self_attn.k_proj"):
        return cfg.num_kv_heads
    return None


def model_fields(
    arch: str, key: Callable, shape: Callable, names: set[str], rope_freqs, fixed: dict, path
) -> dict[str, Any]:
    """ModelConfig fields of a file of `arch` from its metadata (`key(name, default)` reads
    {arch}.name), its tensors' shapes (`shape(name)`, GGML order) and names, and its rope_freqs
    tensor (or None); `fixed`: what the family fixes."""
    from tunix_train.interop.gemma import GEMMA4_ONLY_OFF

    family = families.of_gguf(arch).name
    embed, heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", embed // heads)
    theta = float(key("rope.freq_base", 10_000.0))
    moe = family == "qwen3_moe"
    fields = {
        **GEMMA4_ONLY_OFF,
        "family": family,
        "num_layers": key("block_count"),
        "embed_dim": embed,
        "hidden_dim": key("feed_forward_length"),
        "num_heads": heads,
        "num_kv_heads": key("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "vocab_size": int(shape("token_embd.weight")[-1]),
        "rope_base_global": theta,
        "rope_base_local": theta,
        "rope_scale_global": 1.0,
        "rope_scaling": RopeScaling(),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "context_length": key("context_length"),
        "tie_embeddings": "output.weight" not in names,
        "num_experts": key("expert_count", 0) if moe else 0,
        "num_experts_per_token": key("expert_used_count", 0) if moe else 0,
        "moe_hidden_dim": key("expert_feed_forward_length", 0) if moe else 0,
        "moe_norm_topk_prob": True,
        **fixed,
    }
    kind = key("rope.scaling.type")
    if kind == "linear":
        fields["rope_scale_global"] = float(key("rope.scaling.factor", 1.0))
    elif kind == "yarn":
        if key("rope.scaling.factor") is None or key("rope.scaling.original_context_length") is None:
            raise ConfigError(
                f"{path}: yarn RoPE scaling without {arch}.rope.scaling.factor or "
                f"original_context_length; the file is damaged"
            )
        fields["rope_scaling"] = RopeScaling(
            type=RopeScalingType.yarn,
            factor=float(key("rope.scaling.factor")),
            original_context=int(key("rope.scaling.original_context_length")),
            beta_fast=float(key("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(key("rope.scaling.yarn_beta_slow", 1.0)),
            attention_factor=key("rope.scaling.yarn_attn_factor"),
        )
    elif kind not in (None, "none"):
        raise ConfigError(f"{path}: rope.scaling.type {kind!r} is not supported (linear, yarn)")
    if rope_freqs is not None:
        fields["rope_scaling"] = llama3_scaling(np.asarray(rope_freqs, np.float64), theta, head_dim, path)
    return fields


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


def write_metadata(writer, cfg: ModelConfig, arch: str) -> None:
    """The {arch}.* keys the converter writes for these families beyond the sizes every family
    writes (gguf_export._metadata): module docstring."""
    import gguf

    if arch == "llama":
        writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    if arch == "qwen3moe":
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_token)
        writer.add_expert_feed_forward_length(cfg.moe_hidden_dim)
    scaling = cfg.rope_scaling
    if cfg.rope_scale_global == 1.0 and scaling.type is RopeScalingType.yarn:  # linear: written by all
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling.factor)
        writer.add_rope_scaling_orig_ctx_len(scaling.original_context)
        writer.add_rope_scaling_yarn_beta_fast(scaling.beta_fast)
        writer.add_rope_scaling_yarn_beta_slow(scaling.beta_slow)
        if scaling.attention_factor is not None:
            writer.add_rope_scaling_yarn_attn_factor(scaling.attention_factor)


def check_exportable(cfg: ModelConfig) -> None:
    """What these files cannot say: a ConfigError naming it."""
    if cfg.num_experts and not cfg.moe_norm_topk_prob:
        raise ConfigError(
            "model.moe_norm_topk_prob=false: llama.cpp's qwen3moe renormalizes the chosen experts' "
            "weights; a GGUF cannot hold this model"
        )
    if cfg.rope_scaling.type is RopeScalingType.yarn and not cfg.rope_scaling.truncate:
        raise ConfigError(
            "model.rope_scaling.truncate=false: llama.cpp's yarn rounds the ramp's bounds outward; "
            "a GGUF cannot hold this model"
        )
