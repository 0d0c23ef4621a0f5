"""Logits parity with transformers' Gemma, Gemma 2 and Gemma 3 (tiny random models, sliding windows
included). transformers runs in this process, or in TUNIX_TRAIN_REFERENCE_PYTHON's (hf_reference.py)."""

import jax
import numpy as np
import pytest

from hf_reference import FAMILIES, SEQ, SIZES, WINDOW, checkpoint_and_logits
from tunix_train import api

MESH = [[2, 2], ["fsdp", "tp"]]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tmp_path, family):
    tokens = np.random.default_rng(0).integers(0, SIZES["vocab_size"], (2, SEQ))
    reference = checkpoint_and_logits(family, tmp_path / "checkpoint", tokens)
    model = api.load(tmp_path / "checkpoint", mesh_shape=MESH, devices=jax.devices()[:4])
    if family != "gemma":
        assert model.config.sliding_window == WINDOW and model.config.local_layers_per_global > 0
    np.testing.assert_allclose(model.logits(tokens), reference, atol=1e-4, rtol=0)
