"""A decoder layer (model/decoder.py has the axis letters): its MLP, and the Block that puts
attention, the MLP or the experts and the norms together; a stack of Blocks for the scan over layers."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_train.config import LoraConfig, ModelConfig
from tunix_train.model import kernels
from tunix_train.model.attention import Attention
from tunix_train.model.common import ACTIVATIONS, RMSNorm, param
from tunix_train.model.layout import (
    LayerShape,
)
from tunix_train.model.lora import Adapt, adapter, no_adapter
from tunix_train.model.moe import Dispatch, LocalDispatch, MoE
from tunix_train.sharding import Rules, constrain


class MLP(nnx.Module):
    """down(act(gate(x)) * up(x)): GeGLU (Gemma) or SwiGLU (Llama, Qwen), by model.mlp_activation."""

    def __init__(self, cfg: ModelConfig, width: int, rngs: nnx.Rngs, rules: Rules, adapt: Adapt = no_adapter):
        D, F = cfg.embed_dim, width
        self.gate_DF = param(rngs, (D, F), ("embed", "mlp"), D)
        self.up_DF = param(rngs, (D, F), ("embed", "mlp"), D)
        self.down_FD = param(rngs, (F, D), ("mlp", "embed"), F)
        self.gate_lora, self.up_lora, self.down_lora = (
            adapt(name, w, 1)
            for name, w in (("gate", self.gate_DF), ("up", self.up_DF), ("down", self.down_FD))
        )
        self.activation, self.rules = ACTIVATIONS[cfg.mlp_activation], rules

    def __call__(self, x_BTD):
        gate_BTF = kernels.dense("btd,df->btf", x_BTD, self.gate_DF[...])
        up_BTF = kernels.dense("btd,df->btf", x_BTD, self.up_DF[...])
        if self.gate_lora is not None:
            gate_BTF = gate_BTF + self.gate_lora(x_BTD)
        if self.up_lora is not None:
            up_BTF = up_BTF + self.up_lora(x_BTD)
        h_BTF = constrain(self.activation(gate_BTF) * up_BTF, ("batch", "seq", "act_mlp"), self.rules)
        y_BTD = jnp.einsum("btf,fd->btd", h_BTF, self.down_FD[...])
        return y_BTD if self.down_lora is None else y_BTD + self.down_lora(h_BTF)


class Block(nnx.Module):
    """Pre-norm attention and MLP, each optionally followed by a post-norm (Gemma 2 to 4); experts
    beside the MLP (Gemma 4) or in its place (Qwen 3 MoE); Gemma 4's per-layer input and output
    scalar."""

    def __init__(
        self,
        cfg: ModelConfig,
        shape: LayerShape,
        rngs: nnx.Rngs,
        rules: Rules,
        adapt: Adapt = no_adapter,
        experts: Dispatch = LocalDispatch(),
    ):
        D, P = cfg.embed_dim, cfg.gemma4.per_layer_input_dim
        norm = functools.partial(RMSNorm, D, cfg.rms_norm_eps, cfg.norm_weight_offset)
        self.pre_attn_norm = norm()
        self.attn = Attention(cfg, shape, rngs, rules, adapt)
        self.post_attn_norm = norm() if cfg.use_post_attn_norm else None
        self.pre_ffw_norm = norm()
        # experts beside the dense MLP (Gemma 4) or in its place (mlp_dim 0: Qwen 3 MoE)
        self.mlp = MLP(cfg, shape.mlp_dim, rngs, rules, adapt) if shape.mlp_dim else None
        self.post_ffw_norm = norm() if cfg.use_post_ffw_norm else None
        self.moe = MoE(cfg, rngs, rules, experts) if cfg.moe.experts else None
        if self.mlp is not None and self.moe is not None:
            self.pre_moe_norm, self.post_moe_norm, self.post_mlp_norm = norm(), norm(), norm()
        if P:
            self.per_layer_gate_DP = param(rngs, (D, P), ("embed", None), D)
            self.per_layer_proj_PD = param(rngs, (P, D), (None, "embed"), P)
            self.post_per_layer_norm = norm()
        self.layer_scalar = (
            nnx.Param(jnp.ones((1,), jnp.float32), axes=("norm",)) if cfg.gemma4.use_layer_scalar else None
        )
        self.rules = rules

    def __call__(self, x_BTD, rope, attend, per_layer_input_BTP=None, shared_kv=None, replay_BTK=None):
        """The block's output, what `attend` returned beside attention's output, and side results:
        "kv", this layer's keys and values; "moe", its experts' statistics and "routes", each token's
        experts [B, T, k] (moe.MoE; replay_BTK: the experts to replay, moe.MoE.route)."""
        h_BTD, extra, kv = self.attn(self.pre_attn_norm(x_BTD), rope, attend, shared_kv)
        if self.post_attn_norm is not None:
            h_BTD = self.post_attn_norm(h_BTD)
        x_BTD = x_BTD + h_BTD
        side = {"kv": kv}
        if self.mlp is None:  # the experts in the MLP's place, routed on its normed input
            normed_BTD = self.pre_ffw_norm(x_BTD)
            h_BTD, side["moe"], side["routes"] = self.moe(normed_BTD, normed_BTD, replay_BTK)
        else:
            h_BTD = self.mlp(self.pre_ffw_norm(x_BTD))
        if self.mlp is not None and self.moe is not None:
            # routed on the residual stream itself, the experts reading it normed
            experts_BTD, side["moe"], side["routes"] = self.moe(x_BTD, self.pre_moe_norm(x_BTD), replay_BTK)
            h_BTD = self.post_mlp_norm(h_BTD) + self.post_moe_norm(experts_BTD)
        if self.post_ffw_norm is not None:
            h_BTD = self.post_ffw_norm(h_BTD)
        x_BTD = x_BTD + h_BTD
        if per_layer_input_BTP is not None:
            gate_BTP = jax.nn.gelu(
                kernels.dense("btd,dp->btp", x_BTD, self.per_layer_gate_DP[...]), approximate=True
            )
            h_BTD = jnp.einsum("btp,pd->btd", gate_BTP * per_layer_input_BTP, self.per_layer_proj_PD[...])
            x_BTD = x_BTD + self.post_per_layer_norm(h_BTD)
        if self.layer_scalar is not None:
            x_BTD = x_BTD * self.layer_scalar[...].astype(x_BTD.dtype)
        return constrain(x_BTD, ("batch", "seq", "act_embed"), self.rules), extra, side


def stacked_blocks(
    cfg: ModelConfig,
    shape: LayerShape,
    keys,
    adapter_keys,
    rules: Rules,
    lora: LoraConfig | None,
    experts: Dispatch,
) -> Block:
    """One Block of `shape` whose parameters have a leading `layers` axis (one layer per key), for
    jax.lax.scan; adapters draw from adapter_keys, so the base is the same with adapters or without."""

    def block(key, adapter_key):
        adapt = no_adapter if lora is None else functools.partial(adapter, lora, nnx.Rngs(adapter_key))
        return Block(cfg, shape, nnx.Rngs(key), rules, adapt, experts)

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: block(jax.random.key(0), jax.random.key(0))))
    state = jax.vmap(lambda key, adapter_key: nnx.state(block(key, adapter_key)))(keys, adapter_keys)
    for variable in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        variable.set_metadata(axes=("layers", *variable.get_metadata()["axes"]))
    return nnx.merge(graphdef, state)
