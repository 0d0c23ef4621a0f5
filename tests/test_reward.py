"""Reward models (objective=reward, train/objectives/reward.py): the loss equals TRL's
RewardTrainer.compute_loss (margins, centering); a reward model learns a synthetic preference
(answers naming the requested word) to >= 90% held-out accuracy; bad input is one line."""

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import config, read_metrics

from tunix_train.config import ConfigError
from tunix_train.train.objectives.reward import pair_loss

WORDS = ["king", "love", "night", "blood", "crown", "heart", "death", "sword", "queen", "fool"]


@pytest.mark.parametrize("center", [None, 0.01])
def test_the_loss_equals_trls_reward_trainer(center):
    """Six pairs' rewards and margins: our mean pair loss equals TRL's RewardTrainer.compute_loss
    (its model replaced by the rewards, chosen rows then rejected) within 1e-6."""
    torch = pytest.importorskip("torch")
    from trl import RewardTrainer

    rng = np.random.default_rng(0)
    chosen, rejected, margin = (rng.standard_normal(6).astype(np.float32) for _ in range(3))
    stub = types.SimpleNamespace(
        model=types.SimpleNamespace(training=False),
        args=types.SimpleNamespace(center_rewards_coefficient=center),
        accelerator=types.SimpleNamespace(gather_for_metrics=lambda x: x, gather=lambda x: x),
        _metrics={"eval": __import__("collections").defaultdict(list)},
        _total_train_tokens=0,
    )
    logits = torch.from_numpy(np.concatenate([chosen, rejected]))[:, None]
    inputs = {"margin": torch.from_numpy(margin), "attention_mask": torch.ones(12, 3)}
    theirs = RewardTrainer.compute_loss(stub, lambda **kw: types.SimpleNamespace(logits=logits), inputs)
    ours = jnp.mean(pair_loss(jnp.asarray(chosen), jnp.asarray(rejected), jnp.asarray(margin), center))
    assert float(ours) == pytest.approx(float(theirs), abs=1e-6)


def _pairs(path, count, seed):
    """Pairs whose chosen answer names the prompt's word and the rejected another of WORDS."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(count):
            word, other = rng.choice(WORDS, 2, replace=False)
            answer = "Then speak of {} and be gone."
            f.write(
                json.dumps(
                    {
                        "prompt": f"Speak of {word}.",
                        "chosen": answer.format(word),
                        "rejected": answer.format(other),
                    }
                )
                + "\n"
            )
    return path


REWARD = [
    "model=gemma3_tiny",
    "model.vocab_size=4096",
    "objective=reward",
    "data=jsonl",
    "data.seq_len=32",
    "training.micro_batch_size=16",
    "training.log_every=1",
    "training.warmup_steps=0",
    "checkpoint.every_steps=0",
]


def test_a_reward_model_learns_alike_on_fsdp2_tp2_and_exports_for_transformers(tmp_path):
    """gemma3_tiny with a scalar head, from scratch, on 512 synthetic pairs: after 60 steps the 32
    held-out pairs (other draws) are ranked right at least 90% of the time (eval_accuracy), from
    under 75% at the start. Its first two steps log the same losses on fsdp2 x tp2 (1e-5). It
    exports as Gemma3TextForSequenceClassification: transformers' scores of the held-out pairs (at
    their last token) average to our evaluation's eval_reward_chosen and eval_reward_rejected, and
    rank them as eval_accuracy says; the export reads back as a model with a scalar head."""
    import torch
    import transformers

    from tunix_train import export
    from tunix_train.data.tokenizer import load_tokenizer
    from tunix_train.interop import loader
    from tunix_train.train.loop import train

    pairs = _pairs(tmp_path / "eval.jsonl", 32, 1)
    common = [
        *REWARD,
        f"data.train_files=[{_pairs(tmp_path / 'train.jsonl', 512, 0)}]",
        f"data.eval_files=[{pairs}]",
        "training.learning_rate=3e-3",  # cosine: the first two steps' rates are the same for 2 or 60
        "training.eval_batches=4",  # the 32 held-out pairs, 8 a batch
    ]
    runs = {}
    for name, mesh, devices, rows, steps in (
        ("one", '[[1],["fsdp"]]', 1, 16, 60),
        ("sharded", '[[2,2],["fsdp","tp"]]', 4, 8, 2),  # 8 rows per data shard: the same 16
    ):
        cfg = config(
            *common,
            f"model.mesh_shape={mesh}",
            f"training.micro_batch_size={rows}",
            f"training.max_steps={steps}",
            f"training.eval_every={steps}",
        )
        train(cfg, tmp_path / name, devices=jax.devices()[:devices])
        runs[name] = read_metrics(tmp_path / name)
    losses = {name: [m["loss"] for m in metrics if "loss" in m][:2] for name, metrics in runs.items()}
    np.testing.assert_allclose(losses["sharded"], losses["one"], rtol=1e-5)
    evals = [m for m in runs["one"] if "eval_accuracy" in m]
    assert evals[0]["eval_accuracy"] < 0.75 and evals[-1]["eval_accuracy"] >= 0.9, evals

    assert export.main([str(tmp_path / "one"), str(tmp_path / "hf")]) == 0
    assert loader.source(tmp_path / "hf").cfg.model.score_head
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    assert type(model).__name__ == "Gemma3TextForSequenceClassification"
    tokenizer = load_tokenizer(None, 4096, "data.tokenizer")
    scores = []
    for line in pairs.read_text().splitlines():
        pair = json.loads(line)
        prompt = [tokenizer.bos_id, *tokenizer.encode(pair["prompt"])]
        row = []
        for field in ("chosen", "rejected"):
            ids = [*prompt, *tokenizer.encode(pair[field]), tokenizer.eos_id]
            with torch.no_grad():
                row.append(float(model(torch.tensor([ids])).logits[0, 0]))
        scores.append(row)
    scores = np.array(scores)
    assert evals[-1]["eval_reward_chosen"] == pytest.approx(scores[:, 0].mean(), abs=1e-4)
    assert evals[-1]["eval_reward_rejected"] == pytest.approx(scores[:, 1].mean(), abs=1e-4)
    assert evals[-1]["eval_accuracy"] == pytest.approx((scores[:, 0] > scores[:, 1]).mean())


def test_bad_reward_settings_are_one_line(tmp_path):
    from tunix_train.train.objectives import make_objective

    for overrides, message in [
        (["training.micro_batch_size=3"], "training.micro_batch_size=3 must be even"),
        (["data=synthetic"], "training.objective=reward reads records with prompt, chosen and rejected"),
    ]:
        with pytest.raises(ConfigError, match=message):
            config(*REWARD, "data.train_files=[x.jsonl]", *overrides)
    with pytest.raises(ConfigError, match="set model.score_head=true"):
        make_objective(config(*REWARD, "data.train_files=[x.jsonl]", "model.score_head=false"))


@pytest.mark.slow
def test_under_lora_the_head_trains_beside_the_adapters(tmp_path):
    """LoRA (rank 4) over a transformers reward model: two steps log the same losses on one device
    and on fsdp2 x tp2 (1e-5); the head trains (it moved in step 2), and besides it only the
    adapters do; the merged export carries the trained head as score.weight; the adapters export
    in PEFT's format with the head (modules_to_save), and PEFT's model on the base scores as the
    merged export does (1e-4), unlike the base; a llama.cpp adapter, which cannot hold the head, is
    one line."""
    import torch
    import transformers
    from conftest import checkpoint_arrays
    from peft import PeftModel
    from test_lora import hf_base_overrides

    from tunix_train import api
    from tunix_train.train.loop import train

    train_files = _pairs(tmp_path / "train.jsonl", 64, 0)
    _random_reward_model(tmp_path / "base")
    losses = {}
    for name, mesh, devices, rows in (
        ("one", '[[1],["fsdp"]]', 1, 8),
        ("sharded", '[[2,2],["fsdp","tp"]]', 4, 4),
    ):
        cfg = config(
            *REWARD,
            f"data.train_files=[{train_files}]",
            f"model.mesh_shape={mesh}",
            f"training.micro_batch_size={rows}",
            "training.max_steps=2",
            "training.eval_every=0",
            "training.lora.rank=4",
            "training.learning_rate=1e-2",
            "checkpoint.every_steps=1",
            *hf_base_overrides(tmp_path / "base"),
        )
        train(cfg, tmp_path / name, devices=jax.devices()[:devices])
        losses[name] = [m["loss"] for m in read_metrics(tmp_path / name)]
    np.testing.assert_allclose(losses["sharded"], losses["one"], rtol=1e-5)

    first, last = (checkpoint_arrays(tmp_path / "one" / "checkpoints" / str(s)) for s in (1, 2))
    head = next(k for k in last if k.startswith("['params']") and "score_DO" in k)
    assert not np.array_equal(first[head], last[head])  # trained, with the adapters
    trained = [k for k in last if k.startswith("['params']")]
    assert all("_lora" in k or k == head for k in trained), trained  # the base is frozen

    model = api.load(tmp_path / "one")
    model.export(tmp_path / "hf")
    from safetensors.numpy import load_file

    np.testing.assert_array_equal(
        load_file(tmp_path / "hf" / "model.safetensors")["score.weight"], last[head].T
    )
    model.export_adapters(tmp_path / "peft")
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["modules_to_save"] == ["score"]
    tokens = torch.tensor(np.random.default_rng(0).integers(1, 4096, (3, 12)))
    with torch.no_grad():
        base = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "base").eval()
        plain = base(tokens).logits.numpy()
        adapted = PeftModel.from_pretrained(base, tmp_path / "peft").eval()(tokens).logits.numpy()
        merged = (
            transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()(tokens)
        ).logits.numpy()
    assert np.abs(adapted - plain).max() > 1e-3  # the adapters and the head changed the scores
    np.testing.assert_allclose(adapted, merged, atol=1e-4, rtol=0)
    with pytest.raises(ConfigError, match="which a llama.cpp adapter cannot hold"):
        model.export_adapters(tmp_path / "adapter.gguf", format="gguf")


@pytest.mark.slow  # two runs
def test_a_reward_model_resumes_bit_identically(tmp_path):
    """fsdp2 x tp2, centering on: stopped after 2 steps and resumed to 4, the 4th step's parameters
    (the head's among them) and every logged loss and accuracy equal an uninterrupted run's bit for
    bit."""
    from conftest import assert_resumes_bit_identically

    cfg = config(
        *REWARD,
        f"data.train_files=[{_pairs(tmp_path / 'train.jsonl', 64, 0)}]",
        'model.mesh_shape=[[2,2],["fsdp","tp"]]',
        "training.micro_batch_size=4",
        "training.eval_every=0",
        "training.reward.center_rewards_coefficient=0.01",
        "training.lr_schedule=constant",  # the schedule must not depend on max_steps, which changes
        "checkpoint.every_steps=2",
    )
    assert_resumes_bit_identically(cfg, tmp_path, ("loss", "accuracy"), jax.devices()[:4])


def _random_reward_model(directory):
    """A seeded random Gemma3TextForSequenceClassification (one label) at the test sizes, saved."""
    import torch
    import transformers
    from hf_reference import SIZES, WINDOW

    hf_config = transformers.Gemma3TextConfig(
        **{**SIZES, "vocab_size": 4096}, sliding_window=WINDOW, num_labels=1, pad_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.Gemma3TextForSequenceClassification(hf_config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory)
    return model


def test_grpo_reward_models_score_as_transformers_does(tmp_path):
    """A random Gemma3TextForSequenceClassification as GRPO's reward model, planned on fsdp2 x tp2:
    its rewards of three token sequences of different lengths equal transformers' logits at their
    last token (1e-5); a checkpoint without a head, and one of another vocabulary, are one line."""
    import torch
    from hf_reference import build

    from tunix_train.rewards.arithmetic import write_task
    from tunix_train.train.objectives.grpo import OnPolicy
    from tunix_train.train.setup import setup

    theirs = _random_reward_model(tmp_path / "rm")
    prompts, _ = write_task(tmp_path / "task", count=8, seed=0)

    def grpo(model):
        return config(
            "model.vocab_size=4096",
            "objective=grpo",
            "data=jsonl",
            f"data.train_files=[{prompts}]",
            "data.seq_len=16",
            "training.micro_batch_size=4",
            "training.rollout.num_generations=4",
            "training.rollout.reward=[]",
            f"training.rollout.reward_models=[{model}]",
            'model.mesh_shape=[[2,2],["fsdp","tp"]]',
        )

    cfg = grpo(tmp_path / "rm")
    objective = OnPolicy(cfg)
    run = setup(cfg, jax.devices()[:4], objective)
    models = objective.rewards.models
    models.connect(run.plan_frozen, run.mesh)
    sequences = [[2, 17, 300, 41, 1], [2, 5, 6], [2, 9, 10, 11, 12, 13, 14, 15, 16, 1]]
    ours = models.score(sequences)
    assert ours.shape == (1, 3) and objective.rewards.names == ["reward_model_0"]
    with torch.no_grad():
        expected = [float(theirs(torch.tensor([s])).logits[0, 0]) for s in sequences]
    np.testing.assert_allclose(ours[0], expected, rtol=1e-5, atol=1e-5)

    build("gemma3", tmp_path / "lm", vocab_size=4096)
    build("gemma3", tmp_path / "small", vocab_size=512)
    for model, message in [
        (tmp_path / "lm", "has no scalar head"),
        (tmp_path / "small", "has vocab_size 512 but the trained model's model.vocab_size=4096"),
    ]:
        with pytest.raises(ConfigError, match=message):
            OnPolicy(grpo(model))


@pytest.mark.slow  # a GRPO run (the scoring itself is checked above, in the first leg)
def test_grpo_trains_with_a_reward_model_as_its_only_reward(tmp_path):
    """A reward model (transformers' Gemma3TextForSequenceClassification) as GRPO's only reward:
    two steps run, each logging the model's mean reward (reward_reward_model_0) as the reward; the
    policy's loss is finite."""
    from tunix_train.rewards.arithmetic import write_task
    from tunix_train.train.loop import train

    _random_reward_model(tmp_path / "rm")
    prompts, _ = write_task(tmp_path / "task", count=64, seed=0)
    cfg = config(
        "model.vocab_size=4096",
        "objective=grpo",
        "data=jsonl",
        f"data.train_files=[{prompts}]",
        "data.seq_len=16",
        "training.micro_batch_size=8",
        "training.max_steps=2",
        "training.log_every=1",
        "training.rollout.num_generations=4",
        "training.rollout.max_new_tokens=4",
        "training.rollout.reward=[]",
        f"training.rollout.reward_models=[{tmp_path / 'rm'}]",
        'model.mesh_shape=[[2],["fsdp"]]',
    )
    train(cfg, tmp_path / "grpo", devices=jax.devices()[:2])
    steps = [m for m in read_metrics(tmp_path / "grpo") if "loss" in m]
    assert len(steps) == 2
    for m in steps:
        assert m["reward"] == pytest.approx(m["reward_reward_model_0"]) and np.isfinite(m["loss"]), m


@pytest.mark.slow  # long (conftest.LONG): the whole demo, about 3 minutes on 2 cores
def test_the_demos_grpo_raises_the_rate_of_the_answers_its_reward_model_prefers(tmp_path):
    """scripts/reward_demo.py, as a user runs it: the reward model ranks >= 90% of the held-out pairs
    right, and GRPO with it as the only reward raises the rate of answers naming the prompt's word
    (measured by names_the_word at weight 0) by at least half from the first block of 10 steps to
    the last (0.399 -> 0.875 when written). It runs in a user's environment: one device, the
    compiler at its own level, not the suite's fake devices (on which it is 10 times slower)."""
    import subprocess
    import sys

    from conftest import REPO, users_env

    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "reward_demo.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=users_env(),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["reward_model_accuracy_end"] >= 0.9, figures
    rates = figures["block_rates"]
    assert len(rates) == 4 and rates[-1] >= 1.5 * rates[0], figures
