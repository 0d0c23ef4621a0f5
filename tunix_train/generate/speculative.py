"""Speculative decoding: a cheap drafter proposes k tokens per row, the model scores all k + 1
positions in one forward pass over its cache, and the standard rejection rule keeps a prefix of
them plus one token of its own (Leviathan et al. 2023, Chen et al. 2023): greedy rows emit exactly
the model's argmax tokens, sampled rows exactly its distribution (temperature, top-k, top-p), and
the log-probabilities reported are the model's. Each row keeps its own number of drafts a round.

Drafters: a smaller model sharing the tokenizer (its own KV cache, k + 1 one-token steps a round),
or prompt lookup (the k tokens that followed the most recent earlier occurrence of the row's last
n tokens in its own context, n from `lookup` down to 1: no model, for copying-heavy tasks).

Speculation(adaptive=True) drafts, chunk by chunk, as many of up to k as pay at the rows' recent
acceptance, none when none do (adaptive.py).

Rejected positions need no rollback: both caches hold position p at slot p % S, a slot counts as
holding the most recent position at or before the query's, and the next round writes over them
before any read (cache.py; sliding-window layers keep k more slots for it).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from tunix_train.config import ConfigError, ModelConfig
from tunix_train.generate.sampling import Draws, Kinds, Rules, categorical, cut, draw, sampled, token_keys
from tunix_train.sharding import mesh_over

MOST = 64  # drafted tokens, n-gram length, rounds: a round's k + 1 positions are every row's memory


@dataclasses.dataclass(frozen=True)
class Speculation:
    """`tokens` k drafted per round; the drafter: `draft`, a model's config (its parameters go to
    the session), or `lookup` > 0, the longest n-gram prompt lookup matches. `rounds`: verify
    rounds per compiled call (the engine's chunk of decode steps). `adaptive`: each chunk drafts
    the k of `choices` (at most `tokens`; 0: none) that emits the most tokens a second at the rows'
    recent acceptance (adaptive.py). `draft_mesh_shape`: the draft model's own split of the model's
    devices (draft_mesh), None: the model's mesh."""

    tokens: int = 4
    draft: Optional[ModelConfig] = None
    lookup: int = 0
    rounds: int = 2
    adaptive: bool = False
    draft_mesh_shape: Any = None

    def __post_init__(self):
        if self.draft_mesh_shape is not None:
            if self.draft is None:
                raise ConfigError("speculative draft_mesh_shape is a draft model's: prompt lookup has none")
            object.__setattr__(self, "draft_mesh_shape", _frozen(self.draft_mesh_shape))  # hashable
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"speculative adaptive={self.adaptive!r} must be true or false")
        for name in ("tokens", "lookup", "rounds"):
            value, least = getattr(self, name), int(name != "lookup")
            if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= MOST:
                raise ConfigError(f"speculative {name}={value!r} must be an integer from {least} to {MOST}")
        if (self.draft is None) == (self.lookup == 0):
            raise ConfigError(
                "speculative decoding takes one drafter: a draft model or prompt lookup (lookup=N)"
            )

    @property
    def choices(self) -> tuple[int, ...]:
        """The k a chunk may draft: `tokens`, and adaptively 0 and the powers of two below it."""
        if not self.adaptive:
            return (self.tokens,)
        return (0, *(2**i for i in range(self.tokens.bit_length()) if 2**i < self.tokens), self.tokens)

    def draft_mesh(self, mesh: Mesh, key: str = "draft_mesh_shape") -> Mesh:
        """The draft model's mesh beside a model on `mesh`: that one, or draft_mesh_shape's split of
        its devices (e.g. a small draft whole on every device of a model split over tp: no collectives)."""
        if self.draft_mesh_shape is None:
            return mesh
        return mesh_over(self.draft_mesh_shape, mesh, key)

    def check(self, cfg: ModelConfig) -> None:
        """A one-line error where the draft cannot serve a model of `cfg`."""
        if self.draft is not None and self.draft.vocab_size != cfg.vocab_size:
            raise ConfigError(
                f"the draft model's vocabulary has {self.draft.vocab_size} tokens, the model's "
                f"{cfg.vocab_size}: a draft must share the model's tokenizer"
            )


def _frozen(value):
    """Nested sequences (a mesh shape) as tuples."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        return tuple(_frozen(x) for x in value)
    return value


@dataclasses.dataclass(frozen=True)
class DraftModel:
    """A draft model's side of a session on the devices: its parameters, their layers, its caches."""

    params: object
    per_layer: object
    caches: list


def drafter(engine, draft_params, max_len: int, slots: int):
    """A session's drafter state: None without speculation, the rows' tokens by position on the
    host [slots, max_len] for prompt lookup, or a DraftModel (its caches empty)."""
    if engine.speculation is None:
        if draft_params is not None:
            raise ConfigError("draft parameters were given to an engine that does not speculate")
        return None
    if engine.draft is None:
        return np.zeros((slots, max_len), np.int32)
    if draft_params is None:
        raise ConfigError("this engine speculates with a draft model: pass the draft's parameters")
    with jax.set_mesh(engine.mesh):
        per_layer = engine.draft.unstack(draft_params)
        return DraftModel(
            draft_params, per_layer, engine.draft.empty_caches(draft_params, per_layer, max_len, slots)
        )


def summary(stats) -> str:
    """An engine's speculation so far, in words: its acceptance rate and mean accepted length (and
    under adaptive speculation the tokens drafted a round, on average)."""
    f = figures(stats)
    words = (
        f"speculative decoding accepted {f['acceptance_rate']:.1%} of {f['drafted']} drafted tokens: "
        f"{f['mean_accepted_length']:.2f} tokens a verify round over {f['rounds']} rounds"
    )
    if stats["plain_rounds"]:
        words += f", and {f['plain_rounds']} rounds drafted nothing ({f['drafted_per_round']:.2f} a round)"
    return words


def figures(stats) -> dict:
    """An engine's speculation figures: acceptance_rate, mean_accepted_length (of the rounds that
    drafted), rounds, drafted, plain_rounds (drafting nothing: adaptive.py) and drafted_per_round."""
    rounds = stats["rounds"]
    return {
        "acceptance_rate": stats["accepted"] / max(stats["drafted"], 1),
        "mean_accepted_length": (stats["accepted"] + rounds) / max(rounds, 1),
        "rounds": rounds,
        "drafted": stats["drafted"],
        "plain_rounds": stats["plain_rounds"],
        "drafted_per_round": stats["drafted"] / max(rounds + stats["plain_rounds"], 1),
    }


def looks_up(drafter) -> bool:
    """Whether a session's drafter state is prompt lookup's histories (on the host or the devices)."""
    return drafter is not None and not isinstance(drafter, DraftModel)


def _keys(draws: Draws, count_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[B, T, 3] keys of token numbers count_BT: to draft, to accept, to draw the replacement; and
    [B] the plain engine's key of each row's first token number (a row that does not speculate)."""
    keys_BT = token_keys(draws, count_BT)
    return jax.vmap(jax.vmap(lambda key: jax.random.split(key, 3)))(keys_BT), keys_BT[:, 0]


def _flat(rules: Rules, T: int) -> Rules:
    """Each row's rules repeated for its T positions, as B*T rows."""
    return Rules(*(jnp.repeat(x, T) for x in rules))


def propose(logits_BV, rules: Rules, keys_B, kinds: Kinds):
    """A draft model's token per row, and (sampled rows) the distribution it came from [B, V]: the
    row's own temperature and cuts applied to the draft's logits; argmax for greedy rows."""
    greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    if not kinds.sample:
        return greedy_B, None
    _, kept_BV = cut(logits_BV, rules, kinds)
    token_B = jnp.where(sampled(rules), categorical(keys_B, kept_BV), greedy_B)
    return token_B, jax.nn.softmax(kept_BV, axis=-1)


def lookup_drafts(history_BL, position_B, k: int, longest: int) -> jax.Array:
    """[B, k]: the tokens after the most recent earlier end e < p of the row's last n tokens
    (history up to position p, the current token's), for the largest n <= longest that occurs;
    the current token repeated where none does."""
    B, L = history_BL.shape
    index_L = jnp.arange(L)
    best_B = jnp.full((B,), -1, jnp.int32)
    matched_BL = jnp.ones((B, L), bool)
    for back in range(longest):  # n = back + 1: history[e - back] == history[p - back]
        tail_B1 = jnp.take_along_axis(history_BL, jnp.maximum(position_B - back, 0)[:, None], axis=1)
        matched_BL &= (jnp.roll(history_BL, back, axis=1) == tail_B1) & (index_L >= back)
        found_BL = matched_BL & (index_L < position_B[:, None]) & (position_B[:, None] >= back)
        last_B = jnp.max(jnp.where(found_BL, index_L, -1), axis=1)
        best_B = jnp.where(last_B >= 0, last_B, best_B)
    at_BK = jnp.where(best_B[:, None] >= 0, best_B[:, None] + 1 + jnp.arange(k), position_B[:, None])
    return jnp.take_along_axis(history_BL, jnp.minimum(at_BK, L - 1), axis=1)


def accept(logits_BTV, drafts_BK, draft_probs_BKV, draws: Draws, keys_BT3, kinds: Kinds, alone=None):
    """The rejection rule over a round: (the tokens emitted [B, k+1], valid up to and with index
    n, their log-probabilities under softmax(logits / T), n [B] the drafts kept, and the first
    position's log softmax(logits / T) after the row's cuts, unnormalized [B, V], as sampling.cut
    gives it: first_kept's). draft_probs:
    the distribution each draft came from (None: a certain one, as prompt lookup's). alone:
    (speculate_B, keys_B): the rows that do not speculate keep no draft and draw their token as
    the plain engine does, with its key of the token's number (sampling.draw)."""
    B, T, V = logits_BTV.shape
    k = T - 1
    greedy_BT = jnp.argmax(logits_BTV, axis=-1).astype(jnp.int32)
    rules = _flat(draws.rules, T)
    logp_XV, kept_XV = cut(logits_BTV.reshape(B * T, V), rules, kinds)
    ok_BK = drafts_BK == greedy_BT[:, :k]
    replacement_BT = greedy_BT
    if kinds.sample:
        p_BTV = jax.nn.softmax(kept_XV, axis=-1).reshape(B, T, V)
        q_BTV = (
            jax.nn.one_hot(drafts_BK, V, dtype=p_BTV.dtype) if draft_probs_BKV is None else draft_probs_BKV
        )
        q_BTV = jnp.concatenate([q_BTV, jnp.zeros((B, 1, V), q_BTV.dtype)], axis=1)  # none at k: all kept
        p_draft_BK = jnp.take_along_axis(p_BTV[:, :k], drafts_BK[..., None], axis=-1)[..., 0]
        q_draft_BK = jnp.take_along_axis(q_BTV[:, :k], drafts_BK[..., None], axis=-1)[..., 0]
        u_BK = jax.vmap(jax.vmap(jax.random.uniform))(keys_BT3[:, :k, 1])
        residual_XV = jnp.log(jnp.maximum(p_BTV - q_BTV, 0.0)).reshape(B * T, V)
        drawn_BT = categorical(keys_BT3[:, :, 2].reshape(B * T), residual_XV).reshape(B, T)
        rows_sampled_B1 = sampled(draws.rules)[:, None]
        ok_BK = jnp.where(rows_sampled_B1, u_BK * q_draft_BK < p_draft_BK, ok_BK)
        replacement_BT = jnp.where(rows_sampled_B1, drawn_BT, greedy_BT)
    if alone is not None:
        speculate_B, keys_B = alone
        plain_B, _ = draw(logits_BTV[:, 0], draws.rules, keys_B, kinds)
        ok_BK = ok_BK & speculate_B[:, None]
        replacement_BT = replacement_BT.at[:, 0].set(jnp.where(speculate_B, replacement_BT[:, 0], plain_B))
    kept_B = jnp.sum(jnp.cumprod(ok_BK, axis=1), axis=1).astype(jnp.int32)
    index_T = jnp.arange(T)
    drafts_BT = jnp.pad(drafts_BK, ((0, 0), (0, 1)))  # none kept at k: the model's own
    emitted_BT = jnp.where(index_T < kept_B[:, None], drafts_BT, replacement_BT)
    logprob_BT = jnp.take_along_axis(logp_XV.reshape(B, T, V), emitted_BT[..., None], axis=-1)[..., 0]
    return emitted_BT, logprob_BT, kept_B, kept_XV.reshape(B, T, V)[:, 0]


def first_kept(kept_BV, draft_B, probs_BV, rules: Rules, kinds: Kinds) -> jax.Array:
    """[B] the chance the rejection rule keeps a round's first draft, drawn from probs_BV (None: a
    certain one, as prompt lookup's): whether it is the argmax on greedy rows, else sum_v min(p_v,
    q_v), p(draft) for a certain one, p = softmax(kept_BV), the model's log-probabilities after the
    row's cuts (accept's; the cuts keep the argmax)."""
    equal_B = (jnp.argmax(kept_BV, axis=-1) == draft_B).astype(jnp.float32)
    if not kinds.sample:
        return equal_B
    p_BV = jax.nn.softmax(kept_BV, axis=-1)
    if probs_BV is None:
        chance_B = jnp.take_along_axis(p_BV, draft_B[:, None], axis=-1)[:, 0]
    else:
        chance_B = jnp.sum(jnp.minimum(p_BV, probs_BV), axis=-1)
    return jnp.where(sampled(rules), chance_B, equal_B)


def chunk(engine, model, caches, draft, rows, draws: Draws, *, kinds: Kinds, plan: tuple):
    """plan (k, rounds): `rounds` rounds drafting k tokens (0: none) for every row (the engine's
    speculative decode_step). model: its (params, per_layer). caches: the model's and the
    drafter's state, both donated: the draft model's caches, or with prompt lookup each row's
    tokens by position [B, L]. draft: the draft model's (params, per_layer), else None. rows: each
    row's (token, position, count), as the plain decode step takes them, and whether it
    speculates (Request.speculative). Returns the caches, the next (token, position, count), the
    tokens emitted [B, rounds, k+1] with their log-probabilities, the drafts each round kept [B,
    rounds], and each round's chance of keeping a first draft [B, rounds] (first_kept; a first
    draft is drafted at k = 0 too, for adaptive.py)."""
    spec, (k, rounds) = engine.speculation, plan
    *rows, speculate_B = rows
    lagging = draft is not None and k == 0  # the draft reads the chunk's tokens after it: catch_up

    def draft_tokens(state, token_B, position_B, keys_BT3):
        if draft is None:
            drafts_BK = lookup_drafts(state, position_B, max(k, 1), spec.lookup)
            return state, drafts_BK[:, :k], None, (drafts_BK[:, 0], None)

        def step(carry, j):  # feeds t0, d1, ..., dk: the last one's cache entry, for the next round
            caches, token_B = carry
            logits_BV, caches, _ = engine.draft.extend(*draft, caches, token_B[:, None], position_B + j)
            keys_B = keys_BT3[:, jnp.minimum(j, max(k - 1, 0)), 0]
            proposed_B, probs_BV = propose(logits_BV, draws.rules, keys_B, kinds)
            return (caches, proposed_B), (proposed_B, probs_BV)

        (state, _), (drafts_JB, probs_JBV) = jax.lax.scan(step, (state, token_B), jnp.arange(k + 1))
        first = (drafts_JB[0], None if probs_JBV is None else probs_JBV[0])
        probs_BKV = None if probs_JBV is None else jnp.swapaxes(probs_JBV[:k], 0, 1)
        return state, drafts_JB[:k].T, probs_BKV, first

    def one_round(carry, _):
        (caches, state), token_B, position_B, count_B = carry
        keys_BT3, plain_keys_B = _keys(draws, count_B[:, None] + jnp.arange(k + 1))
        if lagging:
            drafts_BK, probs_BKV = jnp.zeros((token_B.shape[0], 0), jnp.int32), None
        else:
            state, drafts_BK, probs_BKV, first = draft_tokens(state, token_B, position_B, keys_BT3)
        tokens_BT = jnp.concatenate([token_B[:, None], drafts_BK], axis=1)
        logits, caches, _ = engine.extend(*model, caches, tokens_BT, position_B)
        logits_BTV = logits.reshape(*tokens_BT.shape, -1)  # [B, V] for one position
        alone = (speculate_B, plain_keys_B)
        emitted_BT, logprob_BT, kept_B, cut_BV = accept(
            logits_BTV, drafts_BK, probs_BKV, draws, keys_BT3, kinds, alone
        )
        if lagging:  # log p(x) of the token emitted, after the row's cuts (catch_up reads it)
            logp_BV = jax.nn.log_softmax(cut_BV, axis=-1)
            chance_B = jnp.take_along_axis(logp_BV, emitted_BT[:, :1], axis=-1)[:, 0]
        else:
            chance_B = first_kept(cut_BV, *first, draws.rules, kinds)
        if draft is None:  # the emitted tokens join the row's history, at the positions after p
            after_BT = position_B[:, None] + 1 + jnp.arange(k + 1)
            at_BT = jnp.where(jnp.arange(k + 1) <= kept_B[:, None], after_BT, state.shape[1])  # past: dropped
            state = jax.vmap(lambda h, at, x: h.at[at].set(x, mode="drop"))(state, at_BT, emitted_BT)
        advance_B = kept_B + 1
        fed_B, token_B = token_B, jnp.take_along_axis(emitted_BT, kept_B[:, None], axis=1)[:, 0]
        carry = ((caches, state), token_B, position_B + advance_B, count_B + advance_B)
        return carry, (emitted_BT, logprob_BT, kept_B, chance_B, fed_B)

    start_B = rows[1]
    ((caches, state), *rows), (emitted_RBT, logprob_RBT, kept_RB, chance_RB, fed_RB) = jax.lax.scan(
        one_round, (caches, *rows), None, length=rounds
    )
    if lagging:
        state, chance_RB = catch_up(
            engine, draft, state, (fed_RB, start_B), emitted_RBT[..., 0], chance_RB, draws.rules, kinds
        )
    caches = (caches, state)
    swap = functools.partial(jnp.swapaxes, axis1=0, axis2=1)
    return caches, tuple(rows), swap(emitted_RBT), swap(logprob_RBT), kept_RB.T, chance_RB.T


def catch_up(engine, draft, caches, fed, emitted_RB, logp_RB, rules: Rules, kinds: Kinds):
    """After a chunk that drafted nothing (one token a round for every row), the draft model reads
    the tokens it fed the model: fed = (fed_RB, the rows' positions at its start), lookahead + 1
    positions a forward pass (its sliding-window caches keep that many more slots than the
    window). Returns its caches and each round's chance of keeping a first draft, estimated from
    the token x the round emitted, of log-probability logp_RB after the row's cuts: whether x is
    the draft's argmax on greedy rows, else min(1, q(x) / p(x)), whose mean over x ~ p is
    sum_v min(p_v, q_v) (first_kept's)."""
    fed_RB, position_B = fed
    R, B = fed_RB.shape
    chances = []
    for start in range(0, R, engine.lookahead + 1):
        x_BT, fed_BT = emitted_RB[start:].T, fed_RB[start:].T
        x_BT, fed_BT = x_BT[:, : engine.lookahead + 1], fed_BT[:, : engine.lookahead + 1]
        T = x_BT.shape[1]
        logits, caches, _ = engine.draft.extend(*draft, caches, fed_BT, position_B + start)
        logits_XV = logits.reshape(B * T, -1)
        chance_BT = (jnp.argmax(logits_XV, axis=-1).reshape(B, T) == x_BT).astype(jnp.float32)
        if kinds.sample:
            logq_XV = jax.nn.log_softmax(cut(logits_XV, _flat(rules, T), kinds)[1], axis=-1)
            logq_BT = jnp.take_along_axis(logq_XV, x_BT.reshape(-1, 1), axis=-1).reshape(B, T)
            ratio_BT = jnp.minimum(1.0, jnp.exp(logq_BT - logp_RB[start : start + T].T))
            chance_BT = jnp.where(sampled(rules)[:, None], ratio_BT, chance_BT)
        chances.append(chance_BT)
    return caches, jnp.concatenate(chances, axis=1).T


def decode_chunk(session) -> list[tuple[int, list[int]]]:
    """Session._decode_chunk under speculation: one call of `chunk` at the engine's k (adaptive.py
    chooses it from session.acceptance, each running request's), then each running slot's emitted
    tokens (from 1 to k+1 a round) taken in order, and the rounds, drafts and accepted drafts
    counted in the engine's stats up to where each request stopped."""
    e, row, lookup, start = session.engine, session.row, looks_up(session.drafter), time.perf_counter()
    k, rounds = e.speculation.tokens, e.speculation.rounds
    if e.adaptive is not None:
        k = e.adaptive.choose(
            [session.acceptance.get(r[0], e.adaptive.prior) * r[1].speculative for r in session.running if r]
        )
        rounds = rounds if k else e.chunk  # no drafts: as many rounds as the plain engine's steps
    rows, seeds = session.rows_on_devices()
    state = session.drafter.caches if not lookup else session.drafter
    if isinstance(state, np.ndarray):  # the histories changed on the host (a request started)
        state = session.to_devices(state)
    draft = None if lookup else (session.drafter.params, session.drafter.per_layer)
    (session.caches, state), next_rows, *out = e.decode_step(
        (session.params, session.per_layer),
        (session.caches, state),
        draft,
        (rows["token"], rows["position"], rows["count"], rows["speculate"]),
        Draws(Rules(rows["temperature"], rows["top_k"], rows["top_p"]), seeds, rows["stream"]),
        kinds=session.kinds,
        plan=(k, rounds),
    )
    rows.update(zip(("token", "position", "count"), next_rows))  # the next chunk's, on the devices
    fetched = [np.array(x) for x in session.fetch(*next_rows, *out)]  # writable
    row["token"], row["position"], row["count"], emitted_BRT, logprob_BRT, kept_BR, chance_BR = fetched
    session.drafter = (
        state if lookup else dataclasses.replace(session.drafter, caches=state)
    )  # on the devices
    if e.adaptive is not None:
        e.adaptive.record(k, rounds, time.perf_counter() - start)
    e.stats["steps"] += rounds
    new = []
    for slot, running in enumerate(session.running):
        if running is None:
            continue
        (rid, request), lengths = running, kept_BR[slot] + 1
        done = session.completions[rid]
        fed_before = len(done.versions)
        taken = session.take(
            slot,
            [t for r, n in enumerate(lengths) for t in emitted_BRT[slot, r, :n].tolist()],
            [x for r, n in enumerate(lengths) for x in logprob_BRT[slot, r, :n].tolist()],
        )
        ran = int(np.searchsorted(np.cumsum(lengths), len(done.versions) - fed_before)) + 1
        if request.speculative:  # a request that opted out drafts nothing of its own
            e.stats["rounds" if k else "plain_rounds"] += ran
            e.stats["drafted"] += ran * k
            e.stats["accepted"] += int(np.sum(kept_BR[slot, :ran]))
            if e.adaptive is not None:
                previous = session.acceptance.get(rid)
                session.acceptance[rid] = e.adaptive.observed(
                    previous, k, kept_BR[slot, :ran], chance_BR[slot, :ran]
                )
        new.append((rid, taken))
    running = {r[0] for r in session.running if r}
    session.acceptance = {rid: a for rid, a in session.acceptance.items() if rid in running}
    return new
