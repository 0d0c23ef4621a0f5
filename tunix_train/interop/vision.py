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

    def norm(module, name):
        module.scale[...], module.bias[...] = t(name + ".weight"), t(name + ".bias")

    tower.patch[...] = t("embeddings.patch_embedding.weight").transpose(2, 3, 1, 0).reshape(-1, D)
    tower.patch_bias[...] = t("embeddings.patch_embedding.bias")
    tower.position[...] = t("embeddings.position_embedding.weight")
    for i, layer in enumerate(tower.layers):
        p = f"encoder.layers.{i}."
        norm(layer.norm1, p + "layer_norm1")
        norm(layer.norm2, p + "layer_norm2")
        for x in "qkv":
            getattr(layer, x)[...], getattr(layer, x + "_bias")[...] = heads(p + f"self_attn.{x}_proj")
        layer.out[...] = t(p + "self_attn.out_proj.weight").T.reshape(H, -1, D)
        layer.out_bias[...] = t(p + "self_attn.out_proj.bias")
        layer.up[...], layer.up_bias[...] = t(p + "mlp.fc1.weight").T, t(p + "mlp.fc1.bias")
        layer.down[...], layer.down_bias[...] = t(p + "mlp.fc2.weight").T, t(p + "mlp.fc2.bias")
    norm(tower.final_norm, "post_layernorm")
    tower.soft_norm.scale[...] = np.asarray(tensors[projector_prefix + "mm_soft_emb_norm.weight"], np.float32)
    tower.projection[...] = np.asarray(tensors[projector_prefix + "mm_input_projection_weight"], np.float32)
