"""Rotary position embedding's tables: the angle of each rotary pair at each position, with the
long-context frequency schedules (model.rope_scaling) transcribed from transformers'
ROPE_INIT_FUNCTIONS (modeling_rope_utils.py: _compute_llama3_parameters, _compute_yarn_parameters,
_compute_longrope_parameters),
which tests/test_rope.py compares against. kernels.apply_rope turns the heads by them.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from tunix_train.config import RopeScaling, RopeScalingType


def rope_table(
    positions_BT,
    base: float,
    scale: float,
    head_dim: int,
    fraction: float = 1.0,
    scaling: RopeScaling | None = None,
):
    """(sin, cos) [B, T, 1, 1, H/2] of the rotary angles at positions divided by `scale`, for
    kernels.apply_rope; only the first `fraction` of the pairs turn (proportional RoPE, Gemma 4's
    global layers), the others keep angle 0. With `scaling` (llama3, yarn) the pairs' frequencies
    are its schedule's, and yarn scales sin and cos by its attention factor. Computed once per
    forward pass, not per layer."""
    half = head_dim // 2
    if scaling is not None and scaling.type is RopeScalingType.longrope:
        short_h, long_h, magnitude = longrope_frequencies(base, head_dim, scaling)
        # a row past original_context turns by long_factor's frequencies, every position of it
        # (transformers picks by max(position_ids) + 1 of the whole call; here each row's, so that a
        # request's tokens do not depend on the requests beside it)
        long_B11 = (jnp.max(positions_BT, axis=-1) + 1 > scaling.original_context)[:, None, None]
        inv_freq_B1h = jnp.where(
            long_B11, jnp.asarray(long_h, jnp.float32), jnp.asarray(short_h, jnp.float32)
        )
        angle_BTh = positions_BT[..., None].astype(jnp.float32) / scale * inv_freq_B1h
    elif scaling is None or scaling.type is RopeScalingType.none:
        timescale = base ** (2.0 * jnp.arange(half, dtype=jnp.float32) / head_dim)
        angle_BTh = positions_BT[..., None].astype(jnp.float32) / scale / timescale
        magnitude = 1.0
    else:
        inv_freq_h, magnitude = scaled_frequencies(base, head_dim, scaling)
        angle_BTh = positions_BT[..., None].astype(jnp.float32) / scale * jnp.asarray(inv_freq_h, jnp.float32)
    if fraction < 1.0:
        angle_BTh = jnp.where(jnp.arange(half) < int(fraction * head_dim // 2), angle_BTh, 0.0)
    sin, cos = jnp.sin(angle_BTh), jnp.cos(angle_BTh)
    if magnitude != 1.0:
        sin, cos = sin * magnitude, cos * magnitude
    return sin[:, :, None, None, :], cos[:, :, None, None, :]


def _inverse_frequencies(base: float, head_dim: int) -> np.ndarray:
    """Each rotary pair's unscaled angular frequency [H/2], base^(-2i/head_dim), in float64."""
    return 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def longrope_frequencies(
    base: float, head_dim: int, scaling: RopeScaling
) -> tuple[np.ndarray, np.ndarray, float]:
    """LongRoPE's (short and long angular frequencies [H/2], the factor on sin and cos), as
    transformers' _compute_longrope_parameters: each pair's frequency divided by its factor."""
    inv_freq = _inverse_frequencies(base, head_dim)
    short, long = (inv_freq / np.asarray(f, np.float64) for f in (scaling.short_factor, scaling.long_factor))
    attention = scaling.attention_factor
    if attention is None:
        factor, context = scaling.factor, scaling.original_context
        attention = math.sqrt(1 + math.log(factor) / math.log(context)) if factor > 1 else 1.0
    return short, long, float(attention)


def scaled_frequencies(base: float, head_dim: int, scaling: RopeScaling) -> tuple[np.ndarray, float]:
    """(each rotary pair's angular frequency [H/2], the factor on sin and cos) of a llama3 or yarn
    schedule, in float64 from the config's numbers."""
    inv_freq = _inverse_frequencies(base, head_dim)
    factor, context = scaling.factor, scaling.original_context
    if scaling.type is RopeScalingType.llama3:
        low_wavelen = context / scaling.low_freq_factor
        high_wavelen = context / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (context / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled), 1.0
    if scaling.type is RopeScalingType.yarn:

        def correction_dim(rotations):  # the dimension that turns `rotations` times over the context
            return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
        if scaling.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # as transformers: no division by zero
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolated = 1 - ramp  # the share of each pair's frequency kept as pre-trained
        inv_freq = inv_freq / factor * (1 - extrapolated) + inv_freq * extrapolated
        attention = scaling.attention_factor
        if attention is None:
            attention = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        return inv_freq, float(attention)
    raise ValueError(f"no frequency schedule for {scaling.type}")
