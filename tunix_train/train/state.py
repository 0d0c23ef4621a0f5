"""The train state, initialized straight into its shardings."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from tunix_train.config import ModelConfig, Remat
from tunix_train.model import Gemma
from tunix_train.sharding import state_shardings


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer updates applied so far
    params: nnx.State  # float32 master weights, Variables carrying logical `axes`
    opt_state: optax.OptState


def model_graphdef(model_cfg: ModelConfig, remat: Remat) -> nnx.GraphDef:
    """The model's static structure, without allocating any parameter."""
    return nnx.graphdef(nnx.eval_shape(lambda: Gemma(model_cfg, nnx.Rngs(0), remat)))


def create_train_state(model_cfg: ModelConfig, optimizer: optax.GradientTransformation,
                       mesh: Mesh, seed: int) -> tuple[TrainState, Any]:
    """Returns the initialized state and its shardings.

    Shapes come from jax.eval_shape, shardings from the parameters' logical axes, and the state is
    created by a jit whose out_shardings are those shardings: each device computes only its shards
    and the whole model never sits on one device.
    """

    def init(key):
        params = nnx.state(Gemma(model_cfg, nnx.Rngs(key)), nnx.Param)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))

    key = jax.random.key(seed)
    shardings = state_shardings(jax.eval_shape(init, key), mesh)
    return jax.jit(init, out_shardings=shardings)(key), shardings


def count_params(params: nnx.State) -> int:
    return sum(x.size for x in jax.tree.leaves(params))
