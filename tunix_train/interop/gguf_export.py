"""GGUF export: a model of any family with GGUF conventions (families.Family.gguf) as llama.cpp's
convert_hf_to_gguf.py writes one: Gemma, Gemma 2 and Gemma 3 (interop/gguf_gemma.py); Llama 3,
Mistral, Qwen 2.5, Qwen 3, Qwen 3 MoE and Phi-3 with the differences interop/gguf_llama.py holds
(their metadata, Llama's permuted Q and K, stacked experts, llama3's rope_freqs, norms as they
are) and a byte-level BPE vocabulary where the tokenizer has one (data/byte_bpe.py).

What is written, as the converter's Gemma models write it:
- metadata: general.architecture (gemma, gemma2, gemma3) and name, file_type; {arch}.context_length,
  embedding_length, block_count, feed_forward_length, attention.head_count, head_count_kv,
  key_length, value_length, layer_norm_rms_epsilon, rope.freq_base; Gemma 2 and 3:
  attention.sliding_window; Gemma 2: attn_logit_softcapping; final_logit_softcapping where set;
  linear RoPE scaling where set;
- tensors: transformers' names mapped by gguf's TensorNameMap (token_embd, blk.N.attn_q, ...,
  output_norm), in transformers' [out, in] layout (Gemma's Q and K rows are not permuted), the
  RMSNorm weights stored as 1 + w; 1-D tensors in F32, the others in the chosen type, each
  quantized by gguf.quants.quantize (a tensor whose rows do not split into the type's blocks is
  written in F16, as the converter falls back);
- the tokenizer as llama.cpp's SentencePiece vocabulary (tokenizer.ggml.model = llama): tokens,
  scores, token types, the special ids, add_bos_token, and the chat template.

What a GGUF cannot carry (the query scale, the layer pattern, the local RoPE base) its readers
assume per architecture; the export reads its own file back and refuses a model that differs
from what a reader would build (interop/gguf.py holds those assumptions, transformers' own).
The file is written beside the target and renamed into place: a failed export leaves nothing.

A LoRA run's adapters alone (`export_adapters`) as llama.cpp's convert_lora_to_gguf.py writes them,
to apply on top of the unchanged base file (`llama-cli -m base.gguf --lora adapter.gguf`):
general.type = adapter, adapter.type = lora, adapter.lora.alpha; for each adapted weight of GGUF
name blk.N.<tensor>.weight, `.weight.lora_a` = PEFT's lora_A [r, in] and `.weight.lora_b` = lora_B
[out, r], so that W + (alpha / r) lora_b lora_a is the merged weight in the base file's [out, in].
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from flax import nnx

from tunix_train.config import ConfigError, ModelConfig
from tunix_train.files import write_atomically
from tunix_train.interop import families, gguf_llama, hf
from tunix_train.interop import gguf as gguf_import

DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
ADAPTER_DTYPES = ("f32", "f16", "bf16", "q8_0")  # convert_lora_to_gguf.py's --outtype


def _conventions(cfg: ModelConfig) -> families.GgufConventions:
    """cfg.family's GGUF conventions, the model checked against what the family fixes and what its
    files can hold."""
    family = families.named(cfg.family)
    if family.gguf is None:
        raise ConfigError(
            f"GGUF export of {family.name} is not supported yet (this package writes "
            f"{', '.join(families.gguf_architectures())}); export a Hugging Face checkpoint instead"
        )
    family.check(cfg)
    family.gguf.check_exportable(cfg)
    return family.gguf


def _gguf_tensors(
    params, cfg: ModelConfig, conventions
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(transformers' tensors as the converter turns them before naming them: Llama's Q and K rows
    permuted, the experts' fused gate/up as two stacked tensors; the tensors the conventions add,
    by their GGUF names: llama3's rope_freqs)."""
    tensors = {}
    for name, array in hf.hf_tensors(params, cfg, split_experts=False).items():  # every process gathers
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            gate, up = np.split(array, 2, axis=1)
            tensors[base + "gate_proj"], tensors[base + "up_proj"] = gate, up
            continue
        heads = gguf_import.interleaved_heads(name, cfg)
        tensors[name] = array if heads is None else gguf_llama.permute_qk(array, heads)
    return tensors, conventions.extra_tensors(cfg)


def export(
    params,
    cfg: ModelConfig,
    tokenizer,
    chat_template: str | None,
    path: Path,
    dtype: str = "f16",
    overwrite: bool = False,
) -> None:
    """Writes `path` (process 0), a GGUF of the model, its tokenizer and chat template."""
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: GGUF export writes {', '.join(DTYPES)}")
    if path.exists() and not overwrite:
        raise ConfigError(f"{path} exists: pass --overwrite to replace it")
    conventions = _conventions(cfg)
    if tokenizer is None:
        raise ConfigError("this checkpoint carries no tokenizer, and a GGUF file needs one")
    if cfg.vision is not None:  # llama.cpp reads an image tower from a file of its own (mmproj)
        print(f"{path}: the text model only; the image tower goes to its own mmproj file (--mmproj FILE)")
        params = nnx.State({k: v for k, v in params.items() if k != "vision"})
        cfg = dataclasses.replace(cfg, vision=None)

    tensors, extra = _gguf_tensors(params, cfg, conventions)

    def write(writer, names):
        _metadata(writer, cfg, conventions, dtype)
        _vocabulary(writer, tokenizer, cfg.vocab_size, chat_template)
        for name, array in tensors.items():
            _add_tensor(writer, gguf_import.gguf_name(names, name), array, dtype, cfg.norm_weight_offset)
        for name, array in extra.items():
            _add_tensor(writer, name, array, dtype)

    _write(
        path,
        conventions.architecture,
        cfg,
        write,
        check=lambda partial: _check_readable_as(cfg, partial, path),
    )


def export_adapters(
    adapters, cfg: ModelConfig, lora, path: Path, dtype: str = "f16", overwrite: bool = False
) -> None:
    """Writes `path` (process 0), the LoRA adapters as a llama.cpp adapter GGUF (module docstring)."""
    from tunix_train.interop import peft

    if dtype not in ADAPTER_DTYPES:
        raise ConfigError(f"--dtype {dtype}: llama.cpp's LoRA adapters are {', '.join(ADAPTER_DTYPES)}")
    if path.exists() and not overwrite:
        raise ConfigError(f"{path} exists: pass --overwrite to replace it")
    arch = _conventions(cfg).architecture
    if families.named(cfg.family).fused:
        raise ConfigError(
            f"GGUF adapters of {cfg.family} are not written yet (its files fuse q, k, v and gate, up); "
            f"export them for PEFT (--adapters --format hf) or the merged model instead"
        )

    tensors = peft.tensors(adapters, cfg, lora)  # every process gathers its shards

    def write(writer, names):
        writer.add_type("adapter")
        writer.add_string("adapter.type", "lora")
        writer.add_float32("adapter.lora.alpha", float(lora.alpha))
        for key, array in tensors.items():  # base_model.model.<name>.lora_A.weight
            name, factor = key.removeprefix("base_model.model.").rsplit(".lora_", 1)  # factor: "A.weight"
            heads = gguf_import.interleaved_heads(name, cfg) if factor[0] == "B" else None  # B's rows are W's
            array = array if heads is None else gguf_llama.permute_qk(array, heads)
            _add_tensor(
                writer,
                f"{gguf_import.gguf_name(names, name + '.weight')}.lora_{factor[0].lower()}",
                array,
                dtype,
            )

    _write(path, arch, cfg, write)


def _write(path: Path, arch: str, cfg: ModelConfig, write, check=None) -> None:
    """The GGUF file `write(writer, tensor names)` fills, written beside `path` and renamed into place."""
    import gguf
    import jax

    if jax.process_index() != 0:
        return
    path.parent.mkdir(parents=True, exist_ok=True)

    def fill(partial: Path) -> None:
        writer = gguf.GGUFWriter(partial, arch)
        write(writer, gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_layers))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        if check:
            check(partial)

    write_atomically(path, fill)


def _metadata(writer, cfg: ModelConfig, conventions, dtype: str) -> None:
    import gguf

    writer.add_name(cfg.name)
    writer.add_file_type(
        {
            "f32": gguf.LlamaFileType.ALL_F32,
            "f16": gguf.LlamaFileType.MOSTLY_F16,
            "bf16": gguf.LlamaFileType.MOSTLY_BF16,
            "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
            "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
        }[dtype]
    )
    writer.add_context_length(cfg.context_length or 8192)
    writer.add_embedding_length(cfg.embed_dim)
    writer.add_block_count(cfg.num_layers)
    writer.add_feed_forward_length(cfg.hidden_dim)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_base_global)
    if cfg.rope_scale_global != 1.0:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.rope_scale_global)
    conventions.write_metadata(writer, cfg)


def _vocabulary(writer, tokenizer, vocab_size: int, chat_template: str | None) -> None:
    """llama.cpp's SentencePiece vocabulary, or its byte-level BPE (gpt2: Llama 3's and Qwen's);
    the model's rows past the tokenizer's as unused tokens."""
    bpe = tokenizer.gguf_bpe() if hasattr(tokenizer, "gguf_bpe") else None
    if bpe:
        pre, tokens, types, merges = bpe
        padding = range(len(tokens), vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list([*tokens, *(f"[PAD{i}]" for i in padding)])  # as the converter pads
        writer.add_token_types([*types, *(5 for _ in padding)])  # 5: UNUSED
        writer.add_token_merges(merges)
    else:
        tokens, scores, types = tokenizer.gguf_vocabulary()
        padding = range(len(tokens), vocab_size)
        writer.add_tokenizer_model("llama")
        writer.add_token_list([*tokens, *(f"<unused_row{i}>" for i in padding)])
        writer.add_token_scores([*scores, *(-float(i) for i in padding)])
        writer.add_token_types([*types, *(5 for _ in padding)])  # 5: UNUSED
        writer.add_add_space_prefix(tokenizer.adds_space_prefix)
    if tokenizer.bos_id >= 0:
        writer.add_bos_token_id(tokenizer.bos_id)
    writer.add_eos_token_id(tokenizer.eos_id)
    if tokenizer.pad_id >= 0:
        writer.add_pad_token_id(tokenizer.pad_id)
    writer.add_add_bos_token(tokenizer.add_bos)
    writer.add_add_eos_token(False)
    if chat_template:
        writer.add_chat_template(chat_template)


def _add_tensor(writer, name: str, array: np.ndarray, dtype: str, norm_offset: float = 0.0) -> None:
    import gguf

    if name.endswith("norm.weight") and norm_offset:
        array = array + np.float32(norm_offset)  # llama.cpp's Gemma norms hold 1 + w
    types = {
        "f32": gguf.GGMLQuantizationType.F32,
        "f16": gguf.GGMLQuantizationType.F16,
        "bf16": gguf.GGMLQuantizationType.BF16,
        "q8_0": gguf.GGMLQuantizationType.Q8_0,
        "q4_0": gguf.GGMLQuantizationType.Q4_0,
    }
    kind = types[dtype] if array.ndim > 1 else gguf.GGMLQuantizationType.F32
    block, _ = gguf.GGML_QUANT_SIZES[kind]
    if array.shape[-1] % block:
        kind = gguf.GGMLQuantizationType.F16
    if kind == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, array.astype(np.float32))
    elif kind == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, array.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)


def _check_readable_as(cfg: ModelConfig, written: Path, target: Path) -> None:
    """The model a reader builds from the file is this one, or a ConfigError naming what differs."""
    reader = gguf_import.open_gguf(written)
    differs = gguf_import.first_difference(cfg, gguf_import.model_fields(reader, written))
    if differs:
        key, ours, theirs = differs
        raise ConfigError(
            f"{target}: not written: a GGUF cannot hold model.{key}={ours!r}; its readers "
            f"(llama.cpp, transformers) would assume {theirs!r}"
        )
