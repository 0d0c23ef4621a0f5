"""Asynchronous rollouts (training.rollout.asynchronous, train/streaming.py): the settings' one-line
errors, per-token versions and the importance weights they give, and a run stopped by SIGTERM and
by kill -9 that, resumed, trains on every prompt once."""

import json
import signal

import pytest
from conftest import REPO, run_training, start_python

from tunix_train.rewards.arithmetic import write_task

LENGTH = "tests.rewards_for_tests:length"


def _async_run(tmp_path, *extra):
    prompts, _ = write_task(tmp_path / "task", count=33, seed=0)  # 32 to train on, 1 held out
    return [
        "model=gemma3_tiny",
        "model.vocab_size=4096",
        "objective=grpo",
        "data=jsonl",
        f"data.train_files=[{prompts}]",
        "data.seq_len=24",
        'model.mesh_shape=[[2],["fsdp"]]',
        "training.micro_batch_size=4",
        "training.rollout.num_generations=2",
        "training.rollout.max_new_tokens=8",
        f"training.rollout.reward=[{LENGTH}]",
        "training.rollout.asynchronous=true",
        'training.rollout.mesh_shape=[[2],["fsdp"]]',
        "training.learning_rate=1e-3",
        "training.log_every=1",
        "checkpoint.every_steps=3",
        "checkpoint.keep=10",
        f"hydra.run.dir={tmp_path / 'run'}",
        *extra,
    ]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["training.rollout.mesh_shape=null"],
            "training.rollout.asynchronous=true needs training.rollout.mesh_shape",
        ),
        (["training.rollout.max_staleness=1"], "replaces max_staleness=1 and iterations=1"),
        (
            ["training.rollout.tools=[tests.rewards_for_tests:undocumented_tool]"],
            "tools, environments and objective=gkd run synchronously",
        ),
        (["training.rollout.buffer_steps=0"], "training.rollout.buffer_steps=0 must be at least 1"),
        (
            ["training.rollout.weight_update_every=4", "training.rollout.max_lag=2"],
            "training.rollout.max_lag=2 must be >= weight_update_every - 1 = 3",
        ),
    ],
)
def test_impossible_settings_are_one_line(tmp_path, overrides, message):
    out = run_training(*_async_run(tmp_path, "training.max_steps=1", *overrides), devices=4)
    assert out.returncode != 0
    assert out.stderr.strip() == f"tunix_train: {out.stderr.strip().split('tunix_train: ', 1)[1]}"
    assert message in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def _trained(run_dir) -> dict[int, dict]:
    """Each step's record in rollouts.jsonl, the last written for a step (a resumed run writes the
    steps after its checkpoint again)."""
    return {r["step"]: r for r in map(json.loads, (run_dir / "rollouts.jsonl").read_text().splitlines())}


def _wait_for(proc, text):
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"{text!r} never printed:\n{''.join(lines)}")


@pytest.mark.slow
def test_stopped_and_killed_runs_resume_training_on_every_prompt_once(tmp_path):
    """SIGTERM after step 4 (a checkpoint of that step), kill -9 after step 8 (the checkpoint of step
    6 stands), then a run to step 14: 56 groups trained, each prompt's ticket (its place in the
    data's order) once. Tickets 0-31 are the first epoch's 32 prompts: every one trained once.
    The tickets the last checkpoint holds (finished, in flight, handed back) and those trained make
    every ticket handed out, none twice: nothing lost, nothing repeated."""
    args = _async_run(tmp_path, "training.max_steps=14")
    proc = start_python(REPO / "run_training.py", *args, devices=4)
    _wait_for(proc, "step 4/")
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, rest
    proc = start_python(REPO / "run_training.py", *args, devices=4)
    assert any("resumed from" in line for line in _wait_for(proc, "step 8/"))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    out = run_training(*args, devices=4, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "resumed from" in out.stdout + out.stderr

    trained = _trained(tmp_path / "run")
    assert sorted(trained) == list(range(1, 15))
    tickets = [t for step in sorted(trained) for t in trained[step]["tickets"]]
    prompts = {t: p for step in trained.values() for t, p in zip(step["tickets"], step["prompts"])}
    assert len(tickets) == 14 * 4 == len(set(tickets))
    assert set(range(32)) <= set(tickets) and sorted(prompts[t] for t in range(32)) == list(range(32))
    data = json.loads((tmp_path / "run" / "checkpoints" / "14" / "data" / "metadata").read_text())
    held = data["iterator"]
    kept = [g["key"][0] for g in held["finished"]] + [k[0] for k in held["keys"]["returned"]]
    assert sorted(tickets + kept) == list(range(held["keys"]["tickets"]))
