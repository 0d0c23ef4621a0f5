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
    scale = lambda n: np.frombuffer(rng.uniform(1e-5, 1e-2, n).astype(np.float16).tobytes(), np.uint8).reshape(-1, 2)
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
