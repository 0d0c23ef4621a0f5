"""Hugging Face interop: export/import round trips that transformers loads, sliced reads, init_from
(logits parity with transformers: test_hf_parity.py)."""

import dataclasses
import enum

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="these tests need torch: pip install -e '.[reference]'")
transformers = pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[reference]'")

import hf_reference  # noqa: E402
from conftest import config  # noqa: E402
from hf_reference import FAMILIES, SEQ, SIZES  # noqa: E402

from tunix_train import api, export  # noqa: E402
from tunix_train.config import ConfigError  # noqa: E402
from tunix_train.interop import hf  # noqa: E402
from tunix_train.train.loop import train  # noqa: E402

MESH = [[2, 2], ["fsdp", "tp"]]


@pytest.mark.parametrize("family", FAMILIES)
def test_export_then_import_is_identical_and_transformers_loads_it(tmp_path, family):
    reference_model = hf_reference.build(family, tmp_path / "source")
    model = api.load(tmp_path / "source", mesh_shape=MESH, devices=jax.devices()[:4])
    hf.export(model.params, model.config, tmp_path / "exported")
    again = api.load(tmp_path / "exported", mesh_shape=[[4, 1], ["fsdp", "tp"]], devices=jax.devices()[:4])
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(again.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    loaded = type(reference_model).from_pretrained(tmp_path / "exported").eval()
    tokens = np.random.default_rng(1).integers(0, SIZES["vocab_size"], (1, SEQ))
    np.testing.assert_array_equal(
        hf_reference.logits(loaded, tokens), hf_reference.logits(reference_model, tokens)
    )


def test_each_device_reads_only_its_slice(tmp_path, monkeypatch):
    hf_reference.build("gemma3", tmp_path)
    shapes = {}
    original = hf._SafetensorsFiles.read

    def recording_read(self, name, slices):
        block = original(self, name, slices)
        shapes.setdefault(name, set()).add(block.shape)
        return block

    monkeypatch.setattr(hf._SafetensorsFiles, "read", recording_read)
    api.load(tmp_path, mesh_shape=MESH, devices=jax.devices()[:4])
    q_rows = SIZES["num_attention_heads"] * SIZES["head_dim"]
    # q_proj is [heads x head_dim, embed]; tp=2 splits the heads, fsdp=2 the embed dimension.
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == {(q_rows // 2, SIZES["hidden_size"] // 2)}


def model_overrides(fields: dict) -> list[str]:
    """Command-line overrides setting ModelConfig fields (an enum by its value, a section key by key)."""

    def text(value):
        return value.value if isinstance(value, enum.Enum) else value

    overrides = []
    for key, value in fields.items():
        if dataclasses.is_dataclass(value):
            overrides += [
                f"model.{key}.{f.name}={text(getattr(value, f.name))}"
                for f in dataclasses.fields(value)
                if getattr(value, f.name) is not None
            ]
        elif value is not None:
            overrides.append(f"model.{key}={text(value)}")
    return overrides


def test_init_from_starts_training_from_the_checkpoint(tmp_path):
    hf_reference.build("gemma3", tmp_path / "hf")
    fields = hf.model_fields_from_hf(hf.read_hf_config(tmp_path / "hf"))
    overrides = model_overrides(fields)
    # learning rate 0: the step leaves the parameters as they were loaded
    cfg = config(
        *overrides, f"model.init_from={tmp_path / 'hf'}", "training.max_steps=1", "training.learning_rate=0"
    )
    state = train(cfg, tmp_path / "run", devices=jax.devices()[:1])
    loaded = api.load(tmp_path / "hf", devices=jax.devices()[:1])
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(loaded.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert "initialized from model.init_from" in (tmp_path / "run" / "train.log").read_text()

    wrong = config(
        *[o for o in overrides if "embed_dim" not in o],
        "model.embed_dim=32",
        f"model.init_from={tmp_path / 'hf'}",
    )
    with pytest.raises(ConfigError, match="has embed_dim=64 but model.embed_dim=32"):
        train(wrong, tmp_path / "wrong", devices=jax.devices()[:1])
    assert not (tmp_path / "wrong").exists()


def test_native_checkpoint_loads_for_notebooks(tmp_path):
    cfg = config("training.max_steps=2")
    state = train(cfg, tmp_path / "run", devices=jax.devices()[:1])
    model = api.load(tmp_path / "run", mesh_shape=[[2, 2], ["fsdp", "tp"]], devices=jax.devices()[:4])
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(model.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    logits = model.logits([[1, 2, 3, 4]])
    assert logits.shape == (1, 4, cfg.model.vocab_size) and np.all(np.isfinite(logits))
    # ... and exports with the command line tool, for transformers
    assert export.main([str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    np.testing.assert_allclose(
        hf_reference.logits(reference, np.array([[1, 2, 3, 4]])), logits, atol=1e-4, rtol=0
    )
    assert export.main([str(tmp_path / "run"), str(tmp_path / "hf")]) == 2  # never over an existing export
