"""The objectives' sections of the schema (training.dpo, training.grpo) and their choices; the
schema's package (tunix_train/config/) re-exports them."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, List, Optional

from tunix_train.config.fields import ConfigError, _changeable, _fixed


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


class AdvantageEstimator(enum.Enum):  # training.grpo.advantage: rewards -> each completion token's advantage
    grpo = "grpo"  # r minus its group's mean, scaled by scale_rewards (GRPO)
    rloo = "rloo"  # r minus the mean of the group's other completions (RLOO; TRL RLOOTrainer)
    # r on every token, whitened over the batch's tokens (REINFORCE++; OpenRLHF "reinforce")
    reinforce_pp = "reinforce_pp"
    # r minus its group's mean, then whitened so (REINFORCE++-baseline; OpenRLHF "reinforce_baseline")
    reinforce_pp_baseline = "reinforce_pp_baseline"
    # each token's: the teacher's log-probability of it less the sampling policy's (on-policy
    # distillation; the teacher: training.distill.teacher)
    distill = "distill"
    # none: GKD (Agarwal et al. 2024; TRL's GKDTrainer): the loss is training.distill's divergence
    # from the teacher on the completions, the student's own with probability training.distill.lmbda
    gkd = "gkd"
    # each token's: GAE over the value head's estimates, the reward on the last token less a KL to the
    # reference on every token (PPO; training.ppo)
    gae = "gae"


class KlEstimator(enum.Enum):  # training.ppo.kl_estimator: the KL sample of a token in PPO's reward
    k1 = "k1"  # log pi - log pi_ref
    k3 = "k3"  # exp(log pi_ref - log pi) - 1 - (log pi_ref - log pi)


class ImportanceLevel(enum.Enum):
    token = "token"  # a ratio per token (GRPO)
    sequence = "sequence"  # one per completion, exp of its mean log-ratio (GSPO)


class PolicyLoss(enum.Enum):  # training.grpo.policy_loss: the per-token objective of the ratio r
    clip = "clip"  # PPO's clipped surrogate min(r A, clip(r) A) (GRPO, DAPO, GSPO, RLOO, ...)
    # the clipped importance weight, held constant, times A log pi: every token keeps its gradient
    # (CISPO: MiniMax-M1, Chen et al. 2025, eq. 4)
    cispo = "cispo"


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
    loss: PreferenceLoss = _fixed(PreferenceLoss.sigmoid)
    # sigmoid: the strength of the implicit KL constraint to the reference; ipo: its tau; orpo: lambda,
    # the odds-ratio term's weight; simpo: the reward scale (TRL's beta in each)
    beta: float = _fixed(0.1)
    # the assumed probability that a pair's preference is flipped (sigmoid, simpo)
    label_smoothing: float = _fixed(0.0)
    simpo_gamma: float = _fixed(0.5)  # SimPO's target reward margin (gamma; TRL's simpo_gamma)

    def check(self) -> None:
        """A ConfigError naming the first bad key of training.dpo."""
        if self.beta <= 0 or not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(
                f"training.dpo.beta={self.beta} must be positive and training.dpo.label_smoothing="
                f"{self.label_smoothing} in [0, 0.5)"
            )
        if self.label_smoothing and self.loss in (PreferenceLoss.ipo, PreferenceLoss.orpo):
            raise ConfigError(
                f"training.dpo.label_smoothing={self.label_smoothing}: the {self.loss.value} loss has "
                f"none; set it to 0 or use training.dpo.loss=sigmoid or simpo"
            )


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
    # Mixture of experts: the engine records the experts each layer chose for every token, and the
    # trainer's forward uses them instead of its router's top k (routing replay, train/rollout.py).
    routing_replay: bool = _fixed(False)
    # Reward functions, `module:function`, each fn(prompts, completions, **fields) -> list of floats;
    # the reward of a completion is their sum, weighted by reward_weights (empty: all 1).
    reward: List[str] = _fixed(factory=list)
    # A reward function's seconds for one batch, on a thread of its own; one that takes longer (hung)
    # stops the run with a line naming it, as one that raises or returns NaN does. 0: no bound, on
    # the run's own thread (for a function that needs the main thread, e.g. for signals)
    reward_timeout_s: float = _changeable(300.0)
    # Reward models (objective=reward's exports, or any ...ForSequenceClassification checkpoint the
    # loader reads), each scoring [BOS] prompt completion at its last token; their rewards follow
    # the functions', and reward_weights weighs functions then models.
    reward_models: List[str] = _fixed(factory=list)
    reward_weights: List[float] = _fixed(factory=list)
    # Subtracted from the reward of a completion that did not stop (its EOS or end of turn), as an
    # added reward row `missing_eos` (TRL's missing_eos_penalty): a reward model reads a completion
    # at its last token, trained on endings, and a policy can find higher scores by never ending.
    missing_eos_penalty: Optional[float] = _fixed(None)
    # The GRPO family (docs/objectives/grpo-family.md; objective=dapo, dr_grpo, gspo set them):
    loss_aggregation: GrpoAggregation = _fixed(GrpoAggregation.token_mean)
    # rewards -> advantages (objective=rloo, reinforce_pp set it); scale_rewards is grpo's alone,
    # normalize_advantages rloo's (TRL RLOOConfig's: over the batch, std unbiased, + 1e-4)
    advantage: AdvantageEstimator = _fixed(AdvantageEstimator.grpo)
    normalize_advantages: bool = _fixed(False)
    scale_rewards: ScaleRewards = _fixed(ScaleRewards.group)
    multi_reward_normalization: RewardNormalization = _fixed(RewardNormalization.sum)
    epsilon_high: Optional[float] = _fixed(None)  # the clip's upper side, 1 + epsilon_high; null: epsilon
    importance_sampling_level: ImportanceLevel = _fixed(ImportanceLevel.token)
    policy_loss: PolicyLoss = _fixed(PolicyLoss.clip)  # objective=cispo sets cispo
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

    def check(self, micro_batch_size: int) -> None:
        """A ConfigError naming the first bad key of training.grpo (and the micro-batch it needs)."""
        G = self.num_generations
        if G < 2 and self.advantage not in (AdvantageEstimator.gae, AdvantageEstimator.gkd):
            raise ConfigError(
                f"training.grpo.num_generations={G} must be at least 2 (advantages compare a "
                f"completion with the others of its group; PPO's critic and GKD need no group)"
            )
        if G < 1:
            raise ConfigError(f"training.grpo.num_generations={G} must be at least 1")
        if micro_batch_size % G:
            raise ConfigError(
                f"training.micro_batch_size={micro_batch_size} must be a multiple of "
                f"training.grpo.num_generations={G}: a group never spans micro-batches or devices"
            )
        if not self.reward and not self.reward_models:
            raise ConfigError(
                "training.grpo.reward is empty: name at least one reward function, module:function "
                "(or a reward model in training.grpo.reward_models)"
            )
        if (
            not 0 < self.temperature < math.inf
            or self.epsilon <= 0
            or self.beta < 0
            or self.max_new_tokens < 1
        ):
            raise ConfigError(
                "training.grpo.temperature (finite) and epsilon must be positive, beta >= 0 and "
                "max_new_tokens >= 1"
            )
        if not self.reward_timeout_s >= 0:
            raise ConfigError(
                f"training.grpo.reward_timeout_s={self.reward_timeout_s} must be >= 0 (0: no bound)"
            )
        if self.max_staleness < 0 or self.iterations < 1:
            raise ConfigError(
                f"training.grpo.max_staleness={self.max_staleness} must be >= 0 and "
                f"training.grpo.iterations={self.iterations} >= 1"
            )
        if self.importance_cap < 1:
            raise ConfigError(
                f"training.grpo.importance_cap={self.importance_cap} must be at least 1 (it truncates "
                f"the probability ratio, which is 1 on-policy)"
            )
        self._check_family()

    def _check_family(self) -> None:
        """The GRPO family's settings (docs/objectives/grpo-family.md)."""
        estimator = self.advantage
        if estimator is not AdvantageEstimator.grpo and (
            self.scale_rewards is not ScaleRewards.group
            or self.multi_reward_normalization is not RewardNormalization.sum
        ):
            raise ConfigError(
                f"training.grpo.scale_rewards and multi_reward_normalization are GRPO's advantage; "
                f"training.grpo.advantage={estimator.value} has its own (leave them at their defaults)"
            )
        if self.normalize_advantages and estimator is not AdvantageEstimator.rloo:
            own = "whitens its advantages" if "reinforce" in estimator.value else "scales by scale_rewards"
            raise ConfigError(
                f"training.grpo.normalize_advantages is RLOO's; training.grpo.advantage="
                f"{estimator.value} {own}"
            )
        if (
            self.epsilon_high is not None
            and self.epsilon_high < self.epsilon
            and self.policy_loss is PolicyLoss.clip
        ):
            raise ConfigError(
                f"training.grpo.epsilon_high={self.epsilon_high} must be >= training.grpo.epsilon="
                f"{self.epsilon} (clip-higher widens the upper side)"
            )
        scorers = len(self.reward) + len(self.reward_models)
        if self.reward_weights and len(self.reward_weights) != scorers:
            raise ConfigError(
                f"training.grpo.reward_weights has {len(self.reward_weights)} weights for {len(self.reward)} "
                f"reward functions and {len(self.reward_models)} reward models; give one per function "
                f"then model, or none"
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
        if self.overlong_buffer is not None and (
            self.overlong is not Overlong.soft or not 1 <= self.overlong_buffer <= self.max_new_tokens
        ):
            raise ConfigError(
                f"training.grpo.overlong_buffer={self.overlong_buffer} needs training.grpo.overlong=soft "
                f"and a value in [1, max_new_tokens={self.max_new_tokens}]"
            )
        if self.rollout_slots is not None and self.rollout_slots < 1:
            raise ConfigError(
                f"training.grpo.rollout_slots={self.rollout_slots} must be >= 1 (null: every completion at "
                f"once)"
            )
        if self.max_tool_calls < 1 or self.max_tool_result_tokens < 1:
            raise ConfigError(
                f"training.grpo.max_tool_calls={self.max_tool_calls} and "
                f"training.grpo.max_tool_result_tokens="
                f"{self.max_tool_result_tokens} must be positive"
            )
        if self.max_turns < 1 or self.tool_timeout_s <= 0:
            raise ConfigError(
                f"training.grpo.max_turns={self.max_turns} must be >= 1 and training.grpo.tool_timeout_s="
                f"{self.tool_timeout_s} positive"
            )
        if (self.tools or self.environment) and self.overlong is Overlong.soft:
            raise ConfigError(
                "training.grpo.overlong=soft penalizes one completion's length; with tools or an "
                "environment a trajectory has several turns: use overlong=filter or none"
            )
        if self.dynamic_sampling_rounds < 1:
            raise ConfigError(
                f"training.grpo.dynamic_sampling_rounds={self.dynamic_sampling_rounds} must be >= 1"
            )
        if not 1 <= self.eval_k <= self.eval_samples:
            raise ConfigError(
                f"training.grpo.eval_samples={self.eval_samples} must be >= training.grpo.eval_k="
                f"{self.eval_k} >= 1 (pass@k needs at least k samples per prompt)"
            )


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
        """What objective=gkd (training.grpo.advantage=gkd) reads of training.distill."""
        if not self.teacher:
            raise ConfigError(
                "training.grpo.advantage=gkd needs training.distill.teacher: the checkpoint whose "
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
