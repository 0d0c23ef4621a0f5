"""Other formats in and out: Hugging Face safetensors checkpoints (hf.py), GGUF files (gguf.py),
PEFT adapters (peft.py); which of them a path holds, and where in a checkpoint its parts are."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from tunix_train.config import ConfigError


def checkpoint_format(path: str | Path) -> str:
    """ "gguf" (a llama.cpp file), "hf" (a Hugging Face directory: config.json beside the
    safetensors) or "run" (anything else: a tunix_train run, its checkpoints, or one step's)."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        return "gguf"
    return "hf" if (path / "config.json").is_file() else "run"


def importer(path: str | Path):
    """The module that reads the GGUF file or Hugging Face directory at `path` (model_fields,
    load_params)."""
    from tunix_train.interop import gguf, hf

    return gguf if checkpoint_format(path) == "gguf" else hf


def found_prefixes(has: Callable[[str], bool], source: str, tower, projector) -> tuple[str, str]:
    """The first of each (prefixes, a tensor below them) that the checkpoint holds, or a one-line
    error naming what it lacks."""
    found = []
    for what, (prefixes, probe) in (("image tower", tower), ("projector", projector)):
        prefix = next((p for p in prefixes if has(p + probe)), None)
        if prefix is None:
            raise ConfigError(
                f"model.init_from: {source} has no {what} tensors ({prefixes[0]}*); set model.vision=null "
                f"to load its text decoder alone"
            )
        found.append(prefix)
    return found[0], found[1]
