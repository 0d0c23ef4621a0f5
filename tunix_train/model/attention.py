"""A decoder layer's attention (model/decoder.py has the axis letters): grouped-query attention
with the families' variants as config fields. What is written for a compiler's layout rather than
as the math lives in kernels.py."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from flax import nnx

from tunix_train.config import ModelConfig
from tunix_train.model import kernels
from tunix_train.model.common import RMSNorm, param
from tunix_train.model.layout import (
    LayerShape,
)
from tunix_train.model.lora import Adapt, no_adapter
from tunix_train.sharding import Rules, constrain


class Attention(nnx.Module):
    """Grouped-query attention with optional QK-norm (Gemma 3), logit soft-capping (Gemma 2), and
    Gemma 4's value norm, keys as values and keys/values shared from an earlier layer."""

    def __init__(
        self, cfg: ModelConfig, shape: LayerShape, rngs: nnx.Rngs, rules: Rules, adapt: Adapt = no_adapter
    ):
        D, N, K, H = cfg.embed_dim, cfg.num_heads, shape.num_kv_heads, shape.head_dim
        self.q_DNH = param(rngs, (D, N, H), ("embed", "heads", "head_dim"), D)
        computes_kv = not shape.shares_kv
        self.k_DKH = param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), D) if computes_kv else None
        self.v_DKH = (
            param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), D)
            if computes_kv and not shape.k_eq_v
            else None
        )
        self.o_NHD = param(rngs, (N, H, D), ("heads", "head_dim", "embed"), N * H)
        self.q_lora, self.k_lora, self.v_lora = (
            None if w is None else adapt(name, w, 1)
            for name, w in (("q", self.q_DNH), ("k", self.k_DKH), ("v", self.v_DKH))
        )
        self.o_lora = adapt("o", self.o_NHD, 2)
        if cfg.qkv_bias:  # Qwen 2
            self.q_bias_NH = nnx.Param(jnp.zeros((N, H), jnp.float32), axes=("heads", "head_dim"))
            self.k_bias_KH, self.v_bias_KH = (
                nnx.Param(jnp.zeros((K, H), jnp.float32), axes=("kv_heads", "head_dim"))
                if computes_kv and (name == "k" or not shape.k_eq_v)
                else None
                for name in ("k", "v")
            )
        else:
            self.q_bias_NH = self.k_bias_KH = self.v_bias_KH = None
        norm = functools.partial(RMSNorm, H, cfg.rms_norm_eps, cfg.norm_weight_offset)
        self.q_norm = norm() if cfg.use_qk_norm else None
        self.k_norm = norm() if cfg.use_qk_norm and computes_kv else None
        self.v_norm = norm(with_scale=False) if cfg.gemma4.use_v_norm and computes_kv else None
        self.query_scale = (cfg.query_pre_attn_scalar or H) ** -0.5
        self.softcap = cfg.attn_logit_softcap
        self.rules = rules

    def __call__(self, x_BTD, rope, attend, shared_kv=None):
        """`attend(q, k, v, softcap) -> (out, extra)`: attention over the keys this pass may see
        (Decoder.hidden: the masked positions of the pass; the engine: its KV cache, returned as extra).
        shared_kv: the keys and values of the layer this one reuses. Returns (out, extra, (k, v))."""

        def adapted(y, lora, bias=None):
            y = y if lora is None else y + lora(x_BTD)
            return y if bias is None else y + bias[...].astype(y.dtype)

        if self.k_DKH is not None and self.v_DKH is not None:
            q_BTNH, k_BSKH, v_BSKH = kernels.qkv_projection(
                x_BTD, self.q_DNH[...], self.k_DKH[...], self.v_DKH[...]
            )
            q_BTNH, k_BSKH, v_BSKH = (
                adapted(y, lora, bias)
                for y, lora, bias in (
                    (q_BTNH, self.q_lora, self.q_bias_NH),
                    (k_BSKH, self.k_lora, self.k_bias_KH),
                    (v_BSKH, self.v_lora, self.v_bias_KH),
                )
            )
        else:
            q_BTNH = adapted(
                kernels.dense("btd,dnh->btnh", x_BTD, self.q_DNH[...]), self.q_lora, self.q_bias_NH
            )
        if self.k_DKH is not None and self.v_DKH is None:  # keys as values
            k_BSKH = adapted(
                kernels.dense("bsd,dkh->bskh", x_BTD, self.k_DKH[...]), self.k_lora, self.k_bias_KH
            )
            v_BSKH = k_BSKH
        if self.q_norm is not None:
            q_BTNH = self.q_norm(q_BTNH)
        q_BTNH = kernels.apply_rope(q_BTNH, *rope) * self.query_scale
        if self.k_DKH is None:
            k_BSKH, v_BSKH = shared_kv
        else:
            if self.v_norm is not None:
                v_BSKH = self.v_norm(v_BSKH)
            if self.k_norm is not None:
                k_BSKH = self.k_norm(k_BSKH)
            k_BSKH = kernels.apply_rope(k_BSKH, *rope)
        q_BTNH = constrain(q_BTNH, ("batch", "seq", "act_heads", None), self.rules)

        out_BTNH, extra = attend(q_BTNH, k_BSKH, v_BSKH, self.softcap)
        y_BTD = kernels.output_projection(out_BTNH, self.o_NHD[...])
        return (y_BTD if self.o_lora is None else y_BTD + self.o_lora(out_BTNH)), extra, (k_BSKH, v_BSKH)
