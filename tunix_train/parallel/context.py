"""Context parallelism (the `cp` mesh axis): every activation split along the sequence.

Load balance. Under a causal mask a query's work grows with its position, so the shard holding the
end of a row would do most of it. `balanced_order` cuts each row into 2·cp chunks and gives shard i
chunks i and 2·cp−1−i, one early and one late; the step reorders its batch that way before the
model. Every token keeps its position (RoPE) and its index in the row (`token_index`), from which
the masks are built, so the reordering moves work, never results.

Attention runs inside the shard_map over cp that tunix_train.parallel opens round the layer stack;
each shard holds the queries, keys and values of its own tokens, [B, 2c, ...] for chunk length c:
  - global layers, `all_gather`: gather every shard's keys and values (by cp − 1 steps round the
    ring, `_gather`), attend to all of them.
  - global layers, `ring`: the keys and values go round the ring by ppermute in cp steps; each
    (query chunk, key chunk) pair that the causal mask hides entirely is skipped, and the partial
    results are merged by their log-sum-exp. With the balanced order every shard computes the same
    number of chunk pairs (`ring_chunk_pairs`). The backward pass is flash attention's, the blocks
    going round again with their gradients: no shard holds more than one block of scores.
  - sliding-window layers whose window fits in a chunk, whatever the strategy: only the last
    `window` keys of the chunk before each of a shard's chunks are fetched, from its neighbours.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from tunix_train.config import ContextParallelStrategy
from tunix_train.model import kernels

AXIS = "cp"


def balanced_order(seq_len: int, cp: int) -> np.ndarray:
    """Token indices in the order the cp shards hold them: chunk i, then chunk 2·cp−1−i, per shard i."""
    chunks = np.arange(seq_len).reshape(2 * cp, seq_len // (2 * cp))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * cp - 1 - i]]) for i in range(cp)])


NOT_PER_TOKEN = ("images",)  # batch fields [A, B, ...] whose axis 2 is not the sequence


def reorder(batch: dict[str, jax.Array], cp: int) -> dict[str, jax.Array]:
    """[A, B, T, ...] arrays in balanced_order, with `token_index`: where each token stood in its row
    (the images stay as they are: the model places them by the tokens' order in their rows)."""
    order = balanced_order(batch["inputs"].shape[2], cp)
    reordered = {
        name: x if name in NOT_PER_TOKEN else jnp.take(x, order, axis=2) for name, x in batch.items()
    }
    reordered["token_index"] = jnp.broadcast_to(jnp.asarray(order, jnp.int32), batch["inputs"].shape)
    return reordered


def ring_chunk_pairs(seq_len: int, cp: int, balanced: bool) -> list[int]:
    """Per cp shard, the (query chunk, key chunk) pairs the ring computes: those with a key not after
    some query (`_needed`). Counted from the same predicate the ring uses."""
    order = balanced_order(seq_len, cp) if balanced else np.arange(seq_len)
    shards = order.reshape(cp, 2, seq_len // (2 * cp))  # shard, its two chunks, tokens
    return [
        sum(bool(_needed(q, k)) for q in shards[i] for j in range(cp) for k in shards[j]) for i in range(cp)
    ]


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
        """rows: this shard's `token_index` and `segment_ids` [B, 2c] (and `image_ids`, with images)
        -> window -> attend."""
        q_index, q_segments, q_images = rows["token_index"], rows["segment_ids"], rows.get("image_ids")
        gather = partial(_gather, cp=self.size)
        all_index, all_segments = gather(q_index), gather(q_segments)
        all_images = None if q_images is None else gather(q_images)
        near = self._with_neighbours

        def gathered(q, k, v, softcap, window):
            mask = kernels.visible_keys(q_index, q_segments, all_index, all_segments, q_images, all_images)(
                window
            )
            return kernels.attention(q, gather(k), gather(v), mask, softcap)

        def ring(q, k, v, softcap, window):
            return _ring(q, k, v, (q_index, q_segments, q_images), window, softcap, self.size)

        def windowed(q, k, v, softcap, window):  # never with images (parallel._context)
            mask = kernels.visible_keys(q_index, q_segments, near(q_index), near(q_segments))(window)
            return kernels.attention(q, near(k), near(v), mask, softcap)

        global_attention = gathered if self.strategy is ContextParallelStrategy.all_gather else ring

        def for_window(window):
            def attend(q, k, v, softcap):
                if self.sliding_window is None:
                    return global_attention(q, k, v, softcap, window), None
                out = jax.lax.cond(
                    window <= self.sliding_window,
                    lambda *a: windowed(*a, softcap, window),
                    lambda *a: global_attention(*a, softcap, window),
                    q,
                    k,
                    v,
                )
                return out, None

            return attend

        return for_window

    def _with_neighbours(self, x):
        """x [B, 2c, ...] of this shard and the last `sliding_window` entries of the chunk before each
        of its chunks: chunk i−1 is the first chunk of shard i−1, chunk 2·cp−2−i the second chunk of
        shard i+1 (or shard i's own first chunk, already here, for i = cp−1). The ring wraps round;
        what arrives from the wrong end lies after every query here, and the causal mask hides it."""
        c, w, n = x.shape[1] // 2, self.sliding_window, self.size
        from_left = jax.lax.ppermute(x[:, c - w : c], AXIS, [(i, (i + 1) % n) for i in range(n)])
        from_right = jax.lax.ppermute(x[:, 2 * c - w :], AXIS, [(i, (i - 1) % n) for i in range(n)])
        return jnp.concatenate([x, from_left, from_right], axis=1)


def _gather(x, cp):
    """Every shard's x [B, c', ...] along axis 1, in shard order, by cp − 1 steps round the ring.
    Why not jax.lax.all_gather: inside this shard_map (jaxlib 0.10.2), XLA also gathers its rows over
    the data axes first, moving data-parallel-size times the bytes; collective-permutes keep them."""
    received = [x]
    for _ in range(cp - 1):
        received.append(_round_the_ring(received[-1], cp))  # step s holds shard i − s's
    shard = jax.lax.axis_index(AXIS)
    by_source = jnp.take(jnp.stack(received), (shard - jnp.arange(cp)) % cp, axis=0)
    return jnp.concatenate(list(by_source), axis=1)


def _halves(x):
    """A shard's two chunks of x [B, 2c, ...]."""
    c = x.shape[1] // 2
    return x[:, :c], x[:, c:]


def _round_the_ring(x, cp):
    """x of shard i−1, for every shard i."""
    return jax.lax.ppermute(x, AXIS, [(i, (i + 1) % cp) for i in range(cp)])


@partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _ring(q_BTNH, k_BSKH, v_BSKH, where, window, softcap, cp):
    """Attention of this shard's queries to every shard's keys, passed round the ring (where: the
    queries' (positions, segment ids, images), the images each token's, or None without images).
    Why its own backward pass: flash attention's, which keeps only the output and log-sum-exp of
    each query; autodiff of the forward ring kept every block's probabilities."""
    return _ring_fwd(q_BTNH, k_BSKH, v_BSKH, where, window, softcap, cp)[0]


def _block_mask(qi, qs, q_img, k_index, k_segments, k_img, window):
    """A (query chunk, key chunk) pair's mask and whether it is computed at all: any key not after
    a query, or, with images, any key visible (an image's later tokens may lie in a later chunk)."""
    mask = kernels.visible_keys(qi, qs, k_index, k_segments, q_img, k_img)(window)
    return mask, (_needed(qi, k_index) if q_img is None else jnp.any(mask))


def _image_halves(images):
    return (None, None) if images is None else _halves(images)


def _ring_fwd(q_BTNH, k_BSKH, v_BSKH, where, window, softcap, cp):
    """Per query chunk, the output and log-sum-exp so far, merged as the key blocks come round."""
    q_index, q_segments, q_images = where
    queries = list(zip(_halves(q_BTNH), _halves(q_index), _halves(q_segments), _image_halves(q_images)))
    acc = [_nothing(q) for q, *_ in queries]
    block = (k_BSKH, v_BSKH, q_index, q_segments, q_images)
    for step in range(cp):
        if step:
            block = _round_the_ring(block, cp)
        for k, v, k_index, k_segments, k_img in zip(*map(_halves, block[:4]), _image_halves(block[4])):
            for i, (q, qi, qs, q_img) in enumerate(queries):
                mask, needed = _block_mask(qi, qs, q_img, k_index, k_segments, k_img, window)

                def skipped(*_):
                    return _nothing(q)

                out, lse = jax.lax.cond(
                    needed, partial(_block_attention, softcap=softcap), skipped, q, k, v, mask
                )
                acc[i] = _merge(acc[i], (out, lse))
    out_BTNH = jnp.concatenate([out for out, _ in acc], axis=1)
    lse_BTN = jnp.concatenate([lse for _, lse in acc], axis=1)
    residuals = (q_BTNH, k_BSKH, v_BSKH, where, window, out_BTNH, lse_BTN)
    return out_BTNH.astype(q_BTNH.dtype), residuals


def _ring_bwd(softcap, cp, residuals, d_out_BTNH):
    """The key blocks go round again, each with its key and value gradients, which every shard adds
    its queries' part to; one more step takes them home."""
    q_BTNH, k_BSKH, v_BSKH, (q_index, q_segments, q_images), window, out_BTNH, lse_BTN = residuals
    rowsum_BTN = jnp.sum(d_out_BTNH.astype(jnp.float32) * out_BTNH, axis=-1)
    queries = list(
        zip(
            _halves(q_BTNH),
            _halves(q_index),
            _halves(q_segments),
            _image_halves(q_images),
            _halves(d_out_BTNH),
            _halves(lse_BTN),
            _halves(rowsum_BTN),
        )
    )
    d_q = [jnp.zeros_like(q, jnp.float32) for q, *_ in queries]
    block = (k_BSKH, v_BSKH, q_index, q_segments, q_images)
    d_kv = (jnp.zeros_like(k_BSKH, jnp.float32), jnp.zeros_like(v_BSKH, jnp.float32))
    for step in range(cp):
        if step:
            block, d_kv = _round_the_ring((block, d_kv), cp)
        d_k, d_v = map(list, map(_halves, d_kv))
        for j, (k, v, k_index, k_segments, k_img) in enumerate(
            zip(*map(_halves, block[:4]), _image_halves(block[4]))
        ):
            for i, (q, qi, qs, q_img, g, lse, rowsum) in enumerate(queries):
                mask, needed = _block_mask(qi, qs, q_img, k_index, k_segments, k_img, window)

                def skipped(*_):
                    return (
                        jnp.zeros_like(q, jnp.float32),
                        jnp.zeros_like(k, jnp.float32),
                        jnp.zeros_like(v, jnp.float32),
                    )

                dq, dk, dv = jax.lax.cond(
                    needed,
                    partial(_block_grads, softcap=softcap),
                    skipped,
                    q,
                    k,
                    v,
                    mask,
                    g,
                    lse,
                    rowsum,
                )
                d_q[i], d_k[j], d_v[j] = d_q[i] + dq, d_k[j] + dk, d_v[j] + dv
        d_kv = (jnp.concatenate(d_k, axis=1), jnp.concatenate(d_v, axis=1))
    d_k_BSKH, d_v_BSKH = _round_the_ring(d_kv, cp)
    return (
        jnp.concatenate(d_q, axis=1).astype(q_BTNH.dtype),
        d_k_BSKH.astype(k_BSKH.dtype),
        d_v_BSKH.astype(v_BSKH.dtype),
        (None, None, None),
        None,
    )


_ring.defvjp(_ring_fwd, _ring_bwd)


def _nothing(q_BTNH):
    """The (output, log-sum-exp) of attention over no keys, varying like the queries."""
    return jnp.zeros_like(q_BTNH, jnp.float32), jnp.full_like(q_BTNH[..., 0], -1e30, jnp.float32)


def _block_attention(q_BTNH, k_BSKH, v_BSKH, mask_BTS, softcap):
    """float32 softmax attention output [B, T, N, H] and log-sum-exp [B, T, N] over one key block
    (kernels.softmax_attention, in the ring's [B, T, N, H] layout: a block's results merge along T)."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    out_BKXH, lse_BKGT1 = kernels.softmax_attention(
        kernels.grouped(q_BTNH, K),
        kernels.by_head(k_BSKH),
        kernels.by_head(v_BSKH),
        mask_BTS,
        softcap,
        jnp.float32,
    )
    return kernels.ungrouped(out_BKXH, T), lse_BKGT1.reshape(B, K, N // K, T).transpose(0, 3, 1, 2).reshape(
        B, T, N
    )


def _block_grads(q_BTNH, k_BSKH, v_BSKH, mask_BTS, d_out_BTNH, lse_BTN, rowsum_BTN, softcap):
    """float32 (dq, dk, dv) of one key block (kernels.softmax_attention_grads), from the whole
    query's saved log-sum-exp and rowsum(d_out * out)."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]

    def per_group(x_BTN):
        return x_BTN.reshape(B, T, K, N // K).transpose(0, 2, 3, 1)[..., None]  # [B, K, G, T, 1]

    d_q, d_k, d_v = kernels.softmax_attention_grads(
        kernels.grouped(q_BTNH, K),
        kernels.by_head(k_BSKH),
        kernels.by_head(v_BSKH),
        mask_BTS,
        softcap,
        per_group(lse_BTN),
        per_group(rowsum_BTN),
        kernels.grouped(d_out_BTNH, K),
    )
    return (
        kernels.ungrouped(d_q, T).astype(jnp.float32),
        kernels.by_head(d_k).astype(jnp.float32),
        kernels.by_head(d_v).astype(jnp.float32),
    )


def _merge(a, b):
    """Two partial attentions over disjoint keys, each (output, log-sum-exp), as one."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    lse = jnp.logaddexp(lse_a, lse_b)
    return out_a * jnp.exp(lse_a - lse)[..., None] + out_b * jnp.exp(lse_b - lse)[..., None], lse
