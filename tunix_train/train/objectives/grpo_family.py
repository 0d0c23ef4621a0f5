"""The GRPO family's formulas, as settings of one loss (docs/objectives/grpo-family.md), each as
TRL 1.16's GRPOTrainer computes it: advantages from rewards on the host, the per-token objective
and its aggregation inside the compiled step, DAPO's overlong penalty, and pass@k for evaluation.

- scale_rewards: the advantage r - mean(group) divided by the group's std (GRPO), the whole batch's
  (batch; Liu et al. 2025 note the group's biases toward easy and hard prompts) or not at all (none;
  Dr. GRPO), each std unbiased, + 1e-4 (TRL's `scale_rewards`);
- the advantage (ESTIMATORS, by the objective): GRPO's (above); RLOO's leave-one-out baseline r -
  mean(the group's others), then optionally normalized over the batch (TRL RLOOTrainer,
  training.rloo.normalize_advantages); REINFORCE++'s return (gamma 1: the reward on every token of
  its completion), with or without its group's mean subtracted first, whitened over the batch's
  completion tokens (OpenRLHF's "reinforce" and "reinforce_baseline"). A KL to the reference (beta)
  stays a term of the loss, as GRPO's and OpenRLHF's `use_kl_loss`: not subtracted from the reward
  as TRL's RLOO does;
- multi_reward_normalization: the reward functions' weighted sum normalized as above (sum; TRL
  "sum_then_normalize"), or each function normalized within its group first, their weighted sum then
  over the batch (per_reward; GDPO, TRL "normalize_then_sum");
- importance_sampling_level: the ratio pi / pi_old per token (GRPO), or per sequence, exp of the
  mean log-ratio over its tokens (GSPO, Zheng et al. 2025);
- the clip: [1 - epsilon, 1 + epsilon_high] (clip-higher, DAPO; TRL's epsilon, epsilon_high);
- the policy loss (by the objective: Objective.policy_loss): PPO's clipped surrogate min(r A,
  clip(r) A), or CISPO's (MiniMax-M1, Chen et al. 2025, eq. 4) sg(clip(r)) A log pi: the importance
  weight clipped and held constant, so that no token's gradient is dropped (the paper did not bound
  it below: its epsilon_low "a large value");
- loss_aggregation: the masked per-token objective summed over the whole batch, divided by its
  tokens (token_mean; TRL "bnpo" with one micro-batch, "dapo" with any), by completions x
  max_new_tokens (dr_grpo), or each completion's token mean averaged over completions
  (sequence_mean; TRL "grpo").

A completion is a row, or a segment of a packed row (data.padding_free, data/packed_rows.py): the
per-sequence means (GSPO's ratio, sequence_mean) are taken by segment and the sequences counted by
their first positions, so both layouts give the same loss.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from tunix_train.config import (
    AdvantageEstimator,
    GrpoAggregation,
    ImportanceLevel,
    OffPolicyCorrection,
    PolicyLoss,
    RewardNormalization,
    ScaleRewards,
    TrainingConfig,
)

STD_EPS = 1e-4


def advantages(
    rewards_FN: np.ndarray,
    G: int,
    weights=None,
    scale: ScaleRewards = ScaleRewards.group,
    normalization: RewardNormalization = RewardNormalization.sum,
    estimator: AdvantageEstimator = AdvantageEstimator.grpo,
    normalize: bool = False,
    baseline: bool = True,
) -> np.ndarray:
    """Each completion's advantage [N] from every reward function's rewards [functions, N] (N = groups
    of G consecutive completions); REINFORCE++'s (its group's mean subtracted if `baseline`) still
    to be whitened over tokens (`whitened`)."""
    weights = np.ones(len(rewards_FN)) if weights is None else np.asarray(weights, np.float64)
    if normalization is RewardNormalization.per_reward:
        grouped = rewards_FN.T.reshape(-1, G, len(rewards_FN))
        each = (grouped - grouped.mean(axis=1, keepdims=True)) / (
            grouped.std(axis=1, ddof=1, keepdims=True) + STD_EPS
        )
        total = (each * weights).sum(axis=-1).reshape(-1)
        return (total - total.mean()) / (total.std(ddof=1) + STD_EPS)
    total = (weights[:, None] * rewards_FN).sum(axis=0)
    grouped = total.reshape(-1, G)
    if estimator is AdvantageEstimator.reinforce_pp and not baseline:
        return total
    if estimator is AdvantageEstimator.rloo:  # TRL RLOOTrainer: the others' mean, then optionally the batch's
        leave_one_out = grouped - (grouped.sum(axis=1, keepdims=True) - grouped) / (G - 1)
        out = leave_one_out.reshape(-1)
        return (out - out.mean()) / (out.std(ddof=1) + STD_EPS) if normalize else out
    centred = grouped - grouped.mean(axis=1, keepdims=True)
    if scale is ScaleRewards.group and estimator is AdvantageEstimator.grpo:
        centred = centred / (grouped.std(axis=1, ddof=1, keepdims=True) + STD_EPS)
    elif scale is ScaleRewards.batch:
        centred = centred / (total.std(ddof=1) + STD_EPS)
    return centred.reshape(-1)


# The advantage estimators from rewards, by Objective.advantage: each fn(rewards [functions, N],
# weights, G, the training section, each completion's loss tokens [N] (0: it teaches nothing)) ->
# each completion's advantage [N]. PPO's (gae) reads its critic: ppo.py.
ESTIMATORS: dict[AdvantageEstimator, Callable[..., np.ndarray]] = {}


def registered(table: dict, key):
    """A decorator that enters the function it decorates in `table` under `key`."""

    def register(fn):
        table[key] = fn
        return fn

    return register


@registered(ESTIMATORS, AdvantageEstimator.grpo)
def group_relative(rewards_FN, weights, G: int, t: TrainingConfig, tokens_N) -> np.ndarray:
    """GRPO's: r less its group's mean, scaled by training.grpo.scale_rewards."""
    return advantages(rewards_FN, G, weights, t.grpo.scale_rewards, t.grpo.multi_reward_normalization)


@registered(ESTIMATORS, AdvantageEstimator.rloo)
def leave_one_out(rewards_FN, weights, G: int, t: TrainingConfig, tokens_N) -> np.ndarray:
    """RLOO's: r less the mean of its group's others (training.rloo)."""
    return advantages(
        rewards_FN, G, weights, estimator=AdvantageEstimator.rloo, normalize=t.rloo.normalize_advantages
    )


@registered(ESTIMATORS, AdvantageEstimator.reinforce_pp)
def reinforce_pp(rewards_FN, weights, G: int, t: TrainingConfig, tokens_N) -> np.ndarray:
    """REINFORCE++'s: the return, whitened over the batch's tokens (training.reinforce_pp)."""
    returns = advantages(
        rewards_FN, G, weights, estimator=AdvantageEstimator.reinforce_pp, baseline=t.reinforce_pp.baseline
    )
    return whitened(returns, tokens_N)


# on-policy distillation's advantages are the teacher's, computed in the step (grpo.py); GKD has none
@registered(ESTIMATORS, AdvantageEstimator.distill)
@registered(ESTIMATORS, AdvantageEstimator.none)
def no_advantage(rewards_FN, weights, G: int, t: TrainingConfig, tokens_N) -> np.ndarray:
    return np.zeros(rewards_FN.shape[1])


def whitened(returns_N: np.ndarray, tokens_N: np.ndarray) -> np.ndarray:
    """REINFORCE++'s advantages (OpenRLHF's compute_advantages_and_returns at gamma 1, the reward on
    a completion's last token): each completion's return is on each of its tokens, whitened over
    the batch's tokens: less their mean, times rsqrt of their biased variance (at least 1e-8)."""
    tokens = np.asarray(tokens_N, np.float64)
    if not tokens.sum():
        return np.zeros_like(returns_N)
    mean = (returns_N * tokens).sum() / tokens.sum()
    variance = ((returns_N - mean) ** 2 * tokens).sum() / tokens.sum()
    return (returns_N - mean) / math.sqrt(max(variance, 1e-8))


@dataclasses.dataclass(frozen=True)
class Clip:
    """The importance ratio's clip: per token, or its sequence's under GSPO (`level`), clipped to
    [1 - epsilon, 1 + epsilon_high], and where it is not clipped, truncated at `cap` (TRL's
    `delta`); `loss`: which objective reads it (PolicyLoss)."""

    epsilon: float
    epsilon_high: float
    cap: float = math.inf
    level: ImportanceLevel = ImportanceLevel.token
    loss: PolicyLoss = PolicyLoss.clip


# The policy losses, by Objective.policy_loss: each fn(ratio, its clip, advantages, logp, Clip) ->
# (the per-token surrogate to maximize, whether the clip bites), [B, T].
POLICY_LOSSES: dict[PolicyLoss, Callable] = {}


@registered(POLICY_LOSSES, PolicyLoss.clip)
def clipped_surrogate(ratio, clipped_ratio, advantages, logp, clip: Clip):
    """PPO's min(r A, clip(r) A), r truncated at the cap; the clip bites where it lowers the objective."""
    surrogate = jnp.minimum(jnp.minimum(ratio, clip.cap) * advantages, clipped_ratio * advantages)
    clipped = ((ratio < 1 - clip.epsilon) & (advantages < 0)) | (
        (ratio > 1 + clip.epsilon_high) & (advantages > 0)
    )
    return surrogate, clipped


@registered(POLICY_LOSSES, PolicyLoss.cispo)
def clipped_weight(ratio, clipped_ratio, advantages, logp, clip: Clip):
    """CISPO's sg(clip(r)) A log pi: the weight truncated on either side, whatever A's sign."""
    surrogate = jax.lax.stop_gradient(clipped_ratio) * advantages * logp
    return surrogate, (ratio < 1 - clip.epsilon) | (ratio > 1 + clip.epsilon_high)


def importance_weights(logp, behaviour, mask, cap: float, correction: OffPolicyCorrection, segment_ids=None):
    """The decoupled off-policy corrections' weights [B, T] (OffPolicyCorrection), without
    gradient: tis, min(rho, cap) per token; sequence_mask, each completion's geometric-mean rho
    where it lies in [1 / cap, cap], else 0; rho = pi / mu, mu the engine's recorded probability
    (`segment_ids` as `sequence_means`)."""
    log_ratio = jax.lax.stop_gradient(logp) - behaviour
    if correction is OffPolicyCorrection.tis:
        return jnp.minimum(jnp.exp(log_ratio), cap) * mask
    ratio = jnp.exp(sequence_means(log_ratio, mask, segment_ids))
    return jnp.where((ratio >= 1 / cap) & (ratio <= cap), ratio, 0.0) * mask


def token_objective(logp, old_logp, ref_logp, advantages, mask, *, clip: Clip, beta: float, segment_ids=None):
    """Per token [B, T]: the policy loss's surrogate (POLICY_LOSSES[clip.loss]) minus beta KL (to
    maximize), the KL (k3, against the reference; ref_logp None: none), and whether the clip bites
    (`segment_ids` as `sequence_means`)."""
    log_ratio = logp - old_logp
    if clip.level is ImportanceLevel.sequence:
        log_ratio = sequence_means(log_ratio, mask, segment_ids)
    ratio = jnp.exp(log_ratio)
    clipped_ratio = jnp.clip(ratio, 1 - clip.epsilon, 1 + clip.epsilon_high)
    kl = jnp.exp(ref_logp - logp) - (ref_logp - logp) - 1 if ref_logp is not None else jnp.zeros_like(logp)
    surrogate, clipped = POLICY_LOSSES[clip.loss](ratio, clipped_ratio, advantages, logp, clip)
    return surrogate - beta * kl, kl, jnp.broadcast_to(clipped, logp.shape)


def sequence_means(x, mask, segment_ids=None):
    """Each position's masked mean of x over its sequence [B, T]: its row's positions of its
    segment id (packed rows, data.padding_free), or its whole row (segment_ids None)."""
    if segment_ids is None:
        return jnp.sum(x * mask, axis=-1, keepdims=True) / jnp.maximum(
            jnp.sum(mask, axis=-1, keepdims=True), 1.0
        )
    B, T = x.shape
    ids = (jnp.arange(B)[:, None] * (T + 1) + segment_ids).reshape(-1)  # one id per (row, segment)

    def totals(y):
        return jax.ops.segment_sum(y.reshape(-1), ids, num_segments=B * (T + 1))[ids].reshape(B, T)

    return totals(x * mask) / jnp.maximum(totals(mask), 1.0)


def sequence_starts(batch):
    """1 on each sequence's first position (packed or not: position 0 of a segment), 0 elsewhere."""
    return ((batch["positions"] == 0) & (batch["segment_ids"] > 0)).astype(jnp.float32)


def normalizers(batch, max_new_tokens: int) -> dict:
    """The whole batch's normalizers: its completion tokens and its sequences (and dr_grpo's)."""
    sequences = jnp.sum(sequence_starts(batch))
    return {
        "tokens": jnp.sum(batch["loss_mask"]),
        "sequences": sequences,
        "sequences_x_max_new_tokens": sequences * max_new_tokens,
    }


def aggregate(per_token, mask, weight: dict, how: GrpoAggregation, micro=None):
    """A micro-batch's share of the batch's loss (its terms add up over micro-batches exactly);
    sequence_mean reads the sequences of `micro` (its positions and segment_ids)."""
    if how is GrpoAggregation.sequence_mean:
        means = sequence_means(per_token, mask, micro["segment_ids"])
        return jnp.sum(means * sequence_starts(micro)) / weight["sequences"]
    denominator = weight["sequences_x_max_new_tokens"] if how is GrpoAggregation.dr_grpo else weight["tokens"]
    return jnp.sum(per_token * mask) / denominator


def overlong_penalty(length: int, max_new_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment (eq. 13; TRL's get_soft_overlong_punishment): 0 up to
    max_new_tokens - buffer tokens, then falling linearly to -1 at max_new_tokens."""
    expected = max_new_tokens - buffer
    if length <= expected:
        return 0.0
    return max((expected - length) / buffer, -1.0)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c passed (Chen et al. 2021, fig. 3)."""
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))
