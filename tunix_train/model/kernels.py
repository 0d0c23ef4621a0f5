"""Kernels: pieces of the Gemma layers written for the compilers' layouts rather than as the math
reads. Each computes what its plain form computes (tests/test_kernels.py checks values and
gradients against plain jnp.einsum and autodiff); each says in one line why it exists, and
docs/performance.md gives what it gains. gemma.py calls them and otherwise reads as the papers.

Axis letters as in gemma.py; X is a kv group's queries stacked with their positions (G * T), C a
stack of projections.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from tunix_train.config import Remat
from tunix_train.model.layout import GLOBAL_WINDOW

PROJECTION = "projection"  # checkpoint name of projections' outputs: saved like matmul outputs
ATTENTION = "attention"  # checkpoint name of attention's output and log-sum-exp: saved likewise


def projection_output(x):
    """Names a projection's output, or one slice of a stacked projection's, for the remat policies.
    Why: naming the slices, not the stack, lets the backward pass read each saved array whole."""
    return checkpoint_name(x, PROJECTION)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def project(spec: str, x, w):
    """jnp.einsum(spec, x, w) for activations x and weights w, with the weight gradient computed as
    einsum(x, g). Why: autodiff's einsum(g, x) makes XLA:CPU copy g, the larger operand, transposed."""
    return jnp.einsum(spec, x, w)


def _project_fwd(spec, x, w):
    return jnp.einsum(spec, x, w), (x, w)


def _project_bwd(spec, residuals, g):
    x, w = residuals
    inputs, out = spec.split("->")
    x_axes, w_axes = inputs.split(",")
    return jnp.einsum(f"{out},{w_axes}->{x_axes}", g, w), jnp.einsum(f"{x_axes},{out}->{w_axes}", x, g)


project.defvjp(_project_fwd, _project_bwd)


def dense(spec: str, x, w):
    """A projection whose output the remat policies save: project, named."""
    return projection_output(project(spec, x, w))


def output_projection(out_BTNH, o_NHD):
    """einsum("btnh,nhd->btd"), contracting (n, h) in this order. Why: the einsum asks for (h, n),
    for which XLA:CPU transposed the output weights and the activations at every call."""
    return jax.lax.dot_general(out_BTNH, o_NHD, (((2, 3), (0, 1)), ((), ())))


def qkv_projection(x_BTD, q_DNH, k_DKH, v_DKH):
    """(x q, x k, x v) as one matmul when the shapes allow (q, k, v stacked when K = N; k and v
    otherwise). Why: with tp, the backward pass all-reduces one partial input gradient, not three;
    the stack axis after the embed axis makes the output [tokens, stack * features], no transposes."""
    if q_DNH.shape == k_DKH.shape:
        qkv_BTCNH = project("btd,dcnh->btcnh", x_BTD, jnp.stack([q_DNH, k_DKH, v_DKH], axis=1))
        q_BTNH, k_BSKH, v_BSKH = qkv_BTCNH[:, :, 0], qkv_BTCNH[:, :, 1], qkv_BTCNH[:, :, 2]
    else:
        q_BTNH = project("btd,dnh->btnh", x_BTD, q_DNH)
        kv_BSCKH = project("bsd,dckh->bsckh", x_BTD, jnp.stack([k_DKH, v_DKH], axis=1))
        k_BSKH, v_BSKH = kv_BSCKH[:, :, 0], kv_BSCKH[:, :, 1]
    return tuple(map(projection_output, (q_BTNH, k_BSKH, v_BSKH)))


def apply_rope(x_BTNH, sin, cos):
    """Rotary embedding: the halves (x1, x2) of each head become (x1 cos - x2 sin, x2 cos + x1 sin),
    with rope.rope_table's (sin, cos) [B, T, 1, 1, H/2]. Why a flip of a size-2 axis instead of
    split and concatenate: their gradients (pads and slices) cost more than the rotation on CPU."""
    B, T, N, H = x_BTNH.shape
    signs_2 = jnp.array([-1.0, 1.0])[:, None]
    x_BTN2h = x_BTNH.astype(jnp.float32).reshape(B, T, N, 2, H // 2)
    rotated = x_BTN2h * cos + jnp.flip(x_BTN2h, axis=-2) * (signs_2 * sin)
    return rotated.reshape(B, T, N, H).astype(x_BTNH.dtype)


def visible_keys(
    q_index_BT,
    q_segments_BT,
    k_index_BS,
    k_segments_BS,
    q_images_BT=None,
    k_images_BS=None,
    images_on_global: bool = True,
):
    """The one definition of which keys a query sees: window -> [B, T, S], same document (segment),
    not ahead, fewer than `window` positions back, from the queries' and keys' indices in their
    rows and segment ids. With image ids (each token's image in its row, -1 for text), a query in
    an image also sees the image's later tokens (bidirectional within an image, as transformers'
    blockwise overlay): in every layer, or with images_on_global=False in the sliding ones only
    (Gemma 4). The part that does not depend on the window is computed once."""
    distance_BTS = q_index_BT[:, :, None] - k_index_BS[:, None, :]
    same_doc_BTS = q_segments_BT[:, :, None] == k_segments_BS[:, None, :]
    causal_BTS = same_doc_BTS & (distance_BTS >= 0)
    if q_images_BT is None:
        return lambda window: causal_BTS & (distance_BTS < window)
    same_image_BTS = (q_images_BT[:, :, None] == k_images_BS[:, None, :]) & (q_images_BT[:, :, None] >= 0)
    widened_BTS = causal_BTS | (same_doc_BTS & same_image_BTS)
    if images_on_global:
        return lambda window: widened_BTS & (distance_BTS < window)
    return lambda window: (
        jnp.where(window == GLOBAL_WINDOW, causal_BTS, widened_BTS) & (distance_BTS < window)
    )


def grouped(q_BTNH, kv_heads: int):
    """Queries [B, T, N, H] as [B, K, X, H], a kv head's G queries stacked with their positions.
    Why: heads in front of positions and a group's queries stacked make each (batch, kv head) one
    [G*T, H] x [H, S] matmul, with no transposes per dot."""
    B, T, N, H = q_BTNH.shape
    G = N // kv_heads
    return q_BTNH.reshape(B, T, kv_heads, G, H).transpose(0, 2, 3, 1, 4).reshape(B, kv_heads, G * T, H)


def by_head(x):
    """Keys or values [B, S, K, H] <-> [B, K, S, H], the layout `grouped` queries meet."""
    return x.transpose(0, 2, 1, 3)


def ungrouped(x_BKXH, T: int):
    """The inverse of grouped: [B, K, G*T, H] -> [B, T, N, H]."""
    B, K, X, H = x_BKXH.shape
    return x_BKXH.reshape(B, K, X // T, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, K * (X // T), H)


def attention(q_BTNH, k_BSKH, v_BSKH, mask_BTS, softcap: float | None = None, fused: str | None = None):
    """softmax(q k) v over the keys that mask_BTS allows, grouped-query; q comes scaled. `fused`
    names a kernel of jax.nn.dot_product_attention ("cudnn": cuDNN flash attention on NVIDIA GPUs,
    which takes no soft-cap)."""
    if fused is not None:
        return jax.nn.dot_product_attention(
            q_BTNH, k_BSKH, v_BSKH, mask=mask_BTS[:, None], scale=1.0, implementation=fused
        )
    out_BKXH = _attention(
        grouped(q_BTNH, k_BSKH.shape[2]), by_head(k_BSKH), by_head(v_BSKH), mask_BTS, softcap
    )
    return ungrouped(out_BKXH, q_BTNH.shape[1])


def soft_cap(x, cap: float | None):
    """cap * tanh(x / cap): Gemma 2's soft limit on attention and output logits; x where cap is None."""
    return x if cap is None else jnp.tanh(x / cap) * cap


def _scores(q_BKXH, k_BKSH, mask_BTS, softcap):
    """float32 scores [B, K, G, T, S], masked (-1e30 where not allowed), and before masking."""
    B, K, X, _ = q_BKXH.shape
    T = mask_BTS.shape[1]
    logits_BKGTS = (
        jnp.einsum("bkxh,bksh->bkxs", q_BKXH, k_BKSH).reshape(B, K, X // T, T, -1).astype(jnp.float32)
    )
    logits_BKGTS = soft_cap(logits_BKGTS, softcap)
    return jnp.where(mask_BTS[:, None, None], logits_BKGTS, -1e30), logits_BKGTS


def softmax_attention(q_BKXH, k_BKSH, v_BKSH, mask_BTS, softcap, out_dtype=None):
    """The one definition of attention's math: scores, mask, soft-cap, softmax, the weighted sum.
    Returns the output [B, K, X, H] (in out_dtype, default v's) and each query's log-sum-exp
    [B, K, G, T, 1]. Training (with the backward pass below), the cp ring (merging blocks of keys
    by their log-sum-exp) and cached decoding all call it."""
    B, K, X, _ = q_BKXH.shape
    scores_BKGTS, _ = _scores(q_BKXH, k_BKSH, mask_BTS, softcap)
    top_BKGT1 = jnp.max(scores_BKGTS, axis=-1, keepdims=True)
    exp_BKGTS = jnp.exp(scores_BKGTS - top_BKGT1)
    total_BKGT1 = jnp.sum(exp_BKGTS, axis=-1, keepdims=True)
    # normalized after the weighted sum: a division over [X, H], not over [X, S]
    weighted_BKXH = jnp.einsum("bkxs,bksh->bkxh", exp_BKGTS.astype(v_BKSH.dtype).reshape(B, K, X, -1), v_BKSH)
    out_BKXH = (weighted_BKXH / total_BKGT1.reshape(B, K, X, 1)).astype(out_dtype or v_BKSH.dtype)
    return out_BKXH, top_BKGT1 + jnp.log(total_BKGT1)


def softmax_attention_grads(q_BKXH, k_BKSH, v_BKSH, mask_BTS, softcap, lse_BKGT1, rowsum_BKGT1, d_out_BKXH):
    """(dq, dk, dv) of softmax_attention, flash attention's way: the probabilities come back from
    the scores and the saved log-sum-exp, and the softmax gradient needs only
    rowsum(d_out * out) (over the whole of a query's keys, when they come in blocks)."""
    B, K, X, _ = q_BKXH.shape
    scores_BKGTS, capped_BKGTS = _scores(q_BKXH, k_BKSH, mask_BTS, softcap)
    probs_BKGTS = jnp.exp(scores_BKGTS - lse_BKGT1)
    d_probs_BKGTS = jnp.einsum("bkxh,bksh->bkxs", d_out_BKXH, v_BKSH).reshape(scores_BKGTS.shape)
    d_scores_BKGTS = probs_BKGTS * (d_probs_BKGTS - rowsum_BKGT1)
    if softcap is not None:
        d_scores_BKGTS = d_scores_BKGTS * (1.0 - (capped_BKGTS / softcap) ** 2)
    probs_BKXS = probs_BKGTS.astype(v_BKSH.dtype).reshape(B, K, X, -1)
    d_scores_BKXS = d_scores_BKGTS.astype(q_BKXH.dtype).reshape(B, K, X, -1)
    return (
        jnp.einsum("bkxs,bksh->bkxh", d_scores_BKXS, k_BKSH),
        jnp.einsum("bkxs,bkxh->bksh", d_scores_BKXS, q_BKXH),
        jnp.einsum("bkxs,bkxh->bksh", probs_BKXS, d_out_BKXH),
    )


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q_BKXH, k_BKSH, v_BKSH, mask_BTS, softcap):
    """Why its own backward pass: flash attention's, from the saved output and log-sum-exp, instead
    of differentiating through the forward pass's max, sum and division."""
    return _attention_fwd(q_BKXH, k_BKSH, v_BKSH, mask_BTS, softcap)[0]


def _attention_fwd(q_BKXH, k_BKSH, v_BKSH, mask_BTS, softcap):
    """The output and each query's log-sum-exp, both named ATTENTION for the remat policies."""
    out_BKXH, lse_BKGT1 = softmax_attention(q_BKXH, k_BKSH, v_BKSH, mask_BTS, softcap)
    out_BKXH, lse_BKGT1 = checkpoint_name(out_BKXH, ATTENTION), checkpoint_name(lse_BKGT1, ATTENTION)
    return out_BKXH, (q_BKXH, k_BKSH, v_BKSH, mask_BTS, out_BKXH, lse_BKGT1)


def _attention_bwd(softcap, residuals, d_out_BKXH):
    q_BKXH, k_BKSH, v_BKSH, mask_BTS, out_BKXH, lse_BKGT1 = residuals
    rowsum_BKGT1 = jnp.sum(d_out_BKXH.astype(jnp.float32) * out_BKXH.astype(jnp.float32), axis=-1).reshape(
        lse_BKGT1.shape
    )
    return (
        *softmax_attention_grads(
            q_BKXH, k_BKSH, v_BKSH, mask_BTS, softcap, lse_BKGT1, rowsum_BKGT1, d_out_BKXH
        ),
        None,
    )


_attention.defvjp(_attention_fwd, _attention_bwd)


_offload_dots = jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
_offload_projections = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=(),
    names_which_can_be_offloaded=(PROJECTION, ATTENTION),
    offload_src="device",
    offload_dst="pinned_host",
)


@jax.custom_vjp
def take_rows(x, index, inverse):
    """Rows of x at `index` (an index equal to len(x) gives a row of zeros), where every row of x
    lands exactly once and `inverse` says where (an entry equal to the output's length: nowhere).
    Why: autodiff's transpose of a gather is a scatter-add, which XLA:CPU runs serially; with the
    inverse known, the backward pass is another gather."""
    return _with_zero_row(x)[index]


def _with_zero_row(x):
    return jnp.concatenate([x, jnp.zeros((1, *x.shape[1:]), x.dtype)])


def _take_rows_fwd(x, index, inverse):
    return take_rows(x, index, inverse), (index, inverse)


def _take_rows_bwd(residuals, g):
    index, inverse = residuals
    return _with_zero_row(g)[inverse], None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


class Slots(NamedTuple):
    """Where rows go for their experts' matmuls, static sizes: expert e's first
    `base` rows into e's own slots, one batched matmul of the experts' weights as they are; the rest
    into a pool of `blocks` blocks of `block` rows, each block one expert's, a batched matmul of the
    blocks' matrices gathered. Rows that find no place are dropped (Slots.fit says whether all
    find one).
    Why: XLA on CPU and GPU lowers jax.lax.ragged_dot to a dense matmul over every expert's matrix
    (E times the FLOPs; docs/models.md); these are batched matmuls of fixed shape."""

    base: int
    block: int
    blocks: int

    @staticmethod
    def blocks_for(rows: int, experts: int) -> Slots:
        """Pool blocks alone, room for any routing of `rows` rows: each expert's rows padded to whole
        blocks of b = rows / 2E (a sum over experts of ceil(size / b) is at most rows / b + E): 1.5 x
        the rows of work, whatever the routing."""
        b = max(8, -(-rows // (2 * experts)) // 8 * 8)
        return Slots(0, b, -(-rows // b) + experts)

    def fit(self, sizes_E):
        """Whether groups of these sizes all find places."""
        return jnp.sum(-(-jnp.maximum(sizes_E - self.base, 0) // self.block)) <= self.blocks


def slotting(expert_A, experts: int, slots: Slots):
    """(source_R, dest_A, group_J) for rows in any order, expert_A each row's expert (an id >= E: in
    no expert): the row each of the R = E x base + blocks x block places holds (A: none), the place
    of each row (R: none, when slots.fit fails) and each pool block's expert (E: none). An expert's
    rows take its places in their order. Nothing is sorted: a row's rank among its expert's rows is
    a running count, and the places' rows the inverse of the rows' places."""
    E, (base, b, J) = experts, slots
    A = expert_A.shape[0]
    in_expert_AE = expert_A[:, None] == jnp.arange(E)
    sizes_E = jnp.sum(in_expert_AE, axis=0)
    over_E = jnp.maximum(sizes_E - base, 0)  # rows past the expert's own slots, into the pool
    blocks_E = -(-over_E // b)
    first_block_E = jnp.cumsum(blocks_E) - blocks_E
    rows = E * base + J * b
    # each row's place: its expert's slot, or its block (a block past the pool: no place)
    e_A = jnp.minimum(expert_A, E - 1)
    rank_A = jnp.take_along_axis(jnp.cumsum(in_expert_AE, axis=0), e_A[:, None], axis=1)[:, 0] - 1
    dest_A = jnp.where(rank_A < base, e_A * base + rank_A, E * base + first_block_E[e_A] * b + rank_A - base)
    dest_A = jnp.where((expert_A < E) & (dest_A < rows), dest_A, rows)
    source_R = jnp.full(rows + 1, A, dest_A.dtype).at[dest_A].set(jnp.arange(A, dtype=dest_A.dtype))[:rows]
    # block j is the expert's whose blocks end past j
    group_J = jnp.sum(jnp.arange(J)[:, None] >= (first_block_E + blocks_E)[None, :], axis=1)
    group_J = jnp.where(jnp.arange(J) < jnp.sum(blocks_E), group_J, E)
    return source_R, dest_A, group_J


def slotted_matmul(x_RD, w_EDN, group_J, slots: Slots):
    """Each of slotting's places times its expert's matrix: the experts' slots [E, base] by one
    batched matmul, the pool's blocks [J, b] by another, of their matrices gathered. Over manual
    mesh axes, w must vary over those x does (jax.lax.pcast): the blocks' custom gradient has
    w's type."""
    E, D, N = w_EDN.shape
    base, b, J = slots
    parts = []
    if base:
        parts.append(jnp.einsum("ecd,edn->ecn", x_RD[: E * base].reshape(E, base, D), w_EDN).reshape(-1, N))
    if J:
        # autodiff sums the blocks' matrices' gradients back by a scatter-add, which a one-hot matmul
        # beats while it costs at most half the blocks' matmul, E <= b/2 (measured on CPU: 1.4x to
        # 1.7x faster at E = b/2 and b/8, 1.3x slower at E = b)
        w_JDN = _group_matrices(w_EDN, group_J, E) if 2 * E <= b else _gathered_matrices(w_EDN, group_J)
        parts.append(jnp.einsum("jbd,jdn->jbn", x_RD[E * base :].reshape(J, b, D), w_JDN).reshape(-1, N))
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def _gathered_matrices(w_EDN, group_J):
    """w_EDN[group_J] [J, D, N], zeros where group_J = E."""
    E = w_EDN.shape[0]
    return jnp.where((group_J < E)[:, None, None], w_EDN[jnp.minimum(group_J, E - 1)], 0)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _group_matrices(w_EDN, group_J, E: int):
    """_gathered_matrices (E: w's experts), whose gradient sums the J matrices' gradients into the E
    experts' by a one-hot matmul (J x E x D x N multiply-adds), not autodiff's scatter-add."""
    return _gathered_matrices(w_EDN, group_J)


def _group_matrices_fwd(w_EDN, group_J, E):
    return _gathered_matrices(w_EDN, group_J), group_J


def _group_matrices_bwd(E, group_J, g_JDN):
    return jnp.einsum("je,jdn->edn", jax.nn.one_hot(group_J, E, dtype=g_JDN.dtype), g_JDN), None


_group_matrices.defvjp(_group_matrices_fwd, _group_matrices_bwd)


def _offload_matmul_outputs(prim, *args, **params):
    """Offloads matmul outputs: dot_generals and the outputs named above."""
    policy = _offload_projections if prim.name == "name" else _offload_dots
    return policy(prim, *args, **params)


# What a layer keeps for its backward pass (training.remat); Remat.none: everything, no policy.
REMAT_POLICIES = {
    Remat.full: jax.checkpoint_policies.nothing_saveable,
    Remat.save_matmul_outputs: jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(PROJECTION, ATTENTION),
    ),
    Remat.offload_matmul_outputs: _offload_matmul_outputs,
}


def remat_policy(remat: Remat, quantized_base: bool):
    """training.remat's policy; None: no checkpoint. Over a quantized base, Remat.none keeps the
    matmul outputs (save_matmul_outputs): keeping everything would keep each dequantized layer, or
    a stack or transpose of it, for the backward pass, a dense copy of the whole base. No policy
    saves a value derived from the weights alone (none is a matmul output)."""
    if remat is Remat.none and quantized_base:
        return REMAT_POLICIES[Remat.save_matmul_outputs]
    return REMAT_POLICIES.get(remat)
