"""The GGUF block formats dequantized in JAX (tunix_train/model/quant.py) equal gguf-py's
`gguf.quants.dequantize` bit for bit, for every type a quantized base is read in, eagerly and
compiled."""

import gguf
import jax
import numpy as np
import pytest
from gguf import quants

from tunix_train.model import quant

Q = gguf.GGMLQuantizationType


def _blocks(qtype, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Raw blocks uint8 [rows, blocks, bytes]: gguf's own quantization where gguf-py has one
    (Q8_0, Q4_0, Q5_0), otherwise random bytes with finite float16 scales (as tests/gguf_files.py
    builds Q4_K), which cover every code and every 6-bit scale."""
    values, size = quant.block_shape(qtype)
    rng = np.random.default_rng(seed)
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q5_0):
        data = rng.normal(0, 0.05, (rows, blocks_per_row * values)).astype(np.float32)
        data[0, :values] = 0.0  # an all-zero block (scale 0)
        return quants.quantize(data, qtype).reshape(rows, blocks_per_row, size)
    raw = rng.integers(0, 256, (rows, blocks_per_row, size), dtype=np.uint8)

    def scale(n):
        return np.frombuffer(rng.uniform(1e-5, 1e-2, n).astype(np.float16).tobytes(), np.uint8).reshape(-1, 2)

    n = rows * blocks_per_row
    if qtype in (Q.Q4_K, Q.Q5_K):  # d, dmin first
        raw[..., 0:2] = scale(n).reshape(rows, blocks_per_row, 2)
        raw[..., 2:4] = scale(n).reshape(rows, blocks_per_row, 2)
    else:  # Q6_K: d last
        raw[..., 208:210] = scale(n).reshape(rows, blocks_per_row, 2)
    return raw


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_dequantization_equals_gguf_bit_for_bit(qtype):
    raw = _blocks(qtype, rows=6, blocks_per_row=3, seed=int(qtype))
    want = quants.dequantize(raw.reshape(raw.shape[0], -1), qtype)  # float32 [rows, values]
    eager = np.asarray(quant.dequantize(raw, qtype))
    compiled = np.asarray(jax.jit(quant.dequantize, static_argnums=1)(raw, qtype))
    assert want.dtype == eager.dtype == np.float32 and eager.shape == want.shape
    np.testing.assert_array_equal(eager.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(compiled.view(np.uint32), want.view(np.uint32))
    assert np.unique(want).size > 50  # the blocks exercise the codes


def test_a_type_without_a_reader_is_named():
    with pytest.raises(ValueError, match="GGUF type Q2_K is not one a quantized base is read in"):
        quant.dequantize(np.zeros((1, 84), np.uint8), Q.Q2_K)


def _nf4_numpy(x: np.ndarray, block: int = 64):
    """QLoRA's blockwise NF4, transcribed: absmax per block, each scaled value to its nearest level
    (ties to the lower), packed high nibble first."""
    code = np.array(quant.NF4_CODE, np.float32)
    blocks = x.astype(np.float32).reshape(-1, block)
    absmax = np.abs(blocks).max(axis=1)
    scaled = np.clip(
        blocks * (np.float32(1) / np.maximum(absmax, np.float32(1e-38)))[:, None], -1, 1
    ).reshape(-1)
    distance = np.abs(scaled[:, None] - code[None, :])
    q = np.argmin(distance, axis=1).astype(np.uint8)  # argmin takes the first (lower) level on a tie
    return (q[0::2] << 4) | q[1::2], absmax, code[q].reshape(-1, block) * absmax[:, None]


def test_nf4_equals_bitsandbytes_and_the_papers_algorithm():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 256)) * rng.uniform(0.01, 1.0, (6, 1))).astype(np.float32)
    x[0, :64] = 0.0  # a block of zeros
    codes, absmax = (np.asarray(a) for a in quant.quantize_nf4(x))
    back = np.asarray(quant.dequantize_nf4(codes, absmax))
    want_codes, want_absmax, want_back = _nf4_numpy(x)
    np.testing.assert_array_equal(codes.reshape(-1), want_codes)
    np.testing.assert_array_equal(absmax.reshape(-1), want_absmax)
    np.testing.assert_array_equal(back.reshape(-1), want_back.reshape(-1))
    assert np.abs(back - x).max() <= np.abs(x).max() * 0.16  # the widest gap between levels, halved
    torch = pytest.importorskip("torch")
    functional = pytest.importorskip("bitsandbytes.functional")
    packed, state = functional.quantize_4bit(torch.tensor(x), blocksize=64, quant_type="nf4")
    np.testing.assert_array_equal(codes.reshape(-1), packed.numpy().reshape(-1))
    np.testing.assert_array_equal(absmax.reshape(-1), state.absmax.numpy())
    np.testing.assert_array_equal(back, functional.dequantize_4bit(packed, state).numpy())


def test_int8_per_channel_round_trip():
    rng = np.random.default_rng(1)
    x = rng.normal(0, 0.1, (64, 48)).astype(np.float32)
    x[:, 3] = 0.0  # a channel of zeros
    q, scale = quant.quantize_int8(x, reduced=(0,))  # [in, out]: per output channel
    want_scale = np.abs(x).max(axis=0, keepdims=True) / np.float32(127)
    want_q = np.clip(np.round(x / np.where(want_scale == 0, 1, want_scale)), -127, 127).astype(np.int8)
    np.testing.assert_array_equal(np.asarray(q), want_q)
    np.testing.assert_array_equal(np.asarray(scale), want_scale)
    back = np.asarray(quant.dequantize_int8(q, scale))
    np.testing.assert_array_equal(back, want_q.astype(np.float32) * want_scale)
    assert np.all(np.abs(back - x) <= want_scale / 2 + 1e-9)
