"""Teacher-forced scoring: each token's log-probability given the tokens before it, computed on
the devices in one forward pass a batch of rows, with only [B, T] (and the top n) brought back.

lm-eval's loglikelihood (evaluate/), the server's `logprobs` and `echo` (serve/) and their tests
read the same numbers from here. Rows are padded at their end, which a causal model never reads
from an earlier position, to lengths and counts in powers of two: one compilation serves many.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

MAX_TOP = 20  # the most alternatives a position reports (vLLM's default max_logprobs)
LOGIT_BYTES = 1 << 30  # float32 logits of one forward pass, at most (a batch shrinks to fit)


@dataclasses.dataclass(frozen=True)
class Scored:
    """One row of n tokens: for tokens 1..n-1, log p(token | tokens before it) [n-1], whether it
    was the most likely token there [n-1], and the `top` most likely tokens and their
    log-probabilities [n-1, top], most likely first."""

    logprobs: np.ndarray
    greedy: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


def _bucket(n: int, least: int) -> int:
    return max(least, 1 << max(n - 1, 0).bit_length())


class Scorer:
    def __init__(self, graphdef, mesh, vocab_size: int):
        self.mesh, self.vocab_size, self.devices = mesh, vocab_size, mesh.devices.size

        @functools.partial(jax.jit, static_argnames="top")
        def score(params, tokens_BT, *, top: int):
            B, T = tokens_BT.shape
            positions = jnp.broadcast_to(jnp.arange(T), (B, T))
            logits = nnx.merge(graphdef, params)(tokens_BT, positions, jnp.ones((B, T), jnp.int32))
            logp_BTV = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
            targets = tokens_BT[:, 1:]
            chosen = jnp.take_along_axis(logp_BTV, targets[..., None], axis=-1)[..., 0]
            greedy = jnp.argmax(logp_BTV, axis=-1) == targets
            top_lp, top_ids = (
                jax.lax.top_k(logp_BTV, top)
                if top
                else (logp_BTV[..., :0], jnp.zeros((*targets.shape, 0), jnp.int32))
            )
            return chosen, greedy, top_ids, top_lp

        self._score = score

    def __call__(self, params, rows: Sequence[Sequence[int]], top: int = 0, batch: int = 8) -> list[Scored]:
        """Each row scored (rows of at least 2 tokens; top in [0, MAX_TOP]), in batches of at most
        `batch` rows of similar length."""
        if not 0 <= top <= MAX_TOP:
            raise ValueError(f"top={top} must be in [0, {MAX_TOP}]")
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        out: list[Scored | None] = [None] * len(rows)
        start = 0
        while start < len(order):
            T = _bucket(len(rows[order[start]]), 16)
            fits = max(1, LOGIT_BYTES // (T * self.vocab_size * 4))
            chunk = [i for i in order[start : start + min(batch, fits)] if len(rows[i]) <= T]
            start += len(chunk)
            tokens = np.zeros((_bucket(len(chunk), self.devices), T), np.int32)
            for r, i in enumerate(chunk):
                tokens[r, : len(rows[i])] = rows[i]
            with jax.set_mesh(self.mesh):
                results = [np.asarray(x) for x in self._score(params, jnp.asarray(tokens), top=top)]
            for r, i in enumerate(chunk):
                n = len(rows[i]) - 1
                out[i] = Scored(*(x[r, :n] for x in results))
        return out
