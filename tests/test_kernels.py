"""model/kernels.py: each kernel has the values and the gradients of its plain form (jnp.einsum and
autodiff of the textbook formula), in float32 to 1e-6: relative, or of the array's largest entry
(two float32 formulations of one softmax gradient round differently on entries near zero)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_train.model import kernels


def _assert_close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def _normal(shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in shapes]


def _assert_same_values_and_gradients(kernel, plain, args):
    """kernel(*args) == plain(*args), and so are their vector-Jacobian products for one random
    output gradient (checked to be non-trivial)."""
    out, vjp = jax.vjp(kernel, *args)
    want_out, want_vjp = jax.vjp(plain, *args)
    jax.tree.map(_assert_close, out, want_out)
    leaves, treedef = jax.tree.flatten(want_out)
    d_out = jax.tree.unflatten(treedef, _normal([x.shape for x in leaves], seed=7))
    for got, want in zip(vjp(d_out), want_vjp(d_out)):
        assert np.abs(want).max() > 0.1
        _assert_close(got, want)


@pytest.mark.parametrize("kernel", [kernels.project, kernels.dense])
@pytest.mark.parametrize(
    "spec, x_shape, w_shape",
    [("btd,dcf->btcf", (2, 5, 8), (8, 2, 6)), ("btd,dnh->btnh", (2, 5, 8), (8, 3, 4))],
)
def test_project_is_einsum(kernel, spec, x_shape, w_shape):
    """The weight gradient computed as einsum(x, g) is autodiff's einsum(g, x)."""
    _assert_same_values_and_gradients(
        lambda x, w: kernel(spec, x, w), lambda x, w: jnp.einsum(spec, x, w), _normal([x_shape, w_shape])
    )


@pytest.mark.parametrize("kv_heads", [4, 2])  # q, k, v stacked; k and v stacked, q alone
def test_qkv_projection_is_three_einsums(kv_heads):
    B, T, D, N, H = 2, 5, 8, 4, 3
    args = _normal([(B, T, D), (D, N, H), (D, kv_heads, H), (D, kv_heads, H)])

    def plain(x, q, k, v):
        return tuple(jnp.einsum("btd,dnh->btnh", x, w) for w in (q, k, v))

    _assert_same_values_and_gradients(kernels.qkv_projection, plain, args)


def test_apply_rope_is_the_rotation_of_halves():
    B, T, N, H = 2, 6, 3, 8
    x, angle = _normal([(B, T, N, H), (B, T, 1, 1, H // 2)])
    sin, cos = jnp.sin(angle), jnp.cos(angle)

    def plain(x):  # the textbook split and concatenate
        x1, x2 = x[..., : H // 2], x[..., H // 2 :]
        s, c = sin[:, :, 0], cos[:, :, 0]
        return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

    _assert_same_values_and_gradients(lambda x: kernels.apply_rope(x, sin, cos), plain, [x])


def _documents_and_window_mask(window: int):
    """[2, 16, 16]: the first row holds two documents (10 and 6 tokens), the second one; causal."""
    segments = np.array([[1] * 10 + [2] * 6, [1] * 16])
    distance = np.arange(16)[:, None] - np.arange(16)[None, :]
    return jnp.asarray((segments[:, :, None] == segments[:, None, :]) & (distance >= 0) & (distance < window))


def _plain_attention(q, k, v, mask, softcap):
    """Grouped-query attention as the textbook writes it, differentiated by JAX."""
    G = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    scores = jnp.einsum("btnh,bsnh->bnts", q, k)
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    probs = jax.nn.softmax(jnp.where(mask[:, None], scores, -1e30), axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", probs, v)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_attention_is_plain_softmax_attention(softcap):
    """The layout (heads before positions, a group's queries stacked) and the backward pass from the
    saved log-sum-exp, against autodiff of textbook attention, for grouped heads, documents and a
    window."""
    B, T, N, K, H = 2, 16, 4, 2, 8
    args = _normal([(B, T, N, H), (B, T, K, H), (B, T, K, H)], seed=1)
    mask = _documents_and_window_mask(window=5)
    _assert_same_values_and_gradients(
        lambda *qkv: kernels.attention(*qkv, mask, softcap),
        lambda *qkv: _plain_attention(*qkv, mask, softcap),
        args,
    )


def test_fused_attention_gets_the_layout_heads_and_mask_of_the_einsum_attention():
    """What the cuDNN path hands jax.nn.dot_product_attention (BTNH layout, grouped key/value heads,
    a document-and-window mask, queries already scaled), run with its XLA kernel: no GPU here."""
    B, T, N, K, H = 2, 16, 4, 2, 8
    args = _normal([(B, T, N, H), (B, T, K, H), (B, T, K, H)])
    mask = _documents_and_window_mask(window=4)
    _assert_same_values_and_gradients(
        lambda *qkv: kernels.attention(*qkv, mask, fused="xla"),
        lambda *qkv: _plain_attention(*qkv, mask, None),
        args,
    )


@pytest.mark.parametrize(
    "slots",
    [kernels.Slots(0, 8, 16), kernels.Slots(40, 8, 4), kernels.Slots(10, 3, 2), kernels.Slots(16, 4, 0)],
)
@pytest.mark.parametrize("sizes", [[10, 0, 70, 15], [8] * 8, [0, 0, 37], [1, 2, 3]])
@pytest.mark.parametrize("shuffled", [False, True])
def test_slotted_matmul_is_ragged_dot_where_every_row_fits(sizes, slots, shuffled):
    """Values and gradients against jax.lax.ragged_dot on the rows stably sorted by expert, through
    slotting's places and back: rows sorted or shuffled, groups of any size, empty ones, rows in no
    group (zeros); pool blocks alone, the experts' slots alone and both, the blocks' weight gradient
    as a one-hot matmul (E <= b/2) and as autodiff's scatter-add. Where Slots.fit says a row finds
    no place, exactly each group's rows past its places (in row order) give zeros."""
    A, E = max(sum(sizes), 40), len(sizes)
    x = jax.random.normal(jax.random.key(0), (A, 6))
    w = jax.random.normal(jax.random.key(1), (E, 6, 5))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    expert_A = jnp.repeat(jnp.arange(E + 1), jnp.asarray(sizes + [A - sum(sizes)]), total_repeat_length=A)
    if shuffled:
        expert_A = jax.random.permutation(jax.random.key(2), expert_A)
    order = np.argsort(np.asarray(expert_A), kind="stable")

    def slotted(x, w):
        source, dest, group_J = kernels.slotting(expert_A, E, slots)
        return kernels.take_rows(
            kernels.slotted_matmul(kernels.take_rows(x, source, dest), w, group_J, slots), dest, source
        )

    # what fits: each group's first base rows, then whole blocks while the pool lasts
    kept, blocks_left = [], slots.blocks
    for size in sizes:
        over = max(size - slots.base, 0)
        used = min(-(-over // slots.block), blocks_left)
        blocks_left -= used
        kept += [1] * min(size, slots.base + used * slots.block) + [0] * (
            size - min(size, slots.base + used * slots.block)
        )
    kept = jnp.asarray(kept + [0] * (A - sum(sizes)), jnp.float32)[:, None]
    assert bool(slots.fit(group_sizes)) == bool(jnp.all(kept[: sum(sizes)] == 1))
    unsort = np.argsort(order)

    def reference(x, w):
        return jax.lax.ragged_dot(x[order] * kept, w, group_sizes)[unsort]

    np.testing.assert_allclose(slotted(x, w), reference(x, w), atol=1e-5, rtol=0)

    def loss(f):
        return lambda x, w: jnp.sum(jnp.sin(f(x, w)))

    for got, expected in zip(
        jax.grad(loss(slotted), argnums=(0, 1))(x, w), jax.grad(loss(reference), argnums=(0, 1))(x, w)
    ):
        np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)


def test_take_rows_is_indexing_and_its_gradient_that_of_indexing():
    x = jax.random.normal(jax.random.key(0), (5, 3))
    index = jnp.array([3, 5, 0, 4, 5, 1, 2])  # 5: a row of zeros
    inverse = jnp.array([2, 5, 6, 0, 3])  # where each row of x lands
    padded = jnp.concatenate([x, jnp.zeros((1, 3))])
    np.testing.assert_array_equal(kernels.take_rows(x, index, inverse), padded[index])
    g = jax.random.normal(jax.random.key(1), (7, 3))
    got = jax.grad(lambda x: jnp.sum(kernels.take_rows(x, index, inverse) * g))(x)
    expected = jax.grad(lambda x: jnp.sum(jnp.concatenate([x, jnp.zeros((1, 3))])[index] * g))(x)
    np.testing.assert_allclose(got, expected, atol=1e-6)
