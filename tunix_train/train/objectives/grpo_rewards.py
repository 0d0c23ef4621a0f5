"""GRPO's rewards: the reward functions of training.rollout.reward (`fn(prompts, completions,
**fields) -> one number per completion`, fields being the records' other fields; with turns, also
`trajectories`, each conversation's messages), the reward models of training.rollout.reward_models
(train/reward_models.py), then DAPO's overlong penalty (overlong=soft) and
the environment's reward (with training.rollout.environment), each a row of weight reward_weights'
(the added ones 1)."""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from tunix_train.config import ConfigError, Overlong, RolloutConfig
from tunix_train.envs.tools import import_object
from tunix_train.train.objectives import grpo_family as family


def load_reward(name: str) -> Callable:
    """`module:function` -> the function; a ConfigError naming it when it cannot be imported."""
    function = import_object(name, "training.rollout.reward")
    if not callable(function):
        raise ConfigError(f"training.rollout.reward: {name!r} is not module:function naming a function")
    return function


class Rewards:
    def __init__(self, rollout: RolloutConfig, models=None, each_normalized: bool = False):
        """models: the reward models (train/reward_models.RewardModels), scored after the functions;
        each_normalized: each reward is normalized in its group (multi_reward_normalization=per_reward)."""
        self.rollout, self.models, self.each_normalized = rollout, models, each_normalized
        self.functions = {name: load_reward(name) for name in rollout.reward}
        self.names = [name.rpartition(":")[2] for name in rollout.reward] + (models.names if models else [])
        self.weights = list(rollout.reward_weights) or [1.0] * len(self.names)
        self.stop_ids: list[int] = []  # the sampler's (train/rollout.py), for missing_eos_penalty
        for added, wanted in (
            ("overlong", rollout.overlong is Overlong.soft),
            ("environment", rollout.environment),
            ("missing_eos", rollout.missing_eos_penalty is not None),
        ):
            if wanted:
                self.names.append(added)
                self.weights.append(1.0)

    def score(
        self,
        prompts: list,
        completions: list[str],
        records: list[dict[str, Any]],
        token_ids: list[list[int]],
        environment: list[float | None] | None = None,
        sequences: list[list[int]] | None = None,
        **extra,
    ) -> np.ndarray:
        """[rows, completions]: each function's reward of every completion, each reward model's of
        its whole sequence (`sequences`: [BOS] prompt completion ids), then the added rows."""
        fields = {**{k: [r.get(k) for r in records] for k in records[0] if k != "prompt"}, **extra}
        scores = [
            self._call(name, function, prompts, completions, fields, records)
            for name, function in self.functions.items()
        ]
        if self.models:
            scores.extend(self.models.score(sequences))
        g = self.rollout
        if g.overlong is Overlong.soft:
            buffer = g.overlong_buffer or max(g.max_new_tokens // 5, 1)
            scores.append(
                np.array([family.overlong_penalty(len(c), g.max_new_tokens, buffer) for c in token_ids])
            )
        if g.environment:
            scores.append(np.array([r or 0.0 for r in environment], np.float64))
        if g.missing_eos_penalty is not None:
            stopped = [bool(c) and c[-1] in self.stop_ids for c in token_ids]
            scores.append(np.array([0.0 if s else -g.missing_eos_penalty for s in stopped]))
        return np.stack(scores)

    def _call(self, name: str, function: Callable, prompts, completions, fields, records) -> np.ndarray:
        try:
            values = _timed(function, self.rollout.reward_timeout_s, prompts, completions, **fields)
        except _NoAnswer:
            raise ConfigError(
                f"training.rollout.reward {name!r} gave no answer in {self.rollout.reward_timeout_s:g} s "
                f"(training.rollout.reward_timeout_s) on a batch from the record {str(records[0])[:120]}; "
                f"it may hang: the run stops"
            ) from None
        except Exception as err:  # the first record it fails on, found by calling it on each
            record = next(
                (
                    r
                    for i, r in enumerate(records)
                    if _fails(
                        function,
                        self.rollout.reward_timeout_s,
                        prompts[i : i + 1],
                        completions[i : i + 1],
                        {k: v[i : i + 1] for k, v in fields.items()},
                    )
                ),
                None,
            )
            where = (
                f"the record {str(record)[:120]}"
                if record
                else f"a batch from the record {str(records[0])[:120]}"
            )
            raise ConfigError(
                f"training.rollout.reward {name!r} raised {type(err).__name__}: {err} (on {where})"
            ) from None
        if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != len(completions):
            raise ConfigError(
                f"training.rollout.reward {name!r} returned "
                f"{len(values) if hasattr(values, '__len__') else type(values).__name__} values for "
                f"{len(completions)} completions; it must return one number per completion"
            )
        bad = [
            v
            for v in values
            if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not np.isfinite(v)
        ]
        if bad:
            raise ConfigError(
                f"training.rollout.reward {name!r} returned {bad[0]!r}; it must return finite numbers"
            )
        return np.asarray(values, np.float64)

    def total(self, rewards: np.ndarray) -> np.ndarray:
        """Each completion's weighted reward."""
        return (np.asarray(self.weights)[:, None] * rewards).sum(axis=0)

    def informative(self, rewards: np.ndarray) -> bool:
        """Whether a group's rewards [rows, G] differ, so that its advantages do (per reward: any of them)."""
        if not self.each_normalized:
            rewards = self.total(rewards)[None]
        return bool(np.any(rewards != rewards[:, :1]))


def _fails(function, seconds: float, *args) -> bool:
    try:
        _timed(function, seconds, *args[:2], **args[2])
    except Exception:
        return True
    return False


class _NoAnswer(Exception):
    """A reward function still running at its deadline (not a TimeoutError it raised itself)."""


def _timed(function: Callable, seconds: float, *args, **kwargs):
    """function(*args, **kwargs) on a daemon thread of its own (one that hangs does not keep the
    process from exiting); _NoAnswer after `seconds`. seconds 0: on this thread, unbounded."""
    if not seconds:
        return function(*args, **kwargs)
    out: dict[str, Any] = {}

    def run():
        try:
            out["value"] = function(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - raised again on the caller's thread
            out["error"] = err

    thread = threading.Thread(target=run, name="reward", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise _NoAnswer
    if "error" in out:
        raise out["error"]
    return out["value"]
