"""Low-rank adapters (LoRA, Hu et al. 2021): a projection W becomes W + (alpha / r) B A.

A maps the projection's input dimensions to r, B maps r to its output dimensions. A carries the
input's logical axes and B the output's, so both shard like the weight they adapt; the rank axis is
never split. B starts at zero, so an adapted model begins exactly as its base. The factors are
`Adapter` variables: the trainer differentiates and optimizes only those (model/weights.py).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_train.config import LoraConfig


class Adapter(nnx.Param):
    """A parameter that trains while the base weights stay frozen: a LoRA factor, or a head the
    base lacks (a reward model's or PPO's value head, `score_DO`: PEFT's modules_to_save)."""


class LoRA(nnx.Module):
    """x [..., *in] -> (alpha / rank) · x A B [..., *out]; the delta an adapted projection adds."""

    def __init__(
        self,
        rngs: nnx.Rngs,
        in_shape: tuple[int, ...],
        in_axes: tuple[str, ...],
        out_shape: tuple[int, ...],
        out_axes: tuple[str, ...],
        rank: int,
        alpha: float,
    ):
        fan_in = 1
        for size in in_shape:
            fan_in *= size
        bound = fan_in**-0.5  # PEFT's kaiming_uniform(a=sqrt(5)) on A
        self.a = Adapter(
            jax.random.uniform(rngs.params(), (*in_shape, rank), jnp.float32, -bound, bound),
            axes=(*in_axes, "lora_rank"),
        )
        self.b = Adapter(jnp.zeros((rank, *out_shape), jnp.float32), axes=("lora_rank", *out_axes))
        self.scale = alpha / rank

    def __call__(self, x):
        a, b = self.a[...], self.b[...]
        n_in = a.ndim - 1
        contract_in = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
        h = jax.lax.dot_general(x, a.astype(x.dtype), (contract_in, ((), ())))
        return jax.lax.dot_general(h, b.astype(x.dtype), (((h.ndim - 1,), (0,)), ((), ()))) * jnp.asarray(
            self.scale, x.dtype
        )


def merged(weight, a, b, scale: float):
    """weight + scale · A B for stacked layers: weight [L, *in, *out], a [L, *in, r], b [L, r, *out]."""
    delta = jax.vmap(
        lambda a_l, b_l: jnp.tensordot(a_l.astype(jnp.float32), b_l.astype(jnp.float32), axes=1)
    )(a, b)
    return (weight.astype(jnp.float32) + scale * delta).astype(weight.dtype)


# Each LoRA adapter (an attribute of Attention or MLP) and the weight beside it that it adapts.
ADAPTED_WEIGHTS = {
    "q_lora": "q_DNH",
    "k_lora": "k_DKH",
    "v_lora": "v_DKH",
    "o_lora": "o_NHD",
    "gate_lora": "gate_DF",
    "up_lora": "up_DF",
    "down_lora": "down_FD",
}
# The image tower's (model/vision.py, gemma4_vision.py: under `vision.layers`)
TOWER_ADAPTED_WEIGHTS = {f"{x}_lora": x for x in ("q", "k", "v", "out", "gate", "up", "down")}
# The number of input dimensions (after a stack's layers axis) of each adapted weight.
INPUT_DIMS = {"q_DNH": 1, "k_DKH": 1, "v_DKH": 1, "o_NHD": 2, "gate_DF": 1, "up_DF": 1, "down_FD": 1}
Adapt = Callable[[str, nnx.Param, int], LoRA | None]  # (target, weight, input dims) -> its adapter or None


def no_adapter(target: str, weight: nnx.Param, n_in: int) -> None:
    return None


def adapter(lora: LoraConfig, rngs: nnx.Rngs, target: str, weight: nnx.Param, n_in: int) -> LoRA | None:
    """A LoRA adapter of `weight` (its first n_in dimensions are the input) when lora targets it;
    drawn from its own random stream, so the base weights are those of the model without adapters."""
    if target not in lora.targets:
        return None
    axes = weight.get_metadata()["axes"]
    return LoRA(
        rngs, weight.shape[:n_in], axes[:n_in], weight.shape[n_in:], axes[n_in:], lora.rank, lora.alpha
    )
