"""Gemma 3's image tower: SigLIP's vision encoder and the projector into the text model's width.

An image's pixel values [C, H, W] (as transformers' image processors give them) are cut into P x P
patches, each embedded by one matmul (SigLIP's stride-P convolution) plus a learned position per
patch; then L pre-norm encoder layers (stacked and scanned), each bidirectional multi-head attention
and a gelu-tanh MLP (LayerNorms and every projection with a bias), and a final LayerNorm. The
projector averages the patch grid down to tokens_per_image tokens, RMS-normalises them (Gemma's 1 +
scale) and projects them to the text model's width: the embeddings that take the place of an image's
placeholder tokens. Equal to transformers' SiglipVisionModel and Gemma3MultiModalProjector
(test_vision.py).

The merge, for this tower and Gemma 4's (gemma4_vision.py): a row's images [I, *image_shape] give
I x tokens_per_image embeddings, each image's own first (all of them, here); the n-th image
placeholder of a row takes the n-th of the images' own embeddings in order (`image_slots`), after
the text embeddings' scaling. Attention is bidirectional among one image's tokens where
model.vision.image_attention says (kernels.visible_keys). Adapters (training.lora.targets
vision_*) sit beside the encoder layers' projections (`stacked_layers`, `adapted`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_train.config import ImageAttention, LoraConfig, VisionConfig
from tunix_train.model.common import RMSNorm, gelu_tanh, param
from tunix_train.model.lora import Adapt, adapter, no_adapter
from tunix_train.sharding import LOGICAL_RULES, Rules, constrain


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

    def __init__(self, cfg: VisionConfig, rngs: nnx.Rngs, adapt: Adapt = no_adapter):
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
        self.q_lora, self.k_lora, self.v_lora = (
            adapt(f"vision_{x}", getattr(self, x), 1) for x in ("q", "k", "v")
        )
        self.out_lora = adapt("vision_out", self.out, 2)
        self.up_lora, self.down_lora = adapt("vision_up", self.up, 1), adapt("vision_down", self.down, 1)

    def __call__(self, x_NSD):
        h = self.norm1(x_NSD)
        q_NSHK, k_NSHK, v_NSHK = (
            adapted(h, w, lora, "nsd,dhk->nshk") + b[...]
            for w, b, lora in (
                (self.q, self.q_bias, self.q_lora),
                (self.k, self.k_bias, self.k_lora),
                (self.v, self.v_bias, self.v_lora),
            )
        )
        scores_NHST = jnp.einsum("nshk,nthk->nhst", q_NSHK, k_NSHK) * q_NSHK.shape[-1] ** -0.5
        probs_NHST = jax.nn.softmax(scores_NHST.astype(jnp.float32), -1).astype(x_NSD.dtype)
        attended_NSHK = jnp.einsum("nhst,nthk->nshk", probs_NHST, v_NSHK)
        x_NSD = x_NSD + adapted(attended_NSHK, self.out, self.out_lora, "nshk,hkd->nsd") + self.out_bias[...]
        h = gelu_tanh(adapted(self.norm2(x_NSD), self.up, self.up_lora, "nsd,df->nsf") + self.up_bias[...])
        return x_NSD + adapted(h, self.down, self.down_lora, "nsf,fd->nsd") + self.down_bias[...]


def stacked_layers(layer_class, cfg: VisionConfig, keys, lora: LoraConfig | None = None):
    """One layer_class(cfg, rngs, adapt) whose parameters have a leading axis of cfg.num_layers
    (one per key), for jax.lax.scan. The axis is `vision_layers`, not `layers`, which pp splits:
    the tower runs whole before the text model's stages. lora: adapters on the vision_* targets,
    drawn from their own keys (the tower is the same with adapters or without)."""

    def layer(key, adapter_key):
        adapt = no_adapter if lora is None else functools.partial(adapter, lora, nnx.Rngs(adapter_key))
        return layer_class(cfg, nnx.Rngs(key), adapt)

    adapter_keys = jax.random.split(jax.random.fold_in(keys[0], 1), len(keys))
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: layer(jax.random.key(0), jax.random.key(0))))
    state = jax.vmap(lambda key, adapter_key: nnx.state(layer(key, adapter_key)))(keys, adapter_keys)
    for variable in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        variable.set_metadata(axes=("vision_layers", *variable.get_metadata()["axes"]))
    return nnx.merge(graphdef, state)


def scan_layers(layers, x, remat_policy, *args):
    """x through a stack of layers (stacked_layers'), each called as layer(x, *args), scanned;
    remat_policy: what each keeps for the backward pass (None: everything)."""
    graphdef, stacked = nnx.split(layers)

    def layer(x, state):
        return nnx.merge(graphdef, state)(x, *args), None

    if remat_policy is not None:
        layer = jax.checkpoint(layer, policy=remat_policy, prevent_cse=False)
    return jax.lax.scan(layer, x, stacked)[0]


def adapted(x, weight, lora, spec: str):
    """einsum(spec, x, weight), plus the adapter's delta when there is one."""
    y = jnp.einsum(spec, x, weight[...])
    return y if lora is None else y + lora(x)


class Tower(nnx.Module):
    """An image tower: images -> their embeddings [N, tokens_per_image, text_dim]. Each encoder
    builds its parameters in `build`, in the order that fixes their random draws."""

    def __init__(
        self,
        cfg: VisionConfig,
        text_dim: int,
        rngs: nnx.Rngs,
        rules: Rules = LOGICAL_RULES,
        remat_policy=None,
        lora: LoraConfig | None = None,
    ):
        """remat_policy: what each encoder layer keeps for the backward pass (training.remat's, as
        the text layers'); None: everything. lora: adapters on its vision_* targets."""
        self.cfg, self.rules, self.remat_policy = cfg, rules, remat_policy
        self.build(cfg, text_dim, rngs, lora)

    def build(self, cfg: VisionConfig, text_dim: int, rngs: nnx.Rngs, lora: LoraConfig | None) -> None:
        raise NotImplementedError


class VisionTower(Tower):
    """SigLIP (Gemma 3): pixel values [N, C, H, W] -> the images' embeddings [N, tokens_per_image,
    text_dim]."""

    def build(self, cfg: VisionConfig, text_dim: int, rngs: nnx.Rngs, lora: LoraConfig | None) -> None:
        P, C, D = cfg.patch_size, cfg.num_channels, cfg.embed_dim
        self.patch = param(rngs, (P * P * C, D), (None, "embed"), P * P * C)  # rows: (y, x, channel)
        self.patch_bias = nnx.Param(jnp.zeros((D,), jnp.float32), axes=("norm",))
        self.position = param(rngs, (cfg.patches_per_side**2, D), (None, "embed"), 1)
        self.layers = stacked_layers(EncoderLayer, cfg, jax.random.split(rngs.params(), cfg.num_layers), lora)
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
        return self.final_norm(scan_layers(self.layers, x_NSD, self.remat_policy))

    def __call__(self, pixels_NCHW):
        x_NSD = self.encode(pixels_NCHW)
        N, _, D = x_NSD.shape
        side, tokens = self.cfg.patches_per_side, round(self.cfg.tokens_per_image**0.5)
        k = side // tokens  # each token averages a k x k block of patches
        pooled = x_NSD.reshape(N, tokens, k, tokens, k, D).mean((2, 4)).reshape(N, tokens * tokens, D)
        return self.soft_norm(pooled) @ self.projection[...]


def placeholder_counts(tokens_BT, image_token_id: int, token_index_BT=None):
    """Each token's place among its row's image placeholders [B, T] (the n-th of a row: n), -1 for
    text. token_index: where each token stood in its row, when the row comes reordered (cp): the
    count runs in the row's own order."""
    is_image_BT = tokens_BT == image_token_id
    if token_index_BT is None:
        before_BT = jnp.cumsum(is_image_BT, axis=1, dtype=jnp.int32)
    else:  # count in the row's order: scatter to it, count, gather back
        B, T = tokens_BT.shape
        index_BT = jnp.broadcast_to(token_index_BT, (B, T))
        in_order_BT = jnp.zeros((B, T), jnp.int32).at[jnp.arange(B)[:, None], index_BT].set(is_image_BT)
        before_BT = jnp.take_along_axis(jnp.cumsum(in_order_BT, axis=1), index_BT, axis=1)
    return jnp.where(is_image_BT, before_BT - 1, -1)


def token_counts(cfg: VisionConfig, images):
    """Each image's own tokens [..., I] of images [..., I, *image_shape] (numpy or jax): siglip's
    are all tokens_per_image; a gemma4 image's are its patches over k^2."""
    if cfg.traits.patches:
        return (images[..., -1] >= 0).sum(-1) // cfg.pooling_kernel**2
    return jnp.full(images.shape[: images.ndim - 3], cfg.tokens_per_image, jnp.int32)


def image_slots(tokens_BT, cfg: VisionConfig, images_BI, token_index_BT=None):
    """(slots, image ids) [B, T]: each token's row among its row's image embeddings (image i's
    tokens_per_image rows, its own first; -1 for text), and its image (-1 for text), which the
    attention masks read (kernels.visible_keys; None where model.vision.image_attention is causal).
    The n-th placeholder of a row belongs to the first image whose tokens, counted from the row's
    first image, pass n."""
    n_BT = placeholder_counts(tokens_BT, cfg.image_token_id, token_index_BT)
    counts_BI = token_counts(cfg, images_BI).astype(jnp.int32)
    ends_BI = jnp.cumsum(counts_BI, axis=1)
    image_BT = jnp.sum(n_BT[:, :, None] >= ends_BI[:, None, :], -1, dtype=jnp.int32)
    image_BT = jnp.minimum(image_BT, counts_BI.shape[1] - 1)
    start_BT = jnp.take_along_axis(ends_BI - counts_BI, image_BT, axis=1)
    text_BT = n_BT < 0
    slots_BT = jnp.where(text_BT, -1, image_BT * cfg.tokens_per_image + n_BT - start_BT)
    ids_BT = None if cfg.image_attention is ImageAttention.causal else jnp.where(text_BT, -1, image_BT)
    return slots_BT, ids_BT


def images_on_global(cfg: VisionConfig | None) -> bool:
    """Whether an image's tokens see each other in the global layers too (kernels.visible_keys)."""
    return cfg is None or cfg.image_attention is ImageAttention.all_layers


def merged_embeddings(x_BTD, features_BXD, slots_BT):
    """x with each image placeholder's row replaced by its image embedding: features_BXD holds a
    row's images' embeddings in order (X = images x tokens_per_image), slots_BT (image_slots) which
    row each token takes; a slot past them (more placeholders than images: refused where the data
    is read) takes the last."""
    X = features_BXD.shape[1]
    taken_BTD = jnp.take_along_axis(features_BXD, jnp.clip(slots_BT, 0, X - 1)[:, :, None], axis=1)
    return jnp.where((slots_BT >= 0)[:, :, None], taken_BTD.astype(x_BTD.dtype), x_BTD)
