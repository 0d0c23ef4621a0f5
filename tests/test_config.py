"""The config schema's resume marks: every field says whether a resumed run may change it, and the
run directory check reads those marks."""

import dataclasses

import pytest
from conftest import config
from omegaconf import OmegaConf

from tunix_train.compose import load_config
from tunix_train.config import Config, ConfigError, _changeable, _fixed, changeable_on_resume
from tunix_train.train.setup import _flatten, check_same_run, save_config


def test_every_config_field_is_marked_for_resume():
    keys = _flatten(OmegaConf.to_container(OmegaConf.structured(Config)))
    marks = changeable_on_resume()
    assert set(marks) == set(keys)
    assert marks["model.mesh_shape"] and marks["checkpoint.keep"] and marks["training.max_steps"]
    assert not marks["training.seed"] and not marks["model.num_layers"] and not marks["data.seq_len"]


def test_a_field_without_a_mark_is_refused():
    @dataclasses.dataclass
    class Section:
        marked: int = _fixed(1)
        unmarked: int = 2

    @dataclasses.dataclass
    class Schema:
        top: bool = _changeable(True)
        section: Section = dataclasses.field(default_factory=Section)

    with pytest.raises(TypeError, match="config field section.unmarked says neither _changeable nor _fixed"):
        changeable_on_resume(Schema)


def test_resuming_may_change_only_the_fields_marked_changeable(tmp_path):
    save_config(config(), [], tmp_path)
    check_same_run(tmp_path, config())
    changeable = [
        "training.max_steps=7",
        'model.mesh_shape=[[2],["fsdp"]]',
        "checkpoint.keep=5",
        "training.xla_cpu_multi_output_fusion=false",
        "distributed.initialization_timeout_s=30",
    ]
    check_same_run(tmp_path, config(*changeable))
    for fixed, message in (
        ("training.seed=1", "training.seed=0, not 1"),
        ("training.learning_rate=0.1", "training.learning_rate=0.003, not 0.1"),
        ("model.num_layers=3", "model.num_layers=2, not 3"),
    ):
        with pytest.raises(ConfigError, match=f"holds a run with {message}"):
            check_same_run(tmp_path, config(*changeable, fixed))


def test_a_run_saved_with_a_retired_key_still_loads_and_resumes(tmp_path):
    """training.lora.dropout was removed (it only ever accepted 0): a run directory whose saved
    config holds it at 0 resumes and loads; any other value is a one-line error."""
    from tunix_train.api import run_config

    cfg = config("training.lora.rank=4")
    save_config(cfg, [], tmp_path)
    saved = OmegaConf.load(tmp_path / ".hydra" / "config.yaml")
    saved.training.lora.dropout = 0.0
    OmegaConf.save(saved, tmp_path / ".hydra" / "config.yaml")
    check_same_run(tmp_path, cfg)
    assert run_config(tmp_path).training.lora.rank == 4
    saved.training.lora.dropout = 0.1
    OmegaConf.save(saved, tmp_path / ".hydra" / "config.yaml")
    with pytest.raises(ConfigError, match="training.lora.dropout=0.1, a key this version no longer has"):
        check_same_run(tmp_path, cfg)


def test_a_users_config_dir_is_searched_before_the_package_configs(tmp_path):
    """--config-dir DIR: DIR/model/mine.yaml starts from a shipped model and is found as model=mine;
    the package's groups (data, objective) are still there; a missing folder is a one-line error."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text("defaults:\n  - gemma3_tiny\nname: mine\nnum_layers: 3\n")
    cfg, _ = load_config(["--config-dir", str(tmp_path), "model=mine", "data=synthetic"])
    tiny, _ = load_config(["model=gemma3_tiny"])
    assert (cfg.model.name, cfg.model.num_layers, cfg.model.embed_dim) == ("mine", 3, tiny.model.embed_dim)
    assert cfg.data.source.value == "synthetic"
    same, _ = load_config([f"--config-dir={tmp_path}", "model=mine"])
    assert same.model == cfg.model
    with pytest.raises(ConfigError, match="--config-dir '/no/such/folder' is not a directory"):
        load_config(["--config-dir", "/no/such/folder"])
    (tmp_path / "model" / "broken.yaml").write_text("defaults: [gemma3_tiny]\nname: [unclosed\n")
    with pytest.raises(ConfigError, match=r"not a YAML config: .*broken\.yaml\", line 3") as err:
        load_config(["--config-dir", str(tmp_path), "model=broken"])
    assert "\n" not in str(err.value)


def test_errors_read_the_same_under_a_tracer(monkeypatch):
    """OC_CAUSE=1 (as a debugger or coverage does) makes OmegaConf chain its unformatted cause
    ('$VALUE', no key) behind each error: the one line is the same."""
    from tunix_train.compose import load_config

    for cause in ("0", "1"):
        monkeypatch.setenv("OC_CAUSE", cause)
        with pytest.raises(ConfigError) as unknown:
            load_config(["model.foo=1"])
        with pytest.raises(ConfigError) as invalid:
            load_config(["model.context_parallel_strategy=bogus"])
        assert str(unknown.value).startswith("unknown config key 'model.foo': check its spelling")
        assert str(invalid.value) == (
            "config key 'model.context_parallel_strategy': "
            "Invalid value 'bogus', expected one of [all_gather, ring]"
        )
