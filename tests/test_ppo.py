"""PPO (objective=ppo; train/objectives/ppo.py) against the code it
transcribes: the KL in the reward, GAE, the returns and the whitening as OpenRLHF's experience maker
computes them, the rewards' whitening as TRL's PPOTrainer, the policy and value losses (and their
gradients) as OpenRLHF's PolicyLoss and ValueLoss; then runs: equal on one device, fsdp2 x tp2
and with accumulation, resumed bit-identically in the middle of a rollout's epochs, exported as
the language model without its critic; and bad input."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_same_parameters, read_metrics, rl_config, straight_and_resumed

from tunix_train.config import ConfigError, KlEstimator
from tunix_train.train.loop import train
from tunix_train.train.objectives import ppo

torch = pytest.importorskip("torch")
REWARD = "tunix_train.rewards.arithmetic:exact_match"


def _batch(seed=0, N=5, T=9):
    """Rows whose completions start and end at different positions (the loss mask), and what the
    scoring pass and the rewards said of them."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((N, T))
    for row in range(N):
        start = rng.integers(0, 3)
        mask[row, start : start + rng.integers(1, T - start + 1)] = 1
    logp, ref_logp = rng.uniform(-3, -0.1, (2, N, T))
    values = rng.normal(size=(N, T))
    scores = rng.normal(size=N)
    return mask, logp, ref_logp, values, scores


@pytest.mark.parametrize("estimator, gamma, lam", [(KlEstimator.k1, 1.0, 0.95), (KlEstimator.k3, 0.9, 0.5)])
def test_gae_and_the_rewards_equal_openrlhfs_experience_maker(estimator, gamma, lam):
    """OpenRLHF (openrlhf/models/utils.py, trainer/ppo_utils/experience_maker.py), transcribed in
    torch on the action tokens: compute_approx_kl, compute_reward (the score on the last action
    token), get_advantages_and_returns and the advantages' normalization over the batch's action
    tokens; ours on the rows' loss masks (1e-12)."""
    mask, logp, ref_logp, values, scores = _batch()
    kl_coef = 0.05
    # OpenRLHF, on the rows as they stand
    action_mask = torch.tensor(mask)
    log_ratio = torch.tensor(logp) - torch.tensor(ref_logp)
    if estimator is KlEstimator.k3:
        log_ratio = (-log_ratio).exp() - 1 + log_ratio
    kl = log_ratio.clamp(min=-10, max=10)
    eos = action_mask.size(1) - 1 - action_mask.long().fliplr().argmax(dim=1, keepdim=True)
    last_reward = torch.zeros_like(kl).scatter_(dim=1, index=eos, src=torch.tensor(scores).unsqueeze(1))
    reward = last_reward + -kl_coef * kl
    v, r = action_mask * torch.tensor(values), action_mask * reward
    lastgaelam, reversed_ = 0, []
    for t in reversed(range(r.size(1))):
        nextvalues = v[:, t + 1] if t < r.size(1) - 1 else 0.0
        delta = r[:, t] + gamma * nextvalues - v[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        reversed_.append(lastgaelam)
    advantages = torch.stack(reversed_[::-1], dim=1)
    returns = advantages + v
    num_actions = action_mask.sum()
    mean = (advantages * action_mask).sum() / num_actions
    var = ((advantages - mean).pow(2) * action_mask).sum() / num_actions
    normalized = (advantages - mean) * var.clamp(min=1e-8).rsqrt()

    ours_kl = ppo.kl_samples(logp, ref_logp, estimator)
    ours_rewards = ppo.token_rewards(scores, ours_kl, mask, kl_coef)
    ours_advantages, ours_returns = ppo.gae(values, ours_rewards, mask, gamma, lam)
    on = mask.astype(bool)
    np.testing.assert_allclose(ours_rewards[on], reward.numpy()[on], atol=1e-12)
    np.testing.assert_allclose(ours_advantages[on], advantages.numpy()[on], atol=1e-12)
    np.testing.assert_allclose(ours_returns[on], returns.numpy()[on], atol=1e-12)
    np.testing.assert_allclose(ppo.whitened(ours_advantages, mask)[on], normalized.numpy()[on], atol=1e-12)


def test_whitened_rewards_equal_trls_masked_whiten():
    """TRL's masked_whiten(rewards, mask, shift_mean=False) then masked_fill (trl/experimental/ppo/
    ppo_trainer.py), transcribed: unbiased variance, rsqrt(var + 1e-8), the mean put back."""
    mask, logp, ref_logp, values, scores = _batch(1)
    rewards = ppo.token_rewards(scores, logp - ref_logp, mask, 0.05)
    values_t, mask_t = torch.tensor(rewards), torch.tensor(mask)
    mean = (values_t * mask_t).sum() / mask_t.sum()
    var = ((values_t - mean) ** 2 * mask_t).sum() / mask_t.sum() * (mask_t.sum() / (mask_t.sum() - 1))
    theirs = ((values_t - mean) * torch.rsqrt(var + 1e-8) + mean).masked_fill(mask_t == 0, 0)
    np.testing.assert_allclose(ppo.whitened_rewards(rewards, mask), theirs.numpy(), atol=1e-12)


class _Policy:
    """A stand-in for the step's Forward of the policy: its NLL and its value head's values."""

    def __init__(self, logp, values):
        self.logp, self.values = logp, values

    def __call__(self):
        return -self.logp

    def scores(self):
        return self.values


def _ppo_cfg(tmp_path, *overrides):
    return rl_config(
        tmp_path,
        "training.micro_batch_size=4",
        "training.rollout.num_generations=2",
        f"training.rollout.reward=[{REWARD}]",
        *overrides,
        objective="ppo",
    )


@pytest.mark.parametrize("value_clip", [0.2, None])
def test_the_loss_and_its_gradient_equal_openrlhfs_policy_and_value_losses(tmp_path, value_clip):
    """A hand-made micro-batch (ratios inside the importance cap, some clipped): our loss and its
    gradient with respect to the log-probabilities and the values equal OpenRLHF's PolicyLoss
    (clip 0.2, token-level) + vf_coef x ValueLoss (value_clip) in torch (1e-6)."""
    from tunix_train.train.objectives import make_objective

    mask, old_logp, _, old_values, _ = _batch(2, 4, 6)
    rng = np.random.default_rng(3)
    logp = old_logp + rng.uniform(-0.5, 0.5, old_logp.shape)
    values = old_values + rng.uniform(-0.5, 0.5, old_values.shape)
    advantages, returns = rng.normal(size=(2, *mask.shape))
    f32 = {name: x.astype(np.float32) for name, x in locals().items() if isinstance(x, np.ndarray)}
    clip = "null" if value_clip is None else value_clip
    objective = make_objective(_ppo_cfg(tmp_path, f"training.ppo.value_clip={clip}"))
    micro = {
        "loss_mask": f32["mask"],
        "advantages": f32["advantages"],
        "returns": f32["returns"],
        "old_values": f32["old_values"],
        "old_logp": f32["old_logp"],
        "behaviour_logp": f32["old_logp"],
    }
    weight = {"tokens": jnp.float32(mask.sum()), "sequences": 4.0, "sequences_x_max_new_tokens": 16.0}

    def ours(logp, values):
        return objective.loss(_Policy(logp, values), None, micro, weight)[0]

    loss, grads = jax.value_and_grad(ours, argnums=(0, 1))(
        jnp.asarray(f32["logp"]), jnp.asarray(f32["values"])
    )

    t = {name: torch.tensor(x, dtype=torch.float64) for name, x in f32.items()}
    log_probs = t["logp"].clone().requires_grad_()
    v = t["values"].clone().requires_grad_()
    ratio = (log_probs - t["old_logp"]).clamp(min=-20.0, max=20.0).exp()
    surr1, surr2 = ratio * t["advantages"], ratio.clamp(0.8, 1.2) * t["advantages"]
    policy_loss = (-torch.min(surr1, surr2) * t["mask"]).sum() / t["mask"].sum()
    if value_clip is None:
        value_losses = (v - t["returns"]) ** 2
    else:
        clipped = t["old_values"] + (v - t["old_values"]).clamp(-value_clip, value_clip)
        value_losses = torch.max((clipped - t["returns"]) ** 2, (v - t["returns"]) ** 2)
    theirs = policy_loss + 0.1 * 0.5 * (value_losses * t["mask"]).sum() / t["mask"].sum()
    theirs.backward()
    assert float(loss) == pytest.approx(float(theirs.detach()), abs=1e-6)
    np.testing.assert_allclose(np.asarray(grads[0]), log_probs.grad.numpy(), atol=1e-6)
    np.testing.assert_allclose(np.asarray(grads[1]), v.grad.numpy(), atol=1e-6)
    assert 0 < float((torch.lt(surr2, surr1).float() * t["mask"]).sum()) < mask.sum()  # the clip bites


def test_the_preset_and_bad_settings_are_one_line(tmp_path):
    """objective=ppo sets the value head, GAE and the KL in the reward; a gae_lambda outside [0, 1],
    no value head, dynamic sampling and a value clip of 0 are one line each."""
    cfg = _ppo_cfg(tmp_path, "training.rollout.num_generations=1")
    assert cfg.model.score_head and cfg.training.grpo.beta == 0 and cfg.training.ppo.kl_coef == 0.05
    for override, message in [
        ("training.ppo.gae_lambda=1.5", r"training.ppo.gae_lambda=1.5 must be in \[0, 1\]"),
        ("model.score_head=false", "reads a critic: set model.score_head=true"),
        ("training.rollout.dynamic_sampling=true", "PPO's critic learns from them"),
        ("training.ppo.value_clip=0", "value_clip=0.0 positive"),
    ]:
        with pytest.raises(ConfigError, match=message):
            _ppo_cfg(tmp_path, override)


def _figures(run_dir):
    keys = ("loss", "policy_loss", "value_loss", "reward", "kl_reward", "grad_norm")
    return [[m[k] for k in keys] for m in read_metrics(run_dir)]


@pytest.mark.parametrize("lora", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_ppo_is_the_same_on_one_device_fsdp2_tp2_and_with_accumulation(tmp_path, lora):
    """Two steps of PPO (G=1, 4 prompts a step): the same rewards, losses (policy and value) and
    gradient norms on one device and on fsdp2 x tp2 in 2 accumulated micro-batches (whitening and
    every mean are the whole batch's), within 1e-5. Slow, under LoRA (the value head training
    beside the adapters): the same, and on cp2 (the scoring pass puts the positions back in row
    order)."""
    devices = jax.devices()
    runs = {}
    for name, mesh, micro, accumulation in [
        ("one", [[1], ["fsdp"]], 4, 1),
        ("fsdp2_tp2", [[2, 2], ["fsdp", "tp"]], 1, 2),
        # slow, with LoRA: cp2 (the scoring pass puts positions back in row order)
        *([("cp2", [[1, 2], ["fsdp", "cp"]], 4, 1)] if lora else []),
    ]:
        cfg = _ppo_cfg(
            tmp_path,
            "training.rollout.num_generations=1",
            f"training.micro_batch_size={micro}",
            f"training.gradient_accumulation_steps={accumulation}",
            "training.max_steps=2",
            f"training.lora.rank={4 if lora else 'null'}",
        )
        cfg.model.mesh_shape = mesh
        size = int(np.prod(mesh[0]))
        train(cfg, tmp_path / name, devices=devices[:size])
        runs[name] = _figures(tmp_path / name)
    for name in set(runs) - {"one"}:
        np.testing.assert_allclose(runs[name], runs["one"], rtol=1e-5, atol=1e-6, err_msg=name)
    assert runs["one"][1][2] != runs["one"][0][2]  # the critic learns: its loss moves


@pytest.mark.slow
def test_ppo_resumes_bit_identically_within_a_rollouts_epochs_and_exports_without_its_critic(tmp_path):
    """Two epochs per rollout (training.rollout.iterations=2), stopped after step 3, in the middle of
    rollout 1: resumed, its critique comes from the checkpoint, and steps 4 and the parameters are
    bit-identical to a straight run's. The run exports as a causal LM that transformers loads,
    without the value head."""
    cfg = _ppo_cfg(
        tmp_path,
        "training.rollout.iterations=2",
        "checkpoint.every_steps=1",
        "training.lr_schedule=constant",  # the schedule must not depend on max_steps, which changes
    )
    cfg.model.mesh_shape = [[2], ["fsdp"]]
    straight, resumed = straight_and_resumed(cfg, tmp_path, 4, 3, jax.devices()[:2])
    keys = ("loss", "policy_loss", "value_loss", "kl_reward", "grad_norm", "reward", "clip_fraction")
    assert [read_metrics(straight)[3][k] for k in keys] == [read_metrics(resumed)[-1][k] for k in keys]
    assert_same_parameters(straight, resumed, 4)

    from tunix_train import api

    api.load(straight).export(tmp_path / "hf")
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["architectures"] == ["Gemma3ForCausalLM"]
    from safetensors import safe_open

    with safe_open(tmp_path / "hf" / "model.safetensors", "np") as f:
        assert not [k for k in f.keys() if "score" in k]
    from transformers import AutoModelForCausalLM

    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "hf")).__name__ == "Gemma3ForCausalLM"
