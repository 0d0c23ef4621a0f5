"""Logits and greedy-generation parity with transformers' Gemma, Gemma 2 and Gemma 3 (tiny random
models, sliding windows included).
transformers runs in this process, or in TUNIX_TRAIN_REFERENCE_PYTHON's (hf_reference.py)."""

import jax
import numpy as np
import pytest
from hf_reference import FAMILIES, SEQ, SIZES, WINDOW, checkpoint_and_logits

from tunix_train import api

MESH = [[2, 2], ["fsdp", "tp"]]
GREEDY = 24  # new tokens, past the sliding window of 5


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tmp_path, family):
    tokens = np.random.default_rng(0).integers(0, SIZES["vocab_size"], (2, SEQ))
    reference = checkpoint_and_logits(family, tmp_path / "checkpoint", tokens)
    model = api.load(tmp_path / "checkpoint", mesh_shape=MESH, devices=jax.devices()[:4])
    if family != "gemma":
        assert model.config.sliding_window == WINDOW and model.config.local_layers_per_global > 0
    np.testing.assert_allclose(model.logits(tokens), reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_transformers(tmp_path, family):
    prompt = np.random.default_rng(2).integers(3, SIZES["vocab_size"], (1, 6))
    reference = checkpoint_and_logits(family, tmp_path / "checkpoint", prompt, greedy_tokens=GREEDY)
    model = api.load(tmp_path / "checkpoint", mesh_shape=MESH, devices=jax.devices()[:4])
    assert model.stop_ids == (1,)  # transformers' default Gemma EOS, read from config.json
    assert len(set(reference.tolist())) > 3  # not one repeated token
    assert model.generate(prompt.tolist(), max_new_tokens=GREEDY) == [reference.tolist()]
