"""data=reasoning_gym: prompts generated from the seed (the same on every run, held-out ones from
another seed), the reasoning_gym reward equal to each task's own verifier, bad settings as
one-line errors, and a few GRPO steps rewarded by the verifier."""

import json

import jax
import pytest
from conftest import config, read_metrics

reasoning_gym = pytest.importorskip("reasoning_gym", reason="needs reasoning-gym: pip install -e '.[tasks]'")

from tunix_train.config import ConfigError  # noqa: E402
from tunix_train.data.sources import train_and_eval_documents  # noqa: E402
from tunix_train.rewards.verified import reasoning_gym as reward  # noqa: E402
from tunix_train.train.loop import train  # noqa: E402

TASKS = "data.reasoning_gym.tasks=[basic_arithmetic,chain_sum]"


def _docs(*overrides):
    cfg = config(
        "data=reasoning_gym", "data.reasoning_gym.size=6", "data.reasoning_gym.eval_size=3", TASKS, *overrides
    )
    return train_and_eval_documents(cfg.data, ["prompt"])


def test_prompts_come_from_the_seed_and_are_scored_by_their_tasks_verifier():
    train_docs, held_out = _docs()
    again, _ = _docs()
    other, _ = _docs("data.reasoning_gym.seed=1")
    assert train_docs == again and train_docs != other and len(train_docs) == 12 and len(held_out) == 6
    assert not {d["prompt"] for d in held_out} & {d["prompt"] for d in train_docs}
    sources = [json.loads(d["entry"])["metadata"]["source_dataset"] for d in train_docs]
    assert sources == ["basic_arithmetic", "chain_sum"] * 6  # the tasks interleaved
    want = reasoning_gym.create_dataset("chain_sum", size=6, seed=0)
    assert [d["prompt"] for d in train_docs[1::2]] == [e["question"] for e in want]
    answers = [d["answer"] for d in train_docs]
    completions = [
        *answers[:4],
        f"<answer>{answers[4]}</answer>",
        " " + answers[5] + "\n",
        "0",
        "",
        "x" * 50,
        "1 2",
    ]
    completions += [str(int(a) + 1) for a in answers[len(completions) :]]
    got = reward([d["prompt"] for d in train_docs], completions, entry=[d["entry"] for d in train_docs])
    datasets = {s: reasoning_gym.create_dataset(s, size=6, seed=0) for s in set(sources)}
    own = []
    for doc, completion in zip(train_docs, completions):
        entry = json.loads(doc["entry"])
        answer = completion.split("<answer>")[-1].split("</answer>")[0].strip()
        own.append(datasets[entry["metadata"]["source_dataset"]].score_answer(answer, entry))
    assert got == own and got[:6] == [1.0] * 6 and max(got[6:]) < 1.0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.reasoning_gym.tasks=[no_such_task]"], "cannot make the task 'no_such_task'"),
        (["+data.reasoning_gym.settings.basic_arithmetic.bogus=1"], "unexpected keyword argument 'bogus'"),
        (
            [
                "+data.reasoning_gym.settings.chain_sum.min_terms=5",
                "+data.reasoning_gym.settings.chain_sum.max_terms=2",
            ],
            "chain_sum",
        ),
    ],
)
def test_bad_tasks_and_settings_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _docs(*overrides)


def test_settings_of_a_task_not_listed_and_no_tasks_are_config_errors():
    with pytest.raises(ConfigError, match="settings names 'leg_counting', which is not in"):
        config("data=reasoning_gym", "+data.reasoning_gym.settings.leg_counting.min_animals=1")
    with pytest.raises(ConfigError, match="needs tasks"):
        config("data=reasoning_gym", "data.reasoning_gym.tasks=[]")


@pytest.mark.slow  # 23 s: a GRPO run
def test_grpo_steps_are_rewarded_by_the_verifier(tmp_path):
    """2 GRPO steps on 1-digit sums: the reward is the verifier's, logged under its name (held-out
    rewards as any GRPO run's: test_grpo_family.py)."""
    cfg = config(
        "model.vocab_size=4096",
        "objective=grpo",
        "data=reasoning_gym",
        "data.seq_len=32",
        "data.reasoning_gym.size=16",
        "data.reasoning_gym.eval_size=4",
        "+data.reasoning_gym.settings.basic_arithmetic.min_terms=2",
        "+data.reasoning_gym.settings.basic_arithmetic.max_terms=2",
        "+data.reasoning_gym.settings.basic_arithmetic.min_digits=1",
        "+data.reasoning_gym.settings.basic_arithmetic.max_digits=1",
        "training.rollout.reward=[tunix_train.rewards.verified:reasoning_gym]",
        "training.rollout.max_new_tokens=4",
        "training.max_steps=2",
        "training.log_every=1",
        "training.eval_every=0",
        'model.mesh_shape=[[2],["fsdp"]]',
        "training.micro_batch_size=8",
    )
    train(cfg, tmp_path / "run", devices=jax.devices()[:2])
    logged = read_metrics(tmp_path / "run")
    steps = [m for m in logged if "reward" in m]
    assert len(steps) == 2 and all(0 <= m["reward_reasoning_gym"] <= 1 for m in steps)
