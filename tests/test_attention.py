"""One definition of attention, three callers: the training kernel, the cp ring and cached decoding
give the same outputs on one random case with soft-cap, a window and packed documents, and the
two that train the same gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tunix_train.config import ContextParallelStrategy
from tunix_train.generate import cache
from tunix_train.model import kernels
from tunix_train.parallel import context

B, T, N, K, H = 2, 16, 4, 2, 8
SOFTCAP, WINDOW = 5.0, 6


def _case(seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, d_out = (
        jnp.asarray(rng.normal(size=shape), jnp.float32)
        for shape in ((B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H))
    )
    segments = jnp.asarray([[1] * 5 + [2] * 7 + [3] * 4, [1] * 16], jnp.int32)  # packed documents
    return q * 2.0, k, v, d_out, segments  # scaled up so the soft-cap bends the scores


def _training(q, k, v, segments):
    index = jnp.broadcast_to(jnp.arange(T), (B, T))
    return kernels.attention(q, k, v, kernels.visible_keys(index, segments, index, segments)(WINDOW), SOFTCAP)


def _ring(q, k, v, segments, strategy, cp=2):
    """The cp path: the rows in balanced order, each shard's queries against every shard's keys."""
    order = context.balanced_order(T, cp)
    attention = context.ContextAttention(cp, strategy, None)
    mesh = Mesh(np.array(jax.devices()[:cp]), ("cp",))

    def shard(q, k, v, rows):
        return attention.make_attend(rows)(WINDOW)(q, k, v, SOFTCAP)[0]

    rows = {
        "token_index": jnp.broadcast_to(jnp.asarray(order, jnp.int32), (B, T)),
        "segment_ids": segments[:, order],
    }
    seq = P(None, "cp")
    out = jax.shard_map(shard, mesh=mesh, in_specs=(seq, seq, seq, seq), out_specs=seq)(
        q[:, order], k[:, order], v[:, order], rows
    )
    return out[:, np.argsort(order)]


def _gradients(attend, q, k, v, segments, d_out):
    return jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v, segments) * d_out), argnums=(0, 1, 2))(q, k, v)


@pytest.mark.parametrize("strategy", list(ContextParallelStrategy))
def test_the_cp_ring_gives_the_training_kernels_outputs_and_gradients(strategy):
    q, k, v, d_out, segments = _case()

    def ring(q, k, v, segments):
        return _ring(q, k, v, segments, strategy)

    both = jax.jit(lambda attend, *args: (attend(*args[:4]), _gradients(attend, *args)), static_argnums=0)
    (got_out, got_grads), (want_out, want_grads) = (
        both(f, q, k, v, segments, d_out) for f in (ring, _training)
    )
    np.testing.assert_allclose(got_out, want_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(got_grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("slots", [T, WINDOW])  # a global layer's cache, a sliding layer's ring buffer
def test_cached_decoding_gives_the_training_kernels_outputs(slots):
    """Each row decodes its own position (the two rows 3 positions apart) against the cache of the
    positions before it (a prefill's entry, then the step's own write) and equals the training
    kernel at that position: one document per row."""
    q, k, v, _, _ = _case(1)
    want = _training(q, k, v, jnp.ones((B, T), jnp.int32))
    for t in range(1, T):
        position_B = jnp.asarray([t, max(t - 3, 1)], jnp.int32)
        past = {"k": cache._entry(k, slots, position_B), "v": cache._entry(v, slots, position_B)}
        attend = cache.decode_attend(past, WINDOW, position_B)

        def at(x):
            return x[jnp.arange(B), position_B][:, None]

        got, _ = attend(at(q), at(k), at(v), SOFTCAP)
        for row in range(B):
            np.testing.assert_allclose(
                got[row, 0], want[row, position_B[row]], rtol=1e-5, atol=1e-5, err_msg=f"t={t}"
            )
