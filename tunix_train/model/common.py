"""Building blocks the decoder (decoder.py, block.py, attention.py) and the experts (moe.py) share,
and the output layer (`output_logits`) every path to logits goes through."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_train.config import Activation
from tunix_train.model import kernels
from tunix_train.sharding import LOGICAL_RULES, Rules, constrain


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


def output_logits(x, table_VD, softcap: float | None, rules: Rules = LOGICAL_RULES):
    """float32 next-token logits from final hidden states and the output layer: the one place
    logits are computed (the model, the step's chunked loss, the engine).

    x [B, T, D] -> [B, T, V]; x [B, D] (the engine's one position per row) -> [B, V], with the
    vocabulary as the dot's rows, then transposed. Why: XLA:CPU's dot runs [V, D] x [D, B] about
    twice as fast as [B, D] x [D, V] at a decoding batch (git log -- docs/performance-history.md);
    the barrier keeps XLA from folding the transpose back into the dot."""
    table_VD = table_VD.astype(x.dtype)
    if x.ndim == 2:
        logits_VB = jnp.einsum("vd,bd->vb", table_VD, x).astype(jnp.float32)
        logits, axes = jax.lax.optimization_barrier(logits_VB).T, ("batch", "act_vocab")
    else:
        logits, axes = (
            jnp.einsum("btd,vd->btv", x, table_VD).astype(jnp.float32),
            ("batch", "seq", "act_vocab"),
        )
    return constrain(kernels.soft_cap(logits, softcap), axes, rules)
