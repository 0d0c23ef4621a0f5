"""What needs shard_map: the pipeline (pp) schedules, context-parallel (cp) attention and the
experts' dispatch (ep); and `model_graphdef`, the model as it runs on a mesh.

`Parallelism` is the one seam between them and the model: Decoder.hidden hands it the function that
applies a run of layers, and it runs that function as written, in a shard_map over cp, or stage by
stage through the pipeline. Nothing else in the model knows pp or cp exists; the rules table
(tunix_train.sharding) shards the stacked layers over pp and the sequence over cp.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tunix_train.config import (
    AttentionImpl,
    ConfigError,
    ImageAttention,
    LoraConfig,
    ModelConfig,
    Remat,
    RopeScalingType,
    TrainingConfig,
)
from tunix_train.model.decoder import LayerLoop
from tunix_train.model.factory import model_structure
from tunix_train.model.layout import layer_groups, layer_types
from tunix_train.parallel import context, pipeline
from tunix_train.parallel import float32_reductions as reductions
from tunix_train.parallel.experts import MeshDispatch
from tunix_train.sharding import LOGICAL_RULES, Rules


def model_graphdef(
    model_cfg: ModelConfig,
    remat: Remat,
    scan_unroll: int = 1,
    attention: AttentionImpl = AttentionImpl.xla,
    rules: Rules = LOGICAL_RULES,
    parallel: Parallelism | None = None,
    lora: LoraConfig | None = None,
) -> nnx.GraphDef:
    """The model's static structure as it runs on a mesh (its experts dispatched by
    experts.MeshDispatch), without allocating any parameter."""
    return model_structure(
        model_cfg,
        loop=LayerLoop(remat, scan_unroll),
        attention=attention,
        rules=rules,
        parallel=parallel,
        lora=lora,
        experts=MeshDispatch(rules),
    )


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """How the layer stack is laid over the mesh's pp and cp axes (hashable: models hold it as
    static structure)."""

    schedule: pipeline.Schedule | None = None  # pp > 1
    context: context.ContextAttention | None = None  # cp > 1

    def run_layers(
        self, layers: Callable, layer_xs: Any, x_BTD: jax.Array, rows: dict, make_attend: Callable
    ):
        """layers(layer_xs, x_BTD, rows, make_attend) -> (x, statistics) applies the layers of layer_xs
        (stacked on a leading axis) to x; rows holds the per-token data [B, T] (or [1, T]) the masks
        and RoPE read. Under cp, make_attend (rows -> window -> attend) is replaced by cp's, and the
        statistics (sums over tokens) are summed over the shards and pp's micro-batches."""
        if self.context is None and self.schedule is None:
            return layers(layer_xs, x_BTD, rows, make_attend)
        seq, make_attend = (
            (None, make_attend) if self.context is None else (context.AXIS, self.context.make_attend)
        )
        param_dtypes, x_dtype = reductions.dtypes(layer_xs), x_BTD.dtype

        def enter(layer_xs):
            """The parameters as the layers use them, once inside the shard_map. Under cp they vary
            over cp (each shard differentiates its own tokens): the kernels' custom VJPs see what their
            gradients will be, and the cast's transpose sums those over cp."""
            if seq is not None:
                layer_xs = jax.lax.pcast(layer_xs, seq, to="varying")
            return reductions.cast_like(layer_xs, param_dtypes)

        def apply(layer_xs, x, rows):
            return layers(layer_xs, x.astype(x_dtype), rows, make_attend)

        layer_xs = reductions.float32(layer_xs) if seq else layer_xs
        if self.schedule is None:

            def shard(layer_xs, x, rows):
                x, stats = apply(enter(layer_xs), x, rows)
                return x, jax.lax.psum(stats, seq)

            return jax.shard_map(
                shard,
                in_specs=(P(), P(None, seq), P(None, seq)),
                out_specs=(P(None, seq), P()),
                axis_names={seq},
            )(layer_xs, x_BTD, rows)
        M = self.schedule.microbatches

        # micro-batch m takes rows m, m + M, ...: each data shard keeps its own rows
        def split(a):
            return (
                jnp.broadcast_to(a, x_BTD.shape[:2] + a.shape[2:]).reshape(-1, M, *a.shape[1:]).swapaxes(0, 1)
            )

        stages = pipeline.Stages(
            self.schedule,
            apply,
            enter,
            x_dtype,
            seq,
            per_layer=("replay",) if "replay" in rows else (),  # routing replay: [B, T, L, k]
        )
        x_MBTD, stats = stages.run(layer_xs, reductions.float32(split(x_BTD)), jax.tree.map(split, rows))
        return x_MBTD.swapaxes(0, 1).reshape(x_BTD.shape).astype(x_dtype), stats

    def reorder(self, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """The step's batch as the model should see it: under cp, in context.balanced_order."""
        return batch if self.context is None else context.reorder(batch, self.context.size)

    @property
    def seq_shards(self) -> int:
        return 1 if self.context is None else self.context.size

    def describe(self) -> list[str]:
        """What a run's log says of its layout."""
        lines = []
        if s := self.schedule:
            lines.append(
                f"pipeline: {s.stages} stages x {s.repeats} repeats, {s.microbatches} micro-batches per "
                f"micro-step; bubble (S-1)/(R*M+S-1) = {s.bubble:.1%} of each stage's time idle "
                f"(lost time in MFU)"
            )
        if c := self.context:
            window = (
                f"sliding-window layers fetch their {c.sliding_window}-token window from neighbours"
                if c.sliding_window
                else "sliding-window layers attend like global ones"
            )
            lines.append(
                f"context parallel: cp={c.size}, the sequence in 2 x {c.size} load-balanced chunks; global "
                f"layers: {c.strategy.value}; {window}"
            )
        return lines


def pipelines(model: ModelConfig) -> bool:
    """Whether the pp schedules run this model: one group of layers (one stack, or Gemma 4's
    period of layer shapes repeated: the stages split the repeats), no per-layer inputs."""
    return len(layer_groups(model)) == 1 and not model.gemma4.per_layer_input_dim


def for_run(mesh: Mesh, model: ModelConfig, training: TrainingConfig, seq_len: int) -> Parallelism | None:
    """The Parallelism of a training run on `mesh` (None without pp and cp), or a ConfigError."""
    pp, cp = mesh.shape.get(pipeline.AXIS, 1), mesh.shape.get(context.AXIS, 1)
    if pp == 1 and cp == 1:
        return None
    if pp > 1 and not pipelines(model):
        raise ConfigError(
            "model.mesh_shape: pp does not yet run per-layer inputs, nor layers other than one period "
            "of layer shapes repeated (KV-sharing layers, an irregular layer_types); drop the pp axis"
        )
    if training.sync_gradients_every > 1:
        raise ConfigError(
            "training.sync_gradients_every > 1 does not combine with the pp or cp mesh axes; set it to 1"
        )
    return Parallelism(
        _schedule(pp, model, training) if pp > 1 else None,
        _context(cp, model, training, seq_len) if cp > 1 else None,
    )


def _schedule(pp: int, model: ModelConfig, training: TrainingConfig) -> pipeline.Schedule:
    R, M, b = training.pipeline_repeats, training.pipeline_microbatches, training.micro_batch_size
    # the stages split the repeats of the one group's period: single layers (Gemma 1-3), or Gemma
    # 4's period of layer shapes
    (group,) = layer_groups(model)
    L, p = group.repeats, len(group.period)
    stack, unit, are = (
        (f"model.num_layers={L}", "layer", "is")
        if p == 1
        else (f"the {L} repeats of model.layer_types' {p}-layer period", f"{p}-layer period", "are")
    )
    if pp > L:
        raise ConfigError(
            f"model.mesh_shape: pp={pp} is more than {stack}; a stage needs at least one {unit}"
        )
    if L < pp * R:
        raise ConfigError(
            f"training.pipeline_repeats={R}: {stack} {are} too shallow for {R} chunks on each of "
            f"pp={pp} stages; lower the repeats"
        )
    if L % (pp * R):
        raise ConfigError(
            f"{stack} {are} not divisible by pp x training.pipeline_repeats = {pp * R}; choose sizes "
            f"whose product divides {'it' if p == 1 else 'them'}"
        )
    if M < pp or M % pp:
        raise ConfigError(
            f"training.pipeline_microbatches={M} must be a multiple of pp={pp} (at least {pp}; more "
            f"shrinks the bubble)"
        )
    if b % M:
        raise ConfigError(
            f"training.pipeline_microbatches={M} must divide training.micro_batch_size={b}: each "
            f"pipeline micro-batch takes micro_batch_size / pipeline_microbatches rows of every "
            f"data-parallel shard"
        )
    return pipeline.Schedule(pp, R, M)


def _context(cp: int, model: ModelConfig, training: TrainingConfig, seq_len: int) -> context.ContextAttention:
    if model.rope_scaling.type is RopeScalingType.longrope:
        raise ConfigError(
            "model.rope_scaling longrope picks its factors by each sequence's length, which a cp shard "
            "does not see whole: drop the cp mesh axis"
        )
    if seq_len % (2 * cp):
        raise ConfigError(
            f"data.seq_len={seq_len} must be divisible by 2 x cp = {2 * cp}: each cp shard holds two "
            f"chunks of the sequence (load balance)"
        )
    chunk = training.loss_chunk_size
    if 0 < chunk < seq_len and (seq_len // cp) % chunk:
        raise ConfigError(
            f"training.loss_chunk_size={chunk} must divide data.seq_len / cp = {seq_len // cp} "
            f"(or be 0): each cp shard computes the logits of its own positions"
        )
    if training.attention is not AttentionImpl.xla:
        raise ConfigError(
            f"training.attention={training.attention.value} does not combine with the cp mesh axis; "
            f"set training.attention=xla"
        )
    if model.vision is not None and model.vision.image_attention is ImageAttention.sliding_layers:
        raise ConfigError(
            "model.vision.image_attention=sliding_layers (Gemma 4) does not combine with the cp mesh "
            "axis yet; drop cp from model.mesh_shape"
        )
    window = model.sliding_window if "sliding_attention" in layer_types(model) else None
    # with images, a window's keys may lie after the query (an image's later tokens) in the next
    # chunk, which the neighbours' exchange does not fetch: the sliding layers take the global path
    fits = window is not None and window <= seq_len // (2 * cp) and model.vision is None
    return context.ContextAttention(cp, model.context_parallel_strategy, window if fits else None)
