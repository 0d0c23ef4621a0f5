"""The JSON files handed over with a model (config.json, the safetensors index), read through one
checked path: inside their folder (a symlink leading out is refused), of bounded size and depth,
valid JSON without NaN or Infinity, an object; and the model fields read from them checked as a
model needs them (whole numbers where counts go, positive sizes, finite numbers, the image token
inside the vocabulary), so that a nonsense file is one line when it is opened, not a failure when
an image arrives."""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from pathlib import Path
from typing import Any

from tunix_train.config import ConfigError, ModelConfig, MoeConfig, VisionConfig
from tunix_train.interop import vision

MAX_BYTES = 64 << 20  # a safetensors index of a very large model is a few MB
MAX_DEPTH = 64


def read_json(path: Path, what: str = "model.init_from") -> dict[str, Any]:
    """The JSON object in `path` (a file in a handed-over folder), or a one-line error naming it."""
    path = Path(path)
    if not inside(path):
        raise ConfigError(
            f"{what}: {path} is a link to {path.resolve()}, outside its folder; copy the file in"
        )
    if not path.is_file():
        raise ConfigError(f"{what}: {path} is not a file")
    if path.stat().st_size > MAX_BYTES:
        raise ConfigError(f"{what}: {path} has more than {MAX_BYTES:,} bytes")

    def no_constant(name):
        raise ValueError(f"{name} is not a JSON number")

    try:
        value = json.loads(path.read_text(encoding="utf-8"), parse_constant=no_constant)
    except RecursionError:
        raise ConfigError(f"{what}: {path} is nested more than {MAX_DEPTH} deep") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"{what}: {path} is not valid JSON ({' '.join(str(err).split())[:160]})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{what}: {path} must hold a JSON object, not {type(value).__name__}")
    if _depth(value) > MAX_DEPTH:
        raise ConfigError(f"{what}: {path} is nested more than {MAX_DEPTH} deep")
    return value


def inside(path: Path) -> bool:
    """Whether `path` is its folder's own file: not a link leading out of the folder, except a
    Hugging Face cache's (snapshots/<revision>/FILE -> ../../blobs/<hash>)."""
    target, folder = path.resolve(), path.parent.resolve()
    return target.is_relative_to(folder) or (
        folder.parent.name == "snapshots" and target.parent == folder.parent.parent / "blobs"
    )


def _depth(value: Any) -> int:
    level, depth = [value], 0
    while level:
        depth += 1
        level = [
            v
            for x in level
            for v in (x.values() if isinstance(x, dict) else x)
            if isinstance(v, (dict, list))
        ]
    return depth


# sizes that must be at least 1 (the rest of the whole-number fields at least 0)
POSITIVE = {
    "num_layers",
    "embed_dim",
    "hidden_dim",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
    "image_size",
    "patch_size",
    "num_channels",
    "tokens_per_image",
    "pooling_kernel",
    "position_table_size",
    "sliding_window",
    "global_head_dim",
    "num_global_kv_heads",
    "per_layer_input_vocab_size",
}


def checked_fields(
    cfg: ModelConfig | VisionConfig | MoeConfig, source: str, section: str = "", positive=POSITIVE
) -> None:
    """Each whole-number field of cfg (and of its model.moe and model.vision) an int, at least 1
    where it is a size (POSITIVE) and 0 elsewhere; each number finite; the image token inside the
    vocabulary."""
    hints = typing.get_type_hints(type(cfg))
    for field in dataclasses.fields(cfg):
        value, kind = getattr(cfg, field.name), hints[field.name]
        if value is None or kind in (bool, typing.Optional[bool]):
            continue
        where = f"{source}: {section}{field.name}={value!r}"
        if kind in (int, typing.Optional[int]):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{where[:160]} must be a whole number")
            if value < (1 if field.name in positive else 0):
                raise ConfigError(f"{where} must be {'positive' if field.name in positive else 'at least 0'}")
        elif kind in (float, typing.Optional[float]):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{where[:160]} must be a finite number")
    if isinstance(cfg, ModelConfig):
        checked_fields(cfg.moe, source, "moe.", positive=())  # 0 experts: none
        checked_fields(cfg.gemma4, source, "gemma4.")
    if isinstance(cfg, ModelConfig) and cfg.vision is not None:
        checked_fields(cfg.vision, source, "vision ")
        if not 0 <= cfg.vision.image_token_id < cfg.vocab_size:
            raise ConfigError(
                f"{source}: the image token {cfg.vision.image_token_id} lies outside the vocabulary of "
                f"{cfg.vocab_size} tokens"
            )
        if cfg.vision.patch_size > cfg.vision.image_size:
            raise ConfigError(f"{source}: vision patch_size {cfg.vision.patch_size} exceeds its image_size")


def read_hf_config(directory: Path) -> dict[str, Any]:
    file = directory / "config.json"
    if not file.exists():
        raise ConfigError(f"model.init_from: no config.json in {directory}")
    hf = read_json(file)
    if "text_config" not in hf:
        return hf
    if not isinstance(hf["text_config"], dict):
        raise ConfigError(f"model.init_from: {file}'s text_config must be a JSON object")
    # Gemma 3 and 4 multimodal checkpoints nest the text decoder; the class (a scalar head?) is outside
    return {**hf["text_config"], "architectures": hf.get("architectures") or []}


def other_towers(directory: Path) -> list[str]:
    """The vision or audio towers a multimodal checkpoint holds beside its text decoder."""
    hf = read_json(Path(directory) / "config.json")
    return [tower for tower in ("vision_config", "audio_config") if hf.get(tower)]


def vision_from_directory(directory: Path):
    """model.vision of a checkpoint directory's config.json (None: it has no image tower)."""
    file = Path(directory) / "config.json"
    try:
        return vision.vision_from_hf(read_json(file))
    except KeyError as err:
        raise ConfigError(f"model.init_from: {file}'s vision_config has no {err.args[0]!r}") from None
    except (TypeError, AttributeError, ValueError, ZeroDivisionError) as err:
        raise ConfigError(f"model.init_from: {file}'s vision_config cannot be read ({err})") from None


def open_safetensors(safe_open, path: Path):
    """safetensors' safe_open(path), or a one-line error naming the file (a link leading out of its
    folder is refused, as read_json refuses one)."""
    if not inside(path):
        raise ConfigError(f"model.init_from: {path} is a link to {path.resolve()}, outside its folder")
    try:
        return safe_open(str(path), framework="numpy")
    except Exception as err:  # noqa: BLE001 - safetensors' own error types for a damaged header
        said = " ".join(str(err).split())[:160]
        raise ConfigError(f"model.init_from: {path} is not a readable safetensors file ({said})") from None
