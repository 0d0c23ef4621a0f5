"""CISPO (objective=cispo; MiniMax-M1, Chen et al. 2025, eq. 4): the per-token objective and its
gradient equal a numpy transcription of the paper's formula, the weight clipped on both sides and
held constant; a run on fsdp2 x tp2 trains 20 steps, and one stopped and resumed logs the same
losses and parameters bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_same_parameters, read_metrics, rl_config, step_metrics, straight_and_resumed

from tunix_train.config import GrpoAggregation, PolicyLoss
from tunix_train.train.objectives import grpo_family as family

LENGTH = "tests.rewards_for_tests:length"


def _numpy_cispo(logp, old_logp, ref_logp, advantages, mask, eps_low, eps_high, beta):
    """J = sum over tokens of sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi - beta k3, over the
    batch's tokens (the paper's 1 / sum |o_i|), and dJ / d log pi."""
    r = np.exp(logp - old_logp)
    weight = np.clip(r, 1 - eps_low, 1 + eps_high)
    d = ref_logp - logp
    kl = np.exp(d) - d - 1
    tokens = mask.sum()
    value = ((weight * advantages * logp - beta * kl) * mask).sum() / tokens
    gradient = (weight * advantages - beta * (1 - np.exp(d))) * mask / tokens
    return value, gradient, weight != r


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_the_objective_and_its_gradient_equal_the_papers_formula(beta):
    rng = np.random.default_rng(0)
    B, T = 4, 9
    logp = -rng.uniform(0.1, 3.0, (B, T))
    old_logp = logp + rng.normal(0, 0.5, (B, T))
    ref_logp = logp + rng.normal(0, 0.3, (B, T))
    advantages = np.broadcast_to(rng.normal(size=(B, 1)), (B, T))
    mask = (rng.uniform(size=(B, T)) < 0.8).astype(np.float64)
    eps_low, eps_high = 0.3, 0.28
    clip = family.Clip(eps_low, eps_high, loss=PolicyLoss.cispo)
    weight = {"tokens": jnp.asarray(mask.sum())}

    def loss(lp):
        per_token, _, _ = family.token_objective(
            lp,
            jnp.asarray(old_logp),
            jnp.asarray(ref_logp) if beta else None,
            advantages,
            mask,
            clip=clip,
            beta=beta,
        )
        return -family.aggregate(per_token, mask, weight, GrpoAggregation.token_mean)

    value, gradient, truncated = _numpy_cispo(
        logp, old_logp, ref_logp, advantages, mask, eps_low, eps_high, beta
    )
    ours, grad = jax.value_and_grad(loss)(jnp.asarray(logp, jnp.float32))
    _, _, clipped = family.token_objective(
        jnp.asarray(logp), jnp.asarray(old_logp), None, advantages, mask, clip=clip, beta=0.0
    )
    np.testing.assert_allclose(float(ours), -value, rtol=1e-6, atol=1e-7)  # float32 against float64
    np.testing.assert_allclose(np.asarray(grad), -gradient, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(clipped), truncated)
    r = np.exp(logp - old_logp)  # both sides bite, and a truncated token still has its gradient
    assert (r < 1 - eps_low).any() and (r > 1 + eps_high).any()
    assert np.all(np.abs(np.asarray(grad))[(truncated & (mask > 0))] > 0)


def test_unlike_the_clipped_surrogate_no_token_loses_its_gradient():
    """Where PPO's min(r A, clip(r) A) takes the clipped side its gradient is 0; CISPO's is not."""
    logp = jnp.asarray([[-1.0, -1.0]])
    old_logp = logp - jnp.asarray([[0.5, -0.5]])  # r = e^0.5 > 1.2 and e^-0.5 < 0.8
    advantages, mask = jnp.asarray([[1.0, -1.0]]), jnp.ones((1, 2))

    def grad(kind):
        def objective(lp):
            clip = family.Clip(0.2, 0.2, loss=kind)
            return jnp.sum(
                family.token_objective(lp, old_logp, None, advantages, mask, clip=clip, beta=0.0)[0]
            )

        return np.asarray(jax.grad(objective)(logp))

    np.testing.assert_array_equal(grad(PolicyLoss.clip), [[0.0, 0.0]])
    np.testing.assert_allclose(grad(PolicyLoss.cispo), [[1.2, -0.8]], rtol=1e-6)


@pytest.mark.slow  # 20 GRPO steps, then a run stopped and resumed, on fsdp2 x tp2
def test_twenty_steps_on_fsdp2_tp2_then_a_bit_identical_resume(tmp_path):
    from tunix_train.train.loop import train

    def cfg(*overrides):
        c = rl_config(
            tmp_path,
            "training.micro_batch_size=4",
            "training.rollout.num_generations=4",
            f"training.rollout.reward=[{LENGTH}]",
            "training.rollout.temperature=1.5",
            "training.lr_schedule=constant",
            *overrides,
            objective="cispo",
        )
        c.model.mesh_shape = [[2, 2], ["fsdp", "tp"]]
        return c

    twenty = cfg("training.max_steps=20")
    assert twenty.training.objective.policy_loss is PolicyLoss.cispo
    train(twenty, tmp_path / "twenty", devices=jax.devices()[:4])
    logged = [m for m in read_metrics(tmp_path / "twenty") if "loss" in m]
    assert len(logged) == 20 and np.all(np.isfinite([[m["loss"], m["grad_norm"]] for m in logged]))
    # on-policy (r = 1) CISPO's gradient is GRPO's, A grad log pi, while its loss is -mean(A log pi)
    grpo = cfg("training.max_steps=1", "training.objective=grpo", "training.grpo.epsilon=0.2")
    train(grpo, tmp_path / "grpo", devices=jax.devices()[:4])
    first = [m for m in read_metrics(tmp_path / "grpo") if "loss" in m][0]
    assert first["grad_norm"] == pytest.approx(logged[0]["grad_norm"], rel=1e-5)
    assert abs(first["loss"] - logged[0]["loss"]) > 1e-3

    straight, resumed = straight_and_resumed(
        cfg("checkpoint.every_steps=2"), tmp_path / "resume", 4, 2, jax.devices()[:4]
    )
    assert_same_parameters(straight, resumed, 4)
    for key in ("loss", "reward", "clip_fraction"):
        assert [m[key] for m in step_metrics(resumed)] == [m[key] for m in step_metrics(straight)], key
