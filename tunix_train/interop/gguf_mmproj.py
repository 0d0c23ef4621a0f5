"""Gemma 3's or Gemma 4's image tower as llama.cpp's multimodal projector file (mmproj), as its
convert_hf_to_gguf.py --mmproj writes one (its MmprojModel, Gemma3VisionModel and
Gemma4VisionAudioModel), to run beside the text model's GGUF:
`llama-mtmd-cli -m model.gguf --mmproj mmproj.gguf --image cat.png`.

Gemma 4's differs: clip.vision.projector_type = gemma4v, image_size 224 (unused), mean 0 and
std 1 (its processor does not normalize); its encoder's tensors renamed vision_model.model.* and
.linear dropped before the name map (v.blk.N.attn_q, attn_q_norm, attn_post_norm, ffn_gate,
ffn_post_norm, v.std_bias, v.std_scale, ...), the patch embedding [D, 3 P P] in (y, x, channel)
rows as a convolution [D, 3, P, P], its norms as they are, the position table in F32.

- metadata: general.architecture = clip, general.type = mmproj, file_type; clip.has_vision_encoder,
  clip.projector_type = gemma3, clip.vision.projection_dim (the text model's width), image_size,
  patch_size, embedding_length, feed_forward_length, block_count, attention.head_count,
  attention.layer_norm_epsilon, image_mean and image_std (Gemma 3's 0.5), use_gelu; the
  projector's scale factor (patches a side over tokens a side) where it is not Gemma 3's 4;
- tensors: transformers' (interop/vision.py's tower_tensors) named by gguf's TensorNameMap for
  MODEL_ARCH.MMPROJ (v.patch_embd, v.position_embd, v.blk.N.attn_q, ..., v.post_ln,
  mm.input_projection, mm.soft_emb_norm) in transformers' layout; the projector's RMSNorm weight
  stored as 1 + w; the embeddings and 1-D tensors in F32, the input projection in F16 (as the
  converter forces them), the rest in the chosen type.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from flax import nnx

from tunix_train.config import ConfigError, ModelConfig
from tunix_train.files import write_atomically
from tunix_train.interop import vision

DTYPES = ("f32", "f16")


def mmproj_tensors(params, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The tower's tensors under their mmproj names, float32, as the file holds them (Gemma 3's
    projector norm as 1 + w)."""
    import gguf

    from tunix_train.interop import hf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, cfg.vision.num_layers)
    encoder = vision.of(cfg.vision)
    out = {}
    for name, array in hf.hf_tensors(nnx.State({"vision": params["vision"]}), cfg).items():
        name, array = encoder.mmproj_tensor(name, array)
        name = name.replace("mm_input_projection_weight", "mm_input_projection.weight")
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ConfigError(f"the image tower's tensor {name} has no mmproj name")
        out[mapped] = array + np.float32(1) if mapped == "mm.soft_emb_norm.weight" else array
    return out


def check(cfg: ModelConfig, path: Path, dtype: str, overwrite: bool) -> None:
    """A ConfigError for what export would refuse, before anything is written."""
    if cfg.vision is None:
        raise ConfigError("--mmproj: this model has no image tower (model.vision is null)")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: the mmproj file is written in {' or '.join(DTYPES)}")
    if path.exists() and not overwrite:
        raise ConfigError(f"{path} exists: pass --overwrite to replace it")


def export(params, cfg: ModelConfig, path: Path, dtype: str = "f16", overwrite: bool = False) -> None:
    """Writes `path` (process 0): the model's image tower as an mmproj GGUF."""
    import gguf
    import jax

    check(cfg, path, dtype, overwrite)
    v = cfg.vision
    encoder = vision.of(v)
    tensors = mmproj_tensors(params, cfg)  # every process gathers
    if jax.process_index() != 0:
        return

    def fill(partial: Path) -> None:
        writer = gguf.GGUFWriter(partial, "clip")
        writer.add_type(gguf.GGUFType.MMPROJ)
        writer.add_name(f"{cfg.name} image tower")
        writer.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
        writer.add_clip_has_vision_encoder(True)
        writer.add_vision_projection_dim(cfg.embed_dim)
        writer.add_vision_patch_size(v.patch_size)
        writer.add_vision_embedding_length(v.embed_dim)
        writer.add_vision_feed_forward_length(v.hidden_dim)
        writer.add_vision_block_count(v.num_layers)
        writer.add_vision_head_count(v.num_heads)
        writer.add_vision_attention_layernorm_eps(v.layer_norm_eps)
        encoder.mmproj_metadata(writer, v)  # the image size, normalization, projector
        # F32: 1-D tensors, the position tables and what the encoder's converter keeps in F32; what
        # it forces to F16 in F16; the rest in `dtype`
        always_f32 = ("v.position_embd.weight", *encoder.MMPROJ_F32)
        always_f16 = encoder.MMPROJ_F16
        for name, array in tensors.items():
            small = array.ndim == 1 or name in always_f32
            if small or (dtype == "f32" and name not in always_f16):
                writer.add_tensor(name, array.astype(np.float32))
            else:
                writer.add_tensor(name, array.astype(np.float16))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, fill)
