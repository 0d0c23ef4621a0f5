"""GGUF files against transformers: the logits of a GGUF written from a random transformers model,
loaded by us and by transformers' GGUF loader (Gemma 2 and 3; transformers reads no Gemma 1 GGUF,
so that one is checked against the transformers model it was written from)."""

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="these tests need torch: pip install -e '.[reference]'")
transformers = pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[reference]'")

import gguf_files  # noqa: E402
import hf_reference  # noqa: E402
from hf_reference import FAMILIES, SEQ, SIZES  # noqa: E402

from tunix_train import api  # noqa: E402

MESH = [[2, 2], ["fsdp", "tp"]]


# transformers reads no Gemma 1 GGUF: a float32 one is checked against its source, a quantized one not at all.
CASES = [
    (family, types)
    for family in FAMILIES
    for types in ("f32", "mixed")
    if (family, types) != ("gemma", "mixed")
]


@pytest.mark.parametrize("family, types", CASES)
def test_gguf_logits_match_transformers(tmp_path, family, types):
    source = hf_reference.build(family, tmp_path / "hf", for_gguf=True)
    tensors = {name: t.numpy() for name, t in source.state_dict().items()}
    path = gguf_files.write(
        tmp_path / "model.gguf",
        family,
        source.config.to_dict(),
        tensors,
        gguf_files.mixed_types if types == "mixed" else None,
    )
    tokens = np.random.default_rng(0).integers(0, SIZES["vocab_size"], (2, SEQ))
    ours = api.load(path, mesh_shape=MESH, devices=jax.devices()[:4]).logits(tokens)
    if family == "gemma":
        reference = hf_reference.logits(source, tokens)
    else:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, gguf_file="model.gguf", dtype=torch.float32
        ).eval()
        assert type(loaded) is type(source)
        reference = hf_reference.logits(loaded, tokens)
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
