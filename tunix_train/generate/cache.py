"""The engine's KV cache and the attention that reads it.

Each layer keeps keys and values [X, S, H], X = slots x kv heads: one row per (slot, kv head),
sharded like a batch (over dp and fsdp) and by kv head over tp where they divide. A global layer
has S = the engine's max_len slots; a sliding-window layer a ring buffer of `sliding_window`. A
request's position p lives at slot p % S, wherever and whenever it was inserted, so its numbers
(the order of every sum over slots included) do not depend on the slot it got or its neighbours.
The slot s of a row at position p holds position p - ((p - s) mod S), its most recent visit.

Why slots and kv heads share one dimension: with a separate kv-head dimension of size 1 (Gemma 3
up to 1B), XLA:CPU fused each cache update into both of its readers (the attention's reshape and
the loop's output) and copied every cache four times per decode step (git log --
docs/performance-history.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tunix_train.config import ModelConfig
from tunix_train.model import kernels
from tunix_train.model.layout import layer_shapes, layer_windows
from tunix_train.sharding import Rules, logical_to_spec

CACHE_AXES = ("batch", "kv_heads", None, "head_dim")  # of [B, K, S, H], whose first two merge


def slots_per_layer(cfg: ModelConfig, max_len: int, lookahead: int = 0) -> tuple[int, ...]:
    """Cache slots of each layer for `max_len` time steps: its window where that is shorter, plus
    `lookahead` where a step writes that many positions past the row's last kept one (speculative
    decoding's drafts): a rejected draft's key then never overwrites a position still in the window."""
    return tuple(min(int(window) + lookahead, max_len) for window in layer_windows(cfg))


def constrained(caches: list, cfg: ModelConfig, mesh: Mesh, rules: Rules) -> list:
    """The caches (or prefill entries) of a compiled step in their layout, each layer's [rows*K, S, H]
    split by rows over the batch's mesh axes, then over the kv heads' (row-major, so the same split
    as [rows, K] sharded on both): the same sharding in as out, so a step's output feeds the next
    call without a recompile."""

    def constrain(x, shape):
        rows = x.shape[0] // shape.num_kv_heads
        return jax.lax.with_sharding_constraint(
            x, _sharding(mesh, rules, rows, shape.num_kv_heads, *x.shape[1:])
        )

    return [
        None if c is None else {name: constrain(x, shape) for name, x in c.items()}
        for c, shape in zip(caches, layer_shapes(cfg))
    ]


def _sharding(mesh: Mesh, rules: Rules, rows: int, kv_heads: int, slots: int, head_dim: int) -> NamedSharding:
    rows_spec, heads_spec, *rest = logical_to_spec(
        CACHE_AXES, (rows, kv_heads, slots, head_dim), mesh, "KV cache", rules
    )
    merged = tuple(
        a
        for entry in (rows_spec, heads_spec)
        if entry is not None
        for a in ((entry,) if isinstance(entry, str) else entry)
    )
    return NamedSharding(mesh, P(merged or None, *rest))


def prefill_attend(
    window: int,
    slots: int,
    length_B: jax.Array,
    keep: bool = True,
    images_BT=None,
    images_on_global: bool = True,
):
    """For Attention over right-padded prompts of length_B tokens: attention over the prompt itself
    (causal, the window; the padding is a document of its own; images_BT: each token's image, -1
    for text, within which it is bidirectional: kernels.visible_keys), and the layer's cache entry
    [B*K, slots, H] holding the prompt's keys and values (None when not `keep`: a KV-sharing layer)."""

    def attend(q_BTNH, k_BTKH, v_BTKH, softcap):
        B, T = q_BTNH.shape[:2]
        index_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
        valid_BT = index_BT < length_B[:, None]
        mask_BTS = kernels.visible_keys(
            index_BT, valid_BT, index_BT, valid_BT, images_BT, images_BT, images_on_global
        )(window)
        out_BTNH = kernels.attention(q_BTNH, k_BTKH, v_BTKH, mask_BTS, softcap)
        return out_BTNH, (
            {"k": _entry(k_BTKH, slots, length_B), "v": _entry(v_BTKH, slots, length_B)} if keep else None
        )

    return attend


def _rows(x_BTKH: jax.Array) -> jax.Array:
    """[B, T, K, H] keys or values as cache rows [B*K, T, H]."""
    B, T, K, H = x_BTKH.shape
    return x_BTKH.transpose(0, 2, 1, 3).reshape(B * K, T, H)


def stored_positions(position_B: jax.Array, slots: int) -> jax.Array:
    """[B, slots]: the position each slot holds for a row at position_B (negative: none yet)."""
    return position_B[:, None] - jnp.mod(position_B[:, None] - jnp.arange(slots), slots)


def _entry(x_BTKH: jax.Array, slots: int, length_B: jax.Array) -> jax.Array:
    """A cache [B*K, slots, H] holding each row's positions 0..length-1 at slot p % slots (the last
    `slots` of them when the prompt is longer); the slots of no position hold copies of position 0."""
    x_XTH = _rows(x_BTKH)
    K = x_BTKH.shape[2]
    held_XS = jnp.repeat(jnp.maximum(stored_positions(length_B - 1, slots), 0), K, axis=0)
    return jnp.take_along_axis(x_XTH, held_XS[:, :, None], axis=1)


def decode_attend(
    cache: dict[str, jax.Array],
    window: int,
    position_B: jax.Array,
    write: bool = True,
    on_write=lambda new: None,
    positions: int = 1,
):
    """For Attention, `positions` T new positions per row, from position_B on (one in decoding, a
    draft's k+1 in verifying it): their keys and values written to slots position % S (on_write
    sees the new cache), then attention of each over the slots that hold the row's own positions
    up to it, within the window. write=False: a KV-sharing layer reads `cache`, already holding
    them. Positions written past those kept later (rejected drafts) are overwritten before they
    are read: a slot counts as holding the most recent position at or before the query's."""
    X, slots, _ = cache["k"].shape
    B, T = position_B.shape[0], positions
    positions_BT = position_B[:, None] + jnp.arange(T)
    held_BS = stored_positions(positions_BT[:, -1], slots)
    mask_BTS = kernels.visible_keys(positions_BT, jnp.ones((B, T), bool), held_BS, held_BS >= 0)(window)

    def attend(q_BTNH, k_BTKH, v_BTKH, softcap):
        if not write:
            return cached_attention(q_BTNH, cache["k"], cache["v"], mask_BTS, softcap), None
        slot_XT = jnp.repeat(jnp.mod(positions_BT, slots), X // B, axis=0)
        new = {name: _write(cache[name], slot_XT, _rows(x)) for name, x in (("k", k_BTKH), ("v", v_BTKH))}
        on_write(new)
        return cached_attention(q_BTNH, new["k"], new["v"], mask_BTS, softcap), new

    return attend


def _write(cache_XSH: jax.Array, slot_XT: jax.Array, new_XTH: jax.Array) -> jax.Array:
    """The cache with row x's slot slot_XT[x, t] set to new_XTH[x, t]: a scatter, except on
    XLA:CPU, where the scatter in the decode loop fails to compile under
    xla_cpu_use_multi_output_fusion (jaxlib 0.10.2: "symbolic_map.cc Check failed"), so a select
    over the whole cache writes it there."""
    new_XTH = new_XTH.astype(cache_XSH.dtype)

    def select(cache_XSH, slot_XT, new_XTH):
        if slot_XT.shape[1] == 1:
            hit_XS1 = (jnp.arange(cache_XSH.shape[1])[None] == slot_XT)[:, :, None]
            return jnp.where(hit_XS1, new_XTH, cache_XSH)
        hit_XTS = jnp.arange(cache_XSH.shape[1])[None, None] == slot_XT[:, :, None]
        written_XSH = jnp.einsum("xts,xth->xsh", hit_XTS.astype(new_XTH.dtype), new_XTH)
        return jnp.where(jnp.any(hit_XTS, axis=1)[:, :, None], written_XSH, cache_XSH)

    def scatter(cache_XSH, slot_XT, new_XTH):
        rows_XT = jnp.broadcast_to(jnp.arange(cache_XSH.shape[0])[:, None], slot_XT.shape)
        return cache_XSH.at[rows_XT, slot_XT].set(new_XTH, unique_indices=True)

    return jax.lax.platform_dependent(cache_XSH, slot_XT, new_XTH, cpu=select, default=scatter)


def cached_attention(q_BTNH, k_XSH, v_XSH, mask_BTS, softcap: float | None):
    """T query positions against the cache rows X = B*K (kernels.softmax_attention: [B*K, S, H]
    is [B, K, S, H], and the G queries per kv head of T positions are its [B, K, G*T, H])."""
    B, T, N, H = q_BTNH.shape
    K = k_XSH.shape[0] // B

    def by_head(c_XSH):
        return c_XSH.reshape(B, K, -1, H)

    out_BKXH, _ = kernels.softmax_attention(
        kernels.grouped(q_BTNH, K), by_head(k_XSH), by_head(v_XSH), mask_BTS, softcap
    )
    return kernels.ungrouped(out_BKXH, T)


def cache_bytes(cfg: ModelConfig, rows: int, max_len: int, itemsize: int, lookahead: int = 0) -> int:
    """Bytes of the whole cache (keys and values of every layer), before sharding."""
    return int(
        sum(
            2 * rows * shape.num_kv_heads * slots * shape.head_dim * itemsize
            for slots, shape in zip(slots_per_layer(cfg, max_len, lookahead), layer_shapes(cfg))
            if not shape.shares_kv
        )
    )
