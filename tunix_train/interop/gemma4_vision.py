"""Gemma 4's image tower (model.vision.encoder=gemma4) as transformers and llama.cpp name it:
config.json's `vision_config` (model_type gemma4_vision), the tensors of Gemma4VisionModel
(`model.vision_tower.*`) and of the projector Gemma4MultimodalEmbedder (`model.embed_vision.*`), as
model/gemma4_vision.py's tower holds them, and its mmproj file's conventions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import numpy as np

from tunix_train.config import ConfigError, ImageAttention, VisionConfig, VisionEncoder
from tunix_train.interop import found_prefixes

TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.")
PROJECTOR_PREFIXES = ("model.embed_vision.", "embed_vision.")
# where Gemma4ForConditionalGeneration keeps its text model, and its output layer (when untied)
TEXT_PREFIX, OUTPUT_NAME = "model.language_model.", "lm_head.weight"
# transformers' text_config.use_bidirectional_attention -> where an image's tokens see each other
IMAGE_ATTENTION = {"vision": ImageAttention.sliding_layers, None: ImageAttention.causal}
# our names in an encoder layer -> transformers' (below encoder.layers.{i}.)
LINEARS = {
    "q": "self_attn.q_proj.linear.weight",
    "k": "self_attn.k_proj.linear.weight",
    "v": "self_attn.v_proj.linear.weight",
    "out": "self_attn.o_proj.linear.weight",
    "gate": "mlp.gate_proj.linear.weight",
    "up": "mlp.up_proj.linear.weight",
    "down": "mlp.down_proj.linear.weight",
}
NORMS = {
    "q_norm.scale": "self_attn.q_norm.weight",
    "k_norm.scale": "self_attn.k_norm.weight",
    "pre_attn_norm.scale": "input_layernorm.weight",
    "post_attn_norm.scale": "post_attention_layernorm.weight",
    "pre_mlp_norm.scale": "pre_feedforward_layernorm.weight",
    "post_mlp_norm.scale": "post_feedforward_layernorm.weight",
}


def vision_from_hf(config: Mapping[str, Any], tokens_per_image: int = 280) -> VisionConfig:
    """model.vision from a Gemma 4 config.json (the whole file). tokens_per_image is the image
    processor's max_soft_tokens (not in config.json; transformers' default 280)."""
    v, text = config["vision_config"], config.get("text_config") or {}
    where = "model.init_from: the checkpoint's vision_config"
    heads = v["num_attention_heads"]
    if v.get("use_clipped_linears"):
        raise ConfigError(f"{where} has use_clipped_linears=true, which this tower does not implement yet")
    if (
        v.get("num_key_value_heads", heads) != heads
        or v.get("head_dim", v["hidden_size"] // heads) * heads != (v["hidden_size"])
    ):
        raise ConfigError(
            f"{where}: the tower reads num_key_value_heads = num_attention_heads and "
            f"head_dim = hidden_size / num_attention_heads"
        )
    if v.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ConfigError(
            f"{where} has hidden_activation={v['hidden_activation']!r}; the tower reads gelu_pytorch_tanh"
        )
    bidirectional = text.get("use_bidirectional_attention")
    if bidirectional not in IMAGE_ATTENTION:
        raise ConfigError(
            f"model.init_from: text_config.use_bidirectional_attention={bidirectional!r} is not read "
            f"(only 'vision' or none)"
        )
    return VisionConfig(
        encoder=VisionEncoder.gemma4,
        patch_size=v["patch_size"],
        embed_dim=v["hidden_size"],
        hidden_dim=v["intermediate_size"],
        num_layers=v["num_hidden_layers"],
        num_heads=heads,
        layer_norm_eps=v.get("rms_norm_eps", 1e-6),
        tokens_per_image=tokens_per_image,
        image_token_id=config.get("image_token_id", 258_880),
        image_attention=IMAGE_ATTENTION[bidirectional],
        pooling_kernel=v.get("pooling_kernel_size", 3),
        position_table_size=v.get("position_embedding_size", 10_240),
        rope_base=float((v.get("rope_parameters") or {}).get("rope_theta", 100.0)),
        standardize=bool(v.get("standardize", False)),
    )


def tower_prefixes(has: Callable[[str], bool], source: str) -> tuple[str, str]:
    """The (tower, projector) prefixes of the checkpoint whose tensor names `has` knows."""
    return found_prefixes(
        has,
        source,
        (TOWER_PREFIXES, "patch_embedder.input_proj.weight"),
        (PROJECTOR_PREFIXES, "embedding_projection.weight"),
    )


def _layouts(cfg: VisionConfig) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each linear's (our shape, the transposed torch weight reshaped to it)."""
    D, F, H = cfg.embed_dim, cfg.hidden_dim, cfg.num_heads
    K = D // H
    return {
        "q": (D, H, K),
        "k": (D, H, K),
        "v": (D, H, K),
        "out": (H, K, D),
        "gate": (D, F),
        "up": (D, F),
        "down": (F, D),
    }


def tower_arrays(
    cfg: VisionConfig, read: Callable[[str], np.ndarray], tower_prefix: str, projector_prefix: str
) -> dict[str, np.ndarray]:
    """The tower's parameters in our layout, float32, by their path in Gemma4VisionTower, from
    transformers' tensors (torch's Linear weights are [out, in]; the layers stacked)."""

    def t(name):
        return np.asarray(read(tower_prefix + name), np.float32)

    shapes = _layouts(cfg)
    arrays = {
        "patch": t("patch_embedder.input_proj.weight").T,
        "position": t("patch_embedder.position_embedding_table"),
        "projection": np.asarray(read(projector_prefix + "embedding_projection.weight"), np.float32).T,
    }
    if cfg.standardize:
        arrays.update({"std_bias": t("std_bias"), "std_scale": t("std_scale")})
    layers = [f"encoder.layers.{i}." for i in range(cfg.num_layers)]
    for ours, theirs in LINEARS.items():
        arrays["layers." + ours] = np.stack([t(p + theirs).T.reshape(shapes[ours]) for p in layers])
    for ours, theirs in NORMS.items():
        arrays["layers." + ours] = np.stack([t(p + theirs) for p in layers])
    return arrays


def tower_tensors(cfg: VisionConfig, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """tower_arrays' inverse: transformers' tensors, float32, as Gemma4ForConditionalGeneration's
    save_pretrained names them."""
    tower, projector = TOWER_PREFIXES[0], PROJECTOR_PREFIXES[0]
    out = {
        tower + "patch_embedder.input_proj.weight": arrays["patch"].T,
        tower + "patch_embedder.position_embedding_table": arrays["position"],
        projector + "embedding_projection.weight": arrays["projection"].T,
    }
    if cfg.standardize:
        out.update({tower + "std_bias": arrays["std_bias"], tower + "std_scale": arrays["std_scale"]})
    for i in range(cfg.num_layers):
        p = f"{tower}encoder.layers.{i}."
        for ours, theirs in LINEARS.items():
            weight = arrays["layers." + ours][i]
            out[p + theirs] = (
                weight.reshape(-1, weight.shape[-1]).T
                if ours == "out"
                else weight.reshape(weight.shape[0], -1).T
            )
        for ours, theirs in NORMS.items():
            out[p + theirs] = arrays["layers." + ours][i]
    return {name: np.ascontiguousarray(a, np.float32) for name, a in out.items()}


def multimodal_config(cfg: VisionConfig, text_config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json of transformers' Gemma4ForConditionalGeneration around a text model's config.json."""
    text = {k: v for k, v in text_config.items() if k != "architectures"}
    bidirectional = {a: name for name, a in IMAGE_ATTENTION.items()}.get(cfg.image_attention)
    if cfg.image_attention is ImageAttention.all_layers:
        raise ConfigError(
            "model.vision.image_attention=all_layers: transformers' Gemma 4 has no such mask (its "
            "use_bidirectional_attention='all' is bidirectional for text too); this model cannot be exported"
        )
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": {**text, "model_type": "gemma4_text", "use_bidirectional_attention": bidirectional},
        "vision_config": {
            "model_type": "gemma4_vision",
            "hidden_size": cfg.embed_dim,
            "intermediate_size": cfg.hidden_dim,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_heads,
            "head_dim": cfg.embed_dim // cfg.num_heads,
            "hidden_activation": "gelu_pytorch_tanh",
            "rms_norm_eps": cfg.layer_norm_eps,
            "patch_size": cfg.patch_size,
            "pooling_kernel_size": cfg.pooling_kernel,
            "position_embedding_size": cfg.position_table_size,
            "rope_parameters": {"rope_type": "axial", "rope_theta": cfg.rope_base},
            "standardize": cfg.standardize,
            "use_clipped_linears": False,
        },
        "audio_config": None,
        "image_token_id": cfg.image_token_id,
    }


MODEL_TYPE = "gemma4"  # the multimodal config.json's (interop/vision.py's BY_MODEL_TYPE)
tower_from_hf = vision_from_hf

# llama.cpp's mmproj file (interop/gguf_mmproj.py): what its converter's Gemma4VisionAudioModel writes
MMPROJ_F32, MMPROJ_F16 = (), ()  # the tensors it keeps in F32 and F16 beside the 1-D ones


def mmproj_tensor(name: str, array: np.ndarray) -> tuple[str, np.ndarray]:
    """A Gemma 4 tower tensor renamed as the converter's Gemma4VisionAudioModel renames it before
    gguf's name map, the patch embedding's rows (y, x, channel) as a convolution [D, C, P, P]."""
    name = name.replace("model.vision_tower.encoder.", "vision_model.model.").replace(
        ".linear.weight", ".weight"
    )
    if name.endswith("position_embedding_table"):
        name += ".weight"
    if name.endswith("patch_embedder.input_proj.weight"):
        patch = int(round((array.shape[1] // 3) ** 0.5))
        array = array.reshape(array.shape[0], patch, patch, 3).transpose(0, 3, 1, 2)
    return name, array


def mmproj_metadata(writer, cfg: VisionConfig) -> None:
    """The image size (224, unused), no normalization (mean 0, std 1), the gemma4v projector."""
    import gguf

    writer.add_vision_image_size(224)
    writer.add_vision_image_mean([0.0] * 3)
    writer.add_vision_image_std([1.0] * 3)
    writer.add_clip_vision_projector_type(gguf.VisionProjectorType.GEMMA4V)
