"""Pipeline parallelism (the `pp` mesh axis): the layer stack split into stages, micro-batches
flowing through them.

The stacked layers [L, ...] are sharded over pp; with R repeats they are viewed as [R, S, C]
(C = L / (R·S) layers a chunk) and stage s holds the chunks r·S + s, one per repeat. At time step
t, stage s works on micro-batch m of repeat r where t − s = r·M + m (`Schedule.task`); its output
goes to stage s+1 by ppermute, and from the last stage back round to stage 0, which keeps it until
that micro-batch's next repeat (M ≥ S makes it wait, never collide). R = 1 is GPipe. The
backward pass is autodiff's: all forwards, then all backwards, through the same schedule.

Each stage is busy R·M of the R·M + S − 1 time steps: the bubble is (S−1)/(R·M+S−1).

With R > 1 the layers of a stage are not contiguous in [L]: the step regroups the pp-sharded
stack into [R, S, C] each step, a collective-permute of (R−1)/R of the layer parameters (and of
their gradients) that GPipe does not pay. Checkpoints keep the layers in order, so any pp, R or
M resumes any other.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

AXIS = "pp"


@dataclasses.dataclass(frozen=True)
class Schedule:
    stages: int  # S
    repeats: int  # R
    microbatches: int  # M

    @property
    def steps(self) -> int:
        return self.repeats * self.microbatches + self.stages - 1

    def task(self, t, stage):
        """What `stage` does at time step t: (busy, repeat, micro-batch), for ints or traced ints."""
        k = t - stage
        busy = (k >= 0) & (k < self.repeats * self.microbatches)
        return busy, jnp.clip(k // self.microbatches, 0, self.repeats - 1), k % self.microbatches

    @property
    def bubble(self) -> float:
        """The fraction of stage-steps idle: (S−1)/(R·M+S−1)."""
        return (self.stages - 1) / (self.repeats * self.microbatches + self.stages - 1)

    def idle_fraction(self) -> float:
        """The bubble counted from `task` itself: idle stage-steps over all stage-steps."""
        busy = sum(bool(self.task(t, s)[0]) for t in range(self.steps) for s in range(self.stages))
        return 1.0 - busy / (self.steps * self.stages)


@dataclasses.dataclass(frozen=True)
class Stages:
    """A pass through the pipeline's stages: stage_fn(layer_xs of one chunk [C, ...], x [B, T, D],
    rows [B, T]) -> (x, statistics), applied through every stage to each of the M micro-batches of
    x_MBTD (rows: their per-token data, [M, B, T], a dict; those named in per_layer [M, B, T, L, ...]
    carry every layer's, and a stage gets its chunk's layers of them); enter(layer_xs) makes a
    stage's layers what stage_fn takes, once per pass. The statistics (per layer [C, ...], sums over
    tokens; {} for none) come back summed over the micro-batches, per layer [L, ...] in no
    particular order. Runs in a shard_map manual over pp (and over `seq_axis`, which splits T, when
    given). x_MBTD comes in and the outputs leave in float32 (float32_reductions); between stages
    the activations travel in `dtype`."""

    schedule: Schedule
    stage_fn: Callable
    enter: Callable
    dtype: Any  # what the activations travel in between stages
    seq_axis: str | None = None  # the mesh axis that splits T (cp), if any
    per_layer: tuple[str, ...] = ()

    def run(self, layer_xs: Any, x_MBTD: jax.Array, rows: Any) -> tuple[jax.Array, Any]:
        """The stages applied to the micro-batches of x_MBTD (see the class)."""
        schedule, seq_axis = self.schedule, self.seq_axis
        S, R = schedule.stages, schedule.repeats
        chunks = jax.tree.map(lambda a: a.reshape(R, S, a.shape[0] // (R * S), *a.shape[1:]), layer_xs)
        data = P(None, None, seq_axis)
        stages = jax.shard_map(
            self._scan,
            in_specs=(P(None, AXIS), data, data),
            out_specs=(data, P(AXIS)),
            axis_names={AXIS} | ({seq_axis} if seq_axis else set()),
        )
        return stages(chunks, x_MBTD, rows)

    def _scan(self, chunks, x_MBTD, rows):
        """One stage's part of the schedule (in the shard_map): a scan over the time steps."""
        schedule, stage_fn, enter, dtype = self.schedule, self.stage_fn, self.enter, self.dtype
        seq_axis, per_layer = self.seq_axis, self.per_layer
        S, R = schedule.stages, schedule.repeats
        stage = jax.lax.axis_index(AXIS)

        chunks = enter(jax.tree.map(lambda a: a[:, 0], chunks))  # this stage's chunk of each repeat

        def at(a, i):
            return jax.lax.dynamic_index_in_dim(a, i, keepdims=False)

        def put(a, x, i):
            return jax.lax.dynamic_update_index_in_dim(a, x, i, 0)

        def rows_of(micro, repeat):
            """A micro-batch's rows; of those per layer, the layers of this stage's chunk in `repeat`
            (the chunks are the layers in order, repeat-major: layer_xs' reshape in run)."""
            taken = {name: at(a, micro) for name, a in rows.items()}
            for name in per_layer:
                size = taken[name].shape[2] // (R * S)
                taken[name] = jax.lax.dynamic_slice_in_dim(taken[name], (repeat * S + stage) * size, size, 2)
            return taken

        # varying from here on: the input's gradient is summed over pp once, not at every time step
        x_MBTD = jax.lax.pcast(x_MBTD, AXIS, to="varying")

        def step(carry, t):
            received, circulating, outputs = carry
            busy, repeat, micro = schedule.task(t, stage)
            fresh = at(x_MBTD, micro).astype(dtype)
            first_input = fresh if R == 1 else jnp.where(repeat == 0, fresh, at(circulating, micro))
            y, stats = stage_fn(
                jax.tree.map(lambda a: at(a, repeat), chunks),
                jnp.where(stage == 0, first_input, received),
                rows_of(micro, repeat),
            )
            y = y.astype(dtype)
            done = busy & (stage == S - 1) & (repeat == R - 1)
            outputs = put(outputs, jnp.where(done, y.astype(outputs.dtype), at(outputs, micro)), micro)
            received = jax.lax.ppermute(y, AXIS, [(i, (i + 1) % S) for i in range(S)])
            if R > 1:  # stage 0 keeps what comes round from the last stage until its next repeat
                last_busy, last_repeat, last_micro = schedule.task(t, S - 1)
                keep = (stage == 0) & last_busy & (last_repeat < R - 1)
                kept = jnp.where(keep, received, at(circulating, last_micro))
                circulating = put(circulating, kept, last_micro)
            # an idle step's statistics are of no micro-batch
            return (received, circulating, outputs), jax.tree.map(lambda s: jnp.where(busy, s, 0), stats)

        zeros = jnp.zeros_like(x_MBTD, dtype)
        init = (zeros[0], zeros if R > 1 else None, jnp.zeros_like(x_MBTD))
        steps = jnp.arange(schedule.steps)
        (_, _, outputs), stats_T = jax.lax.scan(step, init, steps)
        # each step's statistics [T, C, ...] summed into its repeat's chunk: this stage's layers [R * C, ...]
        repeat_TR = jax.nn.one_hot(schedule.task(steps, stage)[1], R)

        def by_repeat(s):
            return jnp.einsum("tr,tc...->rc...", repeat_TR.astype(s.dtype), s).reshape(-1, *s.shape[2:])

        stats = jax.tree.map(by_repeat, stats_T)
        if seq_axis:
            stats = jax.lax.psum(stats, seq_axis)
        return jax.lax.psum(outputs, AXIS), stats  # only the last stage's outputs are not zero
