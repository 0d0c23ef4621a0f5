"""A fifth family defined here, in the test alone: config values (Gemma 3's decoder with its own
output layer and unscaled embeddings) and an interop table (its config.json both ways). It trains
on fsdp2 x tp2 as on one device, and its checkpoint goes out as a Hugging Face directory and back
with the same logits, without a line of tunix_train/ knowing it."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import config, losses_on_one_device_and_fsdp2_tp2
from flax import nnx

from tunix_train import api
from tunix_train.config import ConfigError
from tunix_train.interop import families
from tunix_train.interop.families import gemma3
from tunix_train.model.factory import build_model

TOY = families.register(
    families.Family(
        name="toy",
        hf_model_types=("toy_text",),
        hf_architecture="ToyForCausalLM",
        from_hf=gemma3.FAMILY.from_hf,
        to_hf=gemma3.to_hf,
        fixed={**gemma3.FIXED, "tie_embeddings": False, "scale_embeddings": False},
    )
)
TOY_MODEL = ("model.family=toy", "model.tie_embeddings=false", "model.scale_embeddings=false")


def _toy(*overrides):
    return config(*TOY_MODEL, "model.vocab_size=256", *overrides)


def test_the_toy_family_has_its_own_output_layer_and_unscaled_embeddings():
    cfg = _toy().model
    model = build_model(cfg, nnx.Rngs(0))
    assert model.output_VD is not None and model.output_VD.shape == model.embedding_VD.shape
    tokens = jnp.array([[3, 7, 11]])
    np.testing.assert_array_equal(model.embed(tokens), model.embedding_VD[...][tokens])
    logits = model(tokens)
    hidden = model.hidden(tokens)
    np.testing.assert_allclose(logits, jnp.einsum("btd,vd->btv", hidden, model.output_VD[...]), rtol=1e-6)


def test_the_toy_family_trains_on_fsdp2_tp2_as_on_one_device(tmp_path):
    runs = losses_on_one_device_and_fsdp2_tp2(tmp_path, *TOY_MODEL, "model.vocab_size=256", steps=2)
    assert len(runs["one"]) == 2 and np.all(np.isfinite(runs["one"]))
    np.testing.assert_allclose(runs["fsdp2_tp2"], runs["one"], rtol=1e-5)

    # out through its interop table and back: config.json names the family, lm_head holds the output
    model = api.load(tmp_path / "fsdp2_tp2", devices=jax.devices()[:4])
    model.export(tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (written["model_type"], written["architectures"], written["tie_word_embeddings"]) == (
        "toy_text",
        ["ToyForCausalLM"],
        False,
    )
    again = api.load(tmp_path / "hf", devices=jax.devices()[:4])
    assert (again.config.family, again.config.tie_embeddings, again.config.scale_embeddings) == (
        "toy",
        False,
        False,
    )
    tokens = [[2, 5, 9, 14, 3]]
    np.testing.assert_allclose(again.logits(tokens), model.logits(tokens), rtol=1e-6, atol=1e-6)


def test_a_model_unlike_its_family_is_not_written_as_one():
    cfg = _toy("model.scale_embeddings=true").model
    with pytest.raises(ConfigError, match="model.scale_embeddings=True: every toy checkpoint"):
        TOY.hf_config(cfg)
    with pytest.raises(ConfigError, match="model.family='falcon' is no family this package knows"):
        families.named("falcon")
