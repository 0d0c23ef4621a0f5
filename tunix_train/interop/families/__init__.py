"""The model families, one module each (family.py: what a family is, and the registry). Importing
this package registers them all; `named`, `of_hf` and `of_gguf` find one."""

from tunix_train.interop.families import (  # noqa: F401 (each registers its family)
    gemma,
    gemma2,
    gemma3,
    gemma4,
    llama,
    mistral,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
)
from tunix_train.interop.families.family import (
    Family,
    GgufConventions,
    GgufFile,
    gguf_architectures,
    named,
    of_gguf,
    of_hf,
    register,
)

__all__ = [
    "Family",
    "GgufConventions",
    "GgufFile",
    "gguf_architectures",
    "named",
    "of_gguf",
    "of_hf",
    "register",
]
