"""Asynchronous rollouts (training.rollout.asynchronous; docs/objectives/async.md): the engine on
the rollout mesh runs on while the trainer steps. Prompts enter its slots as they free; a group
leaves whole once its G completions have stopped, in the order groups finish (generate/groups.py);
a step trains on the first groups to finish. Every weight_update_every steps the trainer's new
weights are installed between two decode chunks, the requests in flight going on under them, each
token recording the version (the training step) of the weights that drew it; the loss's pi_old is
each token's own recorded log-probability (objectives/grpo.py). A group with a token more than
max_lag steps older than the step that would train on it is drawn again, its prompt first in line.

Each prompt the data yields gets a ticket, its place in the data's order: a step's record
(rollouts.jsonl) names the tickets it trained, and a checkpoint keeps the finished groups whole,
and the tickets admitted and not finished, to be admitted again whole on resume, so that a
resumed run trains on every ticket once. Which groups finish first depends on timing: an
asynchronous run is not bit-reproducible (the synchronous default is).

The engine advances while a step runs (OnPolicy.report): at least until the next step's groups
are ready, then for as long as the step runs and the buffer has room. One process for now
(train/setup.py refuses several: streamed across two, the engine's collectives went out of step);
engines on other hosts are Ray actors (generate/remote.py).

With training.rollout.replicas = N (one process), N engines on meshes of their own draw from the
one queue of prompt keys, each decode chunk and install on the replica's thread within a
deadline; a replica that fails or misses it is dropped with a warning and its groups in flight
are admitted again to the others (generate/groups.py); with none left the run stops in one line.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from tunix_train import exit_codes
from tunix_train.config import ConfigError
from tunix_train.data.pipeline import GroupBatches
from tunix_train.generate import speculative
from tunix_train.train.rollouts import Rollout, Rollouts, joined, pack_routes, with_stop_tokens
from tunix_train.train.signals import RunStopped

log = logging.getLogger("tunix_train")


def _once(make: Callable[[], Any]) -> Callable[[], Any]:
    """make(), computed by the first of the threads that ask and then shared."""
    lock, made = threading.Lock(), []

    def get():
        with lock:
            if not made:
                made.append(make())
        return made[0]

    return get


class PromptKeys:
    """The groups to admit, as keys (ticket, prompt index, attempt): those handed back (drawn again
    after max_lag, or in flight at a checkpoint) first, then the data's prompts in order, every
    process's (`gathered`: Sampler.gathered)."""

    def __init__(self, batches: GroupBatches, gathered):
        self.batches, self.gathered = batches, gathered
        self.returned: collections.deque[tuple[int, int, int]] = collections.deque()
        self.pending: collections.deque[int] = collections.deque()  # the current batch's prompts
        self.tickets = 0  # handed out from the data so far

    def __iter__(self):
        return self

    def __next__(self) -> tuple[int, int, int]:
        if self.returned:
            return self.returned.popleft()
        if not self.pending:
            self.pending.extend(
                int(i) for i in self.gathered(next(self.batches)["index"][..., 0]).reshape(-1)
            )
        self.tickets += 1
        return self.tickets - 1, self.pending.popleft(), 0

    def hand_back(self, keys: list[tuple[int, int, int]]) -> None:
        """Keys admitted first next, in the order given."""
        self.returned.extendleft(reversed(keys))

    def get_state(self) -> dict[str, Any]:
        return {
            "batches": self.batches.get_state(),
            "returned": [list(k) for k in self.returned],
            "pending": list(self.pending),
            "tickets": self.tickets,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        self.batches.set_state(state["batches"])
        self.returned = collections.deque(tuple(k) for k in state["returned"])
        self.pending = collections.deque(state["pending"])
        self.tickets = state["tickets"]


class StreamedRollouts(Rollouts):
    """Asynchronous rollouts' host state: the prompt keys, the engine's stream (made at the first
    step), and finished groups restored from a checkpoint, trained on first. Checkpointed as the
    keys (with the groups in flight handed back) and the finished groups whole."""

    def __init__(self, prompts: GroupBatches, gathered, on_close=lambda: None):
        super().__init__(prompts, on_close)
        self.keys = PromptKeys(prompts, gathered)
        self.stream = None  # generate/groups.GroupStream, once the first step's parameters exist
        self.finished: list[dict] = []  # groups as rows (Streaming.rows), restored, trained first
        self.streaming: Streaming | None = None  # what drives the stream, once it started

    def while_step_runs(self, state) -> None:
        if self.streaming is not None:
            self.streaming.while_step_runs(self, state)

    def get_state(self) -> dict[str, Any]:
        keys = self.keys.get_state()
        finished = list(self.finished)
        if self.stream is not None:
            keys["returned"] = [list(k) for k in self.stream.unfinished()] + keys["returned"]
            finished += [self.streaming.rows(g) for g in self.stream.ready]
        return {"asynchronous": True, "keys": keys, "finished": finished}

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        if self.streaming is not None and self.streaming.conversations is not None:
            self.streaming.conversations.close_all()
        super().close()

    def set_state(self, state: dict[str, Any]) -> None:
        if "asynchronous" not in state:
            raise ConfigError(
                "this checkpoint was written by a synchronous run; training.rollout.asynchronous cannot "
                "change on resume"
            )
        self.keys.set_state(state["keys"])
        self.finished = [dict(g, key=tuple(g["key"])) for g in state["finished"]]


class Streaming:
    """The sampler's asynchronous mode (the module docstring): its stream of groups, the weights
    installed into it, and the figures of each step's rollout."""

    def __init__(self, sampler):
        from tunix_train.generate import Sampling
        from tunix_train.generate.sampling import Kinds

        self.sampler, self.r = sampler, sampler.rollout
        self.sampling = Sampling(temperature=self.r.temperature)
        self.kinds = Kinds.of([self.sampling])
        self.figures: dict[str, float] = {}
        self.record: dict[str, list] = {}  # the step's tickets, prompts and groups dropped (rollouts.jsonl)
        self._last = None  # the previous step's start and the engine's busy seconds then
        self._drafts = collections.Counter()  # speculative decoding's counts at the previous step
        self.stats: list = []  # each engine's figures (Engine.stats), once started
        self.conversations = None  # with turns: envs/rollout.Conversations, once started

    @property
    def count(self) -> int:
        """Groups per step: every process's, over the accumulation steps."""
        s = self.sampler
        return s.cfg.training.gradient_accumulation_steps * s.global_rows // self.r.num_generations

    def requests_for(self, key: tuple[int, int, int]) -> list:
        """Group `key`'s G requests (with turns: its conversations' first)."""
        s, G = self.sampler, self.r.num_generations
        doc = s.docs[key[1]]
        if self.conversations is None:
            starts = [(s.prompts[key[1]], self.r.max_new_tokens)] * G
        else:
            starts = self.conversations.start(key, doc, G, s.images.get(id(doc)))
        return s.engine.checked([self._request(key, i, 0, *start) for i, start in enumerate(starts)])

    def _request(self, key: tuple[int, int, int], member: int, turn: int, ids, max_new_tokens: int):
        """Member `member`'s request of group `key`, turn `turn`: its own stream of draws."""
        from tunix_train.generate import Request

        s, G = self.sampler, self.r.num_generations
        ticket, prompt, attempt = key
        return Request(
            tuple(ids),
            max_new_tokens,
            self.sampling,
            s.cfg.training.seed * 1_000_003 + 500_009 + attempt,
            (ticket * G + member) * (self.r.max_turns if self.conversations else 1) + turn,
            images=s.images.get(id(s.docs[prompt])),
        )

    def after(self, key: tuple[int, int, int], member: int, completion):
        """With turns (GroupStream's `after`): the request that continues a conversation whose
        turn finished, or None where it closed."""
        following = self.conversations.after(key, member, completion)
        if following is None:
            return None
        ids, max_new_tokens, turn = following
        return self.sampler.engine.checked([self._request(key, member, turn, ids, max_new_tokens)])[0]

    def _start(self, rollouts: StreamedRollouts, state) -> None:
        """The stream, a session on each replica's engine (its parameters copied there)."""
        from tunix_train.generate.groups import GroupStream

        s, G = self.sampler, self.r.num_generations
        if s.multi_turn:  # the conversations of the groups in flight
            from tunix_train.envs.rollout import Conversations

            self.conversations = Conversations(
                s.turns, s.environment_class, self.r.environment or "Environment"
            )
        slots = s.engine.slots_for(self.count * G)
        sessions = [
            engine.session(
                s.params(state, i),
                s.cfg.data.seq_len,
                slots,
                self.kinds,
                int(state.step),
                s.draft_for(engine),
            )
            for i, engine in enumerate(s.engines)
        ]
        if self.r.ray_replicas:
            from tunix_train.generate import Tuning, remote

            weights = s.link.program.weights
            options = {
                "stop_ids": s.stop_ids,
                "slots": self.r.slots,
                "tuning": Tuning(speculation=s.engine.speculation),  # the draft's params: the session's
                "record_routes": self.r.routing_replay,
                "lora": weights.engine_lora,
            }
            sessions += remote.start(
                self.r.ray_replicas,
                s.cfg.model,
                self.r.mesh_shape,
                options,
                {
                    "max_len": s.cfg.data.seq_len,
                    "slots": slots,
                    "kinds": self.kinds,
                    "params": state.params,  # under LoRA the adapters: the actor merges them
                    "version": int(state.step),
                    "draft_params": s.draft_params[0],
                },
                s.to_engine,
                state.frozen if weights.lora else None,  # LoRA's base, sent once
                self.r.replica_timeout_s,
            )
        self.stats = [session.engine.stats for session in sessions]  # each engine's busy seconds
        # (with turns the prompts' lengths come as the conversations go: compiled as they come)
        lengths = {len(p) for p in s.prompts} if self.conversations is None else ()
        for session in sessions:  # its admissions' programs compile now, not as slots free mid-run
            session.warm(lengths)
        rollouts.stream = GroupStream(
            sessions,
            rollouts.keys,
            self.requests_for,
            buffered=self.r.buffer_steps * self.count,
            timeout_s=self.r.replica_timeout_s,
            install_timeout_s=self.r.weight_install_timeout_s,
            on_lost=self._lost,
            after=self.after if self.conversations else None,
        )
        rollouts.streaming = self

    def _lost(self, replica: int, why: str, groups: int, left: int) -> None:
        """A replica dropped (GroupStream): said in one line while others are left (with none left
        the stream raises ReplicasLost, and the run stops: `_stopped`)."""
        if left:
            log.warning(
                f"warning: training.rollout: {why}; engine replica {replica} is dropped and its {groups} "
                f"groups in flight are drawn again by the {left} left"
            )

    @contextlib.contextmanager
    def _stopped(self):
        """Every replica lost: the run stops with one line (exit 1: a restart resumes from the
        last checkpoint) rather than hang or fail with a traceback."""
        from tunix_train.generate.groups import ReplicasLost

        try:
            yield
        except ReplicasLost as lost:
            raise RunStopped(
                f"training.rollout: {lost}; stopped (the last checkpoint stands)", exit_codes.FAILED
            ) from None

    def while_step_runs(self, rollouts: StreamedRollouts, state) -> None:
        """Advances the engine while the step runs: until the next step's groups are ready, then
        while the step has not finished and there is room."""
        stream = rollouts.stream
        wanted = max(0, self.count - len(rollouts.finished))
        step_done = jax.tree.leaves(state.params)[0]
        with self._stopped():
            stream.fill(min(wanted, stream.buffered), lambda: not step_done.is_ready())

    def rollout_for(self, rollouts: StreamedRollouts, state) -> tuple[Rollout, float]:
        """The step's rollout: the first `count` groups to finish, within max_lag of the step,
        scored (under dynamic sampling, those with signal first); new weights installed first
        when the step is due them."""
        with self._stopped():
            return self._rollout_for(rollouts, state)

    def _rollout_for(self, rollouts: StreamedRollouts, state) -> tuple[Rollout, float]:
        s, step, start = self.sampler, int(state.step), time.perf_counter()
        engine_busy = self._engine_busy()
        s.syncs = dict.fromkeys(("weight_sync_s", "weight_sync_bytes"), 0.0)
        install_s, policy = 0.0, _once(lambda: s.params(state, 0))  # the first engine's, copied once
        if rollouts.stream is None:
            self._start(rollouts, state)
        elif step % self.r.weight_update_every == 0 and rollouts.stream.session.version != step:
            self._install(rollouts.stream, state, step, policy)
            install_s = time.perf_counter() - start
        stream = rollouts.stream
        fill = (len(stream.ready) + len(rollouts.finished)) / stream.buffered
        waited, count, dynamic = time.perf_counter(), self.count, self.r.dynamic_sampling
        kept, spare, requeued, rounds = [], [], 0, 0
        while len(kept) < count and not (
            dynamic and rounds >= self.r.dynamic_sampling_rounds and len(kept) + len(spare) >= count
        ):
            rounds += 1
            wanted = count - len(kept)
            batch = [rollouts.finished.pop(0) for _ in range(min(len(rollouts.finished), wanted))]
            batch += [self._taken(g) for g in stream.take(min(wanted - len(batch), stream.buffered))]
            fresh = []
            for g in batch:
                if step - min(min(v) for v in g["versions"]) <= self.r.max_lag:
                    fresh.append(g)
                else:  # drawn again, first in line
                    rollouts.keys.hand_back([(*g["key"][:2], g["key"][2] + 1)])
                    requeued += 1
            self._score(fresh)
            for g in fresh:
                informative = not dynamic or s.rewards.informative(np.asarray(g["rewards"]))
                (kept if informative else spare).append(g)
        filler = max(0, count - len(kept))  # dynamic sampling's rounds ran out: equal groups fill, last
        groups = kept + spare[:filler]
        waited = time.perf_counter() - waited
        rollout = self._rollout(groups, step, filler, rounds)
        if s.distillation is not None:  # the draft a step toward this step's policy (installed next)
            s.distillation.after(rollout, step, policy())
        self.record = {
            "tickets": rollout.tickets,
            "prompts": rollout.order,
            "without_signal": [g["key"][0] for g in spare[filler:]],  # dynamic sampling set them aside
        }
        taking = {"weight_install_s": install_s, "buffer_fill": fill, "lag_requeued_groups": requeued}
        self._figure(rollout, stream, step, start, engine_busy, waited, taking)
        return rollout, time.perf_counter() - start

    def _engine_busy(self) -> float:
        """The engines' seconds of prefill and decode so far."""
        return sum(stats["decode_s"] + stats["prefill_s"] for stats in self.stats)

    def _install(self, stream, state, step: int, first: Callable) -> None:
        """The step's weights copied to each replica's engine (first(): the first one's) and
        installed, with the distilled draft (draft_distill_every), on the replicas' threads: one
        that fails, or takes over weight_install_timeout_s, is dropped (the last one: the run stops)."""
        s, local = self.sampler, len(self.sampler.engines)
        on_host = _once(lambda: jax.device_get(state.params))  # the Ray replicas' (remote.py), fetched once

        def params(replica: int):
            return s.params(state, replica) if 0 < replica < local else first() if replica == 0 else on_host()

        stream.install(params, step, None if s.distillation is None else s.draft_params[0])

    def _taken(self, group) -> dict:
        """A group handed out: its rows, its conversations (with turns) let go."""
        rows = self.rows(group)
        if self.conversations is not None:
            self.conversations.close(group.key)
        return rows

    def rows(self, group) -> dict:
        """A finished group as plain lists (rows_of); with turns, its conversations' (envs/rollout.py:
        each one's first prompt, the tokens after it, which the model wrote, tool counts, and what
        the rewards read)."""
        if self.conversations is None:
            return self.rows_of(group)
        rows = self.conversations.rows(group.key)
        packed = None if rows["routes"][0] is None else [pack_routes(r) for r in rows["routes"]]
        return {"key": group.key, **rows, "routes": packed}

    @staticmethod
    def rows_of(group) -> dict:
        """A finished group as plain lists (what a checkpoint keeps): its key, and per completion
        its tokens (the stop token included where one ended it), their log-probabilities and
        versions, and with routing replay its experts (pack_routes)."""
        completions, logprobs = with_stop_tokens(group.completions)
        return {
            "key": group.key,
            "completions": completions,
            "logprobs": logprobs,
            "versions": [c.versions for c in group.completions],
            "routes": None
            if group.completions[0].routes is None
            else [pack_routes(c.routes) for c in group.completions],
        }

    def _score(self, groups: list[dict]) -> None:
        """Each group's rewards [functions][G], scored in one batch."""
        if not groups:
            return
        s, G = self.sampler, self.r.num_generations
        docs = [s.docs[g["key"][1]] for g in groups for _ in range(G)]
        completions = joined(groups, "completions")
        if "texts" in groups[0]:  # with turns
            extra = {"trajectories": joined(groups, "messages"), "environment": joined(groups, "environment")}
            rewards = s.scored(
                docs, joined(groups, "prompt_ids"), joined(groups, "texts"), completions, **extra
            )
        else:
            prompts = [s.prompts[g["key"][1]] for g in groups for _ in range(G)]
            texts = [s.tokenizer.decode([t for t in c if t not in s.stop_ids]) for c in completions]
            rewards = s.scored(docs, prompts, texts, completions)
        for i, g in enumerate(groups):
            g["rewards"] = rewards[:, i * G : (i + 1) * G].tolist()

    def _rollout(self, groups: list[dict], step: int, filler: int, rounds: int) -> Rollout:
        versions = joined(groups, "versions")
        return Rollout(
            step,
            min(min(v) for v in versions),
            self.sampler.cfg.training.gradient_accumulation_steps,
            [g["key"][1] for g in groups],
            joined(groups, "completions"),
            joined(groups, "logprobs"),
            np.concatenate([np.asarray(g["rewards"]) for g in groups], 1).tolist(),
            0.0,
            rounds=rounds,
            filler_groups=filler,
            routes=joined(groups, "routes"),
            versions=versions,
            tickets=[g["key"][0] for g in groups],
            **(
                {
                    "prompt_ids": joined(groups, "prompt_ids"),
                    "own": joined(groups, "own"),
                    **{f: sum(joined(groups, f)) for f in ("tool_calls", "tool_errors", "turns")},
                }
                if "texts" in groups[0]
                else {}
            ),
        )

    def _figure(self, rollout, stream, step, start, engine_busy, waited, taking: dict) -> None:
        """The step's asynchronous figures: the lag of its tokens (steps since the weights that drew
        each), the tokens of completions drawn under more than one version, those measured while
        taking its groups (`taking`: the install's seconds, the buffer's fill before the step took
        from it, the groups drawn again past max_lag), and since the previous step's start the
        fractions the trainer waited for groups and the engines did not run."""
        lags = np.concatenate([step - np.asarray(v) for v in rollout.versions])
        mixed = sum(len(v) for v in rollout.versions if len(set(v)) > 1)
        self.figures = {
            "lag_mean": float(lags.mean()),
            "lag_max": int(lags.max()),
            "mixed_version_tokens": mixed,
            **taking,
        }
        # the engine's seconds since the previous step's rollout (since this one's start, the first)
        rollout.sampling_s = self._engine_busy() - (engine_busy if self._last is None else self._last[1])
        if self._last is not None:
            interval = start - self._last[0]
            self.figures["trainer_idle"] = min(1.0, waited / interval)
            busy = (engine_busy - self._last[1]) / interval / len(stream.replicas)
            self.figures["engine_idle"] = max(0.0, 1 - busy)
        if stream.started_with > 1:
            self.figures["replicas_lost"] = stream.started_with - len(stream.replicas)
        if self.sampler.engine.speculation is not None:  # the drafts since the previous step's
            drafts = sum((collections.Counter(dict(stats)) for stats in self.stats), collections.Counter())
            new, self._drafts = drafts - self._drafts, drafts
            if new["rounds"] or new["plain_rounds"]:  # none where no chunk ran since (a full buffer)
                self.figures.update(speculative.figures(new))
        self._last = (start, engine_busy)
