"""The Gemma decoder family (Gemma 1, 2 and 3) in Flax NNX, one implementation behind config fields.

Axis letters: B batch, T query positions, S key positions, D embed, N query heads, K key/value
heads, G query heads per key/value head (N = K * G), H head dim, F MLP width, V vocab, L layers.
Every parameter carries logical axis names (metadata `axes`); tunix_train.sharding maps them.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from tunix_train.config import AttentionImpl, ModelConfig, Remat
from tunix_train.sharding import constrain

_GLOBAL_WINDOW = np.iinfo(np.int32).max  # a global layer's "window" covers every position


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], fan_in: int) -> nnx.Param:
    init = jax.nn.initializers.normal(stddev=fan_in**-0.5)
    return nnx.Param(init(rngs.params(), shape, jnp.float32), axes=axes)


class RMSNorm(nnx.Module):
    """x / rms(x) * (1 + scale), computed in float32; scale starts at zero."""

    def __init__(self, dim: int, eps: float):
        self.scale = nnx.Param(jnp.zeros((dim,), jnp.float32), axes=("norm",))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)


PROJECTION = "projection"  # the checkpoint name of projections' outputs, saved like matmul outputs


def projection_output(x):
    """Names x, a projection's output or one slice of a stacked projection's, for the remat policies
    that save matmul outputs. Naming the slices, not the stack, lets the backward pass read each
    saved array whole (2% faster on CPU than slicing a saved stack there)."""
    return checkpoint_name(x, PROJECTION)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def project(spec: str, x, w):
    """jnp.einsum(spec, x, w) for activations x and weights w, with the weight gradient computed as
    einsum(x, g). JAX's own rule computes einsum(g, x), and XLA's CPU backend then copies the
    output gradient, the larger operand, into a transposed layout (8% slower on CPU)."""
    return jnp.einsum(spec, x, w)


def _project_fwd(spec, x, w):
    return jnp.einsum(spec, x, w), (x, w)


def _project_bwd(spec, residuals, g):
    x, w = residuals
    inputs, out = spec.split("->")
    x_axes, w_axes = inputs.split(",")
    return jnp.einsum(f"{out},{w_axes}->{x_axes}", g, w), jnp.einsum(f"{x_axes},{out}->{w_axes}", x, g)


project.defvjp(_project_fwd, _project_bwd)


def rope_table(positions_BT, base: float, scale: float, head_dim: int):
    """(sin, cos) [B, T, 1, 1, H/2] of the rotary angles at positions divided by `scale`. Computed
    once per forward pass: inside the layers, XLA would recompute them for every head and layer."""
    half = head_dim // 2
    timescale = base ** (2.0 * jnp.arange(half, dtype=jnp.float32) / head_dim)
    angle_BTh = positions_BT[..., None].astype(jnp.float32) / scale / timescale
    return jnp.sin(angle_BTh)[:, :, None, None, :], jnp.cos(angle_BTh)[:, :, None, None, :]


def apply_rope(x_BTNH, sin, cos):
    """Rotary embedding over halves of the head dimension, with rope_table's (sin, cos).

    The halves (x1, x2) become (x1 cos - x2 sin, x2 cos + x1 sin). Written with a flip of a size-2
    axis instead of split and concatenate, whose gradients (pads and slices) cost more than the
    rotation itself on CPU."""
    B, T, N, H = x_BTNH.shape
    signs_2 = jnp.array([-1.0, 1.0])[:, None]
    x_BTN2h = x_BTNH.astype(jnp.float32).reshape(B, T, N, 2, H // 2)
    rotated = x_BTN2h * cos + jnp.flip(x_BTN2h, axis=-2) * (signs_2 * sin)
    return rotated.reshape(B, T, N, H).astype(x_BTNH.dtype)


class Attention(nnx.Module):
    """Grouped-query attention with optional QK-norm (Gemma 3) and logit soft-capping (Gemma 2)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, N, K, H = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_DNH = _param(rngs, (D, N, H), ("embed", "heads", "head_dim"), D)
        self.k_DKH = _param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), D)
        self.v_DKH = _param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), D)
        self.o_NHD = _param(rngs, (N, H, D), ("heads", "head_dim", "embed"), N * H)
        self.q_norm = RMSNorm(H, cfg.rms_norm_eps) if cfg.use_qk_norm else None
        self.k_norm = RMSNorm(H, cfg.rms_norm_eps) if cfg.use_qk_norm else None
        self.query_scale = (cfg.query_pre_attn_scalar or H) ** -0.5
        self.softcap = cfg.attn_logit_softcap

    def __call__(self, x_BTD, rope, mask_BTS, fused=None):
        # One matmul per input where shapes allow (q, k, v stacked when K = N; k, v otherwise): with
        # tensor parallelism the backward pass then all-reduces one partial input gradient, not three.
        # The stack axis sits after the embed axis, so the matmul's output and its gradient are
        # [tokens, stack * features] as the matmul makes them: no transposes (11% faster on CPU).
        q, k, v = self.q_DNH[...], self.k_DKH[...], self.v_DKH[...]
        if q.shape == k.shape:
            qkv_BTCNH = project("btd,dcnh->btcnh", x_BTD, jnp.stack([q, k, v], axis=1))
            q_BTNH, k_BSKH, v_BSKH = qkv_BTCNH[:, :, 0], qkv_BTCNH[:, :, 1], qkv_BTCNH[:, :, 2]
        else:
            q_BTNH = project("btd,dnh->btnh", x_BTD, q)
            kv_BSCKH = project("bsd,dckh->bsckh", x_BTD, jnp.stack([k, v], axis=1))
            k_BSKH, v_BSKH = kv_BSCKH[:, :, 0], kv_BSCKH[:, :, 1]
        q_BTNH, k_BSKH, v_BSKH = map(projection_output, (q_BTNH, k_BSKH, v_BSKH))
        if self.q_norm is not None:
            q_BTNH, k_BSKH = self.q_norm(q_BTNH), self.k_norm(k_BSKH)
        q_BTNH = apply_rope(q_BTNH, *rope) * self.query_scale
        k_BSKH = apply_rope(k_BSKH, *rope)
        q_BTNH = constrain(q_BTNH, ("batch", "seq", "act_heads", None))

        out_BTNH = attend(q_BTNH, k_BSKH, v_BSKH, mask_BTS, self.softcap, fused)
        return jnp.einsum("btnh,nhd->btd", out_BTNH, self.o_NHD[...])


ATTENTION = "attention"  # the checkpoint name of attention's output and log-sum-exp, saved like matmul outputs


def attend(q_BTNH, k_BSKH, v_BSKH, mask_BTS, softcap: float | None = None, fused: str | None = None):
    """softmax(q k) v over the keys that mask_BTS allows; q comes scaled. `fused` names a kernel of
    jax.nn.dot_product_attention ("cudnn": cuDNN flash attention, which takes no soft-cap)."""
    if fused is not None:
        return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=mask_BTS[:, None], scale=1.0,
                                            implementation=fused)
    # Heads in front of positions, and a group's queries stacked along them: each (batch, kv head)
    # is then one [G*T, H] x [H, S] matmul on the layout XLA wants (5% faster on CPU than
    # einsums over the [B, T, K, G, H] layout, which XLA transposed in and out again per dot).
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    G = N // K
    q_BKXH = q_BTNH.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)
    k_BKSH, v_BKSH = k_BSKH.transpose(0, 2, 1, 3), v_BSKH.transpose(0, 2, 1, 3)
    out_BKXH = _attention(q_BKXH, k_BKSH, v_BKSH, mask_BTS, softcap)
    return out_BKXH.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)


def _scores(q_BKXH, k_BKSH, mask_BTS, softcap):
    """float32 scores [B, K, G, T, S], masked (-1e30 where not allowed), and before masking."""
    B, K, X, _ = q_BKXH.shape
    T = mask_BTS.shape[1]
    logits_BKGTS = jnp.einsum("bkxh,bksh->bkxs", q_BKXH, k_BKSH).reshape(B, K, X // T, T, -1).astype(jnp.float32)
    if softcap is not None:
        logits_BKGTS = jnp.tanh(logits_BKGTS / softcap) * softcap
    return jnp.where(mask_BTS[:, None, None], logits_BKGTS, -1e30), logits_BKGTS


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q_BKXH, k_BKSH, v_BKSH, mask_BTS, softcap):
    return _attention_fwd(q_BKXH, k_BKSH, v_BKSH, mask_BTS, softcap)[0]


def _attention_fwd(q_BKXH, k_BKSH, v_BKSH, mask_BTS, softcap):
    """The output and, for the backward pass, the log-sum-exp of each query's scores: both carry the
    checkpoint name `attention`, so the default remat policy saves them instead of recomputing
    softmax(q k) v."""
    B, K, X, _ = q_BKXH.shape
    scores_BKGTS, _ = _scores(q_BKXH, k_BKSH, mask_BTS, softcap)
    top_BKGT1 = jnp.max(scores_BKGTS, axis=-1, keepdims=True)
    exp_BKGTS = jnp.exp(scores_BKGTS - top_BKGT1)
    total_BKGT1 = jnp.sum(exp_BKGTS, axis=-1, keepdims=True)
    # normalized after the weighted sum: a division over [X, H], not over [X, S]
    weighted_BKXH = jnp.einsum("bkxs,bksh->bkxh", exp_BKGTS.astype(v_BKSH.dtype).reshape(B, K, X, -1), v_BKSH)
    out_BKXH = (weighted_BKXH / total_BKGT1.reshape(B, K, X, 1)).astype(v_BKSH.dtype)
    out_BKXH = checkpoint_name(out_BKXH, ATTENTION)
    lse_BKGT1 = checkpoint_name(top_BKGT1 + jnp.log(total_BKGT1), ATTENTION)
    return out_BKXH, (q_BKXH, k_BKSH, v_BKSH, mask_BTS, out_BKXH, lse_BKGT1)


def _attention_bwd(softcap, residuals, d_out_BKXH):
    """Flash attention's backward pass: the probabilities come back from the scores and the saved
    log-sum-exp, and the softmax gradient needs only rowsum(d_out * out), not the forward's reductions
    (1.5 to 3% faster on CPU than differentiating the forward pass)."""
    q_BKXH, k_BKSH, v_BKSH, mask_BTS, out_BKXH, lse_BKGT1 = residuals
    B, K, X, _ = q_BKXH.shape
    scores_BKGTS, capped_BKGTS = _scores(q_BKXH, k_BKSH, mask_BTS, softcap)
    probs_BKGTS = jnp.exp(scores_BKGTS - lse_BKGT1)
    d_probs_BKGTS = jnp.einsum("bkxh,bksh->bkxs", d_out_BKXH, v_BKSH).reshape(scores_BKGTS.shape)
    rowsum_BKGT1 = jnp.sum(d_out_BKXH.astype(jnp.float32) * out_BKXH.astype(jnp.float32),
                           axis=-1).reshape(lse_BKGT1.shape)
    d_scores_BKGTS = probs_BKGTS * (d_probs_BKGTS - rowsum_BKGT1)
    if softcap is not None:
        d_scores_BKGTS = d_scores_BKGTS * (1.0 - (capped_BKGTS / softcap) ** 2)
    probs_BKXS = probs_BKGTS.astype(v_BKSH.dtype).reshape(B, K, X, -1)
    d_scores_BKXS = d_scores_BKGTS.astype(q_BKXH.dtype).reshape(B, K, X, -1)
    return (jnp.einsum("bkxs,bksh->bkxh", d_scores_BKXS, k_BKSH),
            jnp.einsum("bkxs,bkxh->bksh", d_scores_BKXS, q_BKXH),
            jnp.einsum("bkxs,bkxh->bksh", probs_BKXS, d_out_BKXH),
            None)


_attention.defvjp(_attention_fwd, _attention_bwd)


class MLP(nnx.Module):
    """GeGLU: down(gelu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, F = cfg.embed_dim, cfg.hidden_dim
        self.gate_DF = _param(rngs, (D, F), ("embed", "mlp"), D)
        self.up_DF = _param(rngs, (D, F), ("embed", "mlp"), D)
        self.down_FD = _param(rngs, (F, D), ("mlp", "embed"), F)

    def __call__(self, x_BTD):
        # Two matmuls, not one over gate and up stacked: the backward pass then reads each saved
        # output whole, where slices of the stacked one cost 3% of the step on CPU. With tp, XLA's
        # GPU pipeline folds the two input-gradient all-reduces into one; its CPU pipeline does not.
        gate_BTF = projection_output(project("btd,df->btf", x_BTD, self.gate_DF[...]))
        up_BTF = projection_output(project("btd,df->btf", x_BTD, self.up_DF[...]))
        h_BTF = constrain(jax.nn.gelu(gate_BTF, approximate=True) * up_BTF, ("batch", "seq", "act_mlp"))
        return jnp.einsum("btf,fd->btd", h_BTF, self.down_FD[...])


class Block(nnx.Module):
    """Pre-norm attention and MLP, each optionally followed by a post-norm (Gemma 2 and 3)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, eps = cfg.embed_dim, cfg.rms_norm_eps
        self.pre_attn_norm = RMSNorm(D, eps)
        self.attn = Attention(cfg, rngs)
        self.post_attn_norm = RMSNorm(D, eps) if cfg.use_post_attn_norm else None
        self.pre_ffw_norm = RMSNorm(D, eps)
        self.mlp = MLP(cfg, rngs)
        self.post_ffw_norm = RMSNorm(D, eps) if cfg.use_post_ffw_norm else None

    def __call__(self, x_BTD, rope, mask_BTS, fused_attention=None):
        h_BTD = self.attn(self.pre_attn_norm(x_BTD), rope, mask_BTS, fused_attention)
        if self.post_attn_norm is not None:
            h_BTD = self.post_attn_norm(h_BTD)
        x_BTD = x_BTD + h_BTD
        h_BTD = self.mlp(self.pre_ffw_norm(x_BTD))
        if self.post_ffw_norm is not None:
            h_BTD = self.post_ffw_norm(h_BTD)
        return constrain(x_BTD + h_BTD, ("batch", "seq", "act_embed"))


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
    """One Block whose parameters have a leading `layers` axis, for jax.lax.scan."""
    keys = jax.random.split(rngs.params(), cfg.num_layers)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Block(cfg, nnx.Rngs(0))))
    state = jax.vmap(lambda key: nnx.state(Block(cfg, nnx.Rngs(key))))(keys)
    for variable in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        variable.set_metadata(axes=("layers", *variable.get_metadata()["axes"]))
    return nnx.merge(graphdef, state)


def layer_windows(cfg: ModelConfig) -> np.ndarray:
    """Attention window of each layer: `local_layers_per_global` local layers, then a global one."""
    period = cfg.local_layers_per_global + 1
    is_global = (np.arange(cfg.num_layers) + 1) % period == 0
    return np.where(is_global, _GLOBAL_WINDOW, cfg.sliding_window or _GLOBAL_WINDOW).astype(np.int32)


_offload_dots = jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
_offload_projections = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=(), names_which_can_be_offloaded=(PROJECTION, ATTENTION), offload_src="device",
    offload_dst="pinned_host")


def _offload_matmul_outputs(prim, *args, **params):
    """Offloads matmul outputs: dot_generals and project's named outputs."""
    policy = _offload_projections if prim.name == "name" else _offload_dots
    return policy(prim, *args, **params)


_REMAT_POLICIES = {
    Remat.full: jax.checkpoint_policies.nothing_saveable,
    Remat.save_matmul_outputs: jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(PROJECTION, ATTENTION)),
    Remat.offload_matmul_outputs: _offload_matmul_outputs,
}


class Gemma(nnx.Module):
    """Token ids [B, T] -> float32 next-token logits [B, T, V]; embeddings tied to the output."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, remat: Remat = Remat.none, scan_unroll: int = 1,
                 attention: AttentionImpl = AttentionImpl.xla):
        self.cfg, self.remat, self.scan_unroll, self.attention = cfg, remat, scan_unroll, attention
        D, V = cfg.embed_dim, cfg.vocab_size
        self.embedding_VD = _param(rngs, (V, D), ("vocab", "embed"), D)
        self.layers = _stacked_blocks(cfg, rngs)
        self.final_norm = RMSNorm(D, cfg.rms_norm_eps)

    def __call__(self, tokens_BT, positions_BT=None, segment_ids_BT=None):
        """positions restart at 0 and segment ids change at each packed document; by default one
        document per row. Attention never crosses documents or looks ahead."""
        x_BTD = self.hidden(tokens_BT, positions_BT, segment_ids_BT)
        return output_logits(x_BTD, self.output_table(), self.cfg.final_logit_softcap)

    def output_table(self):
        """The tied embedding, gathered over fsdp: used by the lookup and the logits."""
        return constrain(self.embedding_VD[...], ("act_vocab", None))

    def hidden(self, tokens_BT, positions_BT=None, segment_ids_BT=None):
        """The final normed hidden states [B, T, D], from which output_logits computes the logits."""
        cfg = self.cfg
        B, T = tokens_BT.shape
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        if segment_ids_BT is None:
            segment_ids_BT = jnp.ones((B, T), jnp.int32)
        table_VD = self.output_table()
        x_BTD = table_VD[tokens_BT] * jnp.sqrt(jnp.float32(cfg.embed_dim)).astype(table_VD.dtype)
        x_BTD = constrain(x_BTD, ("batch", "seq", "act_embed"))

        index = jnp.arange(T)
        distance_TS = index[:, None] - index[None, :]
        mask_BTS = (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]) & (distance_TS >= 0)

        windows_L = jnp.asarray(layer_windows(cfg))
        is_global_L = windows_L == _GLOBAL_WINDOW
        rope_global = rope_table(positions_BT, cfg.rope_base_global, cfg.rope_scale_global, cfg.head_dim)
        rope_local = rope_table(positions_BT, cfg.rope_base_local, 1.0, cfg.head_dim)

        graphdef, layer_state = nnx.split(self.layers)
        fused = None if self.attention is AttentionImpl.xla else self.attention.value

        def layer(x_BTD, per_layer):
            state, window, is_global = per_layer
            layer_mask_BTS = mask_BTS & (distance_TS < window)
            rope = [jnp.where(is_global, g, l) for g, l in zip(rope_global, rope_local)]
            block = nnx.merge(graphdef, state)
            return block(x_BTD, rope, layer_mask_BTS, fused), None

        if self.remat in _REMAT_POLICIES:
            layer = jax.checkpoint(layer, policy=_REMAT_POLICIES[self.remat], prevent_cse=False)
        x_BTD, _ = jax.lax.scan(layer, x_BTD, (layer_state, windows_L, is_global_L),
                                unroll=self.scan_unroll)

        return self.final_norm(x_BTD)


def output_logits(x_BTD, table_VD, softcap: float | None):
    """float32 next-token logits [B, T, V] from final hidden states and the tied embedding."""
    logits_BTV = jnp.einsum("btd,vd->btv", x_BTD, table_VD.astype(x_BTD.dtype)).astype(jnp.float32)
    if softcap is not None:
        logits_BTV = jnp.tanh(logits_BTV / softcap) * softcap
    return constrain(logits_BTV, ("batch", "seq", "act_vocab"))
