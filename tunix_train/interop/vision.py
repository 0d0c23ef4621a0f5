"""Gemma 3's image tower (model.vision.encoder=siglip) as transformers and llama.cpp name it: the
config.json keys (`vision_config`, `mm_tokens_per_image`, `image_token_index`), the tensors of the
SigLIP model (the published checkpoints' `vision_tower.vision_model.*`, transformers 5's
save_pretrained's `vision_tower.*`) and of the multimodal projector (`multi_modal_projector.*`) as
model/vision.py's VisionTower holds them, and its mmproj file's conventions. Gemma 4's tower has a
module of the same shape (gemma4_vision.py); ENCODERS and BY_MODEL_TYPE (at the end) pick one."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np

from tunix_train.config import VisionConfig, VisionEncoder
from tunix_train.interop import found_prefixes, gemma4_vision

# where checkpoints keep the SigLIP model and the projector (the first a file has is read)
TOWER_PREFIXES = (
    "vision_tower.vision_model.",
    "model.vision_tower.vision_model.",
    "vision_tower.",
    "model.vision_tower.",
)
PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")
# where the exported Gemma3ForConditionalGeneration keeps its text model, and its output layer
TEXT_PREFIX, OUTPUT_NAME = "language_model.model.", "language_model.lm_head.weight"


def of(cfg: VisionConfig):
    """The module that names this tower's config and tensors as transformers and llama.cpp do
    (ENCODERS: this one for SigLIP, gemma4_vision for Gemma 4's): its tower_prefixes, tower_arrays,
    tower_tensors, multimodal_config, vision_from_hf, TEXT_PREFIX, OUTPUT_NAME and mmproj_*."""
    return ENCODERS[cfg.encoder]


def vision_from_hf(config: Mapping[str, Any]) -> VisionConfig | None:
    """model.vision from a multimodal config.json (the whole file, not its text_config) of a
    model_type whose tower a module here reads (BY_MODEL_TYPE); None for a text-only checkpoint,
    and for other families' towers."""
    module = BY_MODEL_TYPE.get(config.get("model_type"))
    if not config.get("vision_config") or module is None:
        return None
    return module.tower_from_hf(config)


def tower_from_hf(config: Mapping[str, Any]) -> VisionConfig:
    """model.vision of Gemma 3's config.json."""
    vision = config["vision_config"]
    return VisionConfig(
        image_size=vision["image_size"],
        patch_size=vision["patch_size"],
        num_channels=vision.get("num_channels", 3),
        embed_dim=vision["hidden_size"],
        hidden_dim=vision["intermediate_size"],
        num_layers=vision["num_hidden_layers"],
        num_heads=vision["num_attention_heads"],
        layer_norm_eps=vision.get("layer_norm_eps", 1e-6),
        tokens_per_image=config.get("mm_tokens_per_image", 256),
        image_token_id=config.get("image_token_index", config.get("image_token_id", 262144)),
    )


def tower_prefixes(has: Callable[[str], bool], source: str) -> tuple[str, str]:
    """The (tower, projector) prefixes of the checkpoint whose tensor names `has` knows."""
    return found_prefixes(
        has,
        source,
        (TOWER_PREFIXES, "post_layernorm.weight"),
        (PROJECTOR_PREFIXES, "mm_input_projection_weight"),
    )


def tower_arrays(
    cfg: VisionConfig, read: Callable[[str], np.ndarray], tower_prefix: str, projector_prefix: str
) -> dict[str, np.ndarray]:
    """The tower's parameters in our layout, float32, by their path in VisionTower (`layers.q`,
    `final_norm.scale`, ...), from transformers' tensors (read(name) -> the whole tensor). torch's
    Linear weights are [out, in]; the patch convolution's [D, C, P, P] becomes rows in (y, x,
    channel) order; the encoder layers are stacked on a leading axis."""
    D, H = cfg.embed_dim, cfg.num_heads

    def t(name):
        return np.asarray(read(tower_prefix + name), np.float32)

    def layer(i):
        p = f"encoder.layers.{i}."
        named = {
            "norm1.scale": t(p + "layer_norm1.weight"),
            "norm1.bias": t(p + "layer_norm1.bias"),
            "norm2.scale": t(p + "layer_norm2.weight"),
            "norm2.bias": t(p + "layer_norm2.bias"),
            "out": t(p + "self_attn.out_proj.weight").T.reshape(H, -1, D),
            "out_bias": t(p + "self_attn.out_proj.bias"),
            "up": t(p + "mlp.fc1.weight").T,
            "up_bias": t(p + "mlp.fc1.bias"),
            "down": t(p + "mlp.fc2.weight").T,
            "down_bias": t(p + "mlp.fc2.bias"),
        }
        for x in "qkv":  # [H*K, D] -> [D, H, K]; the biases [H, K]
            named[x] = t(p + f"self_attn.{x}_proj.weight").T.reshape(D, H, -1)
            named[x + "_bias"] = t(p + f"self_attn.{x}_proj.bias").reshape(H, -1)
        return named

    layers = [layer(i) for i in range(cfg.num_layers)]
    arrays = {"layers." + name: np.stack([named[name] for named in layers]) for name in layers[0]}
    arrays.update(
        {
            "patch": t("embeddings.patch_embedding.weight").transpose(2, 3, 1, 0).reshape(-1, D),
            "patch_bias": t("embeddings.patch_embedding.bias"),
            "position": t("embeddings.position_embedding.weight"),
            "final_norm.scale": t("post_layernorm.weight"),
            "final_norm.bias": t("post_layernorm.bias"),
            "soft_norm.scale": np.asarray(read(projector_prefix + "mm_soft_emb_norm.weight"), np.float32),
            "projection": np.asarray(read(projector_prefix + "mm_input_projection_weight"), np.float32),
        }
    )
    return arrays


def tower_tensors(cfg: VisionConfig, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """tower_arrays' inverse: transformers' tensors, float32, named as the published Gemma 3
    checkpoints name them (vision_tower.vision_model.*, multi_modal_projector.*), from the tower's
    parameters by path."""
    D, C, P = cfg.embed_dim, cfg.num_channels, cfg.patch_size
    tower, projector = TOWER_PREFIXES[0], PROJECTOR_PREFIXES[0]
    out = {
        tower + "embeddings.patch_embedding.weight": arrays["patch"]
        .reshape(P, P, C, D)
        .transpose(3, 2, 0, 1),
        tower + "embeddings.patch_embedding.bias": arrays["patch_bias"],
        tower + "embeddings.position_embedding.weight": arrays["position"],
        tower + "post_layernorm.weight": arrays["final_norm.scale"],
        tower + "post_layernorm.bias": arrays["final_norm.bias"],
        projector + "mm_soft_emb_norm.weight": arrays["soft_norm.scale"],
        projector + "mm_input_projection_weight": arrays["projection"],
    }
    for i in range(cfg.num_layers):
        p = f"{tower}encoder.layers.{i}."

        def at(name, i=i):
            return arrays["layers." + name][i]

        out.update(
            {
                p + "layer_norm1.weight": at("norm1.scale"),
                p + "layer_norm1.bias": at("norm1.bias"),
                p + "layer_norm2.weight": at("norm2.scale"),
                p + "layer_norm2.bias": at("norm2.bias"),
                p + "self_attn.out_proj.weight": at("out").reshape(-1, D).T,
                p + "self_attn.out_proj.bias": at("out_bias"),
                p + "mlp.fc1.weight": at("up").T,
                p + "mlp.fc1.bias": at("up_bias"),
                p + "mlp.fc2.weight": at("down").T,
                p + "mlp.fc2.bias": at("down_bias"),
            }
        )
        for x in "qkv":
            out[p + f"self_attn.{x}_proj.weight"] = at(x).reshape(D, -1).T
            out[p + f"self_attn.{x}_proj.bias"] = at(x + "_bias").reshape(-1)
    return {name: np.ascontiguousarray(a, np.float32) for name, a in out.items()}


LABELS = ("num_labels", "id2label", "label2id")  # a text config.json's scalar head (a reward model)


def multimodal_config(cfg: VisionConfig, text_config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json of transformers' Gemma3ForConditionalGeneration around a text model's config.json
    (Gemma 3's own start and end of image tokens are transformers' defaults, not written); with a
    scalar head (a reward model), its Gemma3ForSequenceClassification, the labels at the top."""
    text = {k: v for k, v in text_config.items() if k != "architectures" and k not in LABELS}
    labels = {k: text_config[k] for k in LABELS if k in text_config}
    return {
        "architectures": ["Gemma3ForSequenceClassification" if labels else "Gemma3ForConditionalGeneration"],
        **labels,
        "model_type": "gemma3",
        "text_config": {**text, "model_type": "gemma3_text"},
        "vision_config": {
            "model_type": "siglip_vision_model",
            "image_size": cfg.image_size,
            "patch_size": cfg.patch_size,
            "num_channels": cfg.num_channels,
            "hidden_size": cfg.embed_dim,
            "intermediate_size": cfg.hidden_dim,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "layer_norm_eps": cfg.layer_norm_eps,
            "vision_use_head": False,
        },
        "mm_tokens_per_image": cfg.tokens_per_image,
        "image_token_index": cfg.image_token_id,
    }


# llama.cpp's mmproj file (interop/gguf_mmproj.py): Gemma3VisionModel keeps the patch embedding in
# F32 and forces the input projection to F16
MMPROJ_F32, MMPROJ_F16 = ("v.patch_embd.weight",), ("mm.input_projection.weight",)


def mmproj_tensor(name: str, array: np.ndarray) -> tuple[str, np.ndarray]:
    return name, array


def mmproj_metadata(writer, cfg: VisionConfig) -> None:
    """The square's size, the processor's mean and std (0.5), the gemma3 projector and its scale."""
    import gguf

    writer.add_vision_image_size(cfg.image_size)
    writer.add_vision_image_mean([0.5] * 3)
    writer.add_vision_image_std([0.5] * 3)
    writer.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
    writer.add_vision_use_gelu(True)
    scale = cfg.patches_per_side // round(cfg.tokens_per_image**0.5)
    if scale != 4:
        writer.add_vision_projector_scale_factor(scale)


# The image towers by model.vision.encoder, and by the multimodal config.json's model_type
ENCODERS = {VisionEncoder.siglip: sys.modules[__name__], VisionEncoder.gemma4: gemma4_vision}
MODEL_TYPE = "gemma3"
BY_MODEL_TYPE = {module.MODEL_TYPE: module for module in ENCODERS.values()}
