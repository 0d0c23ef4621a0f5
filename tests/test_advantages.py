"""The critic-free advantages (objective=rloo, reinforce_pp) against the code they transcribe: RLOO's as
TRL's RLOOTrainer computes it, REINFORCE++'s (with and without its group baseline) as OpenRLHF's
experience maker does; and each trains the arithmetic task's rollouts through the GRPO loop."""

import numpy as np
import pytest
from conftest import LORA_RESUMED, rl_config

from tunix_train.compose import load_config
from tunix_train.config import AdvantageEstimator, ConfigError
from tunix_train.train.objectives import grpo_family as family

torch = pytest.importorskip("torch")
G = 4


def _rewards():
    rng = np.random.default_rng(0)
    return rng.integers(0, 3, (2, 3 * G)).astype(np.float64) + rng.standard_normal((2, 3 * G)) * 0.1


@pytest.mark.parametrize("normalize", [False, True])
def test_rloo_equals_trls_rloo_trainer(normalize):
    """Two reward functions (weights 1 and 0.5), three groups of 4: TRL RLOOTrainer.
    _generate_and_score_completions' advantages at beta 0 (trl/trainer/rloo_trainer.py: the
    weighted sum, the leave-one-out baseline, normalize_advantages with its nanstd + 1e-4)."""
    from trl.trainer.utils import nanstd

    rewards_FN, weights = _rewards(), [1.0, 0.5]
    rewards = (torch.tensor(rewards_FN.T) * torch.tensor(weights, dtype=torch.float64)).nansum(dim=1)
    grouped = rewards.view(-1, G)
    baselines = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (G - 1)
    theirs = rewards - baselines.view(-1)
    if normalize:
        theirs = (theirs - torch.nanmean(theirs)) / (nanstd(theirs) + 1e-4)
    ours = family.advantages(rewards_FN, G, weights, estimator=AdvantageEstimator.rloo, normalize=normalize)
    np.testing.assert_allclose(ours, theirs.numpy(), atol=1e-12)


@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_pp_equals_openrlhfs_experience_maker(baseline):
    """Completions of different lengths (action masks [N, 7]): OpenRLHF's compute_advantages_and_
    returns (openrlhf/trainer/ppo_utils/experience_maker.py) for "reinforce" and
    "reinforce_baseline" without a KL in the reward: the group mean subtracted (baseline only), the
    reward put on the last action token (compute_reward), the cumulative returns at gamma 1, and the
    whitening over every action token of the batch; ours per completion, on each of its tokens."""
    rewards_FN = _rewards()[:1]
    N, T = rewards_FN.shape[1], 7
    lengths = np.random.default_rng(1).integers(1, T + 1, N)
    action_mask = torch.tensor(np.arange(T)[None] < lengths[:, None], dtype=torch.float64)
    rewards = torch.tensor(rewards_FN[0])
    if baseline:
        grouped = rewards.reshape(-1, G)
        rewards = (grouped - grouped.mean(-1, keepdim=True)).reshape(-1)
    per_token = torch.zeros(N, T, dtype=torch.float64)
    per_token[torch.arange(N), torch.tensor(lengths - 1)] = rewards  # compute_reward: r at the eos token
    returns = torch.zeros_like(per_token)
    cumulative = torch.zeros(N, dtype=torch.float64)
    for t in reversed(range(T)):  # get_cumulative_returns, gamma 1
        cumulative = (action_mask * per_token)[:, t] + 1.0 * cumulative
        returns[:, t] = cumulative
    num_actions = action_mask.sum()
    mean = (returns * action_mask).sum() / num_actions
    var = ((returns - mean).pow(2) * action_mask).sum() / num_actions
    theirs = (returns - mean) * var.clamp(min=1e-8).rsqrt()

    estimator = AdvantageEstimator.reinforce_pp
    ours = family.whitened(family.advantages(rewards_FN, G, estimator=estimator, baseline=baseline), lengths)
    ours_per_token = np.broadcast_to(ours[:, None], (N, T))
    mask = action_mask.numpy().astype(bool)
    np.testing.assert_allclose(ours_per_token[mask], theirs.numpy()[mask], atol=1e-12)


def _grpo(*overrides):
    return load_config(
        [
            "objective=grpo",
            "data=jsonl",
            "data.train_files=[x.jsonl]",
            "training.rollout.reward=[tunix_train.rewards.arithmetic:exact_match]",
            *overrides,
        ]
    )[0]


def test_the_presets_and_bad_settings():
    """objective=rloo and reinforce_pp set the advantage; GRPO's own scaling with another
    estimator, and RLOO's normalization with REINFORCE++, are one line each."""
    assert _grpo("objective=rloo").training.objective.advantage is AdvantageEstimator.rloo
    reinforce_pp = _grpo("objective=reinforce_pp").training
    assert reinforce_pp.objective.advantage is AdvantageEstimator.reinforce_pp
    assert reinforce_pp.reinforce_pp.baseline
    for overrides, message in [
        (["objective=rloo", "training.grpo.scale_rewards=none"], "are GRPO's advantage"),
        (
            ["objective=reinforce_pp", "training.rloo.normalize_advantages=true"],
            "normalize_advantages is objective=rloo's; objective=reinforce_pp whitens",
        ),
    ]:
        with pytest.raises(ConfigError, match=message):
            _grpo(*overrides)


def test_the_rows_carry_reinforce_pp_advantages_whitened_over_their_loss_tokens(tmp_path):
    """Two prompts x G=2, completions of 3, 1, 2 and 4 tokens, rewards 1, 0, 0.5, 0.5, the second
    group filling the batch (dynamic sampling): the first group's returns 0.5 and -0.5 whiten over
    its 4 loss tokens to 0.25 / sqrt(0.1875) and -0.75 / sqrt(0.1875) on each of them; the filler's
    are 0 and do not count."""
    from tunix_train.train.objectives.grpo import OnPolicy
    from tunix_train.train.rollouts import Rollout

    (tmp_path / "p.jsonl").write_text('{"prompt": "x", "answer": "1"}\n{"prompt": "y", "answer": "2"}\n')
    cfg = _grpo(
        "objective=reinforce_pp",
        f"data.train_files=[{tmp_path}/p.jsonl]",
        "data.seq_len=16",
        "training.rollout.num_generations=2",
        "training.micro_batch_size=4",
    )
    objective = OnPolicy(cfg)
    objective.sampler.rows = range(0, 4)
    completions = [[5, 6, 7], [5], [6, 7], [5, 6, 7, 8]]
    rollout = Rollout(
        0,
        0,
        1,
        [0, 1],
        completions,
        [[-1.0] * len(c) for c in completions],
        [[1.0, 0.0, 0.5, 0.5]],
        0.0,
        prompt_ids=[[2, 3, 4]] * 4,
        filler_groups=1,
    )
    rows = objective._rows_of(rollout)
    mask, advantages = rows["loss_mask"][0], rows["advantages"][0]
    assert mask.sum(axis=1).tolist() == [3, 1, 2, 4]
    expected = np.array([0.25, -0.75, 0.0, 0.0]) / np.sqrt([0.1875, 0.1875, 1, 1])
    np.testing.assert_allclose(advantages[:, 5], expected, rtol=1e-6)
    assert (advantages == advantages[:, :1]).all()  # each row's on every position


@pytest.mark.slow  # two runs each
@pytest.mark.parametrize("objective", ["rloo", "reinforce_pp"])
def test_under_lora_on_fsdp2_tp2_a_run_resumes_bit_identically(tmp_path, objective):
    """The arithmetic task's rollouts, LoRA rank 4 on fsdp2 x tp2: stopped after 2 steps and resumed
    to 4, the 4th step's parameters and every logged loss, reward and KL equal an uninterrupted run's
    bit for bit; the adapters have moved."""
    import jax
    from conftest import assert_adapters_moved, assert_resumes_bit_identically

    cfg = rl_config(
        tmp_path,
        "training.eval_every=0",
        "training.micro_batch_size=4",
        "training.rollout.num_generations=4",
        "training.rollout.temperature=1.5",
        "training.rollout.reward=[tunix_train.rewards.arithmetic:exact_match,tests.rewards_for_tests:length]",
        *LORA_RESUMED,
        objective=objective,
    )
    straight = assert_resumes_bit_identically(cfg, tmp_path, ("loss", "reward", "kl"), jax.devices()[:4])
    assert_adapters_moved(straight / "checkpoints" / "4")
