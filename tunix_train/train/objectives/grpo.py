"""Group relative policy optimization (Shao et al. 2024, DeepSeekMath) with verifiable rewards.

Each step, before the compiled step runs (`prepare`): every prompt of the batch is completed G times
by the engine (generate/engine.py) on the training mesh with the current parameters, at
training.grpo.temperature; the reward functions score each completion and the rewards add up; a
completion's advantage is A = (r - mean of its group) / (std of its group + 1e-4), the standard
deviation unbiased as TRL computes it. The rows of a group are consecutive and a micro-batch on one
device holds whole groups (training.micro_batch_size is a multiple of G), so no group is split.

The loss, over every completion token (its EOS included, nothing after it) of the whole batch:

    -mean[ min(rho A, clip(rho, 1 - eps, 1 + eps) A) - beta KL ],  rho = pi / pi_old,
    KL = exp(ref - logp) - (ref - logp) - 1      (the k3 estimator, against the reference model)

with pi_old the sampling policy. One update per batch: pi_old is pi with its gradient stopped, so
rho = 1 in value and the clip matters only to its gradient, as in TRL with num_iterations=1. The
token-level mean over the batch makes accumulated micro-batches exactly the full batch.

Sampling is seeded by training.seed and the step, so a resumed run draws the same completions.
"""

from __future__ import annotations

import importlib
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from tunix_train.config import Config, ConfigError
from tunix_train.data.pipeline import GroupBatches, padded_row
from tunix_train.train.hooks import Hook
from tunix_train.train.objectives.base import Objective
from tunix_train.train.objectives.lm import BATCH_DTYPES

_STD_EPS = 1e-4


def group_advantages(rewards_PG: np.ndarray) -> np.ndarray:
    """(r - mean of the group) / (unbiased std of the group + 1e-4), per group [P, G]."""
    mean = rewards_PG.mean(axis=1, keepdims=True)
    return (rewards_PG - mean) / (rewards_PG.std(axis=1, ddof=1, keepdims=True) + _STD_EPS)


def token_objective(logp, old_logp, ref_logp, advantages, epsilon: float, beta: float):
    """Per token: the clipped surrogate minus beta KL (to maximize), the KL, and whether the clip
    bites; ref_logp None: no KL term."""
    ratio = jnp.exp(logp - old_logp)
    surrogate = jnp.minimum(ratio * advantages, jnp.clip(ratio, 1 - epsilon, 1 + epsilon) * advantages)
    kl = jnp.exp(ref_logp - logp) - (ref_logp - logp) - 1 if ref_logp is not None else jnp.zeros_like(logp)
    clipped = ((ratio < 1 - epsilon) & (advantages < 0)) | ((ratio > 1 + epsilon) & (advantages > 0))
    return surrogate - beta * kl, kl, clipped


def load_reward(name: str) -> Callable:
    """`module:function` -> the function; a ConfigError naming it when it cannot be imported."""
    module_name, _, function_name = name.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name) if function_name else None
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"training.grpo.reward: cannot import {name!r} ({type(err).__name__}: {err})") from None
    if not callable(function):
        raise ConfigError(f"training.grpo.reward: {name!r} is not module:function naming a function")
    return function


class GroupRelative(Objective):
    batch_dtypes = {**BATCH_DTYPES, "advantages": jnp.float32}  # advantages: each row's, on every position
    record_fields = ("prompt",)

    def __init__(self, cfg: Config):
        self.cfg, self.grpo = cfg, cfg.training.grpo
        self.needs_reference = self.grpo.beta > 0
        self.rewards = {name: load_reward(name) for name in self.grpo.reward}
        self.reward_names = [name.rpartition(":")[2] for name in self.grpo.reward]
        self.metric_names = ("kl", "clip_fraction")
        self._rollout = None

    # the loss, inside the compiled step

    def weight(self, batch):
        return jnp.sum(batch["loss_mask"])

    def loss(self, policy, reference, micro, weight):
        logp = -policy()
        ref_logp = -reference() if self.needs_reference else None
        objective, kl, clipped = token_objective(logp, jax.lax.stop_gradient(logp), ref_logp, micro["advantages"],
                                                 self.grpo.epsilon, self.grpo.beta)
        mask = micro["loss_mask"]
        mean = lambda x: jnp.sum(x * mask) / weight
        return -mean(objective), {"kl": mean(kl), "clip_fraction": mean(clipped.astype(jnp.float32))}

    # the batches, on the host

    def read(self, data) -> None:
        """Tokenizes the prompts once; a prompt with no room for max_new_tokens is a ConfigError."""
        tok, limit = data.tokenizer, self.cfg.data.seq_len - self.grpo.max_new_tokens
        self._docs, self._tokenizer = data.train_docs, tok
        self._prompts = []
        for number, doc in enumerate(data.train_docs, start=1):
            ids = [tok.bos_id, *tok.encode(doc["prompt"])]
            if len(ids) > limit:
                raise ConfigError(f"data.train_files: prompt {number} is {len(ids)} tokens; with "
                                  f"training.grpo.max_new_tokens={self.grpo.max_new_tokens} it needs "
                                  f"data.seq_len >= {len(ids) + self.grpo.max_new_tokens}")
            self._prompts.append(ids)

    def train_batches(self, data, global_rows: int, rows: range):
        G = self.grpo.num_generations
        indices = [{"index": np.array([[i]], np.int32)} for i in range(len(self._prompts))]
        self._rows = rows
        return GroupBatches(indices, accumulation_steps=self.cfg.training.gradient_accumulation_steps,
                            groups_per_micro_batch=global_rows // G, seed=self.cfg.training.seed,
                            slots=range(rows.start // G, rows.stop // G), prefetch=self.cfg.data.prefetch_batches)

    def connect(self, run, write_samples: Callable[[int, list[tuple[str, str]]], None]) -> None:
        """What sampling needs of the run: the engine on its mesh, the merged parameters."""
        from tunix_train.generate import Engine

        self._run, self._write_samples = run, write_samples
        self._merged = jax.jit(run.weights.merged)  # LoRA: the adapters merged into the base, compiled once
        # every completion of a step at once, in one batch of slots
        self._engine = Engine(self.cfg.model, run.mesh, stop_ids=(self._tokenizer.eos_id,), slots=None)

    def prepare(self, batch: dict[str, np.ndarray], state) -> dict[str, np.ndarray]:
        """Prompt indices [A, prompts, 1] -> the rows of their G completions each, scored."""
        from jax.experimental import multihost_utils

        from tunix_train.generate import Request, Sampling

        start = time.perf_counter()
        G, T, step = self.grpo.num_generations, self.cfg.data.seq_len, int(state.step)
        indices = batch["index"][..., 0]  # [A, this process's prompts]
        if jax.process_count() > 1:  # every process samples every prompt (the engine is one program)
            per_process = np.asarray(multihost_utils.process_allgather(indices))  # [processes, A, prompts]
            starts = np.asarray(multihost_utils.process_allgather(np.array(self._rows.start)))
            indices = np.concatenate([per_process[p] for p in np.argsort(starts)], axis=1)
        A, P = indices.shape
        order = indices.reshape(-1)
        prompts = [self._prompts[i] for i in order for _ in range(G)]
        params = self._merged(jax.device_put(state.params, self._run.plan.on_device.params), state.frozen)
        sampling, seed = Sampling(temperature=self.grpo.temperature), self.cfg.training.seed * 1_000_003 + step
        done = self._engine.generate(params, [Request(tuple(p), self.grpo.max_new_tokens, sampling, seed, i)
                                              for i, p in enumerate(prompts)], max_len=T)
        new = [c.tokens for c in done]
        sampled = time.perf_counter()
        eos = self._tokenizer.eos_id
        completions = [ids + [eos] if len(ids) < self.grpo.max_new_tokens else ids for ids in new]
        texts = [self._tokenizer.decode(ids) for ids in new]
        records = [self._docs[i] for i in order for _ in range(G)]
        rewards = self._score([r["prompt"] for r in records], texts, records)
        advantages = group_advantages(rewards.sum(axis=0).reshape(-1, G)).reshape(-1)
        rows = [padded_row(p, c, T) for p, c in zip(prompts, completions)]
        full = {name: np.stack([r[name] for r in rows]).reshape(A, P * G, T) for name in rows[0]}
        full["advantages"] = np.broadcast_to(advantages.reshape(A, P * G, 1), (A, P * G, T)).astype(np.float32)
        local = self._rows
        self._rollout = {
            **{f"reward_{name}": float(r.mean()) for name, r in zip(self.reward_names, rewards)},
            **{f"reward_{name}_std": float(r.std()) for name, r in zip(self.reward_names, rewards)},
            "reward": float(rewards.sum(axis=0).mean()),
            "completion_tokens": float(np.mean([len(c) for c in completions])),
            "sampling_s": sampled - start, "rollout_s": time.perf_counter() - start,
            "samples": [(records[i]["prompt"], texts[i], float(rewards[:, i].sum())) for i in range(G)],
        }
        return {name: np.ascontiguousarray(x[:, local.start:local.stop]) for name, x in full.items()}

    def _score(self, prompts: list[str], completions: list[str], records: list[dict[str, Any]]) -> np.ndarray:
        """[reward functions, completions]: each function's reward of every completion."""
        fields = {k: [r.get(k) for r in records] for k in records[0] if k != "prompt"}
        scores = []
        for name, function in self.rewards.items():
            values = function(prompts, completions, **fields)
            if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != len(completions):
                raise ConfigError(f"training.grpo.reward {name!r} returned "
                                  f"{len(values) if hasattr(values, '__len__') else type(values).__name__} values for "
                                  f"{len(completions)} completions; it must return one number per completion")
            bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float, np.number))
                   or not np.isfinite(v)]
            if bad:
                raise ConfigError(f"training.grpo.reward {name!r} returned {bad[0]!r}; it must return finite numbers")
            scores.append(np.asarray(values, np.float64))
        return np.stack(scores)

    def hooks(self) -> list:
        """The rollout's figures (rewards, completion length, sampling time) in each logged step's record."""
        return [_RolloutMetrics(self)]


class _RolloutMetrics(Hook):
    def __init__(self, objective: GroupRelative):
        self.objective = objective

    def after_step(self, end) -> None:
        t = self.objective.cfg.training
        if end.step % t.log_every and end.step != t.max_steps:
            return
        rollout = dict(self.objective._rollout or {})
        samples = rollout.pop("samples", [])
        end.scalars.update(rollout)
        self.objective._write_samples(end.step, [(p, f"{text}  [reward {r:g}]") for p, text, r in samples])
