"""The GRPO family (loss_aggregation, scale_rewards, multi_reward_normalization, epsilon_high,
importance_sampling_level, overlong, and the dapo / dr_grpo / gspo presets) against TRL 1.16's
GRPOTrainer on the same log-probabilities, masks and rewards, and exact under accumulation and
with the completions packed into shared rows (data.padding_free)."""

import collections
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_resumes_alike, rl_config

from tunix_train.compose import load_config
from tunix_train.config import (
    ConfigError,
    GrpoAggregation,
    ImportanceLevel,
    RewardNormalization,
    ScaleRewards,
)
from tunix_train.data.packed_rows import Packing
from tunix_train.train.objectives import grpo_family as family
from tunix_train.train.objectives.grpo import OnPolicy

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

B, G, T, MAX_NEW = 8, 4, 10, 12  # rows (two groups of G), positions, max_new_tokens
TRL_LOSS = {
    GrpoAggregation.token_mean: "bnpo",
    GrpoAggregation.sequence_mean: "grpo",
    GrpoAggregation.dr_grpo: "dr_grpo",
    GrpoAggregation.dapo: "dapo",
}
REWARD = "tunix_train.rewards.arithmetic:exact_match"


def _cfg(*overrides):
    # off-policy: pi_old is the recorded logp
    cfg, _ = load_config(
        [
            "objective=grpo",
            "data=jsonl",
            "data.train_files=[x.jsonl]",
            f"training.rollout.reward=[{REWARD},{REWARD}]",
            f"training.rollout.num_generations={G}",
            f"training.rollout.max_new_tokens={MAX_NEW}",
            "training.rollout.max_staleness=1",
            *overrides,
        ]
    )
    return cfg


def _trl_advantages(rewards_FN, weights, scale, normalization):
    """TRL 1.16 GRPOTrainer._generate_and_score_completions' advantages (trl/trainer/grpo_trainer.py
    lines 2761-2800), transcribed line for line with its own nanstd, rewards [N, functions]."""
    from trl.trainer.utils import nanstd

    rewards_per_func, w = torch.tensor(rewards_FN.T), torch.tensor(weights, dtype=torch.float64)
    if normalization == "sum_then_normalize":
        rewards = (rewards_per_func * w.unsqueeze(0)).nansum(dim=1)
        mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
        if scale in ["group", "none"]:
            std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
        else:
            std = nanstd(rewards).expand_as(rewards)
        advantages = rewards - mean
        if scale != "none":
            advantages = advantages / (std + 1e-4)
        return advantages.numpy()
    grouped = rewards_per_func.view(-1, G, len(weights))
    reward_k = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (
        nanstd(grouped, dim=1, keepdim=True) + 1e-4
    )
    rewards = (reward_k.view(-1, len(weights)) * w.unsqueeze(0)).nansum(dim=1)
    return ((rewards - torch.nanmean(rewards)) / (nanstd(rewards).expand_as(rewards) + 1e-4)).numpy()


def _trl_loss(cfg, logp, old, ref, mask, advantages) -> float:
    """TRL's GRPOTrainer._compute_loss itself, its forward replaced by the given log-probabilities."""
    from trl import GRPOTrainer

    g = cfg.training.grpo
    accelerator = types.SimpleNamespace(
        num_processes=1,
        reduce=lambda x, reduction: x,
        gather=lambda x: x,
        gather_for_metrics=lambda x: x,
        sync_gradients=True,
        device="cpu",
    )
    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True),
        accelerator=accelerator,
        aux_loss_enabled=False,
        _get_per_token_logps_and_entropies=lambda *a, **k: (torch.tensor(logp), torch.zeros(B, T), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=g.importance_sampling_level.value,
        beta=g.beta,
        loss_type=TRL_LOSS[g.loss_aggregation],
        epsilon_low=g.epsilon,
        epsilon_high=g.epsilon if g.epsilon_high is None else g.epsilon_high,
        use_vllm=False,
        args=types.SimpleNamespace(
            delta=g.importance_cap, use_bias_correction_kl=False, steps_per_generation=1
        ),
        current_gradient_accumulation_steps=1,
        max_completion_length=MAX_NEW,
        _entropy_bonus_enabled=False,
        _metrics={"train": collections.defaultdict(list)},
    )
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": torch.tensor(mask),
        "advantages": torch.tensor(advantages, dtype=torch.float32),
        "old_per_token_logps": torch.tensor(old),
        "ref_per_token_logps": torch.tensor(ref),
        "num_items_in_batch": torch.tensor(mask.sum()),
    }
    return float(GRPOTrainer._compute_loss(trainer, trainer.model, inputs))


def _data(seed):
    rng = np.random.default_rng(seed)
    logp = rng.uniform(-3, -0.1, (B, T)).astype(np.float32)
    old = (logp + rng.normal(0, 0.3, (B, T))).astype(np.float32)  # ratios around 1, some clipped
    old[0, :2] = logp[0, :2] - 1.5  # ratios e^1.5 beyond importance_cap (TRL's delta) 3
    ref = (logp + rng.normal(0, 0.2, (B, T))).astype(np.float32)
    mask = np.zeros((B, T), np.float32)
    for row in range(B):
        mask[row, : rng.integers(2, T // 2 + 2)] = 1.0  # 2 to 6 tokens: packed, a row holds several
    rewards = rng.integers(0, 3, (2, B)).astype(np.float64)  # two reward functions
    return logp, old, ref, mask, rewards


def _ours(cfg, logp, old, ref, mask, advantages, accumulation=1, packed=False) -> float:
    """Our loss over `accumulation` micro-batches of the rows (each a completion from position 0),
    padded, or packed as data.padding_free packs a rollout (data/packed_rows.py)."""
    objective = OnPolicy(cfg)
    A = accumulation
    rows = {
        "loss_mask": mask,
        "advantages": np.broadcast_to(np.asarray(advantages, np.float32)[:, None], (B, T)),
        "behaviour_logp": old,
        "logp": logp,
        "ref_logp": ref,
        "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)),
        "segment_ids": (mask > 0).astype(np.int32),
    }
    if packed:
        packing = Packing.first_fit(rows["segment_ids"], B)
        assert packing.used_rows < B  # rows of 2 to T tokens: some share a row
        rows = packing.pack(rows)
    batch = {name: jnp.asarray(x.reshape(A, B // A, T)) for name, x in rows.items()}
    weight = jax.tree.map(lambda w: jnp.maximum(w, 1.0), objective.weight(batch))
    total = 0.0
    for a in range(A):
        micro = {name: x[a] for name, x in batch.items()}
        total += float(objective.loss(lambda: -micro["logp"], lambda: -micro["ref_logp"], micro, weight)[0])
    return total


SETTINGS = [
    *[[f"training.grpo.loss_aggregation={how.value}"] for how in GrpoAggregation],
    *[[f"training.grpo.scale_rewards={scale.value}"] for scale in ScaleRewards],
    ["training.grpo.epsilon_high=0.28"],
    ["training.grpo.importance_sampling_level=sequence"],
    [
        "training.grpo.importance_sampling_level=sequence",
        "training.grpo.loss_aggregation=dr_grpo",
        "training.grpo.beta=0",
    ],
    ["training.rollout.reward_weights=[0.3,2.0]"],
    ["training.grpo.multi_reward_normalization=per_reward", "training.rollout.reward_weights=[1.0,0.5]"],
    ["objective=dapo"],
    ["objective=dr_grpo"],
    ["objective=gspo"],
    [
        "objective=gspo",
        "training.grpo.epsilon=0.1",
        "training.grpo.epsilon_high=0.2",
        "training.grpo.beta=0.04",
    ],
]


@pytest.mark.parametrize("overrides", SETTINGS, ids=lambda o: ",".join(x.rpartition(".")[2] for x in o))
def test_loss_equals_trl_grpo_trainer(overrides):
    cfg = _cfg(*overrides)
    g = cfg.training.grpo
    for seed in range(3):
        logp, old, ref, mask, rewards = _data(seed)
        weights = list(cfg.training.rollout.reward_weights) or [1.0, 1.0]
        trl_normalization = {
            RewardNormalization.sum: "sum_then_normalize",
            RewardNormalization.per_reward: "normalize_then_sum",
        }[g.multi_reward_normalization]
        expected_adv = _trl_advantages(rewards, weights, g.scale_rewards.value, trl_normalization)
        advantages = family.advantages(rewards, G, weights, g.scale_rewards, g.multi_reward_normalization)
        # (TRL's nanstd takes its Bessel factor count / (count - 1) in float32: 1e-8 apart)
        np.testing.assert_allclose(advantages, expected_adv, rtol=1e-7, atol=1e-12)
        expected = _trl_loss(cfg, logp, old, ref, mask, advantages)
        for accumulation in (1, 2, 4):
            for packed in (False, True):
                assert _ours(cfg, logp, old, ref, mask, advantages, accumulation, packed) == pytest.approx(
                    expected, abs=1e-6
                ), (seed, accumulation, packed)


def test_the_presets_set_what_their_papers_do():
    g = {name: _cfg(f"objective={name}").training.grpo for name in ("dapo", "dr_grpo", "gspo")}
    dapo_rollout = _cfg("objective=dapo").training.rollout
    assert (
        g["dapo"].loss_aggregation,
        g["dapo"].epsilon_high,
        dapo_rollout.dynamic_sampling,
        dapo_rollout.overlong.value,
        g["dapo"].beta,
    ) == (GrpoAggregation.dapo, 0.28, True, "soft", 0.0)
    assert (g["dr_grpo"].loss_aggregation, g["dr_grpo"].scale_rewards) == (
        GrpoAggregation.dr_grpo,
        ScaleRewards.none,
    )
    assert (g["gspo"].importance_sampling_level, g["gspo"].epsilon, g["gspo"].epsilon_high) == (
        ImportanceLevel.sequence,
        3e-4,
        4e-4,
    )


def test_overlong_penalty_equals_trl_and_pass_at_k_the_estimator():
    from trl.rewards import get_soft_overlong_punishment

    trl = get_soft_overlong_punishment(max_completion_len=20, soft_punish_cache=6)
    lengths = list(range(0, 21))
    assert [family.overlong_penalty(n, 20, 6) for n in lengths] == pytest.approx(
        trl([[1] * n for n in lengths])
    )
    # pass@k = 1 - C(n - c, k) / C(n, k), by hand: n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert family.pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert (
        family.pass_at_k(5, 0, 3) == 0.0
        and family.pass_at_k(5, 3, 3) == 1.0
        and family.pass_at_k(4, 1, 1) == 0.25
    )
    from math import comb

    for n, c, k in [(10, 3, 1), (10, 3, 4), (8, 7, 2), (16, 5, 8)]:
        assert family.pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)


def _run_cfg(tmp_path, *overrides, reward="tests.rewards_for_tests:length_for_even_answers"):
    cfg = rl_config(
        tmp_path,
        "training.micro_batch_size=8",
        "training.rollout.num_generations=4",
        f"training.rollout.reward=[{reward}]",
        "training.rollout.temperature=1.5",
        *overrides,
    )
    cfg.model.mesh_shape = [[2, 2], ["fsdp", "tp"]]
    return cfg


@pytest.mark.slow  # 18 s
def test_dynamic_sampling_refills_the_batch_with_informative_groups(tmp_path):
    """Half the prompts (odd answers) give every completion the same reward: their groups are set
    aside and more prompts rolled out until the batch is full of groups whose rewards differ."""
    from conftest import read_metrics

    from tunix_train.train.loop import train

    cfg = _run_cfg(tmp_path, "training.max_steps=3", "training.rollout.dynamic_sampling=true")
    train(cfg, tmp_path / "run", devices=jax.devices()[:4])
    steps = [m for m in read_metrics(tmp_path / "run") if "loss" in m]
    assert all(m["groups_without_signal"] == 0 for m in steps), steps
    # 4 groups per batch, about 2 informative per round
    assert max(m["dynamic_sampling_rounds"] for m in steps) >= 2
    assert all(m["reward_length_for_even_answers_std"] > 0 for m in steps)


@pytest.mark.slow  # several training runs
def test_a_batch_without_signal_does_not_update_the_weights(tmp_path):
    """Every reward equal: with dynamic sampling no group has signal after its rounds, and the weights
    and AdamW's state stay as they were (without it, weight decay alone would move them)."""
    from tunix_train.train.loop import train

    moved, initial = {}, None
    for dynamic in (True, False):
        cfg = _run_cfg(
            tmp_path,
            "training.max_steps=2",
            "training.weight_decay=0.1",
            f"training.rollout.dynamic_sampling={dynamic}",
            "training.rollout.dynamic_sampling_rounds=2",
            "training.eval_every=0",
            reward="tests.rewards_for_tests:constant",
        )
        state = train(cfg, tmp_path / f"run{dynamic}", devices=jax.devices()[:4])
        if initial is None:  # the initial weights: the same for both (dynamic sampling does not init)
            cfg.training.max_steps = 0
            initial = train(cfg, tmp_path / "init", devices=jax.devices()[:4])
        moved[dynamic] = max(
            float(jnp.max(jnp.abs(a - b)))
            for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(initial.params))
        )
    assert moved[True] == 0.0 and moved[False] > 0, moved


@pytest.mark.slow
def test_resume_is_bit_identical_with_dynamic_sampling(tmp_path):

    cfg = _run_cfg(
        tmp_path,
        "training.lr_schedule=constant",
        "checkpoint.every_steps=2",
        "objective=dapo",
        "training.grpo.beta=0.04",
    )
    keys = ("loss", "grad_norm", "reward", "dynamic_sampling_rounds", "reward_overlong")
    assert_resumes_alike(cfg, tmp_path, 5, 3, jax.devices()[:4], keys)


def test_evaluation_logs_reward_and_pass_at_k(tmp_path):
    from conftest import read_metrics

    from tunix_train.train.loop import train

    cfg = _run_cfg(
        tmp_path,
        "training.max_steps=4",
        "training.eval_every=2",
        "data.eval_fraction=0.25",
        "training.eval_batches=1",
        "training.rollout.eval_samples=4",
        "training.rollout.eval_k=2",
        "training.rollout.eval_pass_reward=0.3",
    )
    train(cfg, tmp_path / "run", devices=jax.devices()[:4])
    evals = [m for m in read_metrics(tmp_path / "run") if "eval_reward" in m]
    assert [m["step"] for m in evals] == [0, 2, 4]
    assert all(0 <= m["eval_pass@2"] <= 1 and np.isfinite(m["eval_reward"]) for m in evals)
    # they move with the weights
    assert len({m["eval_pass@2"] for m in evals} | {m["eval_reward"] for m in evals}) > 1


@pytest.mark.parametrize(
    "overrides",
    [
        ["training.grpo.loss_aggregation=token_mean"],
        ["training.grpo.loss_aggregation=sequence_mean"],
        ["training.grpo.loss_aggregation=dr_grpo"],
        ["objective=gspo"],
    ],
    ids=lambda o: o[0].rpartition("=")[2],
)
def test_the_compiled_step_is_exact_under_accumulation(tmp_path, overrides):
    """The same 16 rows as one micro-batch and as 4: equal loss, gradient norm and gradient. AdamW
    with eps 1 and learning rate 1 makes the update g / (|g| + 1) (no decay, no clipping), so the
    updated weights differ at most as much as the gradients."""
    from tunix_train.data.pipeline import padded_row
    from tunix_train.sharding import to_global_batch
    from tunix_train.train.setup import setup

    rng = np.random.default_rng(0)
    rows = [
        padded_row(
            list(rng.integers(3, 4000, rng.integers(2, 6))),
            list(rng.integers(3, 4000, rng.integers(1, 8))),
            16,
        )
        for _ in range(16)
    ]
    full = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    full["advantages"] = np.repeat(rng.normal(size=(16, 1)), 16, axis=1).astype(np.float32)
    full["behaviour_logp"] = rng.uniform(-9, -7, (16, 16)).astype(np.float32) * full["loss_mask"]
    results = []
    for accumulation in (1, 4):
        cfg = _run_cfg(
            tmp_path,
            f"training.gradient_accumulation_steps={accumulation}",
            f"training.micro_batch_size={16 // accumulation}",
            "training.rollout.max_staleness=1",
            "training.grpo.beta=0.04",
            "training.adam_eps=1.0",
            "training.learning_rate=1.0",
            "training.weight_decay=0",
            "training.grad_clip_norm=0",
            "training.lr_schedule=constant",
            "training.warmup_steps=0",
            *overrides,
        )
        cfg.model.mesh_shape = [[1], ["fsdp"]]
        objective = OnPolicy(cfg)
        run = setup(cfg, jax.devices()[:1], objective)
        state = run.plan.create()
        initial = [np.asarray(x) for x in jax.tree.leaves(state.params)]
        batch = {k: v.reshape(accumulation, 16 // accumulation, 16) for k, v in full.items()}
        with jax.set_mesh(run.mesh):
            state, metrics = run.step_fn(state, to_global_batch(batch, run.mesh))
        updates = [np.asarray(x) - x0 for x, x0 in zip(jax.tree.leaves(state.params), initial)]
        results.append(
            (
                float(metrics["loss"]),
                float(metrics["grad_norm"]),
                np.concatenate([u.ravel() for u in updates]),
            )
        )
    (loss1, norm1, update1), (loss4, norm4, update4) = results
    assert loss4 == pytest.approx(loss1, abs=1e-6) and norm4 == pytest.approx(norm1, rel=1e-6, abs=1e-7)
    assert abs(loss1) > 1e-3 and norm1 > 1e-3  # the comparison means something
    assert np.abs(update1 - update4).max() <= 1e-6 * max(np.abs(update1).max(), 1.0)


@pytest.mark.slow  # several training runs
def test_a_rollout_in_few_slots_gives_the_same_completions_and_losses(tmp_path):
    """training.rollout.slots=4: the 32 completions of a step go through 4 slots at a time
    (continuous batching) and are the ones of all at once, as are the losses."""
    from conftest import read_metrics

    from tunix_train.train.loop import train

    runs = {}
    for slots in ("null", "4"):
        cfg = _run_cfg(
            tmp_path,
            "training.max_steps=2",
            "training.micro_batch_size=16",
            "training.eval_every=0",
            f"training.rollout.slots={slots}",
        )
        train(cfg, tmp_path / slots, devices=jax.devices()[:4])
        runs[slots] = (
            [
                (m["loss"], m["reward"], m["completion_tokens"])
                for m in read_metrics(tmp_path / slots)
                if "loss" in m
            ],
            (tmp_path / slots / "samples.jsonl").read_text(),
        )
    assert runs["4"] == runs["null"] and len(runs["null"][0]) == 2


def test_missing_eos_penalty_is_a_reward_row_for_completions_that_did_not_stop():
    """training.rollout.missing_eos_penalty=2: a row `missing_eos` of weight 1 after the functions',
    -2 for each completion whose last token is not a stop token (TRL's missing_eos_penalty), 0
    for the others; the total subtracts it."""
    from tunix_train.train.objectives.grpo_rewards import Rewards

    cfg = _cfg("training.rollout.missing_eos_penalty=2", f"training.rollout.reward=[{REWARD}]")
    rewards = Rewards(cfg.training.rollout)
    rewards.stop_ids = [1]
    records = [{"prompt": "1+1=", "answer": "2"}] * 3
    scores = rewards.score(["1+1="] * 3, ["2", "2", "3"], records, [[5, 1], [5, 6], []])
    assert rewards.names[-1] == "missing_eos" and rewards.weights[-1] == 1.0
    np.testing.assert_array_equal(scores[-1], [0.0, -2.0, -2.0])
    np.testing.assert_array_equal(rewards.total(scores), [1.0, -1.0, -2.0])


def test_a_reward_that_hangs_raises_or_returns_nan_stops_the_run_with_one_line():
    """A reward function that never answers stops after training.rollout.reward_timeout_s (its thread
    left behind, a daemon's); one that raises or returns NaN stops at once; each a ConfigError
    naming it (docs/objectives/grpo.md: the run stops rather than train on a reward it lacks)."""
    import re
    import time

    from tunix_train.train.objectives.grpo_rewards import Rewards

    records = [{"prompt": "1+1=", "answer": "2"}] * 2
    for name, overrides, words in [
        (
            "hangs",
            ["training.rollout.reward_timeout_s=0.5"],
            "gave no answer in 0.5 s (training.rollout.reward_timeout_s)",
        ),
        ("nan_for_long", [], "returned nan; it must return finite numbers"),
        ("divides", [], "raised ZeroDivisionError"),
    ]:
        rewards = Rewards(
            _cfg(f"training.rollout.reward=[tests.rewards_for_tests:{name}]", *overrides).training.rollout
        )
        start = time.perf_counter()
        with pytest.raises(
            ConfigError, match=re.escape(f"training.rollout.reward 'tests.rewards_for_tests:{name}' {words}")
        ):
            rewards.score(["1+1="] * 2, ["2", "22"], records, [[5], [5, 5]])
        assert time.perf_counter() - start < 5
