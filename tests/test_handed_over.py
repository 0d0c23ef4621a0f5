"""Files handed over with a model, as a hostile or careless user sends them: each crafted
config.json, safetensors file and teacher file is one line naming it (a ConfigError when read;
exit 2 without a traceback from the command line), never a traceback or a model that fails later."""

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, cpu_env

from tunix_train.compose import load_config
from tunix_train.config import ConfigError
from tunix_train.interop import hf, loader


def _config() -> dict:
    """config.json of gemma3_vision_tiny, as our export writes it."""
    return hf.hf_config(load_config(["model=gemma3_vision_tiny", "data=synthetic"])[0].model)


def _vision(**changes):
    def change(config):
        config["vision_config"].update(changes)

    return change


def _drop(key):
    return lambda config: config["vision_config"].pop(key)


def _top(**changes):
    return lambda config: config.update(changes)


CRAFTED = [  # (name, config.json's text or a change to the valid one, words of the error)
    ("not JSON", "{", "is not valid JSON"),
    ("NaN", '{"model_type": "gemma3", "vocab_size": NaN}', "NaN is not a JSON number"),
    ("100k deep", '{"a": ' * 100_000 + "1" + "}" * 100_000, "nested more than 64 deep"),
    ("a list", "[1, 2]", "must hold a JSON object, not list"),
    ("no image_size", _drop("image_size"), "vision_config has no 'image_size'"),
    ("patch_size 0", _vision(patch_size=0), "vision patch_size=0 must be positive"),
    ("no heads", _vision(num_attention_heads=0), "vision num_heads=0 must be positive"),
    ("image_size a string", _vision(image_size="896"), "vision image_size='896' must be a whole number"),
    ("image_size negative", _vision(image_size=-32), "vision image_size=-32 must be positive"),
    ("mm_tokens_per_image negative", _top(mm_tokens_per_image=-16), "tokens_per_image=-16 must be positive"),
    ("image_token_index 1e12", _top(image_token_index=10**12), "the image token 1000000000000 lies outside"),
    (
        "layer_norm_eps a list",
        _vision(layer_norm_eps=[1]),
        "vision layer_norm_eps=[1] must be a finite number",
    ),
]


def _folder(tmp_path, name, content):
    folder = tmp_path / name.replace(" ", "_")
    folder.mkdir()
    if callable(content):
        config = _config()
        content(config)
        content = json.dumps(config)
    (folder / "config.json").write_text(content)
    return folder


@pytest.mark.parametrize("name, content, words", CRAFTED, ids=[c[0] for c in CRAFTED])
def test_a_crafted_config_json_is_one_line_naming_it(tmp_path, name, content, words):
    folder = _folder(tmp_path, name, content)
    with pytest.raises(ConfigError) as err:
        loader.source(folder)
    said = str(err.value)
    assert words in said and str(folder) in said and "\n" not in said and len(said) < 400, said


def test_a_config_json_linked_outside_its_folder_is_not_followed(tmp_path):
    folder = tmp_path / "linked"
    folder.mkdir()
    (folder / "config.json").symlink_to("/etc/passwd")
    with pytest.raises(ConfigError, match=r"config.json is a link to /etc/passwd, outside its folder"):
        loader.source(folder)


def test_a_damaged_safetensors_file_is_one_line_naming_it(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 8 + b"{not a header")
    with pytest.raises(ConfigError, match=r"model.safetensors is not a readable safetensors file"):
        hf._SafetensorsFiles(tmp_path)


def test_the_command_line_says_one_line_and_exits_2(tmp_path):
    """generate on a folder whose config.json gives a negative image size: exit 2, one line."""
    folder = _folder(tmp_path, "negative", _vision(image_size=-32))
    proc = subprocess.run(
        [sys.executable, "-m", "tunix_train.generate", str(folder), "--prompt", "Hi"],
        cwd=REPO,
        env=cpu_env(1),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "vision image_size=-32 must be positive" in proc.stderr


def _teacher_store(folder, values):
    """A teacher_logits directory of one step whose top_log_probs are `values` (else valid)."""
    from tunix_train.data import teacher_logits as stored

    A, B, T, k = 1, 2, 4, 2
    writer = stored.Writer(folder, 0, range(0, B))
    batch = {name: np.zeros((A, B, T), np.int32) for name in stored.TOKEN_FIELDS}
    batch["top_ids"] = np.zeros((A, B, T, k), np.int32)
    batch["top_log_probs"] = np.full((A, B, T, k), values, np.float32)
    writer.add("train", batch)
    writer.close()
    meta = dict(top_k=k, vocab_size=8, seq_len=T, global_micro_batch=B, accumulation_steps=A, steps=1)
    stored.write_meta(folder, {**meta, "eval_batches": 0})
    return stored.read_meta(folder)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, 50.0])
def test_teacher_log_probabilities_are_checked_when_the_file_is_opened(tmp_path, value):
    from tunix_train.data import teacher_logits as stored

    meta = _teacher_store(tmp_path / "bad", [-0.5, value])
    with pytest.raises(ConfigError, match=r"holds log-probabilities that are not finite numbers at most 0"):
        stored.StoredBatches(tmp_path / "bad", "train", range(0, 2), meta)
    meta = _teacher_store(tmp_path / "good", [-0.5, -1e-6])  # at 0 within rounding: read
    assert next(stored.StoredBatches(tmp_path / "good", "train", range(0, 2), meta))["top_log_probs"].shape
