"""Gemma 4's image tower: a ViT on an image's own aspect ratio, and the projector into the text
model's width.

An image comes as transformers' Gemma4ImageProcessor gives it (VisionConfig.image_shape): up to S
patches of P x P pixels in [0, 1], rows y, x, channel, each beside its (x, y) place in the patch
grid; -1 marks the padding past the image's own. A patch is embedded by one matmul of 2p - 1 plus a
learned row per axis (x's and y's). Then L encoder layers (stacked and scanned), each
    x + norm(attention(norm(x))),  x + norm(mlp(norm(x)))
with RMSNorms that multiply by their scale (no 1 +), attention bidirectional over the image's own
patches, queries and keys RMS-normed per head and rotated by a 2-D RoPE (the first half of each head
by x, the second by y), values RMS-normed without scale, no 1/sqrt(d) (the norms set the scale),
and a gated gelu-tanh MLP. The pooler averages each k x k block of the grid into one token (the
blocks in row order: an image of h x w patches gives its h*w/k^2 tokens first, then zeros), scaled
by sqrt(width), optionally standardized; the projector RMS-normalizes without scale and projects.
Equal to transformers' Gemma4VisionModel and Gemma4MultimodalEmbedder (test_vision_gemma4.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_train.config import LoraConfig, VisionConfig
from tunix_train.model.common import RMSNorm, gelu_tanh, param
from tunix_train.model.lora import Adapt, no_adapter
from tunix_train.model.vision import Tower, adapted, scan_layers, stacked_layers
from tunix_train.sharding import constrain

# a masked score: finite, so that an image of no patches gives no NaN
NEVER = float(jnp.finfo(jnp.float32).min)


def _norm(dim: int, eps: float, with_scale: bool = True) -> RMSNorm:
    return RMSNorm(dim, eps, offset=0.0, with_scale=with_scale)  # x / rms(x) * scale


def _rotated(x_NSHK, angles_NSk):
    """x's pairs (i, i + K/2) rotated by angles [N, S, K/2] (transformers' rotate_half)."""
    x1, x2 = jnp.split(x_NSHK.astype(jnp.float32), 2, axis=-1)
    cos, sin = jnp.cos(angles_NSk)[:, :, None], jnp.sin(angles_NSk)[:, :, None]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_NSHK.dtype)


def rope_2d(x_NSHK, places_NS2, base: float):
    """The first half of each head rotated by the patch's x, the second by its y, each with the
    frequencies base^(-2i / (K/2)) (transformers' Gemma4VisionRotaryEmbedding)."""
    K = x_NSHK.shape[-1]
    inv_freq = 1.0 / base ** (jnp.arange(0, K // 2, 2, dtype=jnp.float32) / (K // 2))
    halves = jnp.split(x_NSHK, 2, axis=-1)
    return jnp.concatenate(
        [
            _rotated(h, places_NS2[:, :, axis, None].astype(jnp.float32) * inv_freq)
            for axis, h in enumerate(halves)
        ],
        -1,
    )


class EncoderLayer(nnx.Module):
    def __init__(self, cfg: VisionConfig, rngs: nnx.Rngs, adapt: Adapt = no_adapter):
        D, F, H = cfg.embed_dim, cfg.hidden_dim, cfg.num_heads
        K, eps = D // H, cfg.layer_norm_eps
        self.rope_base = cfg.rope_base
        self.q, self.k, self.v = (param(rngs, (D, H, K), ("embed", "heads", "head_dim"), D) for _ in range(3))
        self.out = param(rngs, (H, K, D), ("heads", "head_dim", "embed"), D)
        self.q_norm, self.k_norm, self.v_norm = _norm(K, eps), _norm(K, eps), _norm(K, eps, with_scale=False)
        self.gate, self.up = (param(rngs, (D, F), ("embed", "mlp"), D) for _ in range(2))
        self.down = param(rngs, (F, D), ("mlp", "embed"), F)
        self.pre_attn_norm, self.post_attn_norm = _norm(D, eps), _norm(D, eps)
        self.pre_mlp_norm, self.post_mlp_norm = _norm(D, eps), _norm(D, eps)
        self.q_lora, self.k_lora, self.v_lora = (
            adapt(f"vision_{x}", getattr(self, x), 1) for x in ("q", "k", "v")
        )
        self.out_lora = adapt("vision_out", self.out, 2)
        self.gate_lora, self.up_lora = adapt("vision_gate", self.gate, 1), adapt("vision_up", self.up, 1)
        self.down_lora = adapt("vision_down", self.down, 1)

    def __call__(self, x_NSD, places_NS2, valid_NS):
        h = self.pre_attn_norm(x_NSD)
        q_NSHK, k_NSHK, v_NSHK = (
            adapted(h, w, lora, "nsd,dhk->nshk")
            for w, lora in ((self.q, self.q_lora), (self.k, self.k_lora), (self.v, self.v_lora))
        )
        q_NSHK = rope_2d(self.q_norm(q_NSHK), places_NS2, self.rope_base)
        k_NSHK = rope_2d(self.k_norm(k_NSHK), places_NS2, self.rope_base)
        v_NSHK = self.v_norm(v_NSHK)
        scores_NHST = jnp.einsum("nshk,nthk->nhst", q_NSHK, k_NSHK).astype(jnp.float32)
        scores_NHST = jnp.where(valid_NS[:, None, None, :], scores_NHST, NEVER)  # keys: the image's own
        probs_NHST = jax.nn.softmax(scores_NHST, -1).astype(x_NSD.dtype)
        attended_NSHK = jnp.einsum("nhst,nthk->nshk", probs_NHST, v_NSHK)
        x_NSD = x_NSD + self.post_attn_norm(adapted(attended_NSHK, self.out, self.out_lora, "nshk,hkd->nsd"))
        h = self.pre_mlp_norm(x_NSD)
        gate = gelu_tanh(adapted(h, self.gate, self.gate_lora, "nsd,df->nsf"))
        h = adapted(
            gate * adapted(h, self.up, self.up_lora, "nsd,df->nsf"), self.down, self.down_lora, "nsf,fd->nsd"
        )
        return x_NSD + self.post_mlp_norm(h)


class Gemma4VisionTower(Tower):
    """Images [N, S, C*P*P + 2] -> their embeddings [N, tokens_per_image, text_dim] (an image's own
    tokens first, token_counts of them)."""

    def build(self, cfg: VisionConfig, text_dim: int, rngs: nnx.Rngs, lora: LoraConfig | None) -> None:
        D, patch = cfg.embed_dim, cfg.num_channels * cfg.patch_size**2
        self.patch = param(rngs, (patch, D), (None, "embed"), patch)
        self.position = param(rngs, (2, cfg.position_table_size, D), (None, None, "embed"), 1)
        self.layers = stacked_layers(EncoderLayer, cfg, jax.random.split(rngs.params(), cfg.num_layers), lora)
        if cfg.standardize:
            self.std_bias = nnx.Param(jnp.zeros((D,), jnp.float32), axes=("norm",))
            self.std_scale = nnx.Param(jnp.ones((D,), jnp.float32), axes=("norm",))
        self.soft_norm = _norm(D, cfg.layer_norm_eps, with_scale=False)  # no parameters
        self.projection = param(rngs, (D, text_dim), (None, "embed"), D)

    def __call__(self, images_NSF):
        k = self.cfg.pooling_kernel
        pixels_NSF, places_NS2 = images_NSF[..., :-2], images_NSF[..., -2:].astype(jnp.int32)
        valid_NS = jnp.all(places_NS2 >= 0, -1)
        places_NS2 = jnp.maximum(places_NS2, 0)
        position_NSD = self.position[0][places_NS2[..., 0]] + self.position[1][places_NS2[..., 1]]
        x_NSD = (2 * pixels_NSF - 1).astype(self.patch.dtype) @ self.patch[...]
        x_NSD = x_NSD + jnp.where(valid_NS[..., None], position_NSD, 0)
        x_NSD = constrain(x_NSD, ("batch", None, "act_embed"), self.rules)
        x_NSD = scan_layers(self.layers, x_NSD, self.remat_policy, places_NS2, valid_NS)
        # the pooler: block (x // k, y // k) of a grid w patches wide is token x // k + (w // k) (y // k)
        width_N1 = jnp.max(places_NS2[..., 0], axis=1, keepdims=True) + 1
        block_NS = places_NS2[..., 0] // k + (width_N1 // k) * (places_NS2[..., 1] // k)
        x_NSD = jnp.where(valid_NS[..., None], x_NSD, 0).astype(jnp.float32)
        tokens = self.cfg.tokens_per_image
        pooled_NXD = jax.vmap(lambda x, b: jax.ops.segment_sum(x, b, tokens))(x_NSD, block_NS) / k**2
        pooled_NXD = pooled_NXD * self.cfg.embed_dim**0.5
        if self.cfg.standardize:
            pooled_NXD = (pooled_NXD - self.std_bias[...]) * self.std_scale[...]
        return self.soft_norm(pooled_NXD) @ self.projection[...]
