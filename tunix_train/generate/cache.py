"""The sampler's KV cache and the attention that reads it.

Prompts are left-padded to a common length, so every row is at the same time step t; row b's
position is t - pad_b. Each layer keeps keys and values [B, K, S, H], sharded like a batch (rows
over dp and fsdp) and over tp by kv head where they divide. A global layer has a slot for every
time step of the generation; a sliding-window layer a ring buffer of `sliding_window` slots. Time t
goes to slot t % S; the slot s then holds time t - ((t - s) mod S), its most recent visit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from tunix_train.config import ModelConfig
from tunix_train.model import kernels
from tunix_train.model.gemma import layer_windows
from tunix_train.sharding import Rules, logical_to_spec

CACHE_AXES = ("batch", "kv_heads", None, "head_dim")  # of each layer's keys and values [B, K, S, H]


def slots_per_layer(cfg: ModelConfig, total_len: int) -> tuple[int, ...]:
    """Cache slots of each layer for `total_len` time steps: its window where that is shorter."""
    return tuple(int(min(window, total_len)) for window in layer_windows(cfg))


def cache_shardings(cfg: ModelConfig, mesh: Mesh, rows: int, total_len: int, rules: Rules) -> list[NamedSharding]:
    return [NamedSharding(mesh, logical_to_spec(CACHE_AXES, (rows, cfg.num_kv_heads, slots, cfg.head_dim), mesh,
                                                "KV cache", rules))
            for slots in slots_per_layer(cfg, total_len)]


def prefill_attend(window: int, slots: int, valid_BT: jax.Array):
    """For Attention: attention over the prompt itself (causal, the window, no padding), and the
    layer's cache holding the prompt's keys and values."""
    T = valid_BT.shape[1]
    index = jnp.arange(T)
    distance_TS = index[:, None] - index[None, :]
    mask_BTS = valid_BT[:, None, :] & (distance_TS >= 0) & (distance_TS < window)

    def attend(q_BTNH, k_BTKH, v_BTKH, softcap):
        out_BTNH = kernels.attention(q_BTNH, k_BTKH, v_BTKH, mask_BTS, softcap)
        return out_BTNH, {"k": _fill(k_BTKH, slots), "v": _fill(v_BTKH, slots)}

    return attend


def _fill(x_BTKH: jax.Array, slots: int) -> jax.Array:
    """A cache [B, K, slots, H] holding times 0..T-1 of x at slot t % slots (the last `slots` of
    them when T is longer)."""
    B, T, K, H = x_BTKH.shape
    x_BKTH = x_BTKH.transpose(0, 2, 1, 3)
    if T <= slots:
        return jnp.zeros((B, K, slots, H), x_BTKH.dtype).at[:, :, :T].set(x_BKTH)
    return jnp.roll(x_BKTH[:, :, T - slots:], (T - slots) % slots, axis=2)


def decode_attend(cache: dict[str, jax.Array], window: int, t: jax.Array, pads_B: jax.Array):
    """For Attention, at time step t (one new position): the new key and value written to slot
    t % S, then attention over the slots that hold this row's past within the window."""
    slots = cache["k"].shape[2]
    time_S = t - jnp.mod(t - jnp.arange(slots), slots)
    valid_BS = (time_S >= pads_B[:, None]) & (t - time_S < window)

    def attend(q_B1NH, k_B1KH, v_B1KH, softcap):
        slot = jnp.mod(t, slots)
        write = lambda c, x: jax.lax.dynamic_update_slice_in_dim(c, x.transpose(0, 2, 1, 3).astype(c.dtype), slot, 2)
        new = {"k": write(cache["k"], k_B1KH), "v": write(cache["v"], v_B1KH)}
        return cached_attention(q_B1NH, new["k"], new["v"], valid_BS, softcap), new

    return attend


def cached_attention(q_B1NH, k_BKSH, v_BKSH, valid_BS, softcap: float | None):
    """One query position against the cache: softmax(q k) v over the valid slots, grouped-query."""
    B, _, N, H = q_B1NH.shape
    K = k_BKSH.shape[1]
    q_BKGH = q_B1NH.reshape(B, K, N // K, H)
    logits_BKGS = jnp.einsum("bkgh,bksh->bkgs", q_BKGH, k_BKSH).astype(jnp.float32)
    if softcap is not None:
        logits_BKGS = jnp.tanh(logits_BKGS / softcap) * softcap
    logits_BKGS = jnp.where(valid_BS[:, None, None], logits_BKGS, -1e30)
    exp_BKGS = jnp.exp(logits_BKGS - jnp.max(logits_BKGS, axis=-1, keepdims=True))
    weighted_BKGH = jnp.einsum("bkgs,bksh->bkgh", exp_BKGS.astype(v_BKSH.dtype), v_BKSH)
    out_BKGH = weighted_BKGH / jnp.sum(exp_BKGS, axis=-1, keepdims=True).astype(weighted_BKGH.dtype)
    return out_BKGH.reshape(B, 1, N, H).astype(v_BKSH.dtype)


def cache_bytes(cfg: ModelConfig, rows: int, total_len: int, itemsize: int) -> int:
    """Bytes of the whole cache (keys and values of every layer), before sharding."""
    return int(sum(2 * rows * cfg.num_kv_heads * slots * cfg.head_dim * itemsize
                   for slots in slots_per_layer(cfg, total_len)))
