"""The turns of many conversations at once through the inference engine (GRPO's rollout with
tools or an environment: envs/environment.py).

Each conversation starts as its environment's reset(record), rendered with the chat template, its
tools' schemas and the generation prompt; its image parts (a model with model.vision) take the
record's images, which every turn's request carries. Then, turn by turn, every conversation still open is
continued by the engine in one batch of requests, up to max_new_tokens per turn and the context
(data.seq_len) in all. A turn that ends at the template's end of turn is appended as the
assistant's message; its tool calls are run (envs/tools.py) and their results appended as tool
messages, or, without a call, the environment's step(messages) answers. The conversation goes on
until the environment says done, max_turns, a turn cut off by max_new_tokens (or stopped by EOS),
or the context runs out.

The trajectory's tokens are the model's own, exactly as sampled (their log-probabilities
recorded), and between its turns the tokens of what the template writes after its end of turn:
the rendered conversation's text from there on, tokenized. The loss covers the model's tokens
only (`own`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from tunix_train.config import ConfigError
from tunix_train.data.chat import ChatTemplate, check_messages
from tunix_train.data.images import split_images
from tunix_train.envs import tools as t


@dataclasses.dataclass
class Trajectory:
    prompt: list[int]  # the first turn's prompt: reset's messages with the generation prompt
    messages: list[dict]  # the conversation so far
    tokens: list[int] = dataclasses.field(default_factory=list)  # everything after the prompt
    own: list[int] = dataclasses.field(default_factory=list)  # 1 where the model wrote the token
    logprobs: list[float] = dataclasses.field(default_factory=list)  # the engine's; 0 elsewhere
    reward: float | None = None  # the environment's (the sum of its steps' rewards, when it gives any)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0  # tool calls and environment steps that raised, timed out or were written wrong
    open: bool = True
    routes: np.ndarray | None = None  # the engine's experts per position fed (its record_routes)
    # the weights' version that drew each token (the template's tokens: the turn's before them)
    versions: list[int] = dataclasses.field(default_factory=list)

    @property
    def last_turn(self) -> str:
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")


@dataclasses.dataclass
class Turns:
    """What a rollout with turns needs besides the engine: the template, the tools, the limits."""

    chat: ChatTemplate
    tools: dict[str, Callable]
    max_new_tokens: int
    max_turns: int
    max_len: int
    timeout_s: float
    max_calls: int = 8  # a turn's calls run, at most
    max_result_tokens: int = 1024  # a tool's result, cut past that
    processes: bool = False  # each call in a process (killed when it hangs), not a thread

    def __post_init__(self):
        self.toolbox = t.Toolbox(self.tools, self.timeout_s, self.processes)
        self.schemas = list(self.toolbox.schemas.values()) or None
        self.style = t.call_style(self.chat.template)
        self.end_of_turn, self.end_of_turn_id = self.chat.end_of_turn(), self.chat.end_of_turn_id()

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        plain = split_images(messages)[0]  # an image part as the template writes it (its marker)
        return self.chat.render(plain, add_generation_prompt, tools=self.schemas)[0]

    def start(self, environment, record: dict[str, Any], name: str, images=None) -> Trajectory:
        """reset's conversation and its first prompt; images: the record's prompt's, as the tower
        takes them [n, *image_shape] (model.vision), which its image parts become."""
        try:
            messages = check_messages(
                environment.reset(record), f"{name}.reset", "its return value", parts=True
            )
        except ConfigError:
            raise
        except Exception as err:
            raise ConfigError(
                f"training.rollout.environment {name}.reset failed on the record {str(record)[:80]} "
                f"({type(err).__name__}: {err})"
            ) from None
        plain = split_images(messages)[0]
        prompt = self.chat.encode(plain, add_generation_prompt=True, images=images, tools=self.schemas)[0]
        if len(prompt) >= self.max_len:
            raise ConfigError(
                f"a conversation's start is {len(prompt)} tokens, not less than data.seq_len="
                f"{self.max_len}: raise data.seq_len"
            )
        return Trajectory(prompt, messages)

    def roll_out(
        self,
        generate: Callable[[list[tuple[list[int], int, int]]], list],
        trajectories: list[Trajectory],
        environments: list,
    ) -> list[Trajectory]:
        """Continues every trajectory until it closes. generate([(ids, max_new_tokens, stream)]) ->
        the engine's completions in order; stream t * N + i for turn t of trajectory i."""
        N = len(trajectories)
        for turn in range(self.max_turns):
            open_ = [i for i, tr in enumerate(trajectories) if tr.open]
            if not open_:
                break
            requests = [
                (
                    trajectories[i].prompt + trajectories[i].tokens,
                    min(
                        self.max_new_tokens,
                        self.max_len - len(trajectories[i].prompt) - len(trajectories[i].tokens),
                    ),
                    turn * N + i,
                )
                for i in open_
            ]
            for i, completion in zip(open_, generate(requests)):
                self.after_turn(trajectories[i], environments[i], completion, turn)
        for trajectory in trajectories:
            trajectory.open = False
        return trajectories

    def after_turn(self, tr: Trajectory, environment, completion, turn: int) -> None:
        """The turn's completion appended, its calls run or the environment's step taken, and the
        observation appended; or the conversation closed."""
        tr.turns += 1
        stopped = completion.stop_token is not None
        tr.tokens += completion.tokens + [completion.stop_token] * stopped
        tr.own += [1] * (len(completion.tokens) + stopped)
        tr.logprobs += completion.logprobs + [completion.stop_logprob] * stopped
        tr.versions += completion.versions  # the stop token's included
        if completion.routes is not None:  # each position keeps the experts of the turn that first fed it
            known = 0 if tr.routes is None else len(tr.routes)
            tr.routes = np.concatenate([tr.routes, completion.routes[known:]]) if known else completion.routes
        tr.messages.append({"role": "assistant", "content": self.chat.tokenizer.decode(completion.tokens)})
        at_end_of_turn = completion.stop_token == self.end_of_turn_id
        if not at_end_of_turn or turn == self.max_turns - 1:
            tr.open = False  # cut off, stopped by EOS, or out of turns
            return
        calls = t.parse_calls(tr.messages[-1]["content"], self.style) if self.tools else []
        if calls:
            observation = []
            for call in calls[: self.max_calls]:
                content, failed = self.toolbox.call(call)
                tr.tool_calls, tr.tool_errors = tr.tool_calls + 1, tr.tool_errors + failed
                observation.append(
                    {
                        "role": "tool",
                        "name": call.name,
                        "content": t.cut(content, self.chat.tokenizer, self.max_result_tokens),
                    }
                )
            if len(calls) > self.max_calls:
                tr.tool_errors += 1
                observation.append(
                    {
                        "role": "tool",
                        "name": "",
                        "content": f"error: the turn wrote {len(calls)} calls "
                        f"and at most {self.max_calls} run in a turn: the first {self.max_calls} ran",
                    }
                )
            done = False
        else:
            ok, answer = t.run_with_timeout(lambda: environment.step(list(tr.messages)), self.timeout_s)
            if ok and _is_step_answer(answer):
                observation, reward, done = answer
                if reward is not None:
                    tr.reward = (tr.reward or 0.0) + float(reward)
            else:
                tr.tool_errors += 1
                why = answer if not ok else "it returned no (messages, reward, done)"
                observation, done = (
                    [{"role": "user", "content": f"error: the environment's step failed: {why}"}],
                    False,
                )
        if done or not observation:
            tr.open = False
            return
        self._append(tr, observation)

    def _append(self, tr: Trajectory, observation: list[dict]) -> None:
        """The observation's tokens: what the template writes after the model's end of turn, up to
        the next generation prompt. No room left in the context: the conversation closes."""
        through = self.render(tr.messages)
        full = self.render(tr.messages + observation, add_generation_prompt=True)
        cut = through.rfind(self.end_of_turn)
        if cut < 0 or not full.startswith(through[: cut + len(self.end_of_turn)]):
            raise ConfigError(
                f"{self.chat.source} does not render a conversation's turns as the start of the "
                f"conversation with the next one, so a rollout cannot continue it"
            )
        between = self.chat.tokenizer.encode_with_offsets(full[cut + len(self.end_of_turn) :])[0]
        if len(tr.prompt) + len(tr.tokens) + len(between) >= self.max_len:
            tr.open = False
            return
        tr.messages += observation
        tr.tokens += between
        tr.own += [0] * len(between)
        tr.logprobs += [0.0] * len(between)
        tr.versions += tr.versions[-1:] * len(between)


class Conversations:
    """Conversations continued one request at a time rather than a batch a turn (asynchronous
    rollouts, train/streaming.py: a GroupStream's `after`): a group's conversations by its key,
    each one's next turn asked for as soon as its last finished."""

    def __init__(self, turns: Turns, environment_class, name: str):
        self.turns, self.environment_class, self.name = turns, environment_class, name
        self.open: dict[Any, list[tuple[Trajectory, Any]]] = {}  # key -> (trajectory, environment)s

    def start(self, key, record: dict[str, Any], count: int, images=None) -> list[tuple[list[int], int]]:
        """`count` conversations of `record` for group `key` (replacing any earlier ones of that
        key: it is drawn again); each one's first request (ids, max_new_tokens)."""
        self.close(key)
        environments = [self.environment_class() for _ in range(count)]
        self.open[key] = [(self.turns.start(e, record, self.name, images), e) for e in environments]
        return [self._request(tr) for tr, _ in self.open[key]]

    def _request(self, tr: Trajectory) -> tuple[list[int], int]:
        ids = tr.prompt + tr.tokens
        return ids, min(self.turns.max_new_tokens, self.turns.max_len - len(ids))

    def after(self, key, member: int, completion) -> tuple[list[int], int, int] | None:
        """Member `member` of group `key` after its request's `completion`: its next request (ids,
        max_new_tokens, turn), or None where the conversation has closed."""
        tr, environment = self.open[key][member]
        turn = tr.turns
        self.turns.after_turn(tr, environment, completion, turn)
        return (*self._request(tr), turn + 1) if tr.open else None

    def rows(self, key) -> dict[str, list]:
        """Group `key`'s finished conversations, per member: the fields a rollout's rows take with
        turns, and what the rewards read of them (texts: the last turn; messages; environment: its
        reward)."""
        trajectories = [tr for tr, _ in self.open[key]]
        fields = ("logprobs", "own", "versions", "routes", "tool_calls", "tool_errors", "turns")
        return {
            "prompt_ids": [tr.prompt for tr in trajectories],
            "completions": [tr.tokens for tr in trajectories],
            **{f: [getattr(tr, f) for tr in trajectories] for f in fields},
            "texts": [tr.last_turn for tr in trajectories],
            "messages": [tr.messages for tr in trajectories],
            "environment": [tr.reward for tr in trajectories],
        }

    def close(self, key) -> None:
        """Group `key`'s environments let go (an OpenEnv server's session), its conversations
        forgotten."""
        for _, environment in self.open.pop(key, []):
            getattr(environment, "close", lambda: None)()

    def close_all(self) -> None:
        for key in list(self.open):
            self.close(key)


def _is_step_answer(answer) -> bool:
    return (
        isinstance(answer, tuple)
        and len(answer) == 3
        and isinstance(answer[0], list)
        and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in answer[0])
    )
