"""Every algorithm is a value of training.objective with its class and its config group; the keys
that chose one before (training.grpo.advantage, policy_loss, training.dpo.loss) and the sampling
keys that moved to training.rollout still run, each with a one-line notice, as the same config;
and a run directory saved by 9a6a2c5 (tests/golden/saved_configs_9a6a2c5/) is the same run. The
model keys that moved into model.moe and model.gemma4 likewise (tests/golden/saved_configs_9424640/)."""

import shutil
from pathlib import Path

import pytest

from tunix_train.compose import CONFIG_DIR, load_config
from tunix_train.config import ConfigError, Objective
from tunix_train.interop import loader
from tunix_train.train.objectives import ALGORITHMS
from tunix_train.train.setup import check_same_run

SAVED = Path(__file__).parent / "golden" / "saved_configs_9a6a2c5"
REWARD = "tunix_train.rewards.arithmetic:exact_match"
RECORDS = ["data=jsonl", "data.train_files=[prompts.jsonl]"]
OLD = [*RECORDS, f"training.grpo.reward=[{REWARD}]"]
NEW = [*RECORDS, f"training.rollout.reward=[{REWARD}]"]
PAIRS = ["data=jsonl", "data.train_files=[pairs.jsonl]"]

# name: (the command line 9a6a2c5 ran, its saved config's; the same run's command line now)
SAVED_RUNS = {
    "rloo": (
        [
            "objective=rloo",
            *OLD,
            "training.grpo.num_generations=2",
            "training.grpo.normalize_advantages=true",
        ],
        [
            "objective=rloo",
            *NEW,
            "training.rollout.num_generations=2",
            "training.rloo.normalize_advantages=true",
        ],
    ),
    "reinforce_pp": (
        ["objective=grpo", *OLD, "training.grpo.advantage=reinforce_pp"],
        ["objective=reinforce_pp", *NEW, "training.reinforce_pp.baseline=false"],
    ),
    "dapo": (["objective=dapo", *OLD], ["objective=dapo", *NEW]),
    "ppo": (
        ["objective=ppo", *OLD, "training.grpo.rollout_slots=4"],
        ["objective=ppo", *NEW, "training.rollout.slots=4"],
    ),
    "ipo": (["objective=dpo", *PAIRS, "training.dpo.loss=ipo"], ["objective=ipo", *PAIRS]),
    "lm": ([], []),
}
# more old command lines and the new ones that are the same config
SAME = {
    **SAVED_RUNS,
    "gae": (
        [
            "objective=grpo",
            *OLD,
            "training.grpo.advantage=gae",
            "model.score_head=true",
            "training.grpo.beta=0",
        ],
        ["objective=ppo", *NEW],
    ),
    "dapo's settings, rloo's advantage": (
        ["objective=dapo", *OLD, "training.grpo.advantage=rloo"],
        ["objective=dapo", *NEW, "training.objective=rloo"],
    ),
    "cispo by its loss": (
        ["objective=grpo", *OLD, "training.grpo.policy_loss=cispo"],
        ["objective=grpo", *NEW, "training.objective=cispo"],
    ),
    "cispo's default advantage": (
        ["objective=cispo", *OLD, "training.grpo.advantage=grpo"],
        ["objective=cispo", *NEW],
    ),
    "the rollout mesh": (
        [
            "objective=grpo",
            *OLD,
            "training.grpo.rollout_mesh_shape=[[2],[fsdp]]",
            "training.grpo.rollout_dtype=bf16",
        ],
        ["objective=grpo", *NEW, "training.rollout.mesh_shape=[[2],[fsdp]]", "training.rollout.dtype=bf16"],
    ),
}


def _config(args):
    return load_config(args)[0]


def test_every_objective_has_its_class_and_its_config_group():
    assert set(ALGORITHMS) == set(Objective)
    for kind in Objective:
        assert (CONFIG_DIR / "objective" / f"{kind.value}.yaml").is_file(), kind
        data = PAIRS if kind.preference_loss or kind in (Objective.kto, Objective.reward) else NEW
        taught = kind in (Objective.distill, Objective.gkd, Objective.distill_on_policy)
        teacher = ["training.distill.teacher=t"] if taught else []
        args = [f"objective={kind.value}", *([] if kind is Objective.lm else data), *teacher]
        assert _config(args).training.objective is kind


@pytest.mark.parametrize("case", SAME)
def test_the_old_keys_run_as_the_new_ones_with_one_line_each(case, capsys):
    old, new = SAME[case]
    was = _config(old)
    notices = capsys.readouterr().err.strip().splitlines()
    now = _config(new)
    assert capsys.readouterr().err == ""
    assert was == now
    deprecated = [a.partition("=")[0] for a in old if a.startswith(("training.grpo.", "training.dpo.loss"))]
    deprecated = [k for k in deprecated if k.rpartition(".")[2] not in ("beta", "epsilon")]
    assert len(notices) == len(deprecated)
    for key, notice in zip(deprecated, notices):
        assert (
            notice.startswith(f"tunix_train: {key}") and "is deprecated and will be removed: use " in notice
        )
        assert ("objective=" in notice) == key.endswith(("advantage", "policy_loss", "loss"))


# old command lines no objective matches now: each its one line
UNMATCHED = {
    "cispo's loss, rloo's advantage": (
        ["objective=cispo", "training.grpo.advantage=rloo"],
        "no objective has both that and objective=cispo's",
    ),
    "two keys, two names": (
        ["objective=grpo", "training.grpo.advantage=rloo", "training.grpo.policy_loss=cispo"],
        "name different objectives",
    ),
    "no such advantage": (
        ["objective=grpo", "training.grpo.advantage=a2c"],
        "advantage=a2c: not one of grpo",
    ),
}


@pytest.mark.parametrize("case", UNMATCHED)
def test_old_keys_that_no_objective_matches_are_one_line(case):
    old, message = UNMATCHED[case]
    with pytest.raises(ConfigError, match=message):
        _config([*old, *NEW])


@pytest.mark.parametrize("name", SAVED_RUNS)
def test_a_run_directory_saved_by_9a6a2c5_is_the_same_run(tmp_path, name):
    """Its saved config (the run's .hydra/config.yaml) against the same run's command line, old
    and new: no key differs; a fixed key changed still refuses; the run's config reads as this
    version's, the objective named (loader.run_config: what model.init_from=RUN and export read)."""
    old, new = SAVED_RUNS[name]
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    shutil.copy(SAVED / f"{name}.yaml", run / ".hydra" / "config.yaml")
    for args in (old, new):
        check_same_run(run, _config(args))
    changed = "training.dpo.beta=0.2" if name == "ipo" else "training.seed=1"
    with pytest.raises(ConfigError, match=f"holds a run with {changed.partition('=')[0]}="):
        check_same_run(run, _config([*new, changed]))
    assert loader.run_config(run).training.objective is Objective(name).computes  # dapo: grpo, as saved


def test_dapo_dr_grpo_and_gspo_are_grpo_with_their_settings_on_resume(tmp_path):
    """A run saved as objective=grpo with DAPO's settings resumes as objective=dapo (9a6a2c5 saved
    dapo as grpo), and one saved as dapo refuses another algorithm."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    shutil.copy(SAVED / "dapo.yaml", run / ".hydra" / "config.yaml")
    check_same_run(run, _config(["objective=dapo", *NEW]))
    check_same_run(run, _config(["objective=dapo", *NEW, "training.objective=grpo"]))
    with pytest.raises(ConfigError, match="holds a run with training.objective='grpo', not 'rloo'"):
        check_same_run(run, _config(["objective=dapo", *NEW, "training.objective=rloo"]))


def test_an_old_key_in_a_users_config_file_names_its_new_key(tmp_path):
    """The command line's old keys are rewritten; a config file's are not (it is the user's to
    change), and the error says where the key went."""
    (tmp_path / "objective").mkdir()
    (tmp_path / "objective" / "mine.yaml").write_text(
        "# @package training\ndefaults:\n  - grpo\n  - _self_\ngrpo:\n  num_generations: 8\n"
    )
    with pytest.raises(ConfigError) as refused:
        _config(["--config-dir", str(tmp_path), "objective=mine", *NEW])
    moved = "'training.grpo.num_generations' moved to training.rollout.num_generations: set that instead"
    assert str(refused.value) == f"config key {moved}"


# the experts' flat model keys (9424640) and their model.moe names
MOE_KEYS = {
    "model.num_experts=4": "model.moe.experts=4",
    "model.num_experts_per_token=1": "model.moe.experts_per_token=1",
    "model.moe_hidden_dim=32": "model.moe.hidden_dim=32",
    "model.moe_router=softmax": "model.moe.router=softmax",
    "model.moe_norm_topk_prob=false": "model.moe.norm_topk_prob=false",
    "model.dense_mlp=false": "model.moe.dense_mlp=false",
    "model.moe_dispatch=capacity": "model.moe.dispatch=capacity",
    "model.moe_capacity_factor=2.0": "model.moe.capacity_factor=2.0",
}


# Gemma 4's flat model keys (2b1c18f) and their model.gemma4 names
GEMMA4_KEYS = {
    f"model.{name}={value}": f"model.gemma4.{name}={value}"
    for name, value in (
        ("global_head_dim", 64),
        ("num_global_kv_heads", 2),
        ("attention_k_eq_v", "false"),
        ("rope_partial_factor_global", 0.5),
        ("use_v_norm", "false"),
        ("num_kv_shared_layers", 2),
        ("double_wide_mlp", "false"),
        ("per_layer_input_dim", 4),
        ("per_layer_input_vocab_size", 128),
        ("use_layer_scalar", "false"),
    )
}


@pytest.mark.parametrize("model, keys", [("gemma4_moe_tiny", MOE_KEYS), ("gemma4_tiny", GEMMA4_KEYS)])
def test_the_old_model_keys_run_as_their_section_with_one_line_each(capsys, model, keys):
    was = _config([f"model={model}", *keys])
    notices = capsys.readouterr().err.strip().splitlines()
    assert was == _config([f"model={model}", *keys.values()])
    assert len(notices) == len(keys)
    for (old, new), notice in zip(keys.items(), notices):
        assert notice == (
            f"tunix_train: {old.partition('=')[0]} is deprecated and will be removed: use "
            f"{new.partition('=')[0]}"
        )


MOE_RUNS = {  # saved by 9424640, before model.moe and model.gemma4 (tests/golden/saved_configs_9424640/)
    "gemma4_moe": ["model=gemma4_moe_tiny", "model.moe.dispatch=capacity", "model.moe.capacity_factor=2.0"],
    "qwen3_moe": [
        "model=qwen3_moe_tiny",
        "model.moe.experts=16",
        "model.moe.experts_per_token=4",
        "model.moe.norm_topk_prob=false",
    ],
}


@pytest.mark.parametrize("name", MOE_RUNS)
def test_a_run_saved_with_the_experts_flat_keys_is_the_same_run(tmp_path, name):
    """Its saved config against the same run's command line now: no key differs, a fixed expert
    key changed still refuses, a changeable one (dispatch) does not; the run's config reads with
    its experts in model.moe and Gemma 4's fields in model.gemma4."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    shutil.copy(SAVED.parent / "saved_configs_9424640" / f"{name}.yaml", run / ".hydra" / "config.yaml")
    now = [*MOE_RUNS[name], "data=synthetic"]
    check_same_run(run, _config(now))
    check_same_run(run, _config([*now, "model.moe.dispatch=dropless"]))
    with pytest.raises(ConfigError, match="holds a run with model.moe.experts_per_token="):
        check_same_run(run, _config([*now, "model.moe.experts_per_token=3"]))
    saved = loader.run_config(run).model
    assert (saved.moe, saved.gemma4) == (_config(now).model.moe, _config(now).model.gemma4)
