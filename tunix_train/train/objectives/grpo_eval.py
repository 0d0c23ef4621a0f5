"""Evaluation during RL (training.eval_every under grpo): on held-out prompts (data.eval_files or
data.eval_fraction), the mean reward of greedy completions (`eval_reward`) and pass@k over
training.rollout.eval_samples completions at the training temperature (`eval_pass@k`, the unbiased
estimator of Chen et al. 2021), a completion passing when its reward reaches eval_pass_reward.
At most training.eval_batches x (the batch's prompts) held-out prompts, the same ones each time,
sampled with the same seeds each time: the figures move only with the weights."""

from __future__ import annotations

import numpy as np

from tunix_train.train.hooks import Hook, StepEnd
from tunix_train.train.objectives import grpo_family as family

EVAL_SEED = 7_919  # the held-out samples' streams, apart from every rollout's


class RewardEvaluation(Hook):
    """At the start, every `every` steps and at the last: the held-out figures, by the rollout engine."""

    def __init__(self, objective, every: int, max_steps: int):
        self.objective, self.every, self.max_steps = objective, every, max_steps

    def evaluate(self, state) -> dict[str, float]:
        from tunix_train.generate import Sampling

        o, g, sampler = self.objective, self.objective.rollout, self.objective.sampler
        count = min(
            len(sampler.eval_prompts), o.cfg.training.eval_batches * sampler.global_rows // g.num_generations
        )
        if not count:
            return {}
        n, seed, params = (
            g.eval_samples,
            o.cfg.training.seed * 1_000_003 + EVAL_SEED,
            sampler.params(state),
        )
        docs, prompts = [sampler.eval_docs[i] for i in range(count)], sampler.eval_prompts[:count]
        greedy = o.rewards.total(sampler.complete(docs, prompts, params, Sampling(), seed, 0)["rewards"])
        sampled = sampler.complete(
            [d for d in docs for _ in range(n)],
            [p for p in prompts for _ in range(n)],
            params,
            Sampling(temperature=g.temperature),
            seed,
            count * g.max_turns,
        )
        passed = (o.rewards.total(sampled["rewards"]) >= g.eval_pass_reward).reshape(count, n).sum(axis=1)
        return {
            "eval_reward": float(greedy.mean()),
            f"eval_pass@{g.eval_k}": float(np.mean([family.pass_at_k(n, int(c), g.eval_k) for c in passed])),
        }

    def at_start(self, start: StepEnd) -> None:
        start.scalars.update(self.evaluate(start.state))

    def after_step(self, end: StepEnd) -> None:
        if end.step % self.every == 0 or end.step == self.max_steps:
            end.scalars.update(self.evaluate(end.state))
