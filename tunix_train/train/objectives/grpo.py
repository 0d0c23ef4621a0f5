"""Group relative policy optimization (Shao et al. 2024, DeepSeekMath) with verifiable rewards.

A rollout (`prepare`, before the compiled step runs; drawn by the rollout component,
train/rollout.py's Sampler): every prompt of a batch is completed G times
by the engine (generate/engine.py) on the training mesh, at training.rollout.temperature, each token
with its log-probability; the reward functions score each completion and their weighted rewards
make its advantage, by default A = (r - mean of its group) / (std of its group + 1e-4), the standard
deviation unbiased as TRL computes it. The rows of a group are consecutive and a micro-batch on one
device holds whole groups (training.micro_batch_size is a multiple of G), so no group is split.

The loss, over every completion token (its EOS included, nothing after it) of the whole batch:

    -mean[ min(rho A, clip(rho, 1 - eps, 1 + eps_high) A) - beta KL ],  rho = min(pi / pi_old,
    importance_cap),
    KL = exp(ref - logp) - (ref - logp) - 1      (the k3 estimator, against the reference model)

with pi, pi_old and ref the probabilities of the logits divided by the temperature, as sampled
(TRL divides them the same way). The mean is by default over the batch's tokens; the GRPO family's
settings (DAPO, Dr. GRPO, GSPO: grpo_family.py) change the advantages, the ratio, the clip and
the mean. Every mean is the whole batch's, so accumulated micro-batches are exactly the full batch.

On-policy (max_staleness 0, iterations 1; TRL's num_iterations=1): each step trains on a rollout
the current parameters drew, pi_old is pi with its gradient stopped, so rho = 1 in value and the
clip matters only to its gradient. Off-policy: rollout r trains steps r*mu .. r*mu + mu - 1 (mu =
iterations) and is drawn k = max_staleness rollouts ahead, at step (r - k)*mu, by parameters up to
k*mu + mu - 1 updates old; pi_old is the engine's recorded log-probability of each token (the
behaviour policy; the GRPO paper's pi_old for mu > 1), and the ratio is truncated at importance_cap
before the clip, bounding the weight of a token whose probability rose (the clip bounds it only
where A > 0): TRL's two-sided clip `delta` (INTELLECT-2), with the cap of TRL's
vllm_importance_sampling_clip_max (3) as default.

Every step logs the train-inference mismatch |logp(trainer) - logp(engine)| of its tokens (mean
and max): on-policy, the numerical difference of the two programs; off-policy it includes the
updates since the rollout.

A prompt may be a conversation ([{role, content}]): it is then rendered with the chat template and
its generation prompt (data/chat.py), the reward functions receive it as messages, and a rollout
also stops at the template's end of turn, which is trained on as EOS is. With tools or an
environment a completion is a conversation of several turns (tunix_train/envs/), its loss on the
model's own tokens only.

Rollout r is seeded by training.seed and r. The rollout in use and those drawn ahead are part of
a checkpoint (Rollouts.get_state), so a resumed run trains on exactly the same completions.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tunix_train.config import Config, Overlong, RewardNormalization
from tunix_train.config import Objective as Kind
from tunix_train.config import OffPolicyCorrection as Correction
from tunix_train.data.packed_rows import Packing
from tunix_train.data.pipeline import GroupBatches, padded_row
from tunix_train.train.hooks import Hook
from tunix_train.train.objectives import distill
from tunix_train.train.objectives import grpo_family as family
from tunix_train.train.objectives.base import Objective, check_tokenizer
from tunix_train.train.objectives.grpo_rewards import Rewards
from tunix_train.train.objectives.lm import BATCH_DTYPES
from tunix_train.train.objectives.reward_models import RewardModels
from tunix_train.train.rollout import Sampler
from tunix_train.train.rollouts import Rollout, Rollouts, unpack_routes
from tunix_train.train.streaming import StreamedRollouts, Streaming


class FromRewards:
    """The advantage of every on-policy objective but PPO's: each completion's, from its rewards by
    the objective's registered estimator (grpo_family.ESTIMATORS), on each of its positions."""

    fields: dict = {}  # the batch fields it adds beside `advantages`
    scores = False  # whether it reads the run's scoring pass (Objective.score)

    def __init__(self, cfg: Config):
        self.cfg, self.estimate = cfg, family.ESTIMATORS[cfg.training.objective.advantage]

    def connect(self, link) -> None:
        pass

    def __call__(self, objective, rollout: Rollout, full: dict[str, np.ndarray], state=None) -> dict:
        """The rows' advantages [rows, seq_len] from the rollout's rewards (each row's on every position)."""
        rows, T = full["loss_mask"].shape
        G = self.cfg.training.rollout.num_generations
        teaching = np.ones(rows, bool)
        if rollout.filler_groups:  # the equal groups that filled the batch teach nothing
            teaching[rows - rollout.filler_groups * G :] = False
        tokens = full["loss_mask"].sum(axis=1) * teaching
        rewards = np.asarray(rollout.rewards)
        advantages = self.estimate(rewards, objective.rewards.weights, G, self.cfg.training, tokens)
        advantages = np.where(teaching, advantages, 0.0)
        return {"advantages": np.broadcast_to(advantages[:, None], (rows, T)).astype(np.float32)}


class ClippedSurrogate:
    """The policy loss of every on-policy objective but GKD's (PPO's adds its value loss to it):
    the clipped surrogate, or CISPO's (Objective.policy_loss), less beta KL, aggregated as
    training.grpo says; on-policy distillation's advantages are the teacher's log-ratios."""

    def __init__(self, cfg: Config):
        t = cfg.training
        self.grpo, self.kind = t.grpo, t.objective
        self.temperature = t.rollout.temperature
        r = t.rollout
        # off-policy, how tokens drawn by other parameters are corrected (OffPolicyCorrection)
        self.correction = None
        if r.max_staleness > 0 or r.iterations > 1 or r.asynchronous:
            self.correction = t.grpo.off_policy_correction or (
                Correction.tis if r.asynchronous else Correction.behaviour_clip
            )
        self.decoupled = self.correction in (Correction.tis, Correction.sequence_mask)
        self.needs_reference = self.grpo.beta > 0
        self.reads_teacher = self.kind is Kind.distill_on_policy  # on-policy distillation
        self.metric_names = ("kl", "clip_fraction", "logprob_mismatch_mean", "logprob_mismatch_max")
        if self.decoupled:
            self.metric_names += ("importance_weight_mean",)
        if self.reads_teacher:
            self.metric_names += ("teacher_reverse_kl",)

    def old_logp(self, micro, logp):
        """pi_old, about which the clip is: a scoring pass's (PPO's old_logp); under behaviour_clip
        the engine's; else (on-policy, or the decoupled corrections) the policy's without gradient."""
        if "old_logp" in micro:
            return micro["old_logp"]
        if self.correction is Correction.behaviour_clip:
            return micro["behaviour_logp"]
        return jax.lax.stop_gradient(logp)

    def __call__(self, policy, reference, micro, weight, models=None):
        g, mask = self.grpo, micro["loss_mask"]
        logp = -policy()
        ref_logp = -reference() if g.beta > 0 else None
        behaviour = micro["behaviour_logp"]
        advantages, extra = micro["advantages"], {}
        if (
            self.reads_teacher
        ):  # each token's log p_teacher - log p_sampling: the negative reverse KL's sample
            advantages = jax.lax.stop_gradient(-models["teacher"]() - behaviour)
            extra["teacher_reverse_kl"] = -jnp.sum(advantages * mask) / weight["tokens"]
        if self.decoupled:  # pi_old is pi (ratio 1 in value), so weighing A weighs the surrogate
            corrected = family.importance_weights(
                logp, behaviour, mask, g.importance_cap, self.correction, micro.get("segment_ids")
            )
            extra["importance_weight_mean"] = jnp.sum(corrected * mask) / weight["tokens"]
            advantages = advantages * corrected
        objective, kl, clipped = family.token_objective(
            logp,
            self.old_logp(micro, logp),
            ref_logp,
            advantages,
            mask,
            clip=family.Clip(
                g.epsilon,
                g.epsilon if g.epsilon_high is None else g.epsilon_high,
                g.importance_cap,
                g.importance_sampling_level,
                self.kind.policy_loss,
            ),
            beta=g.beta,
            segment_ids=micro.get("segment_ids"),
        )

        def mean(x):
            return jnp.sum(x * mask) / weight["tokens"]

        mismatch = jnp.abs(jax.lax.stop_gradient(logp) - behaviour) * mask
        return -family.aggregate(objective, mask, weight, g.loss_aggregation, micro), {
            "kl": mean(kl),
            "clip_fraction": mean(clipped.astype(jnp.float32)),
            "logprob_mismatch_mean": mean(mismatch),
            "logprob_mismatch_max": jnp.max(mismatch),
            **extra,
        }


class OnPolicy(Objective):
    """An on-policy objective (Objective.on_policy): a sampler (the rollout component,
    train/rollout.py), an advantage and a policy loss, composed by name (objectives/__init__.py's
    ALGORITHMS): FromRewards and ClippedSurrogate by default, PPO's critic and value loss
    (ppo.py), GKD's sampler and divergence (gkd.py)."""

    record_fields = ("prompt",)

    def __init__(self, cfg: Config, sampler=Sampler, advantage=FromRewards, loss=ClippedSurrogate):
        self.cfg, self.grpo, self.rollout = cfg, cfg.training.grpo, cfg.training.rollout
        self.advantage, self.policy_loss = advantage(cfg), loss(cfg)
        self.needs_reference = self.policy_loss.needs_reference
        self.temperature = self.policy_loss.temperature
        self.metric_names = self.policy_loss.metric_names
        self.scores = self.advantage.scores
        self.packed = self.skips_empty_micro_batches = cfg.data.padding_free
        models = RewardModels(cfg) if self.rollout.reward_models else None
        each = self.grpo.multi_reward_normalization is RewardNormalization.per_reward
        self.rewards = Rewards(self.rollout, models, each_normalized=each)
        self.sampler = sampler(cfg, self.rewards)
        if self.rollout.asynchronous:  # the engine runs on while the trainer steps
            self.sampler.streaming = Streaming(self.sampler)
        self.rollout_figures = None
        self.batch_dtypes = {
            **BATCH_DTYPES,
            "advantages": jnp.float32,  # each row's, on every position
            "behaviour_logp": jnp.float32,  # the engine's log-probability of each target token
            **self.advantage.fields,
        }
        m = cfg.model
        self.route_shape = (m.num_layers, m.moe.experts_per_token) if self.rollout.routing_replay else None
        if self.route_shape:  # the engine's experts of each position, replayed by the forward (rollout.py)
            self.batch_dtypes["routes"] = (jnp.int32, self.route_shape)

    # the loss, inside the compiled step

    def weight(self, batch):
        return family.normalizers(batch, self.rollout.max_new_tokens)

    def updates(self, batch):
        """Under dynamic sampling, a batch without one informative group does not update the weights."""
        if not self.rollout.dynamic_sampling:
            return True
        return jnp.any((batch["advantages"] != 0) & (batch["loss_mask"] > 0))

    @functools.cached_property
    def teacher(self):
        """The teacher of on-policy distillation and GKD (distill.teacher_model), read once."""
        return distill.teacher_model(self.cfg)

    def extra_models(self):
        return {"teacher": self.teacher} if self.policy_loss.reads_teacher else {}

    def loss(self, policy, reference, micro, weight, models=None):
        return self.policy_loss(policy, reference, micro, weight, models)

    def score(self, policy, reference, micro) -> dict:
        return self.advantage.score(policy, reference, micro)

    # the batches, on the host

    def read(self, data) -> None:
        """The prompts, tokenized once by the sampler (the held-out ones too, for eval_every)."""
        self.sampler.read(data)
        if self.rewards.models:
            self.rewards.models.check_tokenizer(getattr(data, "tokenizer", None))
        if self.policy_loss.reads_teacher:
            check_tokenizer(self.teacher, getattr(data, "tokenizer", None), "training.distill.teacher")

    def train_batches(self, data, global_rows: int, rows: range) -> Rollouts:
        G = self.rollout.num_generations
        indices = [{"index": np.array([[i]], np.int32)} for i in range(len(self.sampler.prompts))]
        self.sampler.rows, self.sampler.global_rows = rows, global_rows
        kind = Rollouts
        if self.rollout.asynchronous:
            kind = functools.partial(StreamedRollouts, gathered=self.sampler.gathered)
        return kind(
            GroupBatches(
                indices,
                accumulation_steps=self.cfg.training.gradient_accumulation_steps,
                groups_per_micro_batch=global_rows // G,
                seed=self.cfg.training.seed,
                slots=range(rows.start // G, rows.stop // G),
                prefetch=self.cfg.data.prefetch_batches,
            ),
            on_close=self.sampler.close,
        )

    def checkpoint_items(self) -> dict:
        return self.sampler.checkpoint_items()

    def connect(self, link) -> None:
        self.sampler.connect(link)
        self.advantage.connect(link)
        self.write_samples, self.write_rollout = link.write_samples, link.write_rollout

    def prepare(self, rollouts: Rollouts, state) -> dict[str, np.ndarray]:
        """The step's rows, from the sampler's rollout for it."""
        rollout, seconds = self.sampler.rollout_for(rollouts, state)
        self._rollouts = rollouts
        self.rollout_figures = self._figures(rollout, int(state.step), seconds)
        return self._rows_of(rollout, state)

    def _rows_of(self, rollout: Rollout, state=None) -> dict[str, np.ndarray]:
        """The rollout's rows of this process, [A, rows, seq_len] each (`state`: the step's)."""
        full = self._rows(rollout)
        full.update(self.advantage(self, rollout, full, state))
        return self.local_rows(self._laid_out(full), rollout.accumulation)

    def packing_of(self, full: dict[str, np.ndarray]) -> Packing | None:
        """data.padding_free: where each padded row's sequence goes among as many packed rows."""
        return Packing.first_fit(full["segment_ids"], len(full["segment_ids"])) if self.packed else None

    def _laid_out(self, full: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The padded rows as the step reads them: packed under data.padding_free."""
        packing = self.packing_of(full)
        return packing.pack(full) if packing else full

    def local_rows(self, full: dict[str, np.ndarray], A: int) -> dict[str, np.ndarray]:
        """Every process's rows [A x rows, ...] -> this process's [A, rows, ...]."""
        local = self.sampler.rows
        return {
            name: np.ascontiguousarray(x.reshape(A, -1, *x.shape[1:])[:, local.start : local.stop])
            for name, x in full.items()
        }

    def _rows(self, rollout: Rollout) -> dict[str, np.ndarray]:
        """Every process's rows of the rollout but their advantages, [A x rows, seq_len] each."""
        G, T = self.rollout.num_generations, self.cfg.data.seq_len
        prompts = rollout.prompt_ids or [self.sampler.prompts[i] for i in rollout.order for _ in range(G)]
        rows = [padded_row(p, c, T) for p, c in zip(prompts, rollout.completions)]
        full = {name: np.stack([r[name] for r in rows]) for name in rows[0]}
        full["behaviour_logp"] = np.zeros((len(rows), T), np.float32)
        for row, (prompt, logprobs) in enumerate(zip(prompts, rollout.logprobs)):  # targets[i] = ids[i + 1]
            full["behaviour_logp"][row, len(prompt) - 1 : len(prompt) - 1 + len(logprobs)] = logprobs
            if rollout.own:  # the tool results and the environment's text are not the model's: no loss
                full["loss_mask"][row, len(prompt) - 1 : len(prompt) - 1 + len(logprobs)] *= rollout.own[row]
        if self.sampler.images:  # each row its prompt's images, padded to data.images_per_row
            v, per_row = self.cfg.model.vision, self.cfg.data.images_per_row
            full["images"] = np.zeros((len(rows), per_row, *v.image_shape), np.float32)
            for row, i in enumerate(i for i in rollout.order for _ in range(G)):
                images = self.sampler.images.get(id(self.sampler.docs[i]))
                if images is not None:
                    full["images"][row, : len(images)] = images
        if self.route_shape:  # -1: the router chooses (the last token, the padding)
            full["routes"] = np.full((len(rows), T, *self.route_shape), -1, np.int32)
            for row, packed in enumerate(rollout.routes):
                routes = unpack_routes(packed, *self.route_shape)
                full["routes"][row, : len(routes)] = routes
        if (
            self.rollout.overlong is Overlong.filter
        ):  # a completion cut at max_new_tokens: no loss (TRL mask_truncated_completions)
            cut = np.array([not c or c[-1] not in self.sampler.stop_ids for c in rollout.completions])
            full["loss_mask"][cut] = 0.0
        return full

    def _figures(self, rollout: Rollout, step: int, rollout_s: float) -> dict[str, Any]:
        """What the log shows of the step's rollout; its samples (the first group) at its first step."""
        G, rewards = self.rollout.num_generations, np.asarray(rollout.rewards)
        weighted = self.rewards.total(rewards)
        first_use = step == rollout.index * self.rollout.iterations

        def text(c):
            return self.sampler.tokenizer.decode(c[:-1] if c and c[-1] in self.sampler.stop_ids else c)

        prompt = self.sampler.docs[rollout.order[0]]["prompt"]
        first_prompt = (rollout.prompt_ids or [self.sampler.prompts[rollout.order[0]]])[0]
        return {
            **{f"reward_{name}": float(r.mean()) for name, r in zip(self.rewards.names, rewards)},
            **{f"reward_{name}_std": float(r.std()) for name, r in zip(self.rewards.names, rewards)},
            "reward": float(weighted.mean()),
            **(
                {"dynamic_sampling_rounds": rollout.rounds, "groups_without_signal": rollout.filler_groups}
                if self.rollout.dynamic_sampling
                else {}
            ),
            **(
                {
                    "tool_calls": rollout.tool_calls / len(rollout.completions),
                    "tool_errors": rollout.tool_errors,
                    "turns": rollout.turns / len(rollout.completions),
                    "tool_timeouts": self.sampler.turns.toolbox.hung,
                }
                if self.sampler.multi_turn
                else {}
            ),
            "completion_tokens": float(np.mean([len(c) for c in rollout.completions])),
            "sampling_s": rollout.sampling_s,
            "rollout_s": rollout_s,
            "rollout_staleness": step - rollout.version,
            **self.sampler.figures(rollout),
            **self.sampler.syncs,  # the weights copied to the rollout mesh for the rollouts this step drew
            "samples": [
                (
                    prompt if isinstance(prompt, str) else self.sampler.tokenizer.decode(first_prompt),
                    text(rollout.completions[i]),
                    float(weighted[i]),
                )
                for i in range(G)
            ]
            if first_use
            else [],
        }

    def report(self, end) -> None:
        """After a step: the deferred rollouts drawn, then on a logged step the rollout's figures
        in the step's record and its samples written."""
        self._rollouts.while_step_runs(end.state)
        if self.rollout.asynchronous:
            self.write_rollout(end.step, self.sampler.streaming.record)
        t = self.cfg.training
        if end.step % t.log_every and end.step != t.max_steps:
            return
        rollout = dict(self.rollout_figures or {})
        samples = rollout.pop("samples", [])
        end.scalars.update(rollout)
        if samples:
            self.write_samples(end.step, [(p, f"{text}  [reward {r:g}]") for p, text, r in samples])

    def hooks(self) -> list:
        """The rollout's figures (rewards, completion length, sampling time) in each logged step's
        record; with training.eval_every, the held-out prompts' rewards and pass@k."""
        from tunix_train.train.objectives.grpo_eval import RewardEvaluation

        t = self.cfg.training
        return [
            _RolloutMetrics(self),
            *([RewardEvaluation(self, t.eval_every, t.max_steps)] if t.eval_every else []),
        ]


class _RolloutMetrics(Hook):
    """First of the hooks: the objective's after_step (OnPolicy.report: it draws the
    deferred rollouts while the step runs on the training mesh, before any hook waits for it)."""

    def __init__(self, objective: OnPolicy):
        self.objective = objective

    def after_step(self, end) -> None:
        self.objective.report(end)
