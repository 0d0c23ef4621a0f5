"""GGUF import (llama.cpp, Ollama, LM Studio files) of every registered family with GGUF
conventions (families.Family.gguf: Gemma 1-3's in interop/gguf_gemma.py; Llama 3, Mistral, Qwen 2.5
/ 3, Qwen 3 MoE and Phi-3's in interop/gguf_llama.py).

The `gguf` package (llama.cpp's own reader) parses the file and dequantizes every type it knows
(gguf.quants.dequantize); nothing here decodes a quantization format. transformers' GGUF loader
(integrations/ggml.py, modeling_gguf_pytorch_utils.py) is the reference for each convention:

- tensor names: llama.cpp's (token_embd, blk.N.attn_q, ..., output_norm), mapped to transformers'
  by gguf's own TensorNameMap, then to ours by interop.hf's table;
- layouts: a dequantized tensor has transformers' [out, in] layout already; the Q and K rows of
  the families whose conventions interleave them (Llama's permute) are put back; fused tensors
  (Phi-3's attn_qkv, ffn_up) are read as the family fuses them (Family.fused);
- RMSNorm weights: llama.cpp stores Gemma's as 1 + w; w is restored by subtracting 1;
- metadata the file leaves out takes the values the family's conventions give.

Dequantized tensors go straight into their shardings: each device's block is cut from one
dequantized tensor, and only the tensors of one parameter (all its layers) are held at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from tunix_train.config import ConfigError, ModelConfig, field_of
from tunix_train.interop import families, gguf_llama, hf, tensor_names
from tunix_train.interop.families import GgufFile
from tunix_train.model import quant
from tunix_train.model.lora import INPUT_DIMS

log = logging.getLogger("tunix_train")

ARCHITECTURES = tuple(families.gguf_architectures())  # what the registered families write
_VISION_PREFIXES = ("v.", "mm.")  # a multimodal file's vision tower and projector: not read


def open_gguf(path: str | Path):
    """gguf.GGUFReader over `path`, or a one-line ConfigError naming the file. The last file's
    reader is kept: loading opens it for the config, the weights and the tokenizer, and the reader
    parses every metadata field in Python (a 262,144-token vocabulary: about 10 s) when it opens."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"{path}: no such GGUF file")
    stat = path.stat()
    return _reader(path.resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=1)
def _reader(path: Path, mtime_ns: int, size: int):
    """The reader of one version of a file (its modification time and size in the key)."""
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as err:  # a truncated or foreign file fails in many ways inside the reader
        reason = " ".join(str(err).split()) or type(err).__name__
        raise ConfigError(f"{path}: not a readable GGUF file ({reason}); is it complete?") from None


def _field(reader, key: str, default: Any = None) -> Any:
    """A metadata value; float32 ones as the shortest decimal that rounds to them (1e-06, not
    9.99999997e-07), as the converter wrote them from the original config."""
    field = reader.get_field(key)
    if field is None:
        return default
    value = field.contents()
    return float(str(np.float32(value))) if isinstance(value, float) else value


def gguf_file(reader, path: Path) -> GgufFile:
    """The file as families' GGUF conventions read it, or a one-line error for an architecture no
    registered family writes."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"{path}: a GGUF of architecture {arch!r}; tunix_train reads {', '.join(ARCHITECTURES)}"
        )
    return GgufFile(
        arch,
        functools.partial(_field, reader),
        frozenset(t.name for t in reader.tensors),
        lambda name: tuple(int(n) for n in _tensor(reader, name, path).shape),
        lambda name: _tensor(reader, name, path).data,
        path,
    )


def model_fields(reader, path: Path) -> dict[str, Any]:
    """ModelConfig fields from the file's metadata ({arch}.* keys) and its tensors' shapes, checked
    against each other first."""
    file = gguf_file(reader, path)
    layers, embed, heads = (
        file.key("block_count"),
        file.key("embedding_length"),
        file.key("attention.head_count"),
    )
    if None in (layers, embed, heads, file.key("feed_forward_length")):
        raise ConfigError(
            f"{path}: the GGUF metadata lacks {file.architecture}.block_count, embedding_length, "
            f"feed_forward_length or attention.head_count"
        )
    family = families.of_gguf(file)
    _check_sizes(file, family.gguf.stacked_experts)
    return {"family": family.name, **family.gguf.fields(file), **family.fixed}


def interleaved_heads(hf_name: str, cfg: ModelConfig) -> int | None:
    """The heads a Q or K tensor is permuted over in the file (llama.cpp's Llama permute), for a
    family whose conventions interleave them; None otherwise."""
    conventions = families.named(cfg.family).gguf
    return gguf_llama.qk_heads(hf_name, cfg) if conventions and conventions.qk_interleaved else None


def _check_sizes(file: GgufFile, stacked_experts: bool) -> None:
    """The sizes the metadata declares, held against the tensors the file holds (GGML order: [in,
    out]) before anything is built from them: a file cannot ask for a model larger than itself.
    Fused tensors (attn_qkv: q, k and v rows; a gate-less ffn_up: gate and up rows) hold their
    parts' sums."""
    key, shape, names = file.key, file.shape, file.names
    heads, embed = key("attention.head_count"), key("embedding_length")
    head_dim, kv_heads = key("attention.key_length", embed // heads), key("attention.head_count_kv", heads)
    gate = "blk.0.ffn_gate_exps.weight" if stacked_experts else "blk.0.ffn_gate.weight"
    checks = [  # (what the metadata says, its value, what the tensors hold)
        ("block_count", key("block_count"), len({n.split(".")[1] for n in names if n.startswith("blk.")})),
        ("embedding_length", embed, shape("token_embd.weight")[0]),
        (
            "feed_forward_length",
            key("expert_feed_forward_length") if stacked_experts else key("feed_forward_length"),
            shape(gate)[1] if gate in names else shape("blk.0.ffn_up.weight")[1] // 2,
        ),
    ]
    if "blk.0.attn_qkv.weight" in names:
        checks.append(
            (
                "attention.head_count + 2 head_count_kv x key_length",
                (heads + 2 * kv_heads) * head_dim,
                shape("blk.0.attn_qkv.weight")[-1],
            )
        )
    else:
        checks += [
            ("attention.head_count x key_length", heads * head_dim, shape("blk.0.attn_q.weight")[-1]),
            ("attention.head_count_kv x key_length", kv_heads * head_dim, shape("blk.0.attn_k.weight")[-1]),
        ]
    for name, said, held in checks:
        if said != held:
            raise ConfigError(
                f"{file.path}: its metadata says {name}={said} but its tensors hold {held}: the file is "
                f"damaged or was not written for this architecture"
            )


def _tensor(reader, name: str, path: Path):
    for tensor in reader.tensors:
        if tensor.name == name:
            return tensor
    raise ConfigError(f"{path}: the GGUF has no tensor {name}")


def first_difference(cfg: ModelConfig, fields: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """(key, ours, the file's) of the first model field that differs from the file's, or None."""
    for key, value in fields.items():
        ours = field_of(cfg, key)
        if key == "context_length" or (
            key == "query_pre_attn_scalar" and (ours or cfg.head_dim) == (value or cfg.head_dim)
        ):
            continue
        if ours != value:
            return key, ours, value
    return None


def check_matches(cfg: ModelConfig, fields: dict[str, Any], path: Path) -> None:
    """A one-line ConfigError naming the first model field that differs from the file's."""
    if differs := first_difference(cfg, fields):
        key, ours, value = differs
        raise ConfigError(
            f"model.init_from: {path} has {key}={value!r} but model.{key}={ours!r}; "
            f"use the matching model config or set model.{key}={value!r}"
        )


def gguf_name(names, hf_name: str) -> str | None:
    """llama.cpp's name of a transformers tensor; one named without a suffix (transformers' fused
    experts) as its .weight."""
    if not hf_name.endswith((".weight", ".bias")):
        hf_name += ".weight"
    return names.get_name(hf_name, try_suffixes=(".weight", ".bias"))


class _GGUFTensors:
    """The file's text tensors under transformers' names and in its layouts, dequantized to float32:
    the norms' offset taken off (Gemma's 1 + w), Llama's Q and K rows un-permuted, the experts' gate
    and up stacked as transformers' gate_up_proj; `hf.load_params_from` reads them block by block."""

    def __init__(self, reader, path: Path, cfg: ModelConfig):
        import gguf

        self.path, self.cfg = path, cfg
        self._names = gguf.get_tensor_name_map(
            gguf.MODEL_ARCH[gguf_file(reader, path).architecture.upper()], cfg.num_layers
        )
        self._by_name = {t.name: t for t in reader.tensors if not t.name.startswith(_VISION_PREFIXES)}
        skipped = len(reader.tensors) - len(self._by_name)
        if skipped:
            log.info(f"{path.name}: {skipped} vision-tower tensors ignored (text weights only)")
        # One parameter's tensors (all its layers) at a time: each device's block is cut from them.
        self._whole = functools.lru_cache(maxsize=cfg.num_layers + 1)(self._read_whole)

    def _gguf_name(self, hf_name: str) -> str | None:
        return gguf_name(self._names, hf_name)

    def _parts(self, hf_name: str) -> list[str | None]:
        """The GGUF tensors one transformers tensor is read from (the experts' gate_up_proj: two)."""
        if hf_name.endswith("mlp.experts.gate_up_proj"):
            base = hf_name.removesuffix("gate_up_proj")
            return [self._gguf_name(base + "gate_proj"), self._gguf_name(base + "up_proj")]
        return [self._gguf_name(hf_name)]

    def has(self, hf_name: str) -> bool:
        return all(name in self._by_name for name in self._parts(hf_name))

    def _dequantize(self, name: str) -> np.ndarray:
        from gguf import quants

        tensor = self._by_name[name]
        try:
            weights = quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise ConfigError(
                f"{self.path}: tensor {name} has type {tensor.tensor_type.name}, which "
                f"gguf.quants cannot dequantize"
            ) from None
        weights = weights.astype(np.float32, copy=False)
        return weights - np.float32(self.cfg.norm_weight_offset) if name.endswith("norm.weight") else weights

    def _read_whole(self, hf_name: str) -> np.ndarray:
        parts = [self._dequantize(name) for name in self._parts(hf_name)]
        weights = np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        heads = interleaved_heads(hf_name, self.cfg)
        return weights if heads is None else gguf_llama.unpermute_qk(weights, heads)

    def read(self, hf_name: str, slices: list[slice]) -> np.ndarray:
        return self._whole(hf_name)[tuple(slices)]


def load_params(
    path: str | Path, cfg: ModelConfig, abstract_params: nnx.State, by_layer: hf.ByLayer | None = None
) -> nnx.State:
    """Parameters in the shapes and shardings of `abstract_params`, from a GGUF file whose model
    matches `cfg`: dequantized, or, where `abstract_params` holds a quantized weight (a LoRA run's
    base_quantization=gguf), the file's own blocks; by_layer: as in hf.load_params_from."""
    path = Path(path).expanduser()
    reader = open_gguf(path)
    check_matches(cfg, model_fields(reader, path), path)
    tensors = _GGUFTensors(reader, path, cfg)
    flat = nnx.to_flat_state(abstract_params)
    blocks = [(p, v) for p, v in flat if quant.is_quantized(v.get_value())]
    quantized = {p for p, _ in blocks}
    dense = hf.load_params_from(
        tensors,
        cfg,
        nnx.from_flat_state([(p, v) for p, v in flat if p not in quantized]),
        str(path),
        by_layer,
    )
    if not blocks:
        return dense
    return nnx.merge_state(
        dense,
        nnx.from_flat_state(
            [(p, v.replace(_blocks(tensors, ".".join(p), v.get_value(), cfg))) for p, v in blocks]
        ),
    )


# the projections a quantized base holds (model/lora.py's table), by their paths in tensor_names.py's
_PROJECTIONS = tuple(
    path for path in tensor_names.SPECS if path.startswith("layers.") and path.split(".")[-1] in INPUT_DIMS
)


def _projection_names(tensors: _GGUFTensors, spec: str, cfg: ModelConfig) -> list[str]:
    return [tensors._gguf_name(tensor_names.hf_name(spec, layer, cfg)) for layer in range(cfg.num_layers)]


def projection_types(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], tuple]]:
    """For a base held in model.init_from's own blocks: each projection (our path), the GGML type
    of its tensor in each layer, and its layout (quant.Quantized.layout); a one-line error for a
    type the step cannot dequantize."""
    if not str(cfg.init_from or "").endswith(".gguf"):
        raise ConfigError(
            "training.lora.base_quantization=gguf trains on a GGUF file's blocks: set "
            f"model.init_from to a .gguf file (it is {cfg.init_from!r})"
        )
    path = Path(cfg.init_from).expanduser()
    reader = open_gguf(path)
    check_matches(cfg, model_fields(reader, path), path)
    tensors = _GGUFTensors(reader, path, cfg)
    found = []
    for spec in _PROJECTIONS:
        if spec.startswith("layers.mlp.") and not cfg.moe.dense_mlp:
            continue  # the experts take the MLP's place, dequantized
        types = []
        for name in _projection_names(tensors, spec, cfg):
            qtype = tensors._by_name[name].tensor_type
            if qtype not in quant.DEQUANTIZE:
                raise ConfigError(
                    f"{path}: tensor {name} has type {qtype.name}, which a gguf base does not read "
                    f"in the step (it reads {', '.join(t.name for t in quant.DEQUANTIZE)}); use "
                    f"training.lora.base_quantization=none, int8 or nf4"
                )
            types.append(int(qtype))
        split, perm = tensor_names.split_view(spec, cfg, None)
        found.append((spec, tuple(types), (split[0], split[1], perm)))
    return found


def _blocks(tensors: _GGUFTensors, spec: str, q, cfg: ModelConfig):
    """A quantized projection (ShapeDtypeStructs with shardings) filled from the file: each layer's
    rows, padded to the widest, and the index of its type."""
    import jax

    names = _projection_names(tensors, spec, cfg)
    width = q.data.shape[-1]
    heads = interleaved_heads(tensor_names.hf_name(spec, 0, cfg), cfg)  # Llama's Q and K: rows un-permuted

    def rows(name: str, row_slice: slice, byte_slice: slice) -> np.ndarray:
        """One device's rows of one layer's tensor (read from the file's map: only those), padded."""
        raw = np.asarray(tensors._by_name[name].data)
        raw = raw.view(np.uint8).reshape(raw.shape[0], -1)  # F16 and F32 rows as their bytes too
        if heads is not None:
            row_slice = gguf_llama.unpermute_qk(np.arange(raw.shape[0]), heads)[row_slice]
        raw = raw[row_slice]
        return np.pad(raw, ((0, 0), (0, width - raw.shape[1])))[:, byte_slice]

    def data(index):
        return np.stack([rows(names[r], *index[1:]) for r in range(*index[0].indices(len(names)))])

    types = np.array([q.qtypes.index(int(tensors._by_name[n].tensor_type)) for n in names], np.int32)
    return dataclasses.replace(
        q,
        data=jax.make_array_from_callback(q.data.shape, q.data.sharding, data),
        scale=jax.make_array_from_callback(q.scale.shape, q.scale.sharding, lambda i: types[i]),
    )
