"""GKD (objective=gkd, train/objectives/gkd.py): a micro-batch's loss equals TRL's
GKDTrainer.generalized_jsd_loss; a rollout is the student's samples with probability lmbda (seeded
per rollout), else the records' completions; a student that is its teacher has no divergence on
either; the runs are the same on fsdp2 x tp2; bad settings and records are one line each."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import LORA_RESUMED, read_metrics, rl_config
from hf_reference import build

from tunix_train.config import ConfigError
from tunix_train.train.objectives import make_objective


def _gkd(tmp_path, *overrides, objective="gkd"):
    return rl_config(
        tmp_path,
        "training.eval_every=0",
        "checkpoint.every_steps=0",
        "training.micro_batch_size=8",
        "training.rollout.reward=[tunix_train.rewards.arithmetic:exact_match]",
        "training.distill.completion_field=answer",
        "training.learning_rate=3e-3",
        *overrides,
        objective=objective,
    )


class _Student:
    """A Forward's per_token over given logits [B, T, V]."""

    def __init__(self, logits):
        self.logits = logits

    def per_token(self, fn, other):
        return fn(self.logits, other.logits)


@pytest.mark.parametrize("beta, temperature", [(0.0, 1.0), (0.5, 2.0), (1.0, 1.0)])
def test_the_loss_of_a_micro_batch_equals_trls_generalized_jsd_loss(tmp_path, beta, temperature):
    """Random logits [2, 6, 11] whose completion tokens are masked in: the loss (divergence over
    the batch's completion tokens) equals TRL's on labels -100 off them, within 1e-6."""
    torch = pytest.importorskip("torch")
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    cfg = _gkd(
        tmp_path,
        "training.distill.teacher=unread",
        f"training.distill.beta={beta}",
        f"training.distill.temperature={temperature}",
    )
    rng = np.random.default_rng(0)
    student, teacher = (rng.standard_normal((2, 6, 11)).astype(np.float32) * 3 for _ in range(2))
    mask = np.zeros((2, 6), np.float32)
    mask[0, 2:5] = mask[1, 1:6] = 1.0
    labels = np.where(mask > 0, rng.integers(0, 11, (2, 6)), -100)
    loss, metrics = make_objective(cfg).loss(
        _Student(jnp.asarray(student)),
        None,
        {"loss_mask": jnp.asarray(mask)},
        {"tokens": jnp.float32(mask.sum())},
        models={"teacher": _Student(jnp.asarray(teacher))},
    )
    theirs = gkd.GKDTrainer.generalized_jsd_loss(
        torch.from_numpy(student), torch.from_numpy(teacher), torch.from_numpy(labels), beta, temperature
    )
    assert float(loss) == pytest.approx(float(theirs), abs=1e-6)
    assert float(metrics["divergence"]) == float(loss)


def _run(tmp_path, name, steps, *overrides, devices=1, model=None):
    """A GKD run's logged steps and samples; `model`: the student's config (started from its
    init_from)."""
    import dataclasses

    from tunix_train.train.loop import train

    cfg = _gkd(tmp_path, f"training.max_steps={steps}", *overrides)
    if model is not None:
        cfg.model = dataclasses.replace(model, mesh_shape=cfg.model.mesh_shape, init_from=model.init_from)
    train(cfg, tmp_path / name, devices=jax.devices()[:devices])
    samples = [json.loads(line) for line in (tmp_path / name / "samples.jsonl").read_text().splitlines()]
    return [m for m in read_metrics(tmp_path / name) if "loss" in m], samples


def test_a_student_that_is_its_teacher_has_no_divergence_on_its_samples_or_the_records(tmp_path):
    """lmbda 0.5, seed 0: rollout r is the student's samples where a generator seeded (0, r) draws
    below 0.5 (logged as on_policy), else the records' answers, which the samples file shows. With
    the student started from its teacher's checkpoint (and kept there), the divergence of every
    step is 0 (below 1e-5: the loss in float32) on either kind."""
    import dataclasses

    from tunix_train.interop import loader

    build("gemma3", tmp_path / "teacher", vocab_size=4096)
    teacher = tmp_path / "teacher"
    model = dataclasses.replace(loader.source(teacher).cfg.model, init_from=str(teacher))
    # learning rate 0: Adam would turn the float noise of a zero gradient into steps of the full rate
    metrics, samples = _run(
        tmp_path, "itself", 4, f"training.distill.teacher={teacher}", "training.learning_rate=0", model=model
    )
    expected = [float(np.random.default_rng([0, r]).random() < 0.5) for r in range(4)]
    assert [m["on_policy"] for m in metrics] == expected and 0 < sum(expected) < 4
    answers = {
        r["prompt"]: r["answer"] for r in map(json.loads, (tmp_path / "task" / "prompts.jsonl").open())
    }
    for sample in samples:
        if not expected[sample["step"] - 1]:
            assert sample["text"] == f"{answers[sample['prompt']]}  [reward 1]", sample  # exact match
    assert all(abs(m["divergence"]) < 1e-5 for m in metrics), metrics


def test_with_seq_kd_the_rollouts_not_the_students_are_the_teachers_samples(tmp_path):
    """lmbda 0 with seq_kd: every rollout is sampled by the teacher's engine. A fresh student's
    rollouts are then the very completions that a student started from the teacher samples itself
    at lmbda 1 (the same weights, sampling settings and seeds), not those the fresh student samples
    at lmbda 1; its divergence from the teacher is well above 0. The records' completion field is
    not read (here it does not exist)."""
    import dataclasses

    from tunix_train.interop import loader

    build("gemma3", tmp_path / "teacher", vocab_size=4096)
    teacher = tmp_path / "teacher"
    itself = dataclasses.replace(loader.source(teacher).cfg.model, init_from=str(teacher))
    same = (
        f"training.distill.teacher={teacher}",
        "training.learning_rate=0",
        "training.rollout.temperature=1.5",
    )
    seq_kd, by_teacher = _run(
        tmp_path,
        "seq_kd",
        2,
        *same,
        "training.distill.lmbda=0",
        "training.distill.seq_kd=true",
        "training.distill.completion_field=missing",
    )
    _, teachers_own = _run(tmp_path, "teacher_on_policy", 2, *same, "training.distill.lmbda=1", model=itself)
    _, students_own = _run(tmp_path, "student_on_policy", 2, *same, "training.distill.lmbda=1")
    assert [m["on_policy"] for m in seq_kd] == [0.0, 0.0]
    assert by_teacher == teachers_own and len({s["text"] for s in by_teacher}) > 1, by_teacher
    assert by_teacher != students_own
    assert all(m["divergence"] > 0.1 for m in seq_kd), seq_kd


@pytest.mark.slow  # two runs
def test_gkd_is_the_same_on_one_device_and_fsdp2_tp2(tmp_path):
    """A random student and teacher: the first two steps' divergence and reward on one device and
    on fsdp2 x tp2 (3e-5; the second follows an Adam step); the divergence is well above 0."""
    build("gemma3", tmp_path / "teacher", vocab_size=4096)
    teacher = tmp_path / "teacher"
    runs = {
        name: _run(
            tmp_path,
            name,
            2,
            f"training.distill.teacher={teacher}",
            f"training.micro_batch_size={rows}",
            f"model.mesh_shape={mesh}",
            "training.distill.lmbda=1.0",
            devices=devices,
        )[0]
        for name, rows, mesh, devices in (
            ("one", 8, '[[1],["fsdp"]]', 1),
            ("sharded", 4, '[[2,2],["fsdp","tp"]]', 4),
        )
    }
    for key in ("divergence", "reward"):
        np.testing.assert_allclose(
            [m[key] for m in runs["sharded"]], [m[key] for m in runs["one"]], rtol=3e-5, err_msg=key
        )
    assert all(m["divergence"] > 0.1 and m["on_policy"] == 1.0 for m in runs["one"])


@pytest.mark.slow  # two runs of 4 and 2 + 2 steps, for each objective
@pytest.mark.parametrize(
    "objective, logged",
    [
        ("gkd", ("loss", "divergence", "on_policy", "reward")),
        ("distill_on_policy", ("loss", "teacher_reverse_kl", "reward")),
    ],
)
def test_on_policy_distillation_under_lora_resumes_bit_identically(tmp_path, objective, logged):
    """LoRA rank 4 on fsdp2 x tp2, a random teacher; GKD at lmbda 0.5, so the run stops between
    rollouts of both kinds (seed 0 draws on, on, off, on... as the test above checks). Stopped after
    2 steps and resumed to 4 with the teacher offloaded (training.distill.teacher_offload, which a
    resumed run may change): the 4th step's parameters (the adapters) and every logged figure equal
    an uninterrupted run's bit for bit; the adapters' b halves (zero at the start) have moved."""
    from conftest import assert_adapters_moved, assert_same_parameters

    from tunix_train.train.loop import train

    build("gemma3", tmp_path / "teacher", vocab_size=4096)
    cfg = _gkd(
        tmp_path,
        f"training.distill.teacher={tmp_path / 'teacher'}",
        "training.micro_batch_size=4",
        *LORA_RESUMED,
        *(["training.rollout.num_generations=4"] if objective == "distill_on_policy" else []),
        objective=objective,
    )
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for run_dir, stops in ((straight, [(4, False)]), (resumed, [(2, False), (4, True)])):
        for cfg.training.max_steps, cfg.training.distill.teacher_offload in stops:
            train(cfg, run_dir, devices=jax.devices()[:4])
    assert_same_parameters(straight, resumed, 4)

    def figures(run_dir):
        return [tuple(m[key] for key in logged) for m in read_metrics(run_dir) if "loss" in m]

    assert len(figures(straight)) == 4 and figures(resumed)[-2:] == figures(straight)[-2:]
    assert_adapters_moved(straight / "checkpoints" / "4")


def test_bad_gkd_settings_and_records_are_one_line(tmp_path):
    from tunix_train.data import Data

    for overrides, message in [
        ([], "objective=gkd needs training.distill.teacher"),
        (["training.distill.teacher=x", "training.distill.lmbda=1.5"], r"lmbda=1.5 must be in \[0, 1\]"),
        (
            ["training.distill.teacher=x", "training.distill.lmbda=1", "training.distill.seq_kd=true"],
            "training.distill.lmbda=1 leaves none",
        ),
        (
            ["training.distill.teacher=x", "training.distill.ce_weight=0.1"],
            "GKD's loss is the divergence alone",
        ),
        (["training.distill.teacher=x", "training.grpo.beta=0.1"], "GKD's loss has no KL to a reference"),
        (
            ["training.distill.teacher=x", "training.rollout.environment=m:E"],
            "GKD's completions are one turn",
        ),
        (
            ["training.distill.teacher=x", "training.distill.teacher_logits=y"],
            "teacher_logits is objective=distill's stored teacher; objective=gkd scores",
        ),
    ]:
        with pytest.raises(ConfigError, match=message):
            _gkd(tmp_path, *overrides)
    with pytest.raises(ConfigError, match="objective=distill_on_policy scores the sampled tokens with the"):
        _gkd(
            tmp_path,
            "training.distill.teacher=x",
            "training.distill.teacher_logits=y",
            objective="distill_on_policy",
        )
    build("gemma3", tmp_path / "teacher", vocab_size=4096)
    teacher = tmp_path / "teacher"
    for overrides, message in [
        (["training.distill.completion_field=missing"], "record 1 has no string 'missing'"),
        (
            ["training.rollout.max_new_tokens=1"],
            r"record 1's answer is \d+ tokens with its stop token, more than",
        ),
    ]:
        cfg = _gkd(tmp_path, f"training.distill.teacher={teacher}", *overrides)
        objective = make_objective(cfg)
        with pytest.raises(ConfigError, match=message):
            objective.read(Data(cfg, objective.record_fields))
