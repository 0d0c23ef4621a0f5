"""Building blocks the decoder (decoder.py) and the experts (moe.py) share."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_train.config import Activation


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], fan_in: int) -> nnx.Param:
    """A float32 parameter drawn from N(0, 1/fan_in), with its logical axes."""
    init = jax.nn.initializers.normal(stddev=fan_in**-0.5)
    return nnx.Param(init(rngs.params(), shape, jnp.float32), axes=axes)


class RMSNorm(nnx.Module):
    """x / rms(x) * (offset + scale), computed in float32; offset + scale starts at one. Gemma 1-3
    store the scale around 0 (offset 1), Gemma 4 around 1 (offset 0); with_scale=False: no scale."""

    def __init__(self, dim: int, eps: float, offset: float = 1.0, with_scale: bool = True):
        self.scale = (
            nnx.Param(jnp.full((dim,), 1.0 - offset, jnp.float32), axes=("norm",)) if with_scale else None
        )
        self.eps, self.offset = eps, offset

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.scale is not None:
            scale = self.scale[...].astype(jnp.float32)
            normed = normed * (self.offset + scale if self.offset else scale)
        return normed.astype(x.dtype)


def gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


ACTIVATIONS = {Activation.gelu_tanh: gelu_tanh, Activation.silu: jax.nn.silu}  # model.mlp_activation
