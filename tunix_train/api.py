"""A small Python API for notebooks: load a checkpoint onto a mesh and compute logits.

    from tunix_train import api
    model = api.load("outputs/default/2026-11-22/10-00-00")       # a run (its latest checkpoint)
    model = api.load("/models/gemma-3-1b-pt", mesh_shape=[[4, 1], ["fsdp", "tp"]])  # Hugging Face
    logits = model.logits([[2, 651, 6037]])                           # [batch, positions, vocab]

    model.generate([[2, 651, 6037]], max_new_tokens=32)              # new token ids per prompt
    model.generate_text(["To be, or not"], max_new_tokens=32, temperature=0.7, top_p=0.9)

`path` is a GGUF file (llama.cpp's format), a Hugging Face Gemma directory (config.json +
safetensors), or a tunix_train run directory, its checkpoints/ folder, or one step's folder.
"""

from tunix_train.generate.loaded import LoadedModel, load
from tunix_train.interop.loader import run_config

__all__ = ["LoadedModel", "load", "run_config"]
