"""Environments: what the model talks with during a multi-turn rollout, beside its tools.

An environment is a class (training.rollout.environment=module:Class, or openenv: an OpenEnv
server's, envs/openenv.py) made once per trajectory, G of them per task, with

    reset(record) -> messages                   the conversation's start (the record: a data row)
    step(messages) -> (observation, reward, done)

After each of the model's turns, its tool calls (if it wrote any, and there are tools) are run and
their results appended as tool messages; a turn without a call goes to `step`, which receives the
conversation so far, ending with that turn, and answers with the messages to append (a game's next
state, a checker's verdict: role "user" or "tool"), a reward or None, and whether the
conversation is over; close(), where the class has one, runs when the rollout is over. A class may
offer tools of its own as a `tools` dict {name: function} (joined to training.rollout.tools').
Without training.rollout.environment, `Environment` itself: the record's prompt, and done at the
first turn without a tool call.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from tunix_train.config import ConfigError
from tunix_train.envs import tools as t


class Environment:
    """The base: the record's prompt as the conversation's start, done at the first turn without a call."""

    tools: dict[str, Callable] = {}

    def reset(self, record: dict[str, Any]) -> list[dict]:
        prompt = record["prompt"]
        return (
            [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        )

    def step(self, messages: list[dict]) -> tuple[list[dict], float | None, bool]:
        return [], None, True


def environment_class(name: str | None) -> type:
    """training.rollout.environment's class `module:Class` (Environment when null), checked."""
    if name is None:
        return Environment
    cls = t.import_object(name, "training.rollout.environment")
    if not inspect.isclass(cls) or not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
        raise ConfigError(
            f"training.rollout.environment: {name!r} is not a class with reset(record) and step(messages)"
        )
    for tool_name, function in dict(getattr(cls, "tools", {}) or {}).items():
        t.schema(function, f"{name}.tools[{tool_name!r}]")
    return cls
