"""Context parallelism (the `cp` mesh axis): every activation split along the sequence.

Load balance. Under a causal mask a query's work grows with its position, so the shard holding the
end of a row would do most of it. `balanced_order` cuts each row into 2·cp chunks and gives shard i
chunks i and 2·cp−1−i, one early and one late; the step reorders its batch that way before the
model. Every token keeps its position (RoPE) and its index in the row (`token_index`), from which
the masks are built, so the reordering moves work, never results.

Attention runs inside the shard_map over cp that tunix_train.parallel opens round the layer stack;
each shard holds the queries, keys and values of its own tokens, [B, 2c, ...] for chunk length c:
  - global layers, `all_gather`: gather every shard's keys and values, attend to all of them.
  - global layers, `ring`: the keys and values go round the ring by ppermute in cp steps; each
    (query chunk, key chunk) pair that the causal mask hides entirely is skipped, and the partial
    results are merged by their log-sum-exp. With the balanced order every shard computes the same
    number of chunk pairs (`ring_chunk_pairs`).
  - sliding-window layers whose window fits in a chunk, whatever the strategy: only the last
    `window` keys of the chunk before each of a shard's chunks are fetched, from its neighbours.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tunix_train.config import ContextParallelStrategy
from tunix_train.model import kernels
from tunix_train.model.gemma import visible_keys
from tunix_train.parallel import float32_reductions as reductions

AXIS = "cp"


def balanced_order(seq_len: int, cp: int) -> np.ndarray:
    """Token indices in the order the cp shards hold them: chunk i, then chunk 2·cp−1−i, per shard i."""
    chunks = np.arange(seq_len).reshape(2 * cp, seq_len // (2 * cp))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * cp - 1 - i]]) for i in range(cp)])


def reorder(batch: dict[str, jax.Array], cp: int) -> dict[str, jax.Array]:
    """[..., T] arrays in balanced_order, with `token_index`: where each token stood in its row."""
    order = balanced_order(batch["inputs"].shape[-1], cp)
    reordered = {name: jnp.take(x, order, axis=-1) for name, x in batch.items()}
    reordered["token_index"] = jnp.broadcast_to(jnp.asarray(order, jnp.int32), batch["inputs"].shape)
    return reordered


def ring_chunk_pairs(seq_len: int, cp: int, balanced: bool) -> list[int]:
    """Per cp shard, the (query chunk, key chunk) pairs the ring computes: those with a key not after
    some query (`_needed`). Counted from the same predicate the ring uses."""
    order = balanced_order(seq_len, cp) if balanced else np.arange(seq_len)
    shards = order.reshape(cp, 2, seq_len // (2 * cp))  # shard, its two chunks, tokens
    return [sum(bool(_needed(q, k)) for q in shards[i] for j in range(cp) for k in shards[j]) for i in range(cp)]


def _needed(q_index, k_index):
    """Whether any key is at or before any query: else the causal mask hides the whole block."""
    return q_index.max() >= k_index.min()


@dataclasses.dataclass(frozen=True)
class ContextAttention:
    """The attention of a cp-sharded layer stack (tunix_train.parallel's `make_attend` for cp)."""

    size: int  # cp
    strategy: ContextParallelStrategy
    sliding_window: int | None  # the local layers' window, or None when it does not fit in a chunk

    def make_attend(self, rows):
        """rows: this shard's `token_index` and `segment_ids` [B, 2c] -> window -> attend."""
        q_index, q_segments = rows["token_index"], rows["segment_ids"]
        all_index, all_segments = (jax.lax.all_gather(x, AXIS, axis=1, tiled=True) for x in (q_index, q_segments))
        gather = lambda x: reductions.all_gather(x, AXIS)
        near = self._with_neighbours

        def gathered(q, k, v, softcap, window):
            mask = visible_keys(q_index, q_segments, all_index, all_segments, window)
            return kernels.attention(q, gather(k), gather(v), mask, softcap)

        def ring(q, k, v, softcap, window):
            return _ring_attention(q, k, v, q_index, q_segments, softcap, window, self.size)

        def windowed(q, k, v, softcap, window):
            mask = visible_keys(q_index, q_segments, near(q_index), near(q_segments), window)
            return kernels.attention(q, near(k), near(v), mask, softcap)

        global_attention = gathered if self.strategy is ContextParallelStrategy.all_gather else ring

        def for_window(window):
            def attend(q, k, v, softcap):
                if self.sliding_window is None:
                    return global_attention(q, k, v, softcap, window), None
                out = jax.lax.cond(window <= self.sliding_window,
                                   lambda *a: windowed(*a, softcap, window),
                                   lambda *a: global_attention(*a, softcap, window), q, k, v)
                return out, None
            return attend

        return for_window

    def _with_neighbours(self, x):
        """x [B, 2c, ...] of this shard and the last `sliding_window` entries of the chunk before each
        of its chunks: chunk i−1 is the first chunk of shard i−1, chunk 2·cp−2−i the second chunk of
        shard i+1 (or shard i's own first chunk, already here, for i = cp−1). The ring wraps round;
        what arrives from the wrong end lies after every query here, and the causal mask hides it."""
        c, w, n = x.shape[1] // 2, self.sliding_window, self.size
        from_left = jax.lax.ppermute(x[:, c - w:c], AXIS, [(i, (i + 1) % n) for i in range(n)])
        from_right = jax.lax.ppermute(x[:, 2 * c - w:], AXIS, [(i, (i - 1) % n) for i in range(n)])
        return jnp.concatenate([x, from_left, from_right], axis=1)


def _ring_attention(q_BTNH, k_BSKH, v_BSKH, q_index, q_segments, softcap, window, cp):
    """Attention of this shard's queries to every shard's keys, passed round the ring; each shard
    keeps, per query chunk, the output and log-sum-exp so far, merged as blocks arrive."""
    c = q_BTNH.shape[1] // 2
    halves = lambda x: (x[:, :c], x[:, c:])
    queries = list(zip(halves(q_BTNH), halves(q_index), halves(q_segments)))
    acc = [_nothing(q) for q, _, _ in queries]
    block = (k_BSKH, v_BSKH, q_index, q_segments)
    for step in range(cp):
        if step:  # the next shard's keys: from shard i−1, round the ring
            block = jax.lax.ppermute(block, AXIS, [(i, (i + 1) % cp) for i in range(cp)])
        for k, v, k_index, k_segments in zip(*map(halves, block)):
            for i, (q, qi, qs) in enumerate(queries):
                mask = visible_keys(qi, qs, k_index, k_segments, window)
                skipped = lambda *_: _nothing(q)
                out, lse = jax.lax.cond(_needed(qi, k_index), _block_attention, skipped, q, k, v, mask, softcap)
                acc[i] = _merge(acc[i], (out, lse))
    return jnp.concatenate([out for out, _ in acc], axis=1).astype(q_BTNH.dtype)


def _nothing(q_BTNH):
    """The (output, log-sum-exp) of attention over no keys, varying like the queries."""
    return jnp.zeros_like(q_BTNH, jnp.float32), jnp.full_like(q_BTNH[..., 0], -1e30, jnp.float32)


def _block_attention(q_BTNH, k_BSKH, v_BSKH, mask_BTS, softcap):
    """float32 softmax attention output [B, T, N, H] and log-sum-exp [B, T, N] over one key block."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    scores_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH).astype(jnp.float32)
    scores_BKGTS = jnp.where(mask_BTS[:, None, None], kernels.soft_cap(scores_BKGTS, softcap), -1e30)
    lse_BKGT = jax.nn.logsumexp(scores_BKGTS, axis=-1)
    probs_BKGTS = jnp.exp(scores_BKGTS - lse_BKGT[..., None])
    out_BTKGH = jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS.astype(v_BSKH.dtype), v_BSKH).astype(jnp.float32)
    return out_BTKGH.reshape(B, T, N, H), lse_BKGT.transpose(0, 3, 1, 2).reshape(B, T, N)


def _merge(a, b):
    """Two partial attentions over disjoint keys, each (output, log-sum-exp), as one."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    lse = jnp.logaddexp(lse_a, lse_b)
    return out_a * jnp.exp(lse_a - lse)[..., None] + out_b * jnp.exp(lse_b - lse)[..., None], lse
