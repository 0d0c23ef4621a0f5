"""The train state: what the compiled step carries from one step to the next and a checkpoint holds.
Its own module so that train/ and checkpoint.py both import it, and neither imports the other."""

from __future__ import annotations

import flax.struct
import jax
import optax
from flax import nnx


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: train steps taken (batches consumed)
    params: nnx.State  # float32 master weights, Variables carrying logical `axes`
    opt_state: optax.OptState
    nonfinite_steps: jax.Array  # int32 scalar: steps whose update was dropped (non-finite loss/grads)
