"""Other formats in and out: Hugging Face safetensors checkpoints (hf.py), GGUF files (gguf.py),
PEFT adapters (peft.py); and which of them a path holds."""

from __future__ import annotations

from pathlib import Path


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
