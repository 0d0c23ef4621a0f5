"""The sampler's KV cache and the attention that reads it.

Prompts are left-padded to a common length, so every row is at the same time step t; row b's
position is t - pad_b. Each layer keeps keys and values [B*K, S, H]: one row per (batch row, kv
head), sharded like a batch (over dp and fsdp) and by kv head over tp where they divide. A global
layer has a slot for every time step of the generation; a sliding-window layer a ring buffer of
`sliding_window` slots. Time t goes to slot t % S; the slot s then holds time t - ((t - s) mod S),
its most recent visit.

Why batch and kv heads share one dimension: with a separate kv-head dimension of size 1 (Gemma 3
up to 1B), XLA:CPU fused each cache update into both of its readers (the attention's reshape and
the loop's output) and copied every cache four times per decode step (docs/performance.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tunix_train.config import ModelConfig
from tunix_train.model import kernels
from tunix_train.model.layout import layer_shapes, layer_windows
from tunix_train.sharding import Rules, logical_to_spec

CACHE_AXES = ("batch", "kv_heads", None, "head_dim")  # of [B, K, S, H], whose first two merge


def slots_per_layer(cfg: ModelConfig, total_len: int) -> tuple[int, ...]:
    """Cache slots of each layer for `total_len` time steps: its window where that is shorter."""
    return tuple(int(min(window, total_len)) for window in layer_windows(cfg))


def cache_shardings(cfg: ModelConfig, mesh: Mesh, rows: int, total_len: int, rules: Rules) -> list[NamedSharding]:
    """Each layer's [B*K, S, H] cache: rows split over the batch's mesh axes, then over the kv
    heads' (row-major, so the same split as [B, K] sharded on both)."""
    shardings = []
    for slots, shape in zip(slots_per_layer(cfg, total_len), layer_shapes(cfg)):
        rows_spec, heads_spec, *rest = logical_to_spec(CACHE_AXES, (rows, shape.num_kv_heads, slots, shape.head_dim),
                                                       mesh, "KV cache", rules)
        merged = tuple(a for entry in (rows_spec, heads_spec) if entry is not None
                       for a in ((entry,) if isinstance(entry, str) else entry))
        shardings.append(NamedSharding(mesh, P(merged or None, *rest)))
    return shardings


def prefill_attend(window: int, slots: int, valid_BT: jax.Array, keep: bool = True):
    """For Attention: attention over the prompt itself (causal, the window, no padding: padding is
    a document of its own), and the layer's cache holding the prompt's keys and values (None when
    not `keep`: a KV-sharing layer)."""
    index_BT = jnp.broadcast_to(jnp.arange(valid_BT.shape[1]), valid_BT.shape)
    mask_BTS = kernels.visible_keys(index_BT, valid_BT, index_BT, valid_BT)(window)

    def attend(q_BTNH, k_BTKH, v_BTKH, softcap):
        out_BTNH = kernels.attention(q_BTNH, k_BTKH, v_BTKH, mask_BTS, softcap)
        return out_BTNH, ({"k": _fill(k_BTKH, slots), "v": _fill(v_BTKH, slots)} if keep else None)

    return attend


def _rows(x_BTKH: jax.Array) -> jax.Array:
    """[B, T, K, H] keys or values as cache rows [B*K, T, H]."""
    B, T, K, H = x_BTKH.shape
    return x_BTKH.transpose(0, 2, 1, 3).reshape(B * K, T, H)


def _fill(x_BTKH: jax.Array, slots: int) -> jax.Array:
    """A cache [B*K, slots, H] holding times 0..T-1 of x at slot t % slots (the last `slots` of
    them when T is longer)."""
    x_XTH = _rows(x_BTKH)
    X, T, H = x_XTH.shape
    if T <= slots:
        return jnp.zeros((X, slots, H), x_XTH.dtype).at[:, :T].set(x_XTH)
    return jnp.roll(x_XTH[:, T - slots:], (T - slots) % slots, axis=1)


def decode_attend(cache: dict[str, jax.Array], window: int, t: jax.Array, pads_B: jax.Array, write: bool = True,
                  on_write=lambda new: None):
    """For Attention, at time step t (one new position): the new key and value written to slot
    t % S (on_write sees the new cache), then attention over the slots that hold this row's past
    within the window (a slot before the row's padding ends is of another document). write=False:
    a KV-sharing layer reads `cache`, already holding time t."""
    slots = cache["k"].shape[1]
    B = pads_B.shape[0]
    time_1S = (t - jnp.mod(t - jnp.arange(slots), slots))[None]
    mask_B1S = kernels.visible_keys(jnp.full((B, 1), t), jnp.ones((B, 1), bool), time_1S,
                                    time_1S >= pads_B[:, None])(window)

    def attend(q_B1NH, k_B1KH, v_B1KH, softcap):
        if not write:
            return cached_attention(q_B1NH, cache["k"], cache["v"], mask_B1S, softcap), None
        slot = jnp.mod(t, slots)
        put = lambda c, x: jax.lax.dynamic_update_slice_in_dim(c, _rows(x).astype(c.dtype), slot, 1)
        new = {"k": put(cache["k"], k_B1KH), "v": put(cache["v"], v_B1KH)}
        on_write(new)
        return cached_attention(q_B1NH, new["k"], new["v"], mask_B1S, softcap), new

    return attend


def cached_attention(q_B1NH, k_XSH, v_XSH, mask_B1S, softcap: float | None):
    """One query position against the cache rows X = B*K (kernels.softmax_attention: [B*K, S, H]
    is [B, K, S, H], and one position's G queries per kv head are its [B, K, G, H])."""
    B, _, N, H = q_B1NH.shape
    K = k_XSH.shape[0] // B
    by_head = lambda c_XSH: c_XSH.reshape(B, K, -1, H)
    out_BKGH, _ = kernels.softmax_attention(q_B1NH.reshape(B, K, N // K, H), by_head(k_XSH), by_head(v_XSH),
                                            mask_B1S, softcap)
    return out_BKGH.reshape(B, 1, N, H)


def cache_bytes(cfg: ModelConfig, rows: int, total_len: int, itemsize: int) -> int:
    """Bytes of the whole cache (keys and values of every layer), before sharding."""
    return int(sum(2 * rows * shape.num_kv_heads * slots * shape.head_dim * itemsize
                   for slots, shape in zip(slots_per_layer(cfg, total_len), layer_shapes(cfg)) if not shape.shares_kv))
