"""Quantized weights, dequantized inside the compiled program (issue 41's frozen base).

NF4 (Dettmers et al. 2023, QLoRA): blocks of 64 values scaled by their absolute maximum (float32,
not quantized again: no double quantization) onto the 16-level NormalFloat code book, each value
its nearest level (a value on a midpoint goes down, as bitsandbytes' `quantize_4bit` bucketizes),
two to a byte, the first in the high half; int8: per output channel, the channel's absolute
maximum / 127, values rounded half to even. Both are equal to bitsandbytes' and to a numpy
transcription (tests/test_quant.py).

The GGUF block formats (llama.cpp's ggml-quants.c; gguf-py's `gguf.quants`) as JAX functions from a
tensor's raw blocks, uint8 [..., blocks, bytes per block], to float32 [..., blocks x block size]:
Q8_0, Q4_0, Q5_0 (blocks of 32) and the K-quants Q4_K, Q5_K, Q6_K (super-blocks of 256), each the
same arithmetic as `gguf.quants.dequantize` in the same order, so the values are equal bit for bit
(tests/test_quant.py). They are written here because neither qwix nor any JAX library reads
ggml's blocks; a tensor keeps its own type (a Q4_K_M file mixes Q4_K, Q6_K and F16/F32).

`Quantized` is a frozen weight held in one of these formats inside the model's parameters: reading
it (`w[...]`) dequantizes it to its compute dtype, inside the layer scan, so one layer is dense at a
time, and the backward pass dequantizes it again rather than keep it (kernels.remat_policy). qwix
(Tunix's QLoRA) quantizes by intercepting a module's dot_generals; our layers are scanned stacks of
nnx.Params read by einsums, so the weight itself carries its format.

Each block's bytes are read little-endian, as gguf-py's `ndarray.view` reads them on the hosts we
run on (x86-64, aarch64, and the GPUs'/TPUs' hosts are all little-endian).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import numpy as np

from tunix_train.sharding import LOGICAL_RULES, constrain

Q = gguf.GGMLQuantizationType
QK_K = 256


def _f16(two_bytes: jax.Array) -> jax.Array:
    """uint8 [..., 2] (little-endian float16) -> float32 [..., 1]."""
    return jax.lax.bitcast_convert_type(two_bytes, jnp.float16).astype(jnp.float32)[..., None]


def _nibbles(qs: jax.Array, groups: int, width: int) -> jax.Array:
    """Low then high 4 bits of [..., groups * width] bytes, as [..., groups, 2, width]."""
    qs = qs.reshape(*qs.shape[:-1], groups, 1, width)
    return (qs >> jnp.array([0, 4], jnp.uint8).reshape(2, 1)) & jnp.uint8(0x0F)


def _q8_0(b):
    return b[..., 2:].view(jnp.int8).astype(jnp.float32) * _f16(b[..., 0:2])


def _q4_0(b):
    qs = _nibbles(b[..., 2:], 1, 16).reshape(*b.shape[:-1], 32).astype(jnp.int8) - jnp.int8(8)
    return _f16(b[..., 0:2]) * qs.astype(jnp.float32)


def _q5_0(b):
    qh = jax.lax.bitcast_convert_type(b[..., 2:6], jnp.uint32)[..., None] >> jnp.arange(32, dtype=jnp.uint32)
    ql = _nibbles(b[..., 6:], 1, 16).reshape(*b.shape[:-1], 32)
    qs = (ql | ((qh & jnp.uint32(1)).astype(jnp.uint8) << jnp.uint8(4))).astype(jnp.int8) - jnp.int8(16)
    return _f16(b[..., 0:2]) * qs.astype(jnp.float32)


def _k_scales(scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Q4_K's and Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit minimums (gguf's get_scale_min)."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    d, m, m_d = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = jnp.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _scaled_minus_min(b, q):
    """Q4_K and Q5_K: d * scale * q - dmin * min, per sub-block of 32."""
    sc, mn = _k_scales(b[..., 4:16])
    d = (_f16(b[..., 0:2]) * sc.astype(jnp.float32))[..., None]
    dm = (_f16(b[..., 2:4]) * mn.astype(jnp.float32))[..., None]
    # d * q first, then - dm, each rounded as numpy rounds it (no fused multiply-add)
    scaled = jax.lax.optimization_barrier(d * q)
    return (scaled - dm).reshape(*b.shape[:-1], QK_K)


def _q4_k(b):
    q = _nibbles(b[..., 16:], 4, 32).reshape(*b.shape[:-1], 8, 32).astype(jnp.float32)
    return _scaled_minus_min(b, q)


def _q5_k(b):
    qh = b[..., 16:48].reshape(*b.shape[:-1], 1, 1, 32) >> jnp.arange(8, dtype=jnp.uint8).reshape(8, 1)
    ql = _nibbles(b[..., 48:], 4, 32).reshape(*b.shape[:-1], 8, 32)
    q = (ql | ((qh.reshape(*b.shape[:-1], 8, 32) & jnp.uint8(1)) << jnp.uint8(4))).astype(jnp.float32)
    return _scaled_minus_min(b, q)


def _q6_k(b):
    lead = b.shape[:-1]
    ql, qh = b[..., :128], b[..., 128:192]
    scales = b[..., 192:208].view(jnp.int8).astype(jnp.float32)
    d = (_f16(b[..., 208:210]) * scales).reshape(*lead, 16, 1)
    ql = _nibbles(ql, 2, 64).reshape(*lead, 8, 32)
    qh = (qh.reshape(*lead, 2, 1, 32) >> jnp.array([0, 2, 4, 6], jnp.uint8).reshape(4, 1)) & jnp.uint8(3)
    q = (ql | (qh.reshape(*lead, 8, 32) << jnp.uint8(4))).astype(jnp.int8) - jnp.int8(32)
    return (d * q.reshape(*lead, 16, 16).astype(jnp.float32)).reshape(*lead, QK_K)


# QLoRA's NormalFloat levels (bitsandbytes' table; the paper's appendix E).
NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
NF4_BLOCK = 64
_NF4_MIDPOINTS = [
    float((np.float32(a) + np.float32(b)) / np.float32(2)) for a, b in zip(NF4_CODE, NF4_CODE[1:])
]


def quantize_nf4(x: jax.Array, block: int = NF4_BLOCK) -> tuple[jax.Array, jax.Array]:
    """float [..., n] (n a multiple of 2 x block) -> (codes uint8 [..., n / 2], absmax float32 [..., n /
    block])."""
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, block)
    absmax = jnp.max(jnp.abs(blocks), axis=-1)
    # a block of zeros scales by 0 (bitsandbytes' 1 / max(absmax, 1e-38): a denormal, flushed to zero here)
    inverse = jnp.where(absmax > 0, 1.0 / jnp.where(absmax > 0, absmax, 1.0), 0.0)
    scaled = jnp.clip(blocks * inverse[..., None], -1, 1)
    # each value's code: how many midpoints between codes lie below it (searchsorted's side="left"),
    # counted in one fused loop in uint8 (searchsorted's int32 indices cost 4 bytes a value)
    q = sum((scaled > m).astype(jnp.uint8) for m in _NF4_MIDPOINTS)
    q = q.reshape(*x.shape[:-1], -1, 2)
    return (q[..., 0] << 4) | q[..., 1], absmax


def dequantize_nf4(codes: jax.Array, absmax: jax.Array) -> jax.Array:
    """The inverse of quantize_nf4 up to the levels: float32 [..., n]."""
    code = jnp.asarray(NF4_CODE, jnp.float32)
    q = jnp.stack([codes >> 4, codes & jnp.uint8(0x0F)], axis=-1).reshape(*absmax.shape, -1)
    return (code[q] * absmax[..., None]).reshape(*codes.shape[:-1], -1)


def quantize_int8(x: jax.Array, reduced: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """Per channel: each channel's absolute maximum over the axes `reduced` (its inputs) / 127, kept
    as size-1 axes -> (int8, float32 scales)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=reduced, keepdims=True) / 127.0
    q = jnp.round(x / jnp.where(scale == 0, 1.0, scale))
    return jnp.clip(q, -127, 127).astype(jnp.int8), scale


def dequantize_int8(q: jax.Array, scale: jax.Array) -> jax.Array:
    return q.astype(jnp.float32) * scale


def _float(dtype):
    """F32, F16, BF16: each value its own block of its bytes."""
    return lambda b: jax.lax.bitcast_convert_type(b, dtype).astype(jnp.float32)[..., None]


DEQUANTIZE = {
    Q.Q8_0: _q8_0,
    Q.Q4_0: _q4_0,
    Q.Q5_0: _q5_0,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
    Q.F32: _float(jnp.float32),
    Q.F16: _float(jnp.float16),
    Q.BF16: _float(jnp.bfloat16),
}


def block_shape(qtype: Q) -> tuple[int, int]:
    """(values, bytes) of one block of `qtype`."""
    return gguf.GGML_QUANT_SIZES[qtype]


def row_bytes(qtype: Q, values: int) -> int:
    """The bytes of a row of `values` values in `qtype`."""
    per_block, nbytes = block_shape(qtype)
    return values // per_block * nbytes


def dequantize(blocks: jax.Array, qtype: Q) -> jax.Array:
    """A tensor's raw blocks uint8 [..., blocks, bytes per block] -> float32 [..., blocks x block size]."""
    if qtype not in DEQUANTIZE:
        raise ValueError(
            f"GGUF type {qtype.name} is not one a quantized base is read in; "
            f"types: {', '.join(t.name for t in DEQUANTIZE)}"
        )
    values = DEQUANTIZE[qtype](blocks)
    return values.reshape(*blocks.shape[:-2], -1)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["data", "scale"],
    meta_fields=["kind", "axis", "dtype", "qtypes", "layout"],
)
@dataclasses.dataclass(frozen=True)
class Quantized:
    """A frozen weight held quantized. nf4: `data` the codes, two per byte along `axis`, `scale`
    each block's absmax (the weight's shape with `axis` divided by 2 and by 64); int8: `data` the
    int8 values, `scale` per output channel (1 along the input dimensions); both arrays have the
    weight's rank, so they shard along its axes. gguf: `data` a GGUF tensor's rows [layers, out,
    bytes] (transformers' [out, in], blocks along `in`), each layer in its own type, qtypes[scale],
    and padded to the widest; `layout` (out sizes, in sizes, permutation) leads from its [out, in]
    to ours, as interop/hf.py's table does. `w[...]` is the weight, dequantized to `dtype`."""

    data: Any
    scale: Any
    kind: str  # "nf4" | "int8" | "gguf"
    axis: int  # nf4: the blocks' axis, counted from the end (a stacked layers axis leaves it in place)
    dtype: Any  # of the dequantized weight
    qtypes: tuple = ()  # gguf: the GGML types (ints) of its layers
    layout: tuple = ()  # gguf: ((out sizes), (in sizes), permutation of them to our layout)

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.data.shape)
        if self.kind == "gguf":
            out, in_, perm = self.layout
            split = (*out, *in_)
            return (*shape[:-2], *(split[p] for p in perm))
        if self.kind == "nf4":
            shape[self.axis] *= 2
        return tuple(shape)

    def dequantized(self) -> jax.Array:
        if self.kind == "gguf":
            return self._gguf().astype(self.dtype)
        if self.kind == "int8":
            return dequantize_int8(self.data, self.scale).astype(self.dtype)
        codes, absmax = (jnp.moveaxis(x, self.axis, -1) for x in (self.data, self.scale))
        return jnp.moveaxis(dequantize_nf4(codes, absmax), -1, self.axis).astype(self.dtype)

    def _gguf(self) -> jax.Array:
        """Each layer's rows in its own type (one branch per type; a layer's index picks it), then
        reshaped and transposed from [out, in] to our layout."""
        out, in_, perm = self.layout
        width = math.prod(in_)

        def rows(qtype):
            qtype, nbytes = Q(qtype), block_shape(Q(qtype))[1]
            return lambda data: dequantize(
                data[..., : row_bytes(qtype, width)].reshape(*data.shape[:-1], -1, nbytes), qtype
            )

        branches = [rows(q) for q in self.qtypes]

        def one(data, index):  # a layer's rows, in its type qtypes[index]
            return branches[0](data) if len(branches) == 1 else jax.lax.switch(index, branches, data)

        for _ in range(self.scale.ndim):  # a stack of layers (outside the scan): each its own
            one = jax.vmap(one)
        # gathered whole before it is dequantized: the layer's blocks (its rows split over tp and
        # fsdp) travel quantized, and no split of [out, in] need map onto our layout's
        w = one(constrain(self.data, (None,) * self.data.ndim, LOGICAL_RULES), self.scale)
        lead = w.ndim - 2
        w = w.reshape(*w.shape[:lead], *out, *in_)
        return w.transpose(*range(lead), *(lead + p for p in perm))

    def array_axes(self, weight_axes: tuple) -> Quantized:
        """The logical axes of `data` and of `scale`, given the weight's: the weight's own (a
        per-channel scale's size-1 input dimensions unsplit); gguf's rows split over every axis
        that splits a weight (gguf_rows), its blocks never."""
        if self.kind == "gguf":
            return dataclasses.replace(
                self, data=(weight_axes[0], "gguf_rows", None), scale=(weight_axes[0],)
            )

        def unsplit(x):
            return tuple(None if n == 1 else a for a, n in zip(weight_axes, x.shape))

        return dataclasses.replace(self, data=unsplit(self.data), scale=unsplit(self.scale))

    def __getitem__(self, index):
        if index is not Ellipsis:
            raise IndexError("a quantized weight is read whole: w[...]")
        return self.dequantized()

    def astype(self, dtype) -> Quantized:
        """The same codes, dequantized to `dtype` where they are read."""
        return dataclasses.replace(self, dtype=jnp.dtype(dtype))


def quantize(x: jax.Array, kind: str, input_dims: tuple[int, ...], block_axis: int) -> Quantized:
    """x as `kind`: int8 per output channel (the maximum over `input_dims`); nf4 in blocks of 64 along
    `block_axis` (negative)."""
    if kind == "int8":
        return Quantized(*quantize_int8(x, input_dims), kind, -1, x.dtype)
    codes, absmax = quantize_nf4(jnp.moveaxis(x, block_axis, -1))
    return Quantized(
        jnp.moveaxis(codes, -1, block_axis), jnp.moveaxis(absmax, -1, block_axis), kind, block_axis, x.dtype
    )


def is_quantized(x: Any) -> bool:
    return isinstance(x, Quantized)


def cast(tree: Any, dtype) -> Any:
    """Every array of `tree` as `dtype`, and every quantized weight dequantized to it."""
    return jax.tree.map(lambda x: x.astype(dtype), tree, is_leaf=is_quantized)


def retyped(shardings: Any, dtype) -> Any:
    """Shardings shaped as cast(tree, dtype) is: each quantized weight's dtype (static, part of the
    tree's structure) set to dtype, its shardings unchanged."""
    return jax.tree.map(lambda x: x.astype(dtype) if is_quantized(x) else x, shardings, is_leaf=is_quantized)


def dense(tree: Any) -> Any:
    """`tree` with every quantized weight dequantized."""
    return jax.tree.map(lambda x: x.dequantized() if is_quantized(x) else x, tree, is_leaf=is_quantized)
