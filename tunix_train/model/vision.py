"""Gemma 3's image tower: SigLIP's vision encoder and the projector into the text model's width.

An image's pixel values [C, H, W] (as transformers' image processors give them) are cut into P x P
patches, each embedded by one matmul (SigLIP's stride-P convolution) plus a learned position per
patch; then L pre-norm encoder layers (stacked and scanned), each bidirectional multi-head attention
and a gelu-tanh MLP (LayerNorms and every projection with a bias), and a final LayerNorm. The
projector averages the patch grid down to tokens_per_image tokens, RMS-normalises them (Gemma's 1 +
scale) and projects them to the text model's width: the embeddings that take the place of an image's
placeholder tokens. Equal to transformers' SiglipVisionModel and Gemma3MultiModalProjector
(test_vision.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_train.model.common import RMSNorm, gelu_tanh, param
from tunix_train.sharding import LOGICAL_RULES, Rules, constrain


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The tower's sizes; the defaults are Gemma 3's (SigLIP so400m at 896 pixels, 256 tokens)."""

    image_size: int = 896
    patch_size: int = 14
    num_channels: int = 3
    embed_dim: int = 1152
    hidden_dim: int = 4304
    num_layers: int = 27
    num_heads: int = 16
    layer_norm_eps: float = 1e-6
    tokens_per_image: int = 256

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    def __post_init__(self):
        side, tokens = self.patches_per_side, round(self.tokens_per_image**0.5)
        if tokens * tokens != self.tokens_per_image or side % tokens or self.embed_dim % self.num_heads:
            raise ValueError(
                f"vision tower: tokens_per_image={self.tokens_per_image} must be a square whose side divides "
                f"the {side} patches a side, and embed_dim={self.embed_dim} must divide by num_heads"
            )


class LayerNorm(nnx.Module):
    """(x - mean) / std * scale + bias over the last axis, in float32."""

    def __init__(self, dim: int, eps: float):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), axes=("norm",))
        self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32), axes=("norm",))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        normed = (x32 - mean) * jax.lax.rsqrt(jnp.square(x32 - mean).mean(-1, keepdims=True) + self.eps)
        return (normed * self.scale[...] + self.bias[...]).astype(x.dtype)


class EncoderLayer(nnx.Module):
    """x + attention(norm1(x)), then + mlp(norm2(x)); every token of an image sees every other."""

    def __init__(self, cfg: VisionConfig, rngs: nnx.Rngs):
        D, F, H = cfg.embed_dim, cfg.hidden_dim, cfg.num_heads
        K = D // H
        self.norm1, self.norm2 = LayerNorm(D, cfg.layer_norm_eps), LayerNorm(D, cfg.layer_norm_eps)
        self.q, self.k, self.v = (param(rngs, (D, H, K), ("embed", "heads", "head_dim"), D) for _ in range(3))
        self.q_bias, self.k_bias, self.v_bias = (
            nnx.Param(jnp.zeros((H, K), jnp.float32), axes=("heads", "head_dim")) for _ in range(3)
        )
        self.out = param(rngs, (H, K, D), ("heads", "head_dim", "embed"), D)
        self.out_bias = nnx.Param(jnp.zeros((D,), jnp.float32), axes=("norm",))
        self.up = param(rngs, (D, F), ("embed", "mlp"), D)
        self.up_bias = nnx.Param(jnp.zeros((F,), jnp.float32), axes=("mlp",))
        self.down = param(rngs, (F, D), ("mlp", "embed"), F)
        self.down_bias = nnx.Param(jnp.zeros((D,), jnp.float32), axes=("norm",))

    def __call__(self, x_NSD):
        h = self.norm1(x_NSD)
        q_NSHK, k_NSHK, v_NSHK = (
            jnp.einsum("nsd,dhk->nshk", h, w[...]) + b[...]
            for w, b in ((self.q, self.q_bias), (self.k, self.k_bias), (self.v, self.v_bias))
        )
        scores_NHST = jnp.einsum("nshk,nthk->nhst", q_NSHK, k_NSHK) * q_NSHK.shape[-1] ** -0.5
        probs_NHST = jax.nn.softmax(scores_NHST.astype(jnp.float32), -1).astype(x_NSD.dtype)
        attended_NSHK = jnp.einsum("nhst,nthk->nshk", probs_NHST, v_NSHK)
        x_NSD = x_NSD + jnp.einsum("nshk,hkd->nsd", attended_NSHK, self.out[...]) + self.out_bias[...]
        h = gelu_tanh(self.norm2(x_NSD) @ self.up[...] + self.up_bias[...])
        return x_NSD + h @ self.down[...] + self.down_bias[...]


def _stacked_layers(cfg: VisionConfig, keys) -> EncoderLayer:
    """One EncoderLayer whose parameters have a leading axis of cfg.num_layers (one per key), for
    jax.lax.scan. The axis is not `layers`, which pp splits: the tower runs whole before the text
    model's stages."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: EncoderLayer(cfg, nnx.Rngs(0))))
    state = jax.vmap(lambda key: nnx.state(EncoderLayer(cfg, nnx.Rngs(key))))(keys)
    for variable in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        variable.set_metadata(axes=(None, *variable.get_metadata()["axes"]))
    return nnx.merge(graphdef, state)


class VisionTower(nnx.Module):
    """Pixel values [N, C, H, W] -> the images' embeddings [N, tokens_per_image, text_dim]."""

    def __init__(self, cfg: VisionConfig, text_dim: int, rngs: nnx.Rngs, rules: Rules = LOGICAL_RULES):
        P, C, D = cfg.patch_size, cfg.num_channels, cfg.embed_dim
        self.cfg, self.rules = cfg, rules
        self.patch = param(rngs, (P * P * C, D), (None, "embed"), P * P * C)  # rows: (y, x, channel)
        self.patch_bias = nnx.Param(jnp.zeros((D,), jnp.float32), axes=("norm",))
        self.position = param(rngs, (cfg.patches_per_side**2, D), (None, "embed"), 1)
        self.layers = _stacked_layers(cfg, jax.random.split(rngs.params(), cfg.num_layers))
        self.final_norm = LayerNorm(D, cfg.layer_norm_eps)
        self.soft_norm = RMSNorm(D, cfg.layer_norm_eps)  # Gemma's: 1 + scale
        self.projection = param(rngs, (D, text_dim), (None, "embed"), D)

    def encode(self, pixels_NCHW):
        """SigLIP's last hidden state [N, patches, embed_dim] (patches row by row)."""
        N, C, H, W = pixels_NCHW.shape
        P = self.cfg.patch_size
        patches = pixels_NCHW.reshape(N, C, H // P, P, W // P, P).transpose(0, 2, 4, 3, 5, 1)
        x_NSD = patches.reshape(N, (H // P) * (W // P), P * P * C) @ self.patch[...] + self.patch_bias[...]
        x_NSD = constrain(x_NSD + self.position[...], ("batch", None, "act_embed"), self.rules)
        graphdef, stacked = nnx.split(self.layers)
        x_NSD, _ = jax.lax.scan(lambda x, layer: (nnx.merge(graphdef, layer)(x), None), x_NSD, stacked)
        return self.final_norm(x_NSD)

    def __call__(self, pixels_NCHW):
        x_NSD = self.encode(pixels_NCHW)
        N, _, D = x_NSD.shape
        side, tokens = self.cfg.patches_per_side, round(self.cfg.tokens_per_image**0.5)
        k = side // tokens  # each token averages a k x k block of patches
        pooled = x_NSD.reshape(N, tokens, k, tokens, k, D).mean((2, 4)).reshape(N, tokens * tokens, D)
        return self.soft_norm(pooled) @ self.projection[...]
