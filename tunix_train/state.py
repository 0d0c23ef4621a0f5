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
    # Weights the step reads but never changes (tunix_train/model/weights.py): LoRA's base, or the
    # reference copy of the starting weights that DPO and GRPO compare with; None when there are
    # none. Checkpoints leave them out: a run rebuilds them from where it started.
    frozen: nnx.State | None = None
