"""Mixture of experts: a router picks k of E gated experts (GeGLU or SwiGLU, model.mlp_activation)
per token.

Routers (model.moe.router):
- gemma4 (transformers' Gemma4TextRouter): the token's residual stream, RMS-normed without a
  weight, times a learned scale and 1/sqrt(D), projected to E logits; softmax in float32; the top
  k probabilities renormalised to sum to one, then each multiplied by its expert's learned scale.
- softmax (Qwen 3 MoE's Qwen3MoeTopKRouter, Mixtral's): the layer's normed input projected to E
  logits; softmax in float32; the top k, renormalised where model.moe.norm_topk_prob.

Dispatch (model.moe.dispatch):
- dropless: the token copies (X tokens x k choices) through their experts' matmuls, each
  expert's group whatever its size: no copy is dropped (dropless_experts). Where ragged_dot is
  native: jax.lax.ragged_dot on the copies sorted. Elsewhere batched matmuls of fixed shape
  (kernels.Slots), the copies gathered into their places unsorted (kernels.slotting): slots of
  1.25 x the even share per expert, then those and a pool of row blocks for the excess, then row
  blocks alone, the first that holds every copy (dropless_places), or always the last where the
  caller may not choose at run time.
- capacity: each expert has C = ceil(capacity_factor * X * k / E) slots; a copy past its expert's
  C is dropped (adds nothing). Batched matmuls of fixed shape, for backends where ragged_dot is slow.

How tokens reach their experts over a mesh (each data shard its own tokens, the experts split over
ep) is the caller's: MoE takes a `Dispatch`, as Attention takes `attend`. LocalDispatch runs every
expert here; tunix_train.parallel.experts the mesh's. Axis letters: X tokens, A token copies
(X * k), E experts, M an expert's width, C capacity slots.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Callable, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_train.config import ModelConfig, MoeDispatch, MoeRouter
from tunix_train.model import kernels
from tunix_train.model.common import ACTIVATIONS, RMSNorm, gelu_tanh, param
from tunix_train.sharding import Rules, constrain


@dataclasses.dataclass(frozen=True)
class Dispatching:
    """How a layer's copies reach their experts and run there: dropless or in capacity slots
    (model.moe.dispatch, model.moe.capacity_factor), the experts' gate activation, and, for
    dropless, whether ragged_dot runs the rows (ragged) and whether the place may be chosen by a
    jax.lax.switch (may_choose; dropless_experts)."""

    kind: MoeDispatch
    capacity_factor: float
    act: Callable = gelu_tanh
    ragged: bool = False
    may_choose: bool = True


class Dispatch(Protocol):
    """How the router's top k is taken and the copies reach their experts (a static, hashable
    part of the model)."""

    def top_k(self, probs_XE, k: int): ...

    def __call__(self, x_XD, weights_XK, experts_XK, gate_up_EDCM, down_EMD, how: Dispatching): ...


@dataclasses.dataclass(frozen=True)
class LocalDispatch:
    """Every expert here, on the tokens as they come."""

    ragged: bool = False  # whether jax.lax.ragged_dot computes the filled rows alone

    def top_k(self, probs_XE, k: int):
        return jax.lax.top_k(probs_XE, k)

    def __call__(self, x_XD, weights_XK, experts_XK, gate_up_EDCM, down_EMD, how: Dispatching):
        how = dataclasses.replace(how, ragged=self.ragged)
        return apply_experts(x_XD, weights_XK, experts_XK, gate_up_EDCM, down_EMD, how)


class MoE(nnx.Module):
    """(route_x, x) [B, T, D] -> (y [B, T, D], statistics, experts [B, T, k]): y the weighted sum of
    each token's top-k experts applied to x, routed by route_x (or replayed: route); statistics per
    expert (sums over tokens, which add up across shards): "expert_tokens" [E], the copies routed
    to it, and "router_probs" [E], its router probability summed; each token's experts."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, rules: Rules, dispatch: Dispatch = LocalDispatch()):
        D, E, M = cfg.embed_dim, cfg.moe.experts, cfg.moe.hidden_dim
        gemma4 = cfg.moe.router is MoeRouter.gemma4
        self.router_norm = RMSNorm(D, cfg.rms_norm_eps, with_scale=False) if gemma4 else None
        self.router_scale = nnx.Param(jnp.ones((D,), jnp.float32), axes=("norm",)) if gemma4 else None
        # small (D x E) and replicated: split over fsdp, its gradient made XLA reshard every token's
        # activations to meet it ("involuntary full rematerialization")
        self.router_DE = param(rngs, (D, E), (None, None), D)
        self.expert_scale = nnx.Param(jnp.ones((E,), jnp.float32), axes=(None,)) if gemma4 else None
        self.norm_topk_prob = gemma4 or cfg.moe.norm_topk_prob
        # gate and up of each expert side by side (C = 2), one matmul for both
        self.gate_up_EDCM = param(rngs, (E, D, 2, M), ("experts", "embed", None, "moe_mlp"), D)
        self.down_EMD = param(rngs, (E, M, D), ("experts", "moe_mlp", "embed"), M)
        self.top_k = cfg.moe.experts_per_token
        self.how = Dispatching(cfg.moe.dispatch, cfg.moe.capacity_factor, ACTIVATIONS[cfg.mlp_activation])
        self.rules, self.dispatch = rules, dispatch

    def route(self, route_XD, replay_XK=None):
        """(weights [X, k], experts [X, k], probabilities [X, E]) of the router. replay_XK: experts
        to use instead of the router's top k where a row's first is >= 0 (routing replay: those the
        inference engine chose), weighted by this router's probabilities of them, as Megatron-Core's
        RouterReplay does in REPLAY_FORWARD (`scores.gather(1, top_indices)`; verl's R3)."""
        D = route_XD.shape[-1]
        h_XD = route_XD
        if self.router_norm is not None:
            h_XD = self.router_norm(route_XD) * self.router_scale[...].astype(route_XD.dtype)
            h_XD = h_XD * jnp.asarray(D**-0.5, route_XD.dtype)
        probs_XE = jax.nn.softmax(
            jnp.einsum("xd,de->xe", h_XD, self.router_DE[...]).astype(jnp.float32), axis=-1
        )
        top_XK, experts_XK = self.dispatch.top_k(probs_XE, self.top_k)
        if replay_XK is not None:
            experts_XK = jnp.where(replay_XK[:, :1] >= 0, replay_XK, experts_XK)
            top_XK = jnp.take_along_axis(probs_XE, experts_XK, axis=-1)
        if self.norm_topk_prob:
            top_XK = top_XK / jnp.sum(top_XK, axis=-1, keepdims=True)
        if self.expert_scale is not None:
            top_XK = top_XK * self.expert_scale[...].astype(jnp.float32)[experts_XK]
        return top_XK, experts_XK, probs_XE

    def __call__(self, route_BTD, x_BTD, replay_BTK=None):
        B, T, D = x_BTD.shape
        replay_XK = None if replay_BTK is None else replay_BTK.reshape(B * T, -1)
        weights_XK, experts_XK, probs_XE = self.route(route_BTD.reshape(B * T, D), replay_XK)
        E = probs_XE.shape[-1]
        stats = {
            "expert_tokens": jnp.sum(jax.nn.one_hot(experts_XK, E, dtype=jnp.float32), axis=(0, 1)),
            "router_probs": jnp.sum(probs_XE, axis=0),
        }
        y_XD = self.dispatch(
            x_BTD.reshape(B * T, D),
            weights_XK,
            experts_XK,
            self.gate_up_EDCM[...],
            self.down_EMD[...],
            self.how,
        )
        y_BTD = constrain(y_XD.reshape(B, T, D), ("batch", "seq", "act_embed"), self.rules)
        return y_BTD, stats, experts_XK.reshape(B, T, -1)


def load_balancing_loss(expert_tokens_LE, router_probs_LE):
    """The router's auxiliary loss (Switch Transformer; as transformers computes it for Mixtral),
    averaged over layers: E · Σ_e f_e · P_e, with f_e the share of tokens that have expert e among
    their top k and P_e its mean router probability (k when routing is even; padding counts).
    Takes MoE's statistics: per layer, copies per expert and router probabilities summed."""
    E = expert_tokens_LE.shape[-1]
    tokens_L1 = jnp.sum(router_probs_LE, axis=-1, keepdims=True)  # each token's probabilities sum to 1
    return jnp.mean(E * jnp.sum((expert_tokens_LE / tokens_L1) * (router_probs_LE / tokens_L1), axis=-1))


def _glu(h_AC2M, act):
    return act(h_AC2M[..., 0, :]) * h_AC2M[..., 1, :]


def apply_experts(x_XD, weights_XK, experts_XK, gate_up_EDCM, down_EMD, how: Dispatching):
    """Σ_k weight_k · expert_k(x) for every token, the experts all held here, placed and run as
    `how` says."""
    dispatch, capacity_factor, act, ragged, may_choose = (
        how.kind,
        how.capacity_factor,
        how.act,
        how.ragged,
        how.may_choose,
    )
    X, K = experts_XK.shape
    x_AD, expert_A = jnp.repeat(x_XD, K, axis=0), experts_XK.reshape(-1)  # copy a is token a // K
    E = gate_up_EDCM.shape[0]
    if dispatch is MoeDispatch.dropless:
        y_AD = dropless_experts(x_AD, expert_A, gate_up_EDCM, down_EMD, X * K, ragged, may_choose, act)
    else:
        y_AD = capacity_experts(
            x_AD, expert_A, gate_up_EDCM, down_EMD, slots_for(X * K, E, capacity_factor), act
        )
    return jnp.einsum("xkd,xk->xd", y_AD.reshape(X, K, -1), weights_XK.astype(y_AD.dtype))


def ragged_experts(x_AD, group_sizes_E, gate_up_EDCM, down_EMD, act: Callable = gelu_tanh):
    """Rows of x sorted by expert, group_sizes_E of them per expert (rows past their sum give 0):
    each row through its expert's GeGLU by two jax.lax.ragged_dot (megablox on TPUs)."""
    E, D, _, M = gate_up_EDCM.shape
    h_AF = jax.lax.ragged_dot(x_AD, gate_up_EDCM.reshape(E, D, 2 * M), group_sizes_E)
    h_AM = kernels.projection_output(_glu(h_AF.reshape(-1, 2, M), act))
    return jax.lax.ragged_dot(h_AM, down_EMD, group_sizes_E)


def slotted_experts(x_AD, expert_A, gate_up_EDCM, down_EMD, slots: kernels.Slots, act: Callable = gelu_tanh):
    """Rows of x in any order, expert_A each row's expert (an id >= E goes nowhere), through their
    experts' GeGLU in the places kernels.Slots describes; a row that finds no place gives 0 (is
    dropped). One gather of the rows into their places and one back: the rows are never sorted."""
    source_R, dest_A, group_J = kernels.slotting(expert_A, gate_up_EDCM.shape[0], slots)
    y_RD = experts_in_places(
        kernels.take_rows(x_AD, source_R, dest_A), group_J, gate_up_EDCM, down_EMD, slots, act
    )
    return kernels.take_rows(y_RD, dest_A, source_R)


def experts_in_places(x_RD, group_J, gate_up_EDCM, down_EMD, slots: kernels.Slots, act: Callable = gelu_tanh):
    """The experts' GeGLU on rows already in kernels.slotting's places (group_J: its pool blocks'
    experts)."""
    E, D, _, M = gate_up_EDCM.shape
    h_RF = kernels.slotted_matmul(x_RD, gate_up_EDCM.reshape(E, D, 2 * M), group_J, slots)
    h_RM = kernels.projection_output(_glu(h_RF.reshape(-1, 2, M), act))
    return kernels.slotted_matmul(h_RM, down_EMD, group_J, slots)


def dropless_experts(
    x_AD,
    expert_A,
    gate_up_EDCM,
    down_EMD,
    typical_rows: int,
    ragged: bool = False,
    may_choose: bool = True,
    act: Callable = gelu_tanh,
):
    """Rows of x in any order, expert_A each row's expert (an id >= E: in no expert, gives 0), each
    through its expert, none dropped. typical_rows: how many rows hold a copy when routing is even
    (fewer than x's rows under ep, whose receive buffer has room for the worst case).

    `ragged` (where ragged_dot is native): ragged_experts on the rows sorted. Otherwise
    slotted_experts in the first of dropless_places that holds every row (the last hold any
    routing), or in the last when not `may_choose` (the caller allows no jax.lax.switch)."""
    E = gate_up_EDCM.shape[0]
    sizes_E = jnp.bincount(expert_A, length=E + 1)[:E]
    if ragged:
        order_A, position_A = _sorting(expert_A)  # rows in no expert last

        def ragged(x):
            return ragged_experts(x, sizes_E, gate_up_EDCM, down_EMD, act)

        y_AD = _on_filled_rows(
            ragged,
            kernels.take_rows(x_AD, order_A, position_A),
            jnp.sum(sizes_E),
            FILLED_ROWS_BOUND * typical_rows,
        )
        return kernels.take_rows(y_AD, position_A, order_A)
    places = dropless_places(typical_rows, x_AD.shape[0], E)
    if not may_choose:
        return slotted_experts(x_AD, expert_A, gate_up_EDCM, down_EMD, places[-1], act)
    first = jnp.argmax(jnp.stack([slots.fit(sizes_E) for slots in places[:-1]] + [jnp.array(True)]))
    return _slotted_in_one_of(places, act, first, x_AD, expert_A, gate_up_EDCM, down_EMD)


def _sorting(ids):
    """(order, position): the permutation sorting `ids` (stable) and where each element lands."""
    order = jnp.argsort(ids, stable=True)
    return order, jnp.argsort(order)


def dropless_places(typical_rows: int, rows: int, experts: int) -> tuple[kernels.Slots, ...]:
    """dropless_experts' places, cheapest first, in even shares s = typical_rows / E: fixed slots of
    1.25 s per expert (1.25 x the rows of even routing); the same and a pool of E/2 blocks of s/4
    rows (one expert up to 1.25 s + E/8 s, or half of them up to 1.5 s); then blocks alone, room
    for FILLED_ROWS_BOUND x typical_rows filled rows, then for all `rows`, which hold any routing."""
    base, block = slots_for(typical_rows, experts, 1.25), max(1, -(-typical_rows // (4 * experts)))
    places = [
        kernels.Slots(base, 1, 0),
        kernels.Slots(base, block, max(1, experts // 2)),
        kernels.Slots.blocks_for(min(FILLED_ROWS_BOUND * typical_rows, rows), experts),
        kernels.Slots.blocks_for(rows, experts),
    ]
    return tuple(dict.fromkeys(places))


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _slotted_in_one_of(places, act, index, x_AD, expert_A, gate_up_EDCM, down_EMD):
    """slotted_experts in places[index] (jax.lax.switch). Why its own backward pass: autodiff of a
    switch makes every branch return every branch's residuals, zeros for those not taken (under the
    layer's remat on CPU, a two-way switch cost 3x the slots it chose); this one saves the inputs
    alone and runs the chosen branch's forward again inside its backward."""
    return jax.lax.switch(
        index,
        [partial(slotted_experts, slots=slots, act=act) for slots in places],
        x_AD,
        expert_A,
        gate_up_EDCM,
        down_EMD,
    )


def _slotted_in_one_of_fwd(places, act, index, x_AD, expert_A, gate_up_EDCM, down_EMD):
    return (
        _slotted_in_one_of(places, act, index, x_AD, expert_A, gate_up_EDCM, down_EMD),
        (index, x_AD, expert_A, gate_up_EDCM, down_EMD),
    )


def _slotted_in_one_of_bwd(places, act, residuals, g_AD):
    index, x_AD, expert_A, gate_up_EDCM, down_EMD = residuals

    def backward(slots):
        return lambda *args: jax.vjp(lambda x, g, d: slotted_experts(x, expert_A, g, d, slots, act), *args)[
            1
        ](g_AD)

    grads = jax.lax.switch(index, [backward(slots) for slots in places], x_AD, gate_up_EDCM, down_EMD)
    return None, grads[0], None, grads[1], grads[2]


_slotted_in_one_of.defvjp(_slotted_in_one_of_fwd, _slotted_in_one_of_bwd)


def slots_for(rows: int, experts: int, factor: float) -> int:
    """Slots per expert: factor x the even share of `rows`, rounded up."""
    return max(1, math.ceil(factor * rows / experts))


def capacity_experts(x_AD, expert_A, gate_up_EDCM, down_EMD, C: int, act: Callable = gelu_tanh):
    """Rows of x in any order (expert_A each row's expert; an id >= E goes nowhere) through their
    experts in C fixed slots per expert; a row past its expert's first C gives 0 (it is dropped)."""
    return slotted_experts(x_AD, expert_A, gate_up_EDCM, down_EMD, kernels.Slots(C, 1, 0), act)


# A shard receives A copies on average (S x A in the worst case): the experts run in places for 2A
# received rows whenever those hold every copy, for all S x A only when routing is that uneven
FILLED_ROWS_BOUND = 2


def _on_filled_rows(fn, x_RD, filled, bound: int):
    """fn(x_RD) for rows sorted with the `filled` ones first, where fn gives 0 for the rest: computed
    on the first `bound` rows when they hold every filled one (jax.lax.cond runs one branch), on all
    of them otherwise. Nothing is dropped; the common case costs bound rows, not R."""
    R = x_RD.shape[0]
    if bound >= R:
        return fn(x_RD)

    def head(x):
        return jnp.pad(fn(x[:bound]), ((0, R - bound), (0, 0)))

    return jax.lax.cond(filled <= bound, head, fn, x_RD)
