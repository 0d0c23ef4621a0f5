"""Gemma 3's image tower as transformers names it: the SigLIP vision config and tensors (the
published checkpoints' `vision_tower.vision_model.*`, transformers 5's save_pretrained's
`vision_tower.*`) and the multimodal projector's (`multi_modal_projector.*`), read into
model/vision.py's VisionTower."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tunix_train.model.vision import VisionConfig, VisionTower


def vision_from_hf(vision: Mapping[str, Any], mm_tokens_per_image: int) -> VisionConfig:
    """VisionConfig from a Gemma 3 config.json's `vision_config` and its `mm_tokens_per_image`."""
    return VisionConfig(
        image_size=vision["image_size"],
        patch_size=vision["patch_size"],
        num_channels=vision.get("num_channels", 3),
        embed_dim=vision["hidden_size"],
        hidden_dim=vision["intermediate_size"],
        num_layers=vision["num_hidden_layers"],
        num_heads=vision["num_attention_heads"],
        layer_norm_eps=vision.get("layer_norm_eps", 1e-6),
        tokens_per_image=mm_tokens_per_image,
    )


def load_tower(
    tower: VisionTower, tensors: Mapping[str, np.ndarray], tower_prefix: str, projector_prefix: str
) -> None:
    """Sets `tower`'s parameters from transformers' tensors: the SigLIP model's under `tower_prefix`,
    the projector's under `projector_prefix`. torch's Linear weights are [out, in]; the patch
    convolution's [D, C, P, P] becomes rows in (y, x, channel) order."""
    cfg = tower.cfg
    D, H = cfg.embed_dim, cfg.num_heads

    def t(name):
        return np.asarray(tensors[tower_prefix + name], np.float32)

    def heads(name):  # q, k, v: [H*K, D] -> [D, H, K]; their biases [H, K]
        return t(name + ".weight").T.reshape(D, H, -1), t(name + ".bias").reshape(H, -1)

    tower.patch[...] = t("embeddings.patch_embedding.weight").transpose(2, 3, 1, 0).reshape(-1, D)
    tower.patch_bias[...] = t("embeddings.patch_embedding.bias")
    tower.position[...] = t("embeddings.position_embedding.weight")

    def layer(i):  # one layer's tensors, named as the EncoderLayer's parameters
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
        for x in "qkv":
            named[x], named[x + "_bias"] = heads(p + f"self_attn.{x}_proj")
        return named

    layers = [layer(i) for i in range(cfg.num_layers)]
    for name in layers[0]:  # the stack: each parameter [L, ...]
        module = tower.layers
        *parents, leaf = name.split(".")
        for parent in parents:
            module = getattr(module, parent)
        getattr(module, leaf)[...] = np.stack([named[name] for named in layers])
    tower.final_norm.scale[...], tower.final_norm.bias[...] = (
        t("post_layernorm.weight"),
        t("post_layernorm.bias"),
    )
    tower.soft_norm.scale[...] = np.asarray(tensors[projector_prefix + "mm_soft_emb_norm.weight"], np.float32)
    tower.projection[...] = np.asarray(tensors[projector_prefix + "mm_input_projection_weight"], np.float32)
