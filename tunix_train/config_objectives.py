"""The objectives' sections of the schema (training.dpo, training.grpo) and their choices; the
schema's module (tunix_train/config.py) re-exports them."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, List, Optional

from tunix_train.config_fields import _changeable, _fixed


class PreferenceLoss(enum.Enum):  # training.dpo.loss (docs/objectives/dpo.md)
    sigmoid = "sigmoid"  # DPO (Rafailov et al. 2023), with cDPO's label smoothing
    ipo = "ipo"  # IPO (Azar et al. 2023): squared, on per-token log-ratios
    orpo = "orpo"  # ORPO (Hong et al. 2024): the chosen answer's NLL plus an odds-ratio term; no reference
    # SimPO (Meng et al. 2024): length-normalized log-probabilities with a margin; no reference
    simpo = "simpo"


class GrpoAggregation(enum.Enum):  # training.grpo.loss_aggregation: the per-token objective -> the loss
    token_mean = "token_mean"  # over the whole batch's completion tokens (TRL "bnpo" on one micro-batch)
    sequence_mean = "sequence_mean"  # each completion's token mean, averaged over completions (TRL "grpo")
    dr_grpo = "dr_grpo"  # summed, divided by completions x max_new_tokens (Dr. GRPO)
    dapo = "dapo"  # DAPO's token mean over the whole batch: token_mean, which is already exact here


class ScaleRewards(enum.Enum):
    group = "group"  # advantages divided by their group's reward std (GRPO)
    batch = "batch"  # by the whole batch's
    none = "none"  # not divided (Dr. GRPO)


class ImportanceLevel(enum.Enum):
    token = "token"  # a ratio per token (GRPO)
    sequence = "sequence"  # one per completion, exp of its mean log-ratio (GSPO)


class Overlong(enum.Enum):
    none = "none"
    filter = "filter"  # a completion cut at max_new_tokens gets no loss
    soft = "soft"  # DAPO's soft punishment over the last overlong_buffer tokens, added as a reward


class RewardNormalization(enum.Enum):
    sum = "sum"  # the weighted sum of the rewards, normalized (TRL "sum_then_normalize")
    # each reward normalized in its group, then weighted (GDPO, TRL "normalize_then_sum")
    per_reward = "per_reward"


class RolloutDtype(enum.Enum):  # training.grpo.rollout_dtype: the engine's weights, activations and KV cache
    fp32 = "fp32"
    bf16 = "bf16"


@dataclasses.dataclass
class DpoConfig:
    loss: PreferenceLoss = _fixed(PreferenceLoss.sigmoid)
    # sigmoid: the strength of the implicit KL constraint to the reference; ipo: its tau; orpo: lambda,
    # the odds-ratio term's weight; simpo: the reward scale (TRL's beta in each)
    beta: float = _fixed(0.1)
    # the assumed probability that a pair's preference is flipped (sigmoid, simpo)
    label_smoothing: float = _fixed(0.0)
    simpo_gamma: float = _fixed(0.5)  # SimPO's target reward margin (gamma; TRL's simpo_gamma)


@dataclasses.dataclass
class GrpoConfig:
    num_generations: int = _fixed(4)  # G completions sampled per prompt: one group
    beta: float = _fixed(0.04)  # weight of the KL penalty to the reference
    epsilon: float = _fixed(0.2)  # the probability ratio is clipped to [1 - epsilon, 1 + epsilon]
    max_new_tokens: int = _fixed(32)
    temperature: float = _fixed(1.0)
    # Off-policy steps: rollouts drawn this many batches ahead, each trained on `iterations` times (mu);
    # beyond (0, 1) pi_old is the engine's recorded log-probability, the ratio truncated at importance_cap.
    max_staleness: int = _fixed(0)
    iterations: int = _fixed(1)
    importance_cap: float = _fixed(3.0)
    # The engine's own mesh, [[sizes], [names]], on devices apart from the training mesh's (each
    # process's last ones), the weights copied to it for every rollout; null: the training mesh.
    rollout_mesh_shape: Any = _changeable(None)
    # The engine's slots for a rollout: null, every completion at once; N, at most N (continuous batching).
    rollout_slots: Optional[int] = _changeable(None)
    # What the engine computes in (bf16: half the bytes a decoded token reads, and a larger train-
    # inference mismatch, logged as logprob_mismatch_*); the trainer's forward is unchanged.
    rollout_dtype: RolloutDtype = _fixed(RolloutDtype.fp32)
    # Reward functions, `module:function`, each fn(prompts, completions, **fields) -> list of floats;
    # the reward of a completion is their sum, weighted by reward_weights (empty: all 1).
    reward: List[str] = _fixed(factory=list)
    reward_weights: List[float] = _fixed(factory=list)
    # The GRPO family (docs/objectives/grpo-family.md; objective=dapo, dr_grpo, gspo set them):
    loss_aggregation: GrpoAggregation = _fixed(GrpoAggregation.token_mean)
    scale_rewards: ScaleRewards = _fixed(ScaleRewards.group)
    multi_reward_normalization: RewardNormalization = _fixed(RewardNormalization.sum)
    epsilon_high: Optional[float] = _fixed(None)  # the clip's upper side, 1 + epsilon_high; null: epsilon
    importance_sampling_level: ImportanceLevel = _fixed(ImportanceLevel.token)
    overlong: Overlong = _fixed(Overlong.none)
    # soft: the penalized last tokens; null: max_new_tokens // 5
    overlong_buffer: Optional[int] = _fixed(None)
    # Groups whose rewards are all equal are replaced by more prompts' (at most this many rollouts of a
    # batch's prompts; short of that they fill it, and a batch without signal does not update: DAPO).
    dynamic_sampling: bool = _fixed(False)
    dynamic_sampling_rounds: int = _fixed(4)
    # Conversations over turns (tunix_train/envs/, docs/objectives/tools.md): tools `module:function`,
    # an environment `module:Class`; at most max_turns turns of max_new_tokens, data.seq_len in all.
    tools: List[str] = _fixed(factory=list)
    environment: Optional[str] = _fixed(None)
    max_turns: int = _fixed(4)
    tool_timeout_s: float = _changeable(10.0)
    # a turn runs at most max_tool_calls calls; a result past max_tool_result_tokens is cut (and says so);
    # tool_processes: each call in a process of its own, killed when it hangs (threads: left, counted)
    max_tool_calls: int = _changeable(8)
    max_tool_result_tokens: int = _changeable(1024)
    tool_processes: bool = _changeable(False)
    # training.eval_every: held-out prompts' greedy reward, and pass@eval_k of eval_samples samples (a
    # sample passes when its reward reaches eval_pass_reward).
    eval_samples: int = _changeable(4)
    eval_k: int = _changeable(1)
    eval_pass_reward: float = _changeable(1.0)
