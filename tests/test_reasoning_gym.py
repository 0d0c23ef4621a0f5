"""data=reasoning_gym: prompts generated from the seed (the same on every run, held-out ones from
another seed), the reasoning_gym reward equal to each task's own verifier, bad settings as
one-line errors, and GRPO with the verifier raising the held-out reward."""

import json

import jax
import pytest
from conftest import config, read_metrics

reasoning_gym = pytest.importorskip("reasoning_gym", reason="needs reasoning-gym: pip install -e '.[tasks]'")

from tunix_train import api  # noqa: E402
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


def test_a_prompt_longer_than_the_sequence_names_the_task(tmp_path):
    cfg = config(
        "objective=grpo",
        "data=reasoning_gym",
        TASKS,
        "model.vocab_size=4096",
        "data.seq_len=8",
        "training.rollout.reward=[tunix_train.rewards.verified:reasoning_gym]",
    )
    with pytest.raises(
        ConfigError, match=r"^data.reasoning_gym: prompt 1 is \d+ tokens; .* data.seq_len >= \d+$"
    ):
        train(cfg, tmp_path / "run", devices=jax.devices()[:1])
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # about 55 s: 30 steps of SFT, 10 of GRPO and two held-out evaluations
def test_grpo_with_the_verifier_raises_the_held_out_reward(tmp_path):
    """The tiny model, fine-tuned 30 steps on syllogism's prompts and answers, samples Yes or No
    without favouring the answer that is more often right (Yes, for about 70% of the prompts); 10
    GRPO steps rewarded by the task's verifier (logged under its name) raise the held-out reward:
    the mean verifier score of 8 samples (temperature 1) on each of 16 prompts drawn from the
    held-out seed. What the tiny model learns is the likelier answer, not logic."""
    task = ["data=reasoning_gym", "data.reasoning_gym.tasks=[syllogism]", "data.reasoning_gym.size=512"]
    task += ["data.reasoning_gym.eval_size=16", "data.seq_len=96", "model.vocab_size=4096"]
    sft = config(
        *task,
        "objective=lm",
        "training.max_steps=30",
        "training.micro_batch_size=16",
        "training.learning_rate=3e-3",
        "training.eval_every=0",
    )
    train(sft, tmp_path / "sft", devices=jax.devices()[:1])
    api.load(tmp_path / "sft", devices=jax.devices()[:1]).export(tmp_path / "sft_hf")
    cfg = config(
        *task,
        "objective=grpo",
        f"model.init_from={tmp_path / 'sft_hf'}",
        "training.rollout.reward=[tunix_train.rewards.verified:reasoning_gym]",
        "training.rollout.max_new_tokens=2",
        "training.rollout.num_generations=8",
        "training.rollout.eval_samples=8",
        "training.micro_batch_size=64",
        "training.max_steps=10",
        "training.eval_every=10",
        "training.eval_batches=2",
        "training.learning_rate=1e-3",
        "training.lr_schedule=constant",
        "training.log_every=1",
    )
    train(cfg, tmp_path / "grpo", devices=jax.devices()[:1])
    logged = read_metrics(tmp_path / "grpo")
    steps = [m for m in logged if "reward" in m]
    assert len(steps) == 10 and all(m["reward"] == m["reward_reasoning_gym"] for m in steps)
    before, after = (m["eval_pass@1"] for m in logged if "eval_pass@1" in m)
    assert after >= before + 0.1, (before, after)  # 0.41 -> 0.70 on the 2-core CPU runner
