"""A sampler: prefill, then a compiled decode loop, on the mesh the parameters live on.

The prompts are left-padded to a bucket length P (a power of two), so one compiled prefill serves
every batch of prompts up to P tokens. Decoding runs `chunk` steps per call to one compiled scan,
so the host looks at the tokens (streaming, stopping when every row is done) once per chunk, not
per token. Layers are unrolled in the decode step (each has its own cache, updated in place);
google-deepmind/gemma's sampler does the same. Parameters are an argument: the sampler holds no
copy of the weights, so training and the RL objectives sample with the state they hold.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tunix_train.config import ConfigError, ModelConfig, Remat
from tunix_train.generate import cache as kv
from tunix_train.model import kernels
from tunix_train.parallel import model_graphdef
from tunix_train.model.layout import kv_sources, layer_windows
from tunix_train.sharding import BATCH_AXES, LOGICAL_RULES, Rules, constrain, data_parallel_size

DONE = -1  # a row's token after it stopped


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is drawn: greedy at temperature 0; otherwise from softmax(logits / T)
    restricted to the top_k most likely tokens and to the smallest set whose mass reaches top_p."""

    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ConfigError(f"temperature={self.temperature} must be >= 0")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top_k={self.top_k} must be >= 1 (or None for no limit)")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1] (or None for no limit)")


def next_tokens(logits_BV: jax.Array, sampling: Sampling, key: jax.Array) -> jax.Array:
    """The next token of each row under `sampling`."""
    if sampling.temperature == 0 or sampling.top_k == 1:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = logits_BV.astype(jnp.float32) / sampling.temperature
    if sampling.top_k is not None:
        kth_B1 = jax.lax.top_k(logits_BV, sampling.top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV >= kth_B1, logits_BV, -jnp.inf)
    if sampling.top_p is not None:
        logits_BV = jnp.where(logits_BV >= top_p_threshold(logits_BV, sampling.top_p), logits_BV, -jnp.inf)
    return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


def top_p_threshold(logits_BV: jax.Array, top_p: float) -> jax.Array:
    """[B, 1]: the smallest logit of the smallest set of most likely tokens whose mass reaches top_p
    (a token is kept when the mass of the tokens more likely than it is below top_p)."""
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    kept_BV = mass_before_BV < top_p
    return jnp.min(jnp.where(kept_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)


def _fetch(x: jax.Array) -> np.ndarray:
    """The whole of a global array on this host: in a multi-process run the rows on other
    processes' devices are gathered (every process runs the same sampling loop)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def bucket(length: int) -> int:
    """Prompts are left-padded to a power of two (at least 16): few prefill compilations."""
    return max(16, 1 << math.ceil(math.log2(max(length, 1))))


class Sampler:
    """Generates from a Gemma of `cfg` whose parameters are sharded over `mesh`."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh, stop_ids: Sequence[int] = (), rules: Rules = LOGICAL_RULES,
                 chunk: int = 16):
        """stop_ids: the tokens that end a row (EOS, end of turn), excluded from the output."""
        # the sampler keeps positions whole: a prompt bucket or one decoded token is not split over cp
        self.cfg, self.mesh, self.rules, self.chunk = cfg, mesh, rules.replace(seq=()), chunk
        self.stop_ids = tuple(int(i) for i in stop_ids)
        self.graphdef = model_graphdef(cfg, Remat.none, rules=self.rules)
        self.windows = tuple(int(w) for w in layer_windows(cfg))
        self.source = kv_sources(cfg)
        self._prefill = jax.jit(self._prefill_fn, static_argnames=("total_len", "sampling"))
        self._decode = jax.jit(self._decode_fn, static_argnames=("sampling",), donate_argnums=(2,))
        self._unstack = jax.jit(self._unstack_fn)

    def _unstack_fn(self, params):
        """Each layer's parameters, cut from the stacked ones. On XLA:CPU each cut is a copy, so
        generate() makes them once per call and the compiled steps take them as arguments; cut
        inside the decode loop they were copied again at every chunk of steps."""
        return nnx.merge(self.graphdef, params).layer_states()

    def _forward(self, params, per_layer, tokens_BT, positions_BT, attend_of_layer: Callable[[int], Callable]):
        """Next-token logits [B, V] at the last position, and each layer's cache (None for a layer
        that reuses an earlier one's keys and values: attend_of_layer reads that layer's)."""
        model = nnx.merge(self.graphdef, params)
        x_BD, caches = model.unrolled_layers(per_layer, tokens_BT, positions_BT, attend_of_layer)
        return self._logits(x_BD, model.output_table()), caches

    def _logits(self, x_BD, table_VD):
        """float32 logits [B, V], as gemma.output_logits computes them for training, but with the
        vocabulary as the dot's rows. Why: XLA:CPU's dot runs [V, D] x [D, B] about twice as fast as
        [B, D] x [D, V] at a decoding batch (performance-history.md); the barrier keeps XLA from
        folding the transpose back into the dot."""
        logits_VB = jnp.einsum("vd,bd->vb", table_VD.astype(x_BD.dtype), x_BD).astype(jnp.float32)
        logits_BV = jax.lax.optimization_barrier(logits_VB).T
        logits_BV = kernels.soft_cap(logits_BV, self.cfg.final_logit_softcap)
        return constrain(logits_BV, ("batch", "act_vocab"), self.rules)

    def _stops(self, token_B):
        return jnp.isin(token_B, jnp.asarray(self.stop_ids or (DONE,), jnp.int32))

    def _prefill_fn(self, params, per_layer, tokens_BP, pads_B, key, *, total_len: int, sampling: Sampling):
        Pn = tokens_BP.shape[1]
        valid_BP = jnp.arange(Pn)[None, :] >= pads_B[:, None]
        positions_BP = jnp.maximum(jnp.arange(Pn)[None, :] - pads_B[:, None], 0)
        slots = kv.slots_per_layer(self.cfg, total_len)
        logits_BV, caches = self._forward(
            params, per_layer, tokens_BP, positions_BP,
            lambda i: kv.prefill_attend(self.windows[i], slots[i], valid_BP, keep=self.source[i] == i))
        shardings = kv.cache_shardings(self.cfg, self.mesh, tokens_BP.shape[0], total_len, self.rules)
        caches = [c if c is None else jax.lax.with_sharding_constraint(c, s) for c, s in zip(caches, shardings)]
        return caches, next_tokens(logits_BV, sampling, jax.random.fold_in(key, 0))

    def _decode_fn(self, params, per_layer, caches, token_B, t, pads_B, done_B, key, start, *, sampling: Sampling):
        """`chunk` steps from time t, where token_B is fed; returns the caches, the next state and
        the [B, chunk] tokens drawn (DONE for rows that had stopped)."""

        def step(carry, _):
            caches, token_B, t, done_B = carry
            positions_B1 = (t - pads_B)[:, None]
            updated = list(caches)  # the KV-sharing layers read their source's cache after its update

            def attend_of_layer(i):
                if self.source[i] != i:
                    return kv.decode_attend(updated[self.source[i]], self.windows[i], t, pads_B, write=False)
                return kv.decode_attend(caches[i], self.windows[i], t, pads_B, on_write=lambda c: updated.__setitem__(i, c))

            logits_BV, caches = self._forward(params, per_layer, token_B[:, None], positions_B1, attend_of_layer)
            drawn_B = next_tokens(logits_BV, sampling, jax.random.fold_in(key, t + 1 - start))
            out_B = jnp.where(done_B, DONE, drawn_B)
            return (caches, drawn_B, t + 1, done_B | self._stops(drawn_B)), out_B

        (caches, token_B, t, done_B), out_CB = jax.lax.scan(step, (caches, token_B, t, done_B), None,
                                                            length=self.chunk)
        return caches, token_B, t, done_B, out_CB.T

    def generate(self, params, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling = Sampling(),
                 seed: int = 0, on_tokens: Optional[Callable[[list[list[int]]], None]] = None) -> list[list[int]]:
        """New token ids of each prompt, EOS excluded, at most max_new_tokens each. `on_tokens`
        receives each chunk's new tokens per prompt as they are produced."""
        prompts = [list(map(int, p)) for p in prompts]
        if max_new_tokens <= 0:
            raise ConfigError(f"max_new_tokens={max_new_tokens} must be positive")
        if not prompts or min(map(len, prompts)) == 0:
            raise ConfigError("every prompt needs at least one token")
        longest = max(map(len, prompts))
        limit = self.cfg.context_length
        if limit is not None and longest + max_new_tokens > limit:
            raise ConfigError(f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} is longer than "
                              f"the model's context of {limit} tokens: shorten the prompt or lower max_new_tokens")
        vocab = self.cfg.vocab_size
        if any(not 0 <= i < vocab for p in prompts for i in p):
            raise ConfigError(f"a prompt holds a token id outside the model's vocabulary [0, {vocab})")
        Pn = bucket(longest)
        total_len = Pn + self.chunk * math.ceil(max_new_tokens / self.chunk)
        # Rows fill every data-parallel shard: the batch is padded with copies of the first prompt.
        rows = -(-len(prompts) // data_parallel_size(self.mesh)) * data_parallel_size(self.mesh)
        padded = prompts + [prompts[0]] * (rows - len(prompts))
        tokens = np.zeros((rows, Pn), np.int32)
        pads = np.array([Pn - len(p) for p in padded], np.int32)
        for row, p in enumerate(padded):
            tokens[row, Pn - len(p):] = p
        batch = NamedSharding(self.mesh, P(tuple(a for a in BATCH_AXES if a in self.mesh.shape)))
        rows_of = lambda x: jax.device_put(x, NamedSharding(self.mesh, P(*batch.spec, *[None] * (x.ndim - 1))))
        key = jax.random.key(seed)

        new: list[list[int]] = [[] for _ in prompts]
        finished = [False] * len(prompts)

        def take(drawn_BC):
            fresh = []
            for row in range(len(prompts)):
                got = []
                for token in drawn_BC[row]:
                    if finished[row] or token == DONE:
                        break
                    if token in self.stop_ids or len(new[row]) == max_new_tokens:
                        finished[row] = True
                        break
                    new[row].append(int(token))
                    got.append(int(token))
                    if len(new[row]) == max_new_tokens:
                        finished[row] = True
                fresh.append(got)
            if on_tokens is not None:
                on_tokens(fresh)

        with jax.set_mesh(self.mesh):
            pads_B = rows_of(pads)
            per_layer = self._unstack(params)
            caches, token_B = self._prefill(params, per_layer, rows_of(tokens), pads_B, key,
                                            total_len=total_len, sampling=sampling)
            take(_fetch(token_B)[:, None])
            t = jnp.int32(Pn)
            done_B = self._stops(token_B)
            while not all(finished):
                caches, token_B, t, done_B, drawn_BC = self._decode(
                    params, per_layer, caches, token_B, t, pads_B, done_B, key, jnp.int32(Pn), sampling=sampling)
                take(_fetch(drawn_BC))
        return new
