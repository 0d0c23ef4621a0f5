"""PPO (Schulman et al. 2017) for language models, as RLHF runs it (Ouyang et al. 2022): the
on-policy objective (grpo.py's OnPolicy) with two parts of its own, the advantage (Critic: each
token's from a critic by GAE, Schulman et al. 2016) and the loss (WithValueLoss).

The critic is a value head on the policy's own trunk (model.score_head: V(s_t) = w . h_t, the
final hidden state at the position that predicts completion token t), trained with the policy by
one loss, so it costs a vector of D parameters, not a second model (TRL and OpenRLHF keep a
separate value model; a shared trunk is their `PolicyAndValueWrapper` with one backbone).

At a rollout's first step a scoring pass (train/scoring.py, without gradient) computes, for
every completion token, the critic's value, the policy's log-probability and the reference's; they
are kept with the rollout (so every step trained on it, a resumed one too, reads the same). On the
host, per completion, as OpenRLHF's experience maker computes them
(openrlhf/trainer/ppo_utils/experience_maker.py, openrlhf/models/utils.py):

    kl_t = log pi(t) - log pi_ref(t)   (k1; k3: exp(-d) - 1 + d with d that difference), in [-10, 10]
    r_t  = -kl_coef kl_t, plus the weighted reward of the completion on its last token
    delta_t = r_t + gamma V_{t+1} - V_t,   A_t = delta_t + gamma lambda A_{t+1}   (GAE)
    R_t  = A_t + V_t                   (the value's target)

the advantages then whitened over the batch's completion tokens (whiten_advantages: mean, biased
variance, rsqrt(max(var, 1e-8))) and, before GAE, optionally the rewards scaled by their std
(whiten_rewards, TRL's masked_whiten without shifting the mean). The step's loss, over the batch's
completion tokens:

    policy: GRPO's clipped surrogate (grpo_family.token_objective) of A_t with pi_old the scoring
            pass's log pi (TRL's and OpenRLHF's old log-probabilities);
    value:  vf_coef * 0.5 * mean max((V - R)^2, (V_old + clip(V - V_old, +-value_clip) - R)^2).

Settings: training.ppo (config/objectives.py's PpoConfig, TRL's defaults); training.rollout.iterations is
PPO's epochs over each rollout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from tunix_train.config import Config, KlEstimator
from tunix_train.sharding import to_global_batch
from tunix_train.train.objectives.grpo import ClippedSurrogate
from tunix_train.train.rollouts import Rollout

FIGURES = ("values", "logp", "ref_logp")  # what the scoring pass says of each completion token


def kl_samples(logp: np.ndarray, ref_logp: np.ndarray, estimator: KlEstimator) -> np.ndarray:
    """Each token's sample of KL(pi || pi_ref) (OpenRLHF's compute_approx_kl, clamped alike)."""
    d = logp - ref_logp
    kl = d if estimator is KlEstimator.k1 else np.exp(-d) - 1 + d
    return np.clip(kl, -10.0, 10.0)


def token_rewards(scores_N: np.ndarray, kl_NT: np.ndarray, mask_NT: np.ndarray, kl_coef: float) -> np.ndarray:
    """-kl_coef kl on every token, and each row's score on its last masked token (compute_reward)."""
    rewards = -kl_coef * kl_NT
    last = mask_NT.shape[1] - 1 - np.argmax(mask_NT[:, ::-1] > 0, axis=1)
    rewards[np.arange(len(scores_N)), last] += scores_N * (mask_NT.sum(axis=1) > 0)
    return rewards


def whitened_rewards(rewards_NT: np.ndarray, mask_NT: np.ndarray) -> np.ndarray:
    """TRL's masked_whiten(shift_mean=False): over the masked tokens, times rsqrt(unbiased var +
    1e-8), the mean kept; 0 off the mask. Fewer than two tokens: as they are."""
    tokens = mask_NT.sum()
    if tokens < 2:
        return rewards_NT * mask_NT
    mean = (rewards_NT * mask_NT).sum() / tokens
    variance = ((rewards_NT - mean) ** 2 * mask_NT).sum() / tokens * tokens / (tokens - 1)
    return ((rewards_NT - mean) / np.sqrt(variance + 1e-8) + mean) * mask_NT


def gae(values_NT, rewards_NT, mask_NT, gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """OpenRLHF's get_advantages_and_returns: (advantages, returns) [N, T], values and rewards
    masked first."""
    values, rewards = values_NT * mask_NT, rewards_NT * mask_NT
    advantages = np.zeros_like(values)
    last = np.zeros(len(values))
    for t in reversed(range(values.shape[1])):
        next_values = values[:, t + 1] if t < values.shape[1] - 1 else 0.0
        last = rewards[:, t] + gamma * next_values - values[:, t] + gamma * lam * last
        advantages[:, t] = last
    return advantages, advantages + values


def whitened(x_NT: np.ndarray, mask_NT: np.ndarray) -> np.ndarray:
    """Over the masked tokens: less their mean, times rsqrt(max(biased var, 1e-8)) (OpenRLHF's
    advantage normalization)."""
    tokens = max(mask_NT.sum(), 1.0)
    mean = (x_NT * mask_NT).sum() / tokens
    variance = ((x_NT - mean) ** 2 * mask_NT).sum() / tokens
    return (x_NT - mean) / np.sqrt(max(variance, 1e-8))


def value_loss(values, old_values, returns, clip: float | None):
    """Each token's 0.5 max((V - R)^2, (V_old + clip(V - V_old) - R)^2) (OpenRLHF's ValueLoss), and
    whether the clipped term is the larger."""
    loss = (values - returns) ** 2
    if clip is None:
        return 0.5 * loss, jnp.zeros_like(loss, bool)
    clipped = (old_values + jnp.clip(values - old_values, -clip, clip) - returns) ** 2
    return 0.5 * jnp.maximum(loss, clipped), clipped > loss


class Critic:
    """PPO's advantage (OnPolicy's part, grpo.py): GAE over the critic's values, which the scoring
    pass computes at a rollout's first step with the policy's and the reference's log-probabilities."""

    fields = {
        "returns": jnp.float32,  # each completion token's value target
        "old_values": jnp.float32,  # and the critic's value at the rollout's first step
        "old_logp": jnp.float32,  # the policy's log-probability then (pi_old)
    }
    scores = True

    def __init__(self, cfg: Config):
        self.ppo, self.G = cfg.training.ppo, cfg.training.rollout.num_generations

    def connect(self, link) -> None:
        self.mesh, self.score_fn = link.mesh, link.score

    def score(self, policy, reference, micro) -> dict:
        """The scoring pass's figures of each position (train/scoring.py)."""
        figures = {"values": policy.scores(), "logp": -policy()}
        figures["ref_logp"] = -reference() if self.ppo.kl_coef > 0 else figures["logp"]
        return figures

    def __call__(self, objective, rollout: Rollout, full: dict[str, np.ndarray], state=None) -> dict:
        """Per token: GAE's advantages and returns, and the scoring pass's values and log-probabilities
        (scored now when the rollout has not been)."""
        if rollout.critique is None:
            rollout.critique = self._critique(objective, rollout, full, state)
        p, mask, starts = self.ppo, full["loss_mask"].astype(np.float64), self._starts(objective, rollout)
        values, logp, ref_logp = (
            self._spread(rollout.critique[name], starts, mask.shape) for name in FIGURES
        )
        kl = kl_samples(logp, ref_logp, p.kl_estimator) if p.kl_coef > 0 else np.zeros_like(logp)
        rewards = token_rewards(objective.rewards.total(np.asarray(rollout.rewards)), kl, mask, p.kl_coef)
        if objective.rollout_figures is not None:  # the log's: the KL in the reward, per completion token
            objective.rollout_figures["kl_reward"] = float((kl * mask).sum() / max(mask.sum(), 1.0))
        if p.whiten_rewards:
            rewards = whitened_rewards(rewards, mask)
        advantages, returns = gae(values, rewards, mask, p.gamma, p.gae_lambda)
        if p.whiten_advantages:
            advantages = whitened(advantages, mask)
        fields = {"advantages": advantages * mask, "returns": returns, "old_values": values, "old_logp": logp}
        return {name: x.astype(np.float32) for name, x in fields.items()}

    def _critique(self, objective, rollout: Rollout, full: dict[str, np.ndarray], state) -> dict:
        """The scoring pass over the rollout's rows by `state`'s parameters: each row's FIGURES at its
        completion's positions (those of behaviour_logp), as lists for the checkpoint's JSON."""
        packing = objective.packing_of(full)
        with jax.set_mesh(self.mesh):
            rows = packing.pack(full) if packing else full
            batch = to_global_batch(objective.local_rows(rows, rollout.accumulation), self.mesh)
            figures = self.score_fn(state.params, state.frozen, batch)
            figures = {
                name: np.asarray(multihost_utils.process_allgather(x, tiled=True)).reshape(-1, x.shape[-1])
                for name, x in figures.items()
            }
        if packing:  # back to each completion's padded row
            figures = {name: packing.unpack(x) for name, x in figures.items()}
        return {
            name: [
                figures[name][row, start : start + len(c)].tolist()
                for row, (start, c) in enumerate(zip(self._starts(objective, rollout), rollout.completions))
            ]
            for name in FIGURES
        }

    def _starts(self, objective, rollout: Rollout) -> list[int]:
        """Each row's first completion position (where its first completion token is the target)."""
        prompts = rollout.prompt_ids or [
            objective.sampler.prompts[i] for i in rollout.order for _ in range(self.G)
        ]
        return [len(prompt) - 1 for prompt in prompts]

    @staticmethod
    def _spread(per_row: list[list[float]], starts: list[int], shape) -> np.ndarray:
        """A critique's figure (per row, its completion's) [rows, seq_len], float64, 0 elsewhere."""
        out = np.zeros(shape)
        for row, (start, values) in enumerate(zip(starts, per_row)):
            out[row, start : start + len(values)] = values
        return out


class WithValueLoss:
    """PPO's loss (OnPolicy's part): the clipped surrogate of the critic's advantages, with pi_old
    the scoring pass's log-probability, plus vf_coef times the value loss."""

    reads_teacher = False

    def __init__(self, cfg: Config):
        self.surrogate, self.ppo = ClippedSurrogate(cfg), cfg.training.ppo
        self.temperature = self.surrogate.temperature
        self.needs_reference = cfg.training.grpo.beta > 0 or self.ppo.kl_coef > 0
        names = (
            *self.surrogate.metric_names,
            "policy_loss",
            "value_loss",
            "value_clip_fraction",
            "value_mean",
        )
        self.metric_names = tuple(m for m in names if m != "kl" or cfg.training.grpo.beta > 0)  # kl_reward

    def __call__(self, policy, reference, micro, weight, models=None):
        policy_loss, metrics = self.surrogate(policy, reference, micro, weight, models)
        mask = micro["loss_mask"]
        values = policy.scores()
        per_token, clipped = value_loss(values, micro["old_values"], micro["returns"], self.ppo.value_clip)

        def mean(x):
            return jnp.sum(x * mask) / weight["tokens"]

        return policy_loss + self.ppo.vf_coef * mean(per_token), {
            **metrics,
            "policy_loss": policy_loss,
            "value_loss": mean(per_token),
            "value_clip_fraction": mean(clipped.astype(jnp.float32)),
            "value_mean": mean(jax.lax.stop_gradient(values)),
        }
