"""A rollout's record and the queue of them, as a checkpoint keeps them: `Rollout` (one batch of
completions with their log-probabilities and rewards, as plain lists) and `Rollouts` (the prompt
batches and the rollouts drawn from them and not yet trained on). The sampler (rollout.py) and the
asynchronous stream (streaming.py) make them; the objectives turn them into batch rows.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
from typing import Any, Callable

import numpy as np

from tunix_train.data.pipeline import GroupBatches


@dataclasses.dataclass
class Rollout:
    """One rollout batch, as plain lists (a checkpoint keeps the queued ones as JSON): rollout
    number `index`, drawn by the parameters of step `version`, for the prompts `order` (every
    process's, A accumulation steps of them); per row (G consecutive rows per prompt) the
    completion (EOS included where it stopped) and the engine's log-probability of each token; the
    rewards [reward functions][rows]."""

    index: int
    version: int
    accumulation: int
    order: list[int]
    completions: list[list[int]]
    logprobs: list[list[float]]
    rewards: list[list[float]]
    sampling_s: float
    rounds: int = 1  # dynamic sampling: the rollouts of prompt batches it took
    filler_groups: int = 0  # dynamic sampling: groups without signal that filled the batch (last)
    # with turns (tools, an environment): each row's first prompt, which of its tokens the model
    # wrote, and the rollout's tool calls, failed calls and turns
    prompt_ids: list[list[int]] | None = None
    own: list[list[int]] | None = None
    tool_calls: int = 0
    tool_errors: int = 0
    turns: int = 0
    routes: list[str] | None = None  # routing_replay: per row, the experts the engine chose (pack_routes)
    # PPO: per row, its completion tokens' values, logp and ref_logp at its first step (ppo.py)
    critique: dict[str, list[list[float]]] | None = None
    # asynchronous (streaming.py): per row, the version of the weights that drew each token; per
    # group, its prompt's ticket
    versions: list[list[int]] | None = None
    tickets: list[int] | None = None
    # speculative decoding (training.rollout.draft, prompt_lookup): its acceptance in this rollout
    speculation: dict[str, float] | None = None


def pack_routes(routes_PLK: np.ndarray) -> str:
    """A row's experts [positions, layers, k] as text for the checkpoint's JSON: one byte each
    (routing_replay allows at most 256 experts), base64."""
    return base64.b64encode(np.ascontiguousarray(routes_PLK, np.uint8).tobytes()).decode("ascii")


def unpack_routes(text: str, layers: int, k: int) -> np.ndarray:
    """pack_routes' [positions, layers, k], as int32."""
    return np.frombuffer(base64.b64decode(text), np.uint8).reshape(-1, layers, k).astype(np.int32)


def with_stop_tokens(done) -> tuple[list[list[int]], list[list[float]]]:
    """Each Completion's tokens and their log-probabilities, its stop token appended where one
    ended it (then it is trained on too)."""
    stopped = [c.stop_token is not None for c in done]
    return (
        [c.tokens + [c.stop_token] * s for c, s in zip(done, stopped)],
        [c.logprobs + [c.stop_logprob] * s for c, s in zip(done, stopped)],
    )


def joined(groups: list[dict], field: str) -> list | None:
    """The groups' rows of `field`, one list, in group order (None where the groups have none)."""
    return None if groups[0][field] is None else [row for g in groups for row in g[field]]


class Rollouts:
    """GRPO's host batches: the prompt batches, and the rollouts drawn from them that have not yet
    been trained on for the last time (`current`, then `queued`), some of them perhaps still to be
    drawn (`deferred`: callables giving them). Checkpointed whole, the deferred ones drawn first."""

    def __init__(self, prompts: GroupBatches, on_close: Callable[[], None] = lambda: None):
        """on_close: what the run's end also stops (the sampler's environment server)."""
        self.prompts, self.next_index, self.on_close = prompts, 0, on_close
        self.current: Rollout | None = None
        self.queued: collections.deque[Rollout] = collections.deque()
        self.deferred: list[Callable[[], Rollout]] = []

    def while_step_runs(self, state) -> None:
        """What the rollout side does while the step runs on the training mesh."""
        self.draw_deferred()

    def draw_deferred(self) -> None:
        self.queued.extend(draw() for draw in self.deferred)
        self.deferred.clear()

    def get_state(self) -> dict[str, Any]:
        self.draw_deferred()
        return {
            "prompts": self.prompts.get_state(),
            "next_index": self.next_index,
            "rollouts": [
                dataclasses.asdict(r) for r in ([self.current] if self.current else []) + [*self.queued]
            ],
        }

    def set_state(self, state: dict[str, Any]) -> None:
        if "prompts" not in state:  # written before off-policy steps: on-policy, only the prompts' position
            self.prompts.set_state(state)
            self.next_index = None  # the restored step's rollout comes next
            return
        self.prompts.set_state(state["prompts"])
        self.next_index = state["next_index"]
        rollouts = [Rollout(**r) for r in state["rollouts"]]
        self.current, self.queued = (rollouts[0] if rollouts else None), collections.deque(rollouts[1:])

    def close(self) -> None:
        self.prompts.close()
        self.on_close()
