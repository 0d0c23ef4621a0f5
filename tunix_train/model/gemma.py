"""The Gemma decoder family (Gemma 1, 2 and 3) in Flax NNX, one implementation behind config fields.

Axis letters: B batch, T query positions, S key positions, D embed, N query heads, K key/value
heads, G query heads per key/value head (N = K * G), H head dim, F MLP width, V vocab, L layers.
Every parameter carries logical axis names (metadata `axes`); activations are constrained by
logical names under `rules`, the table tunix_train.sharding maps to the mesh. What is written for
a compiler's layout rather than as the math (fused projections, attention's layout and backward
pass, the rotary flip, the remat policies) lives in kernels.py.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix_train.config import AttentionImpl, LoraConfig, ModelConfig, Remat
from tunix_train.model import kernels
from tunix_train.model.lora import LoRA
from tunix_train.sharding import LOGICAL_RULES, Rules, constrain

if TYPE_CHECKING:  # tunix_train.parallel imports this module
    from tunix_train.parallel import Parallelism

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


# Each LoRA adapter (an attribute of Attention or MLP) and the weight beside it that it adapts.
ADAPTED_WEIGHTS = {"q_lora": "q_DNH", "k_lora": "k_DKH", "v_lora": "v_DKH", "o_lora": "o_NHD",
                   "gate_lora": "gate_DF", "up_lora": "up_DF", "down_lora": "down_FD"}
Adapt = Callable[[str, nnx.Param, int], "LoRA | None"]  # (target, weight, input dims) -> its adapter or None


def _no_adapter(target: str, weight: nnx.Param, n_in: int) -> None:
    return None


def _adapter(lora: LoraConfig, rngs: nnx.Rngs, target: str, weight: nnx.Param, n_in: int) -> LoRA | None:
    """A LoRA adapter of `weight` (its first n_in dimensions are the input) when lora targets it;
    drawn from its own random stream, so the base weights are those of the model without adapters."""
    if target not in lora.targets:
        return None
    axes = weight.get_metadata()["axes"]
    return LoRA(rngs, weight.shape[:n_in], axes[:n_in], weight.shape[n_in:], axes[n_in:], lora.rank, lora.alpha)


def rope_table(positions_BT, base: float, scale: float, head_dim: int):
    """(sin, cos) [B, T, 1, 1, H/2] of the rotary angles at positions divided by `scale`, for
    kernels.apply_rope. Computed once per forward pass, not per layer."""
    half = head_dim // 2
    timescale = base ** (2.0 * jnp.arange(half, dtype=jnp.float32) / head_dim)
    angle_BTh = positions_BT[..., None].astype(jnp.float32) / scale / timescale
    return jnp.sin(angle_BTh)[:, :, None, None, :], jnp.cos(angle_BTh)[:, :, None, None, :]


class Attention(nnx.Module):
    """Grouped-query attention with optional QK-norm (Gemma 3) and logit soft-capping (Gemma 2)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, rules: Rules, adapt: Adapt = _no_adapter):
        D, N, K, H = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_DNH = _param(rngs, (D, N, H), ("embed", "heads", "head_dim"), D)
        self.k_DKH = _param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), D)
        self.v_DKH = _param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), D)
        self.o_NHD = _param(rngs, (N, H, D), ("heads", "head_dim", "embed"), N * H)
        self.q_lora, self.k_lora, self.v_lora = (adapt(name, w, 1) for name, w in
                                                 (("q", self.q_DNH), ("k", self.k_DKH), ("v", self.v_DKH)))
        self.o_lora = adapt("o", self.o_NHD, 2)
        self.q_norm = RMSNorm(H, cfg.rms_norm_eps) if cfg.use_qk_norm else None
        self.k_norm = RMSNorm(H, cfg.rms_norm_eps) if cfg.use_qk_norm else None
        self.query_scale = (cfg.query_pre_attn_scalar or H) ** -0.5
        self.softcap = cfg.attn_logit_softcap
        self.rules = rules

    def __call__(self, x_BTD, rope, attend):
        """`attend(q, k, v, softcap) -> (out, extra)`: attention over the keys this pass may see
        (Gemma.hidden: the masked positions of the pass; a sampler: its KV cache, returned as extra)."""
        q_BTNH, k_BSKH, v_BSKH = kernels.qkv_projection(x_BTD, self.q_DNH[...], self.k_DKH[...], self.v_DKH[...])
        q_BTNH, k_BSKH, v_BSKH = (y if lora is None else y + lora(x_BTD) for y, lora in
                                  ((q_BTNH, self.q_lora), (k_BSKH, self.k_lora), (v_BSKH, self.v_lora)))
        if self.q_norm is not None:
            q_BTNH, k_BSKH = self.q_norm(q_BTNH), self.k_norm(k_BSKH)
        q_BTNH = kernels.apply_rope(q_BTNH, *rope) * self.query_scale
        k_BSKH = kernels.apply_rope(k_BSKH, *rope)
        q_BTNH = constrain(q_BTNH, ("batch", "seq", "act_heads", None), self.rules)

        out_BTNH, extra = attend(q_BTNH, k_BSKH, v_BSKH, self.softcap)
        # contracts (n, h) in this order: jnp.einsum("btnh,nhd->btd") asks for (h, n), for which
        # XLA:CPU transposed the output weights and the activations at every call
        y_BTD = jax.lax.dot_general(out_BTNH, self.o_NHD[...], (((2, 3), (0, 1)), ((), ())))
        return (y_BTD if self.o_lora is None else y_BTD + self.o_lora(out_BTNH)), extra


class MLP(nnx.Module):
    """GeGLU: down(gelu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, rules: Rules, adapt: Adapt = _no_adapter):
        D, F = cfg.embed_dim, cfg.hidden_dim
        self.gate_DF = _param(rngs, (D, F), ("embed", "mlp"), D)
        self.up_DF = _param(rngs, (D, F), ("embed", "mlp"), D)
        self.down_FD = _param(rngs, (F, D), ("mlp", "embed"), F)
        self.gate_lora, self.up_lora, self.down_lora = (adapt(name, w, 1) for name, w in
                                                        (("gate", self.gate_DF), ("up", self.up_DF), ("down", self.down_FD)))
        self.rules = rules

    def __call__(self, x_BTD):
        gate_BTF = kernels.dense("btd,df->btf", x_BTD, self.gate_DF[...])
        up_BTF = kernels.dense("btd,df->btf", x_BTD, self.up_DF[...])
        if self.gate_lora is not None:
            gate_BTF = gate_BTF + self.gate_lora(x_BTD)
        if self.up_lora is not None:
            up_BTF = up_BTF + self.up_lora(x_BTD)
        h_BTF = constrain(jax.nn.gelu(gate_BTF, approximate=True) * up_BTF, ("batch", "seq", "act_mlp"), self.rules)
        y_BTD = jnp.einsum("btf,fd->btd", h_BTF, self.down_FD[...])
        return y_BTD if self.down_lora is None else y_BTD + self.down_lora(h_BTF)


class Block(nnx.Module):
    """Pre-norm attention and MLP, each optionally followed by a post-norm (Gemma 2 and 3)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, rules: Rules, adapt: Adapt = _no_adapter):
        D, eps = cfg.embed_dim, cfg.rms_norm_eps
        self.pre_attn_norm = RMSNorm(D, eps)
        self.attn = Attention(cfg, rngs, rules, adapt)
        self.post_attn_norm = RMSNorm(D, eps) if cfg.use_post_attn_norm else None
        self.pre_ffw_norm = RMSNorm(D, eps)
        self.mlp = MLP(cfg, rngs, rules, adapt)
        self.post_ffw_norm = RMSNorm(D, eps) if cfg.use_post_ffw_norm else None
        self.rules = rules

    def __call__(self, x_BTD, rope, attend):
        """The block's output and what `attend` returned beside attention's output."""
        h_BTD, extra = self.attn(self.pre_attn_norm(x_BTD), rope, attend)
        if self.post_attn_norm is not None:
            h_BTD = self.post_attn_norm(h_BTD)
        x_BTD = x_BTD + h_BTD
        h_BTD = self.mlp(self.pre_ffw_norm(x_BTD))
        if self.post_ffw_norm is not None:
            h_BTD = self.post_ffw_norm(h_BTD)
        return constrain(x_BTD + h_BTD, ("batch", "seq", "act_embed"), self.rules), extra


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs, rules: Rules, lora: LoraConfig | None) -> Block:
    """One Block whose parameters have a leading `layers` axis, for jax.lax.scan."""
    keys = jax.random.split(rngs.params(), cfg.num_layers)
    # after the base's keys, so the base is the same with adapters or without
    adapter_keys = keys if lora is None else jax.random.split(rngs.params(), cfg.num_layers)

    def block(key, adapter_key):
        adapt = _no_adapter if lora is None else functools.partial(_adapter, lora, nnx.Rngs(adapter_key))
        return Block(cfg, nnx.Rngs(key), rules, adapt)

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: block(jax.random.key(0), jax.random.key(0))))
    state = jax.vmap(lambda key, adapter_key: nnx.state(block(key, adapter_key)))(keys, adapter_keys)
    for variable in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        variable.set_metadata(axes=("layers", *variable.get_metadata()["axes"]))
    return nnx.merge(graphdef, state)


def layer_windows(cfg: ModelConfig) -> np.ndarray:
    """Attention window of each layer: `local_layers_per_global` local layers, then a global one."""
    period = cfg.local_layers_per_global + 1
    is_global = (np.arange(cfg.num_layers) + 1) % period == 0
    return np.where(is_global, _GLOBAL_WINDOW, cfg.sliding_window or _GLOBAL_WINDOW).astype(np.int32)


class Gemma(nnx.Module):
    """Token ids [B, T] -> float32 next-token logits [B, T, V]; embeddings tied to the output."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, remat: Remat = Remat.none, scan_unroll: int = 1,
                 attention: AttentionImpl = AttentionImpl.xla, rules: Rules = LOGICAL_RULES,
                 parallel: Parallelism | None = None, lora: LoraConfig | None = None):
        """parallel: a tunix_train.parallel.Parallelism that runs the layer stack over the pp and cp
        mesh axes; None runs it as written. lora: adapters on the projections it targets."""
        self.cfg, self.remat, self.scan_unroll, self.attention = cfg, remat, scan_unroll, attention
        self.rules, self.parallel = rules, parallel
        D, V = cfg.embed_dim, cfg.vocab_size
        self.embedding_VD = _param(rngs, (V, D), ("vocab", "embed"), D)
        self.layers = _stacked_blocks(cfg, rngs, rules, lora)
        self.final_norm = RMSNorm(D, cfg.rms_norm_eps)

    def __call__(self, tokens_BT, positions_BT=None, segment_ids_BT=None, token_index_BT=None):
        """positions restart at 0 and segment ids change at each packed document; by default one
        document per row. Attention never crosses documents or looks ahead. token_index: where each
        token stands in its row (default 0, 1, ...); the masks read it, so a row may come reordered."""
        x_BTD = self.hidden(tokens_BT, positions_BT, segment_ids_BT, token_index_BT)
        return output_logits(x_BTD, self.output_table(), self.cfg.final_logit_softcap, self.rules)

    def output_table(self):
        """The tied embedding, gathered over fsdp: used by the lookup and the logits."""
        return constrain(self.embedding_VD[...], ("act_vocab", None), self.rules)

    def embed(self, tokens_BT):
        """Token embeddings [B, T, D], scaled by sqrt(D)."""
        table_VD = self.output_table()
        x_BTD = table_VD[tokens_BT] * jnp.sqrt(jnp.float32(self.cfg.embed_dim)).astype(table_VD.dtype)
        return constrain(x_BTD, ("batch", "seq", "act_embed"), self.rules)

    def rope_tables(self, positions_BT):
        """rope_table of global and of local layers at `positions_BT`."""
        cfg = self.cfg
        return (rope_table(positions_BT, cfg.rope_base_global, cfg.rope_scale_global, cfg.head_dim),
                rope_table(positions_BT, cfg.rope_base_local, 1.0, cfg.head_dim))

    def hidden(self, tokens_BT, positions_BT=None, segment_ids_BT=None, token_index_BT=None):
        """The final normed hidden states [B, T, D], from which output_logits computes the logits."""
        B, T = tokens_BT.shape
        index_1T = jnp.arange(T, dtype=jnp.int32)[None]
        rows = {"positions": jnp.broadcast_to(index_1T, (B, T)) if positions_BT is None else positions_BT,
                "segment_ids": jnp.ones((B, T), jnp.int32) if segment_ids_BT is None else segment_ids_BT,
                "token_index": index_1T if token_index_BT is None else token_index_BT}
        layer_xs = (nnx.split(self.layers)[1], jnp.asarray(layer_windows(self.cfg)))
        x_BTD = self.embed(tokens_BT)
        if self.parallel is None:
            x_BTD = self._layers(layer_xs, x_BTD, rows, self._masked_attention)
        else:
            x_BTD = self.parallel.run_layers(self._layers, layer_xs, x_BTD, rows, self._masked_attention)
        return self.final_norm(x_BTD)

    def _layers(self, layer_xs, x_BTD, rows, make_attend):
        """The layers of layer_xs (stacked parameters, windows) applied in order, by a scan.
        make_attend: rows -> window -> attend, the attention over the keys of this pass."""
        graphdef = nnx.graphdef(self.layers)
        rope_global, rope_local = self.rope_tables(rows["positions"])
        attend_within = make_attend(rows)

        def layer(x_BTD, per_layer):
            state, window = per_layer
            rope = [jnp.where(window == _GLOBAL_WINDOW, g, l) for g, l in zip(rope_global, rope_local)]
            return nnx.merge(graphdef, state)(x_BTD, rope, attend_within(window))[0], None

        if self.remat in kernels.REMAT_POLICIES:
            layer = jax.checkpoint(layer, policy=kernels.REMAT_POLICIES[self.remat], prevent_cse=False)
        return jax.lax.scan(layer, x_BTD, layer_xs, unroll=self.scan_unroll)[0]

    def _masked_attention(self, rows):
        """rows -> window -> attend: attention over the keys of the pass that visible_keys allows,
        its window-independent part computed once per pass."""
        fused = None if self.attention is AttentionImpl.xla else self.attention.value
        index, segments = rows["token_index"], rows["segment_ids"]
        distance_BTS = index[:, :, None] - index[:, None, :]
        mask_BTS = (segments[:, :, None] == segments[:, None, :]) & (distance_BTS >= 0)
        return lambda window: lambda q, k, v, softcap: (
            kernels.attention(q, k, v, mask_BTS & (distance_BTS < window), softcap, fused), None)


def visible_keys(q_index_BT, q_segments_BT, k_index_BS, k_segments_BS, window):
    """[B, T, S]: which keys each query may see: same document, not ahead, fewer than `window`
    positions back (indices and segments of the queries and of the keys)."""
    distance_BTS = q_index_BT[:, :, None] - k_index_BS[:, None, :]
    same_document_BTS = q_segments_BT[:, :, None] == k_segments_BS[:, None, :]
    return same_document_BTS & (distance_BTS >= 0) & (distance_BTS < window)


def output_logits(x_BTD, table_VD, softcap: float | None, rules: Rules = LOGICAL_RULES):
    """float32 next-token logits [B, T, V] from final hidden states and the tied embedding."""
    logits_BTV = jnp.einsum("btd,vd->btv", x_BTD, table_VD.astype(x_BTD.dtype)).astype(jnp.float32)
    logits_BTV = kernels.soft_cap(logits_BTV, softcap)
    return constrain(logits_BTV, ("batch", "seq", "act_vocab"), rules)
