"""GRPO: advantages and the clipped loss against numpy, KL 0 at the start, groups that stay whole
and equal across meshes, resume that draws the same completions, and bad input."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    assert_resumes_alike,
    read_metrics,
    rl_config,
    run_python,
    run_training,
    step_metrics,
)
from test_cli import run_cli

from tunix_train.rewards.arithmetic import write_task
from tunix_train.train.loop import train
from tunix_train.train.objectives.grpo_family import Clip, advantages, token_objective
from tunix_train.train.setup import setup

REWARD = "tunix_train.rewards.arithmetic:exact_match"
LENGTH = "tests.rewards_for_tests:length"


def test_advantages_and_the_clipped_loss_equal_numpy():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, 1.0, 0.0, 2.0]])
    expected = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, ddof=1, keepdims=True) + 1e-4)
    ours = advantages(rewards.reshape(1, -1), 4).reshape(3, 4)
    np.testing.assert_allclose(ours, expected, rtol=1e-12)
    assert np.all(ours[1] == 0)  # a group of equal rewards teaches nothing

    rng = np.random.default_rng(0)
    logp, old, ref = (rng.uniform(-3, -0.1, (4, 6)) for _ in range(3))
    adv = np.repeat(rng.normal(size=(4, 1)), 6, axis=1)
    eps, beta = 0.2, 0.04
    ratio = np.exp(logp - old)
    kl = np.exp(ref - logp) - (ref - logp) - 1
    numpy = np.minimum(ratio * adv, np.clip(ratio, 1 - eps, 1 + eps) * adv) - beta * kl
    ours, our_kl, clipped = token_objective(
        *(jnp.asarray(x, jnp.float32) for x in (logp, old, ref, adv)),
        jnp.ones((4, 6)),
        clip=Clip(eps, eps),
        beta=beta,
    )
    np.testing.assert_allclose(np.asarray(ours), numpy, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(our_kl), kl, rtol=1e-5, atol=1e-6)
    assert np.array_equal(
        np.asarray(clipped), ((ratio < 1 - eps) & (adv < 0)) | ((ratio > 1 + eps) & (adv > 0))
    )
    assert 0 < np.asarray(clipped).mean() < 1  # the hand-made ratios exercise the clip


def test_off_policy_ratios_use_the_recorded_logprobs(tmp_path):
    """The loss of a hand-made micro-batch: on-policy, rho = 1 (pi_old is pi); off-policy, pi_old is
    the engine's recorded log-probability and rho is truncated at importance_cap, as numpy computes it.
    The mismatch metrics are |logp - recorded| over the loss mask."""
    from tunix_train.train.objectives.grpo import OnPolicy

    rng = np.random.default_rng(1)
    logp, behaviour, ref = (rng.uniform(-3, -0.1, (4, 6)).astype(np.float32) for _ in range(3))
    behaviour[0, :3] = logp[0, :3] - 1.5  # ratios e^1.5 > cap 3: truncated
    adv = np.repeat(rng.normal(size=(4, 1)), 6, axis=1).astype(np.float32)
    mask = np.ones((4, 6), np.float32)
    mask[:, 4:] = 0
    micro = {
        "advantages": jnp.asarray(adv),
        "behaviour_logp": jnp.asarray(behaviour),
        "loss_mask": jnp.asarray(mask),
    }
    eps, beta, cap = 0.2, 0.04, 3.0
    kl = np.exp(ref - logp) - (ref - logp) - 1
    weight = {"tokens": mask.sum(), "sequences": 4.0, "sequences_x_max_new_tokens": 16.0}
    for staleness, ratio in ((0, np.ones_like(logp)), (1, np.minimum(np.exp(logp - behaviour), cap))):
        objective = OnPolicy(
            _cfg(tmp_path, [[1], ["fsdp"]], 4, f"training.rollout.max_staleness={staleness}")
        )
        loss, metrics = objective.loss(lambda: -jnp.asarray(logp), lambda: -jnp.asarray(ref), micro, weight)
        surrogate = np.minimum(ratio * adv, np.clip(ratio, 1 - eps, 1 + eps) * adv) - beta * kl
        np.testing.assert_allclose(float(loss), -(surrogate * mask).sum() / mask.sum(), rtol=1e-5)
        mismatch = np.abs(logp - behaviour) * mask
        np.testing.assert_allclose(float(metrics["logprob_mismatch_max"]), mismatch.max(), rtol=1e-6)
        np.testing.assert_allclose(
            float(metrics["logprob_mismatch_mean"]), mismatch.sum() / mask.sum(), rtol=1e-5
        )
    assert (np.exp(logp - behaviour) > cap).any() and 0 < ((ratio < 1 - eps) | (ratio > 1 + eps)).mean() < 1


def _cfg(tmp_path, mesh_shape, micro_batch, *overrides, reward=REWARD):
    cfg = rl_config(
        tmp_path,
        f"training.micro_batch_size={micro_batch}",
        "training.rollout.num_generations=4",
        f"training.rollout.reward=[{reward}]",
        *overrides,
    )
    cfg.model.mesh_shape = mesh_shape
    return cfg


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _samples(run_dir):
    return [
        (s["step"], s["prompt"], s["text"])
        for s in map(json.loads, (run_dir / "samples.jsonl").read_text().splitlines())
    ]


def test_groups_are_the_same_on_every_mesh_and_kl_starts_at_zero(tmp_path):
    """8 prompts x G=4 per step on fsdp=8 (4 rows per device) and on dp2 x fsdp2 x tp2 (8 rows per data
    shard). The reward is the completion's length, which varies from the start: with rewards all
    equal, as exact match gives a random model, the gradient is float noise that AdamW amplifies."""
    runs = {"fsdp8": ([[8], ["fsdp"]], 4), "dp2_fsdp2_tp2": ([[2, 2, 2], ["dp", "fsdp", "tp"]], 8)}
    results = {}
    for name, (mesh_shape, micro_batch) in runs.items():
        cfg = _cfg(
            tmp_path,
            mesh_shape,
            micro_batch,
            "training.max_steps=3",
            "training.rollout.temperature=1.5",
            "training.grpo.beta=0.5",
            reward=LENGTH,
        )
        train(cfg, tmp_path / name, devices=jax.devices()[:8])
        results[name] = ([m for m in read_metrics(tmp_path / name) if "loss" in m], _samples(tmp_path / name))
    (a, samples_a), (b, samples_b) = results.values()
    assert samples_a == samples_b and len(samples_a) == 3 * 4  # the first group of each step, the same
    for key in ("loss", "reward", "kl", "completion_tokens", "grad_norm"):
        np.testing.assert_allclose(
            [m[key] for m in a], [m[key] for m in b], rtol=1e-5, atol=1e-7, err_msg=key
        )
    assert a[0]["kl"] == 0.0 and a[-1]["kl"] > 0  # the policy starts as the reference, then leaves it
    # the engine's log-probabilities are the trainer's, up to float32 rounding (1e-5 in test_generate)
    assert all(0 < m["logprob_mismatch_max"] < 1e-4 and m["logprob_mismatch_mean"] < 1e-5 for m in a), a
    assert all(m["reward_length_std"] > 0 and m["grad_norm"] > 1e-3 for m in a)


@pytest.mark.slow  # 21 s and more; the two-process GRPO tests use a rollout mesh too
@pytest.mark.parametrize("staleness", [0, 1])
def test_a_rollout_mesh_of_its_own_trains_like_the_training_mesh(tmp_path, staleness):
    """[[4],["fsdp"]] training on devices 0-3 alone, and with a [[4],["fsdp"]] rollout mesh on
    devices 4-7 (the weights copied there for every rollout): the same completions and losses.
    With max_staleness 1 the rollout mesh draws the next rollout while the step runs."""
    runs = {"on_mesh": ([], 4), "apart": (['training.rollout.mesh_shape=[[4],["fsdp"]]'], 8)}
    for name, (extra, devices) in runs.items():
        cfg = _cfg(
            tmp_path,
            [[4], ["fsdp"]],
            4,
            "training.max_steps=3",
            "training.rollout.temperature=1.5",
            "training.grpo.beta=0.5",
            f"training.rollout.max_staleness={staleness}",
            *extra,
            reward=LENGTH,
        )
        train(cfg, tmp_path / name, devices=jax.devices()[:devices])
    metrics = {name: [m for m in read_metrics(tmp_path / name) if "loss" in m] for name in runs}
    assert _samples(tmp_path / "apart") == _samples(tmp_path / "on_mesh")
    for key in ("loss", "reward", "kl", "grad_norm"):
        np.testing.assert_allclose(
            [m[key] for m in metrics["apart"]],
            [m[key] for m in metrics["on_mesh"]],
            rtol=1e-5,
            atol=1e-7,
            err_msg=key,
        )
    parameters = _nbytes(setup(cfg, jax.devices()[:8]).plan.abstract.params)
    assert [m["weight_sync_bytes"] for m in metrics["apart"]] == [parameters] * 3
    assert "weight_sync_bytes" not in metrics["on_mesh"][0]


@pytest.mark.slow
def test_lora_copies_only_the_adapters_to_the_rollout_mesh(tmp_path):
    """Under LoRA the frozen base moves to the rollout mesh once, with the first rollout; then
    each rollout copies the adapters alone, and they are merged there."""
    run, metrics = lora_rollouts(tmp_path)
    assert _nbytes(run.plan.abstract.params) < _nbytes(run.plan.abstract.frozen) / 10
    # the merged adapters reach the engine: the policy it samples from is the trained one
    assert metrics[-1]["kl"] > 0 and all(m["logprob_mismatch_max"] < 1e-4 for m in metrics)


def lora_rollouts(tmp_path, *overrides):
    """3 GRPO steps under LoRA, the engine on a mesh of its own: the run's setup and logged steps.
    The first rollout copies the frozen base and the adapters to the engine, the others the
    adapters alone (weight_sync_bytes)."""
    cfg = _cfg(
        tmp_path,
        [[2, 2], ["fsdp", "tp"]],
        4,
        "training.max_steps=3",
        "training.rollout.temperature=1.5",
        "training.lora.rank=4",
        'training.rollout.mesh_shape=[[2,2],["fsdp","tp"]]',
        "training.learning_rate=1e-2",
        *overrides,
        reward=LENGTH,
    )
    train(cfg, tmp_path / "run", devices=jax.devices()[:8])
    run = setup(cfg, jax.devices()[:8])
    adapters, base = _nbytes(run.plan.abstract.params), _nbytes(run.plan.abstract.frozen)
    metrics = step_metrics(tmp_path / "run")
    assert [m["weight_sync_bytes"] for m in metrics] == [adapters + base, adapters, adapters]
    return run, metrics


@pytest.mark.slow
@pytest.mark.parametrize("staleness, iterations", [(0, 1), (1, 2)])
def test_a_resumed_run_draws_the_same_completions_and_losses(tmp_path, staleness, iterations):
    """Off-policy, the run stops in the middle of a rollout's iterations with the next one queued:
    the checkpoint keeps both, so the resumed run trains on the same completions."""
    mesh = [[2, 2], ["fsdp", "tp"]]
    cfg = _cfg(
        tmp_path,
        mesh,
        4,
        "training.lr_schedule=constant",
        "checkpoint.every_steps=2",
        "training.rollout.temperature=1.5",
        f"training.rollout.max_staleness={staleness}",
        f"training.rollout.iterations={iterations}",
        reward=LENGTH,
    )
    keys = ("loss", "grad_norm", "reward", "logprob_mismatch_max", "rollout_staleness")
    straight = assert_resumes_alike(cfg, tmp_path, 5, 3, jax.devices()[:4], keys)
    assert _samples(tmp_path / "resumed") == _samples(straight)
    # rollout r trains steps r*mu .. r*mu + mu - 1, drawn at step (r - k)*mu (at 0 for the first k)
    expected = [step - max(step // iterations - staleness, 0) * iterations for step in range(5)]
    assert [m["rollout_staleness"] for m in step_metrics(straight)] == expected
    # a rollout's samples at its first step
    assert len(_samples(straight)) == 4 * len(range(0, 5, iterations))
    if staleness:  # off-policy: the ratio moves away from 1 once the parameters have
        assert step_metrics(straight)[-1]["logprob_mismatch_max"] > 1e-3


@pytest.mark.slow
def test_a_bf16_engine_samples_with_bf16_weights_and_logs_its_larger_mismatch(tmp_path):
    """rollout_dtype=bf16: the engine reads bf16 weights (and keeps a bf16 cache); the trainer's
    float32 forward is unchanged, so the mismatch grows from float32 rounding to bf16's."""
    runs = {}
    for dtype in ("fp32", "bf16"):
        cfg = _cfg(
            tmp_path,
            [[2, 2], ["fsdp", "tp"]],
            4,
            "training.max_steps=2",
            "training.rollout.temperature=1.5",
            f"training.rollout.dtype={dtype}",
            reward=LENGTH,
        )
        train(cfg, tmp_path / dtype, devices=jax.devices()[:4])
        runs[dtype] = [m for m in read_metrics(tmp_path / dtype) if "loss" in m]
    assert all(m["logprob_mismatch_max"] < 1e-4 for m in runs["fp32"])
    assert all(
        1e-3 < m["logprob_mismatch_max"] < 0.5 and m["logprob_mismatch_mean"] < 0.05 for m in runs["bf16"]
    )
    assert all(np.isfinite(m["loss"]) for m in runs["bf16"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["training.rollout.reward=[no_such_module:f]"],
            "training.rollout.reward: cannot import 'no_such_module:f'",
        ),
        (
            ["training.rollout.reward=[tests.rewards_for_tests:bad_length]"],
            "bad_length' returned 1 values for 8 completions",
        ),
        (["training.rollout.reward=[tests.rewards_for_tests:not_a_number]"], "not_a_number' returned 'yes'"),
        (["training.rollout.num_generations=1"], "training.rollout.num_generations=1 must be at least 2"),
        (
            ["training.micro_batch_size=6"],
            "training.micro_batch_size=6 must be a multiple of training.rollout.num_generations=4",
        ),
        (
            ["data.train_files=[{tmp}/no_prompt.jsonl]"],
            "no_prompt.jsonl:1: no string or messages field 'prompt'",
        ),
        (["data=synthetic"], "training.objective=grpo reads records with prompt"),
        (["training.grpo.loss_aggregation=mean"], "training.grpo.loss_aggregation': Invalid value 'mean'"),
        (
            ["training.grpo.epsilon_high=0.1"],
            "training.grpo.epsilon_high=0.1 must be >= training.grpo.epsilon=0.2",
        ),
        (
            ["training.rollout.reward_weights=[1,2]"],
            "training.rollout.reward_weights has 2 weights for 1 reward functions",
        ),
        (
            ["training.rollout.overlong_buffer=8"],
            "training.rollout.overlong_buffer=8 needs training.rollout.overlong=soft",
        ),
        (
            ["training.grpo.multi_reward_normalization=per_reward", "training.grpo.scale_rewards=none"],
            "training.grpo.scale_rewards=none: under multi_reward_normalization=per_reward",
        ),
        (
            ["training.eval_every=2", "training.rollout.eval_samples=2", "training.rollout.eval_k=4"],
            "training.rollout.eval_samples=2 must be >= training.rollout.eval_k=4",
        ),
        (
            ["training.rollout.tools=[json:JSONDecoder]"],
            "training.rollout.tools: 'json:JSONDecoder' is a type, not a function",
        ),
        (
            ["training.rollout.tools=[tests.rewards_for_tests:undocumented_tool]"],
            "'tests.rewards_for_tests:undocumented_tool' cannot make a tool schema",
        ),
        (
            ["training.rollout.environment=no_such_module:Game"],
            "training.rollout.environment: cannot import 'no_such_module:Game'",
        ),
        (
            ["training.rollout.environment=json:dumps"],
            "'json:dumps' is not a class with reset(record) and step(messages)",
        ),
        (["training.rollout.max_turns=0"], "training.rollout.max_turns=0 must be >= 1"),
        pytest.param(  # named: pytest versions make different ids of this message
            ["training.rollout.reward=[tests.rewards_for_tests:divides]"],
            "training.rollout.reward 'tests.rewards_for_tests:divides' raised ZeroDivisionError: float "
            "division by zero (on the "
            "record {'prompt': '",
            id="a_reward_raises",
        ),
        (["training.rollout.max_staleness=-1"], "training.rollout.max_staleness=-1 must be >= 0"),
        (["training.rollout.iterations=0"], "training.rollout.iterations=0 >= 1"),
        (["training.grpo.importance_cap=0.5"], "training.grpo.importance_cap=0.5 must be at least 1"),
    ],
)
def test_bad_input_is_one_line(tmp_path, overrides, message):
    prompts, _ = write_task(tmp_path / "task", count=64, seed=0)
    (tmp_path / "no_prompt.jsonl").write_text('{"question": "1+1="}\n' * 64)
    overrides = [o.replace("{tmp}", str(tmp_path)) for o in overrides]
    data = [] if "data=synthetic" in overrides else ["data=jsonl", f"data.train_files=[{prompts}]"]
    result = run_cli(
        "model=gemma3_tiny",
        "model.vocab_size=4096",
        "objective=grpo",
        *data,
        "data.seq_len=16",
        "training.micro_batch_size=8",
        "training.rollout.num_generations=4",
        "training.rollout.max_new_tokens=4",
        f"training.rollout.reward=[{REWARD}]",
        "training.max_steps=2",
        *overrides,
        f"hydra.run.dir={tmp_path}/run",
        devices=1,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1 and lines[0].startswith("tunix_train: error:"), (
        result.stderr
    )
    assert message in lines[0], lines[0]


@pytest.mark.parametrize(
    "mesh, rollout_mesh, message",
    [
        (
            [[8], ["fsdp"]],
            [[4], ["fsdp"]],
            "model.mesh_shape takes 8 devices and training.rollout.mesh_shape 4 more; "
            "the two meshes must not share devices and together use the run's 8",
        ),
        (
            [[2], ["fsdp"]],
            [[4], ["fsdp"]],
            "model.mesh_shape takes 2 devices and training.rollout.mesh_shape 4 more",
        ),
        (
            [[-1], ["fsdp"]],
            [[8], ["fsdp"]],
            "training.rollout.mesh_shape: its 8 devices must leave devices for "
            "training on each of the 1 processes",
        ),
        (
            [[-1], ["fsdp"]],
            [[-1], ["fsdp"]],
            "training.rollout.mesh_shape: sizes [-1] must be given, not -1",
        ),
        ([[-1], ["fsdp"]], [[2], ["sp"]], "training.rollout.mesh_shape: unknown mesh axis 'sp'"),
    ],
)
def test_a_rollout_mesh_that_does_not_fit_is_a_config_error(tmp_path, mesh, rollout_mesh, message):
    from tunix_train.config import ConfigError

    cfg = _cfg(tmp_path, mesh, 4)
    cfg.training.rollout.mesh_shape = rollout_mesh
    with pytest.raises(ConfigError) as error:
        setup(cfg, jax.devices()[:8])
    assert message in str(error.value), error.value


def _two_process_run(prompts) -> list[str]:
    return [
        "model=gemma3_tiny",
        "model.vocab_size=4096",
        "objective=grpo",
        "data=jsonl",
        f"data.train_files=[{prompts}]",
        "data.seq_len=16",
        "training.log_every=1",
        "training.max_steps=3",
        "training.micro_batch_size=4",
        "training.rollout.num_generations=4",
        "training.rollout.max_new_tokens=4",
        "training.rollout.temperature=1.5",
        f"training.rollout.reward=[{LENGTH}]",
        "training.learning_rate=1e-3",
        'model.mesh_shape=[[4],["fsdp"]]',
        "distributed.initialization_timeout_s=60",
    ]


def _launched_on_two_processes(run_dir, *overrides, devices: int):
    """run_training.py with `overrides` by the launcher: 2 processes of `devices` CPU devices each."""
    import os

    from conftest import REPO

    return run_python(
        "-m",
        "tunix_train.launch",
        "--nprocs=2",
        f"--cpu_devices_per_process={devices}",
        str(REPO / "run_training.py"),
        *overrides,
        f"hydra.run.dir={run_dir}",
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=300,
    )


@pytest.fixture(scope="module")
def one_process_grpo(tmp_path_factory):
    """The run both two-process tests compare with: 1 process x 4 devices; (its directory, prompts)."""

    tmp_path = tmp_path_factory.mktemp("one_process_grpo")
    prompts, _ = write_task(tmp_path / "task", count=64, seed=0)
    one = run_training(
        *_two_process_run(prompts),
        f"hydra.run.dir={tmp_path / 'one'}",
        devices=4,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr
    return tmp_path / "one", prompts


@pytest.mark.slow
@pytest.mark.xdist_group("one_process_grpo")  # one worker runs both: the reference run is shared
@pytest.mark.parametrize("rollout_mesh", [False, True])
def test_two_processes_sample_and_train_like_one(tmp_path, rollout_mesh, one_process_grpo):
    """Every process samples the step's prompts and keeps its own rows: 2 processes x 2 devices give
    the completions and losses of 1 process x 4. With a rollout mesh, 2 processes x 4 devices, each
    giving 2 to a [[4],["fsdp"]] rollout mesh, each copying its own shards of the weights there."""
    one_dir, prompts = one_process_grpo
    run = _two_process_run(prompts)
    apart = ['training.rollout.mesh_shape=[[4],["fsdp"]]'] if rollout_mesh else []
    two = _launched_on_two_processes(tmp_path / "two", *run, *apart, devices=4 if rollout_mesh else 2)
    assert two.returncode == 0, two.stdout
    assert _samples(tmp_path / "two") == _samples(one_dir)
    assert all(
        ("weight_sync_bytes" in m) == rollout_mesh for m in read_metrics(tmp_path / "two") if "loss" in m
    )
    for key in ("loss", "reward", "kl"):
        np.testing.assert_allclose(
            [m[key] for m in read_metrics(tmp_path / "two") if "loss" in m],
            [m[key] for m in read_metrics(one_dir) if "loss" in m],
            rtol=1e-5,
            atol=1e-7,
            err_msg=key,
        )


@pytest.mark.slow  # a one-process and a two-process run
@pytest.mark.xdist_group("one_process_grpo")
def test_two_processes_distill_a_draft_like_one(tmp_path, one_process_grpo):
    """GRPO drafting with the reference run's final checkpoint and distilling it every step
    (draft_distill_every=1): 2 processes x 2 devices log the losses, acceptance and draft
    divergences of 1 process x 4 (the divergence to float32 rounding: another device layout), and
    save the distilled draft in their checkpoint."""
    one_dir, prompts = one_process_grpo
    run = [
        *_two_process_run(prompts),
        f"training.rollout.draft={one_dir}",
        "training.rollout.draft_distill_every=1",
        "training.rollout.draft_learning_rate=1e-3",
    ]
    one = run_training(*run, f"hydra.run.dir={tmp_path / 'one'}", devices=4, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    two = _launched_on_two_processes(tmp_path / "two", *run, devices=2)
    assert two.returncode == 0, two.stdout[-2000:]
    steps = {name: [m for m in read_metrics(tmp_path / name) if "loss" in m] for name in ("one", "two")}
    assert [m["step"] for m in steps["two"]] == [1, 2, 3]
    for key, rtol in (("loss", 1e-5), ("acceptance_rate", 0), ("draft_divergence", 1e-5)):
        np.testing.assert_allclose(
            [m[key] for m in steps["two"]], [m[key] for m in steps["one"]], rtol=rtol, atol=1e-7, err_msg=key
        )
    assert all(m["draft_divergence"] > 0 for m in steps["two"])
    assert (tmp_path / "two" / "checkpoints" / "3" / "draft").is_dir()
