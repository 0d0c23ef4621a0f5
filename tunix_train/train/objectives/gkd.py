"""GKD (Agarwal et al. 2024, "On-Policy Distillation of Language Models"; TRL's GKDTrainer):
objective=gkd, the on-policy objective (grpo.py's OnPolicy) with a sampler (GkdSampler) and a
loss (TeacherDivergence) of its own, and no advantage.

On the records' prompts the student learns the teacher's next-token distributions over the
completion tokens: training.distill's divergence (generalized Jensen-Shannon with beta, at its
temperature, over the whole vocabulary in chunks or the teacher's top k; distill.py), its mean over
the batch's completion tokens. The completions are the student's own samples (the rollout component,
grpo.py: the engine at training.rollout.temperature, max_new_tokens) for a rollout with probability
training.distill.lmbda (TRL's lmbda: the fraction of on-policy student outputs). The others are the
records' training.distill.completion_field, ended by a stop token, or with training.distill.seq_kd
the teacher's samples, drawn as the student's would be (an engine of the teacher's model on the
training mesh, the same sampling settings and seeds; TRL's seq_kd). Rollout r's draw is seeded by
training.seed and r, so a resumed run makes the same choice. The loss is supervised: its gradient
flows through the student's distribution at every position, unlike on-policy distillation's
advantages (objective=distill_on_policy). The reward functions score the completions for the
log, and make no advantage.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tunix_train.config import Config, ConfigError
from tunix_train.train.objectives import distill
from tunix_train.train.rollout import Sampler
from tunix_train.train.rollouts import Rollout


class GkdSampler(Sampler):
    """The rollout component, whose rollouts are the student's samples with probability lmbda
    and otherwise the records' completions, or the teacher's samples (seq_kd)."""

    def __init__(self, cfg: Config, rewards):
        super().__init__(cfg, rewards)
        self.lmbda, self.field = cfg.training.distill.lmbda, cfg.training.distill.completion_field
        self.seq_kd = cfg.training.distill.seq_kd

    def figures(self, rollout: Rollout) -> dict[str, float]:
        return {"on_policy": float(self.on_policy(rollout.index))}

    def on_policy(self, index: int) -> bool:
        """Whether rollout `index` is sampled (seeded by training.seed and the rollout's number)."""
        return bool(np.random.default_rng([self.cfg.training.seed, index]).random() < self.lmbda)

    def read(self, data) -> None:
        """The prompts (Sampler.read), and with lmbda < 1 each record's completion, tokenized and
        ended by the stop token; a record without one, or too long, is a one-line error."""
        super().read(data)
        self.completions = []
        if self.lmbda == 1 or self.seq_kd:
            return
        limit = self.rollout.max_new_tokens
        for number, doc in enumerate(self.docs, start=1):
            text = doc.get(self.field)
            if not isinstance(text, str):
                raise ConfigError(
                    f"data.train_files: record {number} has no string '{self.field}' (training.distill."
                    f"completion_field): with training.distill.lmbda={self.lmbda} < 1 GKD trains on it"
                )
            ids = [*self.tokenizer.encode(text), self.stop_ids[-1]]
            if len(ids) > limit:
                raise ConfigError(
                    f"data.train_files: record {number}'s {self.field} is {len(ids)} tokens with its "
                    f"stop token, more than training.rollout.max_new_tokens={limit}"
                )
            self.completions.append(ids)

    def connect(self, link) -> None:
        """The student's engine (Sampler.connect), and with seq_kd the teacher's, on the training
        mesh where the teacher's parameters are."""
        from tunix_train.generate import Engine

        super().connect(link)
        if self.seq_kd:
            teacher = link.program.extras.specs["teacher"].model
            self.teacher_engine = Engine(teacher, link.mesh, stop_ids=self.stop_ids, slots=self.rollout.slots)

    def sample(
        self, order: np.ndarray, index: int, round_: int, params
    ) -> tuple[list[dict[str, Any]], float]:
        if self.on_policy(index):
            return super().sample(order, index, round_, params)
        if self.seq_kd:  # the student's sampling, with the teacher's engine and parameters
            extras = self.link.program.extras  # an offloaded teacher is copied to the devices for it
            teacher = jax.device_put(extras.params()["teacher"], extras.device_shardings["teacher"])
            return super().sample(order, index, round_, teacher, self.teacher_engine)
        start, G = time.perf_counter(), self.rollout.num_generations
        order = [int(i) for i in order]
        rows = [i for i in order for _ in range(G)]
        docs, completions = [self.docs[i] for i in rows], [self.completions[i] for i in rows]
        rewards = self.rewards.score(
            [d["prompt"] for d in docs],
            [self.tokenizer.decode(c[:-1]) for c in completions],
            docs,
            completions,
            sequences=[[*self.prompts[i], *c] for i, c in zip(rows, completions)],
        )
        return (
            [
                {
                    "prompt": p,
                    "completions": completions[k * G : (k + 1) * G],
                    "logprobs": [[0.0] * len(c) for c in completions[k * G : (k + 1) * G]],  # not sampled
                    **dict.fromkeys(("prompt_ids", "own", "routes")),
                    "rewards": rewards[:, k * G : (k + 1) * G],
                    **dict.fromkeys(("tool_calls", "tool_errors", "turns"), 0),
                }
                for k, p in enumerate(order)
            ],
            time.perf_counter() - start,
        )


class TeacherDivergence:
    """GKD's loss (OnPolicy's part, grpo.py): training.distill's divergence from the teacher,
    its mean over the batch's completion tokens, the logits as they are."""

    temperature = 1.0  # the divergence takes training.distill's
    metric_names = ("divergence",)
    needs_reference = False
    reads_teacher = True

    def __init__(self, cfg: Config):
        self.distill = cfg.training.distill

    def __call__(self, policy, reference, micro, weight, models=None):
        divergence = policy.per_token(lambda s, t: distill.divergence(s, t, self.distill), models["teacher"])
        divergence = jnp.sum(divergence * micro["loss_mask"]) / weight["tokens"]
        return divergence, {"divergence": divergence}
