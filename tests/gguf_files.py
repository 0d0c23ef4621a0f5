"""Tiny GGUF files for the tests, written with gguf.GGUFWriter the way llama.cpp's converter writes
Gemma: llama.cpp tensor names (gguf's TensorNameMap), RMSNorm weights stored as 1 + w, the
{arch}.* metadata. Tensors come as transformers-named float32 arrays (a transformers model's state
dict, or tunix_train's export layout)."""

from pathlib import Path

import gguf
import numpy as np
from gguf import quants

ARCH = {"gemma": gguf.MODEL_ARCH.GEMMA, "gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3}
Q = gguf.GGMLQuantizationType


def q4_k_bytes(shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """A Q4_K tensor of `shape` (rows of a multiple of 256): random 4-bit codes and 6-bit scales
    under small fixed block scales. gguf's Python side cannot quantize K-quants, so the bytes are
    made directly; both readers dequantize them with gguf.quants.dequantize."""
    rows, cols = shape
    block = np.random.default_rng(seed).integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    block[..., 0:2] = np.frombuffer(np.float16(2e-4).tobytes(), np.uint8)  # d
    block[..., 2:4] = np.frombuffer(np.float16(1e-4).tobytes(), np.uint8)  # dmin
    return block.reshape(rows, cols // 256 * 144)


def write(
    path: Path,
    family: str,
    hf_config: dict,
    tensors: dict[str, np.ndarray],
    types=None,
    metadata: dict | None = None,
    extra: dict[str, np.ndarray] | None = None,
) -> Path:
    """`types(gguf_name, array) -> GGMLQuantizationType` picks each tensor's type (default F32);
    `metadata` adds or overrides {arch}.* keys (value None removes one); `extra`: more float32
    tensors under their GGUF names (a vision tower's, say)."""
    arch = gguf.MODEL_ARCH_NAMES[ARCH[family]]
    writer = gguf.GGUFWriter(str(path), arch)
    c = hf_config
    keys = {
        "block_count": c["num_hidden_layers"],
        "context_length": c.get("max_position_embeddings", 8192),
        "embedding_length": c["hidden_size"],
        "feed_forward_length": c["intermediate_size"],
        "attention.head_count": c["num_attention_heads"],
        "attention.head_count_kv": c["num_key_value_heads"],
        "attention.key_length": c["head_dim"],
        "attention.value_length": c["head_dim"],
        "attention.layer_norm_rms_epsilon": c.get("rms_norm_eps", 1e-6),
        "vocab_size": c["vocab_size"],
    }
    if family != "gemma":
        keys["attention.sliding_window"] = c["sliding_window"]
    for key, value in {**keys, **(metadata or {})}.items():
        if value is None:
            continue
        if isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        elif isinstance(value, str):
            writer.add_string(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", int(value))
    names = gguf.get_tensor_name_map(ARCH[family], c["num_hidden_layers"])
    for hf_name, array in tensors.items():
        if hf_name == "lm_head.weight":
            continue  # tied to the embedding
        name = names.get_name(hf_name, try_suffixes=(".weight",))
        array = np.asarray(array, np.float32)
        if name.endswith("norm.weight"):
            array = array + 1.0
        kind = types(name, array) if types else Q.F32
        if kind == Q.Q4_K:
            writer.add_tensor(name, q4_k_bytes(array.shape), raw_dtype=Q.Q4_K)
        elif kind == Q.F32:
            writer.add_tensor(name, array)
        else:
            try:
                data = quants.quantize(array, kind)
            except NotImplementedError:  # a type gguf cannot write (nor read): zero bytes of its size
                block, size = gguf.GGML_QUANT_SIZES[kind]
                data = np.zeros((array.shape[0], array.shape[1] // block * size), np.uint8)
            writer.add_tensor(name, data, raw_dtype=kind)
    for name, array in (extra or {}).items():
        writer.add_tensor(name, np.asarray(array, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def mixed_types(name: str, array: np.ndarray):
    """Like a Q4_K_M file, several types in one: F16 embedding, Q8_0 attention, Q4_K where rows
    allow (ffn_down), Q5_0 and Q4_0 for the other MLP matrices, F32 norms."""
    if array.ndim == 1:
        return Q.F32
    if name == "token_embd.weight":
        return Q.F16
    if "ffn_down" in name and array.shape[1] % 256 == 0:
        return Q.Q4_K
    if "ffn_gate" in name:
        return Q.Q5_0
    if "ffn_up" in name:
        return Q.Q4_0
    return Q.Q8_0
