"""The objectives' names (training.objective) and their sections of the schema (training.dpo,
kto, grpo, rloo, reinforce_pp, ppo, reward, distill) with their choices; training.rollout, the
on-policy objectives' sampling, is rollout.py's. The schema's package (tunix_train/config/)
re-exports them."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Optional

from tunix_train.config.fields import ConfigError, _changeable, _fixed


class PreferenceLoss(
    enum.Enum
):  # a preference objective's loss (Objective.preference_loss; objectives/dpo.md)
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


class AdvantageEstimator(enum.Enum):  # what an on-policy objective's advantages are (Objective.advantage)
    grpo = "grpo"  # r minus its group's mean, scaled by training.grpo.scale_rewards (GRPO)
    rloo = "rloo"  # r minus the mean of the group's other completions (RLOO; TRL RLOOTrainer)
    # r on every token, whitened over the batch's tokens, its group's mean subtracted first or not
    # (REINFORCE++; OpenRLHF "reinforce_baseline" and "reinforce": training.reinforce_pp.baseline)
    reinforce_pp = "reinforce_pp"
    # each token's: the teacher's log-probability of it less the sampling policy's (on-policy
    # distillation; the teacher: training.distill.teacher)
    distill = "distill"
    # none: GKD's loss is training.distill's divergence from the teacher on the completions
    none = "none"
    # each token's: GAE over the critic's estimates, the reward on the last token less a KL to the
    # reference on every token (PPO; training.ppo)
    gae = "gae"


class KlEstimator(enum.Enum):  # training.ppo.kl_estimator: the KL sample of a token in PPO's reward
    k1 = "k1"  # log pi - log pi_ref
    k3 = "k3"  # exp(log pi_ref - log pi) - 1 - (log pi_ref - log pi)


class ImportanceLevel(enum.Enum):
    token = "token"  # a ratio per token (GRPO)
    sequence = "sequence"  # one per completion, exp of its mean log-ratio (GSPO)


class OffPolicyCorrection(enum.Enum):  # training.grpo.off_policy_correction
    # pi_old is the engine's recorded log-probability: the clip is about the policy that drew the
    # tokens, the ratio truncated at importance_cap (TRL's two-sided clip `delta`)
    behaviour_clip = "behaviour_clip"
    # decoupled (Hilton et al. 2021; AReaL's for asynchronous RL): the clip is about the current
    # policy and each token is weighted by its truncated importance ratio to the behaviour
    # policy, min(pi / mu, importance_cap) (TIS, Yao et al. 2025; TRL's token_truncate)
    tis = "tis"
    # decoupled; a completion whose geometric-mean ratio pi / mu lies outside [1 / importance_cap,
    # importance_cap] gets no loss, else it is weighted by that ratio (TRL's sequence_mask, per token
    # mean rather than sum so that long completions do not underflow)
    sequence_mask = "sequence_mask"


class PolicyLoss(enum.Enum):  # an on-policy objective's per-token objective of the ratio r
    clip = "clip"  # PPO's clipped surrogate min(r A, clip(r) A) (every on-policy objective but cispo)
    # the clipped importance weight, held constant, times A log pi: every token keeps its gradient
    # (CISPO: MiniMax-M1, Chen et al. 2025, eq. 4)
    cispo = "cispo"


class RewardNormalization(enum.Enum):
    sum = "sum"  # the weighted sum of the rewards, normalized (TRL "sum_then_normalize")
    # each reward normalized in its group, then weighted (GDPO, TRL "normalize_then_sum")
    per_reward = "per_reward"


class Objective(enum.Enum):
    """What training optimizes, each algorithm by its own name (tunix_train/train/objectives/,
    docs/objectives/); its settings are its section's (training.dpo, kto, grpo, rloo, ...), and
    an on-policy one's sampling is training.rollout's."""

    lm = "lm"  # next-token cross-entropy: pre-training and supervised fine-tuning
    # preference pairs (prompt, chosen, rejected), training.dpo: DPO, IPO, ORPO, SimPO
    dpo = "dpo"
    ipo = "ipo"
    orpo = "orpo"
    simpo = "simpo"
    kto = "kto"  # Kahneman-Tversky optimization on unpaired (prompt, completion, label) records
    reward = "reward"  # a scalar head learns to score the chosen answer of each pair above the rejected
    distill = "distill"  # the trained model learns a frozen teacher's distributions on the data
    # on-policy: completions sampled by the model (training.rollout), scored by reward functions
    gkd = "gkd"  # a teacher's distributions on the student's own samples (GKD)
    distill_on_policy = "distill_on_policy"  # the teacher's log-probabilities as advantages
    grpo = "grpo"  # group relative policy optimization
    dapo = "dapo"  # presets of GRPO's settings (configs/objective/)
    dr_grpo = "dr_grpo"
    gspo = "gspo"
    cispo = "cispo"  # GRPO's advantages, CISPO's policy loss
    rloo = "rloo"  # leave-one-out advantages (training.rloo)
    reinforce_pp = "reinforce_pp"  # REINFORCE++'s whitened returns (training.reinforce_pp)
    ppo = "ppo"  # a critic and GAE (training.ppo)

    @property
    def preference_loss(self) -> Optional[PreferenceLoss]:
        """Its preference loss, for a preference objective (dpo, ipo, orpo, simpo); else None."""
        return _PREFERENCE.get(self)

    @property
    def advantage(self) -> Optional[AdvantageEstimator]:
        """Its advantages, for an on-policy objective; else None."""
        return _ADVANTAGE.get(self)

    @property
    def on_policy(self) -> bool:
        """Whether it samples its completions (training.rollout)."""
        return self in _ADVANTAGE

    @property
    def policy_loss(self) -> PolicyLoss:
        return PolicyLoss.cispo if self is Objective.cispo else PolicyLoss.clip

    @property
    def computes(self) -> "Objective":
        """The objective it computes: DAPO, Dr. GRPO and GSPO are GRPO's loss with their settings (a
        run saved as one of them resumes as another with the same settings)."""
        return Objective.grpo if self in (Objective.dapo, Objective.dr_grpo, Objective.gspo) else self


_PREFERENCE = {
    Objective.dpo: PreferenceLoss.sigmoid,
    Objective.ipo: PreferenceLoss.ipo,
    Objective.orpo: PreferenceLoss.orpo,
    Objective.simpo: PreferenceLoss.simpo,
}
_ADVANTAGE = {
    **dict.fromkeys(
        (Objective.grpo, Objective.dapo, Objective.dr_grpo, Objective.gspo, Objective.cispo),
        AdvantageEstimator.grpo,
    ),
    Objective.rloo: AdvantageEstimator.rloo,
    Objective.reinforce_pp: AdvantageEstimator.reinforce_pp,
    Objective.distill_on_policy: AdvantageEstimator.distill,
    Objective.gkd: AdvantageEstimator.none,
    Objective.ppo: AdvantageEstimator.gae,
}


@dataclasses.dataclass
class KtoConfig:
    """training.kto: Kahneman-Tversky optimization on unpaired records (train/objectives/kto.py)."""

    beta: float = _fixed(0.1)  # how far the policy may move from the reference (TRL's beta)
    desirable_weight: float = _fixed(1.0)  # the desirable records' losses' weight (TRL's)
    undesirable_weight: float = _fixed(1.0)

    def check(self) -> None:
        """A ConfigError naming the first bad key of training.kto."""
        for key in ("beta", "desirable_weight", "undesirable_weight"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"training.kto.{key}={getattr(self, key)} must be positive")


@dataclasses.dataclass
class DpoConfig:
    # sigmoid: the strength of the implicit KL constraint to the reference; ipo: its tau; orpo: lambda,
    # the odds-ratio term's weight; simpo: the reward scale (TRL's beta in each)
    beta: float = _fixed(0.1)
    # the assumed probability that a pair's preference is flipped (sigmoid, simpo)
    label_smoothing: float = _fixed(0.0)
    simpo_gamma: float = _fixed(0.5)  # SimPO's target reward margin (gamma; TRL's simpo_gamma)

    def check(self, objective: Objective) -> None:
        """A ConfigError naming the first bad key of training.dpo (objective: dpo, ipo, orpo, simpo)."""
        if self.beta <= 0 or not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(
                f"training.dpo.beta={self.beta} must be positive and training.dpo.label_smoothing="
                f"{self.label_smoothing} in [0, 0.5)"
            )
        if self.label_smoothing and objective in (Objective.ipo, Objective.orpo):
            raise ConfigError(
                f"training.dpo.label_smoothing={self.label_smoothing}: objective={objective.value} has "
                f"none; set it to 0 or use objective=dpo or simpo"
            )


@dataclasses.dataclass
class GrpoConfig:
    """training.grpo: the GRPO family's policy loss and its advantage from rewards
    (docs/objectives/grpo-family.md); objective=dapo, dr_grpo, gspo and cispo set some of it, and
    PPO reads its clip. What is sampled and how it is rewarded is training.rollout's."""

    beta: float = _fixed(0.04)  # weight of the KL penalty to the reference
    epsilon: float = _fixed(0.2)  # the probability ratio is clipped to [1 - epsilon, 1 + epsilon]
    epsilon_high: Optional[float] = _fixed(None)  # the clip's upper side, 1 + epsilon_high; null: epsilon
    # Off-policy (training.rollout.max_staleness, iterations), pi_old is the engine's recorded
    # log-probability and the ratio is truncated at importance_cap.
    importance_cap: float = _fixed(3.0)
    importance_sampling_level: ImportanceLevel = _fixed(ImportanceLevel.token)
    # How off-policy tokens are corrected (OffPolicyCorrection); null: behaviour_clip, or tis under
    # training.rollout.asynchronous (whose policy moves on while the engine draws)
    off_policy_correction: Optional[OffPolicyCorrection] = _fixed(None)
    loss_aggregation: GrpoAggregation = _fixed(GrpoAggregation.token_mean)
    # GRPO's advantage (objective=grpo, dapo, dr_grpo, gspo, cispo): r less its group's mean, scaled
    scale_rewards: ScaleRewards = _fixed(ScaleRewards.group)
    multi_reward_normalization: RewardNormalization = _fixed(RewardNormalization.sum)

    def check(self, objective: "Objective") -> None:
        """A ConfigError naming the first bad key of training.grpo."""
        if self.epsilon <= 0 or self.beta < 0:
            raise ConfigError(
                f"training.grpo.epsilon={self.epsilon} must be positive and training.grpo.beta="
                f"{self.beta} >= 0"
            )
        if self.importance_cap < 1:
            raise ConfigError(
                f"training.grpo.importance_cap={self.importance_cap} must be at least 1 (it truncates "
                f"the probability ratio, which is 1 on-policy)"
            )
        if objective.advantage is not AdvantageEstimator.grpo and (
            self.scale_rewards is not ScaleRewards.group
            or self.multi_reward_normalization is not RewardNormalization.sum
        ):
            raise ConfigError(
                f"training.grpo.scale_rewards and multi_reward_normalization are GRPO's advantage; "
                f"objective={objective.value} has its own (leave them at their defaults)"
            )
        if (
            self.epsilon_high is not None
            and self.epsilon_high < self.epsilon
            and objective.policy_loss is PolicyLoss.clip
        ):
            raise ConfigError(
                f"training.grpo.epsilon_high={self.epsilon_high} must be >= training.grpo.epsilon="
                f"{self.epsilon} (clip-higher widens the upper side)"
            )
        if (
            self.multi_reward_normalization is RewardNormalization.per_reward
            and self.scale_rewards is not ScaleRewards.group
        ):
            raise ConfigError(
                f"training.grpo.scale_rewards={self.scale_rewards.value}: under multi_reward_normalization="
                f"per_reward each reward is scaled in its group and the sum over the batch (GDPO); "
                f"leave scale_rewards=group"
            )


@dataclasses.dataclass
class RlooConfig:
    """training.rloo (objective=rloo): RLOO's leave-one-out advantages, then optionally normalized
    over the batch (TRL RLOOConfig's normalize_advantages: std unbiased, + 1e-4)."""

    normalize_advantages: bool = _fixed(False)


@dataclasses.dataclass
class ReinforcePpConfig:
    """training.reinforce_pp (objective=reinforce_pp): the return whitened over the batch's tokens,
    its group's mean subtracted first (baseline: OpenRLHF's "reinforce_baseline") or not ("reinforce")."""

    baseline: bool = _fixed(True)


@dataclasses.dataclass
class PpoConfig:
    """training.ppo (objective=ppo, docs/objectives/ppo.md): a critic (the value head on the policy's
    trunk) and GAE make each token's advantage; the defaults are TRL's PPOConfig's."""

    gamma: float = _fixed(1.0)  # the discount
    gae_lambda: float = _fixed(0.95)  # GAE's lambda (TRL's lam, OpenRLHF's lambd)
    vf_coef: float = _fixed(0.1)  # the value loss's weight in the loss
    # a value moves at most this far from the rollout's estimate before its loss stops pulling it
    # (TRL's cliprange_value, OpenRLHF's value_clip); null: no clip
    value_clip: Optional[float] = _fixed(0.2)
    kl_coef: float = _fixed(0.05)  # the KL to the reference, subtracted from each token's reward
    kl_estimator: KlEstimator = _fixed(KlEstimator.k1)
    # the per-token rewards scaled by their std over the batch's completion tokens (TRL's whiten_rewards)
    whiten_rewards: bool = _fixed(False)
    # the advantages less their mean, over their std, over the batch's completion tokens
    whiten_advantages: bool = _fixed(True)

    def check(self) -> None:
        """A ConfigError naming the first bad key of training.ppo."""
        if not 0.0 <= self.gae_lambda <= 1.0:
            raise ConfigError(f"training.ppo.gae_lambda={self.gae_lambda} must be in [0, 1]")
        if not 0.0 <= self.gamma <= 1.0:
            raise ConfigError(f"training.ppo.gamma={self.gamma} must be in [0, 1]")
        if self.vf_coef < 0 or self.kl_coef < 0 or (self.value_clip is not None and self.value_clip <= 0):
            raise ConfigError(
                f"training.ppo.vf_coef={self.vf_coef} and kl_coef={self.kl_coef} must be >= 0 and "
                f"value_clip={self.value_clip} positive (or null)"
            )


@dataclasses.dataclass
class RewardConfig:
    """training.reward (objective=reward, docs/objectives/reward.md): a scalar head learns to score
    the chosen answer of each pair above the rejected (Bradley-Terry; TRL's RewardTrainer)."""

    # + this times mean((r_chosen + r_rejected)^2): keeps the rewards centred (Eisenstein et al. 2023)
    center_rewards_coefficient: Optional[float] = _fixed(None)


@dataclasses.dataclass
class DistillConfig:
    """training.distill (objective=distill, docs/objectives/distill.md): the trained model (the
    student) learns a frozen teacher's next-token distributions on the data's tokens."""

    teacher: Optional[str] = _fixed(None)  # a Hugging Face directory, a .gguf or a run: its weights
    # or: a directory of the teacher's top-k log-probabilities and their batches, written once by
    # scripts/teacher_logits.py, read instead of running a teacher (offline distillation)
    teacher_logits: Optional[str] = _fixed(None)
    # GKD's generalized Jensen-Shannon divergence (Agarwal et al. 2024; TRL's generalized_jsd_loss):
    # 0 is the forward KL(teacher || student), 1 the reverse KL(student || teacher)
    beta: float = _fixed(0.5)
    temperature: float = _fixed(1.0)  # both models' logits are divided by it
    ce_weight: float = _fixed(0.0)  # the data's cross-entropy, added with this weight
    teacher_bf16: bool = _fixed(False)  # the teacher computes in bfloat16 (half its memory)
    # the teacher waits in pinned host memory between the steps that use it (copied in for each)
    teacher_offload: bool = _changeable(False)
    # 0: the divergence over the whole vocabulary; k: over the teacher's k likeliest tokens at each
    # position, both distributions renormalized over them
    top_k: int = _fixed(0)
    # objective=gkd: the share of rollouts whose completions the student samples (TRL's lmbda); the
    # others are the records' completion_field, as written
    lmbda: float = _fixed(0.5)
    completion_field: str = _fixed("completion")
    # objective=gkd: the other rollouts are the teacher's samples instead (TRL's seq_kd)
    seq_kd: bool = _fixed(False)

    def check_gkd(self) -> None:
        """What objective=gkd reads of training.distill."""
        if not self.teacher:
            raise ConfigError(
                "objective=gkd needs training.distill.teacher: the checkpoint whose "
                "distributions the student learns on the completions"
            )
        if not 0.0 <= self.lmbda <= 1.0:
            raise ConfigError(f"training.distill.lmbda={self.lmbda} must be in [0, 1]")
        if self.seq_kd and self.lmbda == 1.0:
            raise ConfigError(
                "training.distill.seq_kd=true samples the rollouts that are not the student's from the "
                "teacher, and training.distill.lmbda=1 leaves none: lower lmbda or unset seq_kd"
            )
        if self.ce_weight:
            raise ConfigError(
                f"training.distill.ce_weight={self.ce_weight} is objective=distill's; GKD's loss is the "
                f"divergence alone (TRL's GKDTrainer): set it to 0"
            )

    def check(self, vocab_size: int) -> None:
        """A ConfigError naming the first bad key of training.distill."""
        if bool(self.teacher) == bool(self.teacher_logits):
            raise ConfigError(
                "training.objective=distill needs one of training.distill.teacher (a checkpoint to "
                "learn from) and training.distill.teacher_logits (its stored top-k log-probabilities)"
            )
        if self.teacher_offload and not self.teacher:
            raise ConfigError(
                "training.distill.teacher_offload=true keeps a live teacher in host memory, and "
                "training.distill.teacher_logits has none: set it to false"
            )
        if not 0.0 <= self.beta <= 1.0:
            raise ConfigError(f"training.distill.beta={self.beta} must be in [0, 1]")
        if not (self.temperature > 0 and math.isfinite(self.temperature)) or self.ce_weight < 0:
            raise ConfigError(
                f"training.distill.temperature={self.temperature} must be positive and "
                f"training.distill.ce_weight={self.ce_weight} >= 0"
            )
        if not 0 <= self.top_k <= vocab_size:
            raise ConfigError(
                f"training.distill.top_k={self.top_k} must be in [0, model.vocab_size={vocab_size}] "
                f"(0: the whole vocabulary)"
            )
