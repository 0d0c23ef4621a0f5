"""How the next token is drawn, row by row: each row of a batch has its own temperature, top-k,
top-p and random stream, so a request draws the same tokens whatever shares the batch with it."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from tunix_train.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Greedy at temperature 0; otherwise from softmax(logits / T) restricted to the top_k most
    likely tokens and to the smallest set whose mass reaches top_p."""

    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None

    def __post_init__(self):
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, (int, float))
            or not 0 <= self.temperature < math.inf
        ):
            raise ConfigError(f"temperature={self.temperature!r} must be a finite number >= 0")
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1
        ):
            raise ConfigError(f"top_k={self.top_k!r} must be an integer >= 1 (or None for no limit)")
        if self.top_p is not None and (
            isinstance(self.top_p, bool)
            or not isinstance(self.top_p, (int, float))
            or not 0 < self.top_p <= 1
        ):
            raise ConfigError(f"top_p={self.top_p!r} must be in (0, 1] (or None for no limit)")

    def check(self, vocab_size: int) -> None:
        """A one-line error where the settings cannot hold for a vocabulary of vocab_size tokens."""
        if self.top_k is not None and self.top_k > vocab_size:
            raise ConfigError(
                f"top_k={self.top_k} is more than the vocabulary's {vocab_size} tokens (None: no limit)"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class Rules(NamedTuple):
    """The rows' sampling settings as arrays [B]: temperature (0: greedy), top_k (the vocabulary
    size: no limit), top_p (1: no limit)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array


class Draws(NamedTuple):
    """How each row draws its tokens [B]: its sampling rules, the raw data of its key(seed), and
    its stream (token number n of a row comes from fold_in(fold_in(key, stream), n))."""

    rules: Rules
    seeds: jax.Array
    stream: jax.Array


class Kinds(NamedTuple):
    """What some row of the batch needs (static: one compiled program per combination): a random
    draw at all, the top-k cut, the top-p cut. An all-greedy batch computes only an argmax."""

    sample: bool
    top_k: bool
    top_p: bool

    @classmethod
    def of(cls, samplings) -> "Kinds":
        drawn = [s for s in samplings if not s.greedy]
        return cls(
            bool(drawn), any(s.top_k is not None for s in drawn), any(s.top_p is not None for s in drawn)
        )


def token_keys(draws: Draws, count: jax.Array) -> jax.Array:
    """The keys of token numbers `count` [B, ...] of each row: fold_in(fold_in(key(seed), stream), n)."""
    stream_B = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(draws.seeds), draws.stream)
    fold = jax.random.fold_in
    for _ in range(count.ndim - 1):  # over each row's further axes
        fold = jax.vmap(fold, (None, 0))
    return jax.vmap(fold)(stream_B, count)


def draw(logits_BV: jax.Array, rules: Rules, keys_B: jax.Array, kinds: Kinds):
    """The next token of each row and its log-probability under softmax(logits / T), the
    distribution before the top-k and top-p cuts (as vLLM reports them; T = 1 for a greedy row)."""
    logits_BV = logits_BV.astype(jnp.float32)
    greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logp_BV, kept_BV = cut(logits_BV, rules, kinds)
    token_B = greedy_B
    if kinds.sample:
        token_B = jnp.where(sampled(rules), categorical(keys_B, kept_BV), greedy_B)
    return token_B, jnp.take_along_axis(logp_BV, token_B[:, None], axis=-1)[:, 0]


def sampled(rules: Rules) -> jax.Array:
    """[B]: the rows that draw at random (the others take the most likely token)."""
    return (rules.temperature > 0) & (rules.top_k != 1)


def cut(logits_BV: jax.Array, rules: Rules, kinds: Kinds) -> tuple[jax.Array, jax.Array]:
    """float32 (log softmax(logits / T), the same less the tokens the top-k and top-p cuts remove,
    -inf there, not renormalized): what a row reports, and what it draws from."""
    logits_BV = logits_BV.astype(jnp.float32)
    temperature_B1 = rules.temperature[:, None]
    logp_BV = jax.nn.log_softmax(logits_BV / jnp.where(temperature_B1 > 0, temperature_B1, 1.0), axis=-1)
    kept_BV = logp_BV
    if kinds.sample and (kinds.top_k or kinds.top_p):
        sorted_BV = jnp.sort(logp_BV, axis=-1)[:, ::-1]
        if kinds.top_k:
            kth_B1 = jnp.take_along_axis(sorted_BV, rules.top_k[:, None] - 1, axis=-1)
            kept_BV = jnp.where(logp_BV >= kth_B1, kept_BV, -jnp.inf)
        if kinds.top_p:
            kept_BV = jnp.where(logp_BV >= top_p_threshold(sorted_BV, rules.top_p), kept_BV, -jnp.inf)
    return logp_BV, kept_BV


def top_p_threshold(sorted_BV: jax.Array, top_p_B: jax.Array) -> jax.Array:
    """[B, 1]: from log-probabilities sorted in descending order, the smallest of the smallest set
    of most likely tokens whose mass reaches top_p (a token is kept when the mass of the tokens
    more likely than it is below top_p)."""
    probs_BV = jnp.exp(sorted_BV)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    kept_BV = mass_before_BV < top_p_B[:, None]
    return jnp.min(jnp.where(kept_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)


def categorical(keys_B: jax.Array, logits_BV: jax.Array) -> jax.Array:
    """Each row's draw from softmax(logits), exactly, in two Gumbel-max steps: a block of `block`
    consecutive tokens by its log-mass, then a token within the block. 2·sqrt(V) random numbers a
    row instead of V: over Gemma's 262144 tokens, one Gumbel draw per token took as long as the
    forward pass of a 270M model on a CPU (docs/performance.md)."""
    B, V = logits_BV.shape
    block = 1 << round(math.log2(V) / 2)
    blocks = -(-V // block)
    logits_BNK = jnp.pad(logits_BV, ((0, 0), (0, blocks * block - V)), constant_values=-jnp.inf).reshape(
        B, blocks, block
    )
    keys_B2 = jax.vmap(lambda key: jax.random.split(key))(keys_B)
    which_B = jax.vmap(jax.random.categorical)(keys_B2[:, 0], jax.nn.logsumexp(logits_BNK, axis=-1))
    # the chosen block's logits, as a max over blocks (a reduction, where a gather would collect
    # the whole vocabulary on one device when it is split over tp)
    chosen_BK = jnp.max(
        jnp.where((jnp.arange(blocks) == which_B[:, None])[:, :, None], logits_BNK, -jnp.inf), axis=1
    )
    return (which_B * block + jax.vmap(jax.random.categorical)(keys_B2[:, 1], chosen_BK)).astype(jnp.int32)
