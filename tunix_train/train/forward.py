"""What an objective may ask of a model on one micro-batch: a `Forward` (train/objectives/).

The step hands an objective one Forward per model it reads: the trained policy, the frozen
reference (the same model without its update), and any model the objective declares beside them
(`Objective.extra_models`: a teacher of another size, ...). Each is computed only as far as asked,
and once:

- `forward()`: the per-token negative log-likelihood of micro["targets"], [B, T];
- `forward.hidden()`: the final normed hidden states [B, T, D] (for a head of one's own);
- `forward.scores()`: the scalar head's value at each position [B, T] (model.score_head);
- `forward.per_token(fn, *others, fields=...)`: fn over the logits of this model and of `others`
  (Forwards of the same micro-batch) and micro's `fields`, position by position, [B, T] (or any
  arrays with more axes after T: a teacher's top k). With
  0 < chunk < T it runs `chunk` positions at a time and is recomputed in the backward pass, so the
  [B, T, V] logits of no model exist whole: a KL to a teacher over a 262k vocabulary costs a
  chunk's logits, as the cross-entropy does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_train.model import quant
from tunix_train.model.common import output_logits


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Per-token next-token cross-entropy, in float32."""
    logits_BTV = logits_BTV.astype(jnp.float32)
    target_logit_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits_BTV, axis=-1) - target_logit_BT


def in_compute_dtype(tree: Any, compute_dtype: Any, shardings: Any) -> Any:
    """`tree` cast to the compute dtype (quantized weights: dequantized to it where read), kept on
    `shardings` (None: unconstrained), which a quantized weight's static dtype must match."""
    tree = quant.cast(tree, compute_dtype)
    if shardings is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, quant.retyped(shardings, compute_dtype))


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
    """How a Forward computes: in `compute_dtype`, the logits `chunk` positions at a time (0: all),
    over a sequence split in `seq_shards` parts (cp), the logits divided by `temperature`."""

    compute_dtype: Any = jnp.float32
    chunk: int = 0
    seq_shards: int = 1
    temperature: float = 1.0


class Forward:
    """One model (its graphdef, and parameters: one state, or the frozen base and the adapters) on
    one micro-batch (with `token_index` when it comes reordered).

    Parameters are cast to the compute dtype where they are stored (the master copy is untouched),
    so fsdp gathers them already in that dtype. The logits are divided by `temperature` (the
    distribution an RL objective sampled from). With the sequence split in `seq_shards` parts
    (cp), every part computes its own chunks at once (ForwardOptions)."""

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        params: Sequence[nnx.State],
        micro: dict[str, jax.Array],
        options: ForwardOptions = ForwardOptions(),
        *,
        param_shardings: Any = None,
        frozen: bool = False,
    ):
        """frozen: every result without gradient (the reference, a teacher)."""
        self.graphdef, self.params, self.micro = graphdef, tuple(params), micro
        self.options, self.param_shardings, self.frozen = options, param_shardings, frozen
        self._computed = None

    def _run(self):
        """(hidden states, experts' statistics, the output layer and its soft-cap and rules)."""
        if self._computed is None:
            params = self.params
            if self.options.compute_dtype != jnp.float32:
                params = in_compute_dtype(params, self.options.compute_dtype, self.param_shardings)
            model = nnx.merge(self.graphdef, *params)
            micro = self.micro
            x_BTD, stats = model.hidden_and_stats(
                micro["inputs"],
                micro["positions"],
                micro["segment_ids"],
                micro.get("token_index"),
                micro.get("routes"),  # the engine's experts, replayed (GRPO's routing_replay)
                micro.get("images"),  # each row's images (model.vision)
            )
            head = (model.output_table(), model.cfg.final_logit_softcap, model.rules)
            score = None if model.score_DO is None else model.score_DO[...]
            self._computed = (x_BTD, stats, head, score)
        return self._computed

    @property
    def ran(self) -> bool:
        """Whether anything was asked of the model."""
        return self._computed is not None

    def _out(self, x):
        return jax.lax.stop_gradient(x) if self.frozen else x

    def scores(self) -> jax.Array:
        """The scalar head's value at every position [B, T], float32 (model.score_head)."""
        x_BTD, _, _, score_DO = self._run()
        return self._out(
            jnp.einsum("btd,d->bt", x_BTD.astype(jnp.float32), score_DO[:, 0].astype(jnp.float32))
        )

    def hidden(self) -> jax.Array:
        """The final normed hidden states [B, T, D]."""
        return self._out(self._run()[0])

    @property
    def stats(self) -> dict:
        """The experts' statistics per layer (Decoder.hidden_and_stats; {} without experts)."""
        return self._run()[1]

    def logits(self, x_BTD: jax.Array) -> jax.Array:
        """float32 logits of hidden states (some positions' of this model), divided by temperature."""
        table_VD, softcap, rules = self._run()[2]
        logits_BTV = output_logits(x_BTD, table_VD, softcap, rules)
        return logits_BTV if self.options.temperature == 1.0 else logits_BTV / self.options.temperature

    def __call__(self) -> jax.Array:
        """The per-token negative log-likelihood of micro["targets"], [B, T]."""
        return self.per_token(cross_entropy, fields=("targets",))

    def per_token(self, fn: Callable, *others: Forward, fields: Sequence[str] = ()) -> Any:
        """fn(logits [B, C, V] of this model, of each of `others`, then micro[f] [B, C, ...] for f in
        fields) -> [B, C] (or arrays [B, C, ...]), over every position: [B, T] (see the module
        docstring for chunks)."""
        passes = (self, *others)
        x_list = [p._run()[0] for p in passes]
        field_list = [self.micro[f] for f in fields]

        def values(x_list, field_list):
            return fn(*(p.logits(x) for p, x in zip(passes, x_list)), *field_list)

        B, T, _ = x_list[0].shape
        chunk = self.options.chunk
        if not chunk or chunk >= T:
            return self._out(values(x_list, field_list))
        chunk_values = jax.checkpoint(values, policy=jax.checkpoint_policies.nothing_saveable)
        # scan step n takes positions [n·chunk, (n+1)·chunk) of each of the sequence's parts
        parts, N = self.options.seq_shards, T // (self.options.seq_shards * chunk)

        def by_step(x):
            return jnp.moveaxis(x.reshape(B, parts, N, chunk, *x.shape[2:]), 2, 0).reshape(
                N, B, parts * chunk, *x.shape[2:]
            )

        def by_position(v):
            return jnp.moveaxis(v.reshape(N, B, parts, chunk, *v.shape[3:]), 0, 2).reshape(B, T, *v.shape[3:])

        _, values_N = jax.lax.scan(
            lambda _, xs: (None, chunk_values(*xs)),
            None,
            ([by_step(x) for x in x_list], [by_step(f) for f in field_list]),
        )
        return self._out(jax.tree.map(by_position, values_N))


def token_losses(
    graphdef: nnx.GraphDef,
    params: tuple[nnx.State, ...],
    micro: dict[str, jax.Array],
    options: ForwardOptions = ForwardOptions(),
    param_shardings: Any = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token loss [B, T] of one micro-batch and the experts' statistics (a Forward's)."""
    forward = Forward(graphdef, params, micro, options, param_shardings=param_shardings)
    return forward(), forward.stats
