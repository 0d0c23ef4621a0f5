"""The rollout component: prompts completed by the engine with the policy's current parameters and
scored, for on-policy objectives (GRPO and its family, on-policy distillation, PPO). It owns the
engine on its mesh (the rollout mesh, else the training mesh) and the parameters copied there, the
prompts and held-out prompts, groups of completions per prompt, conversations with tools or an
environment (envs/rollout.py), the rewards' scores and dynamic sampling; what it draws is a
`Rollout`, queued ahead for off-policy steps in `Rollouts` (rollouts.py). Its settings are
training.grpo's (num_generations, temperature, max_new_tokens, max_staleness, iterations,
rollout_*, tools, environment, dynamic_sampling). The objective turns a Rollout into its batch
rows (GRPO: advantages, train/objectives/grpo.py; PPO: objectives/ppo.py).
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from tunix_train.config import Config, ConfigError, RolloutDtype
from tunix_train.data.chat import prompt_ids
from tunix_train.data.images import has_images
from tunix_train.data.sources import prompt_source
from tunix_train.generate import speculative
from tunix_train.model import quant
from tunix_train.sharding import cross_mesh_copier, state_shardings
from tunix_train.train.rollouts import Rollout, Rollouts, joined, pack_routes, with_stop_tokens


class Sampler:
    """Completes and scores prompts for an on-policy objective (the module docstring); `rewards`
    scores completions (train/objectives/grpo_rewards.Rewards).

    Routing replay (training.rollout.routing_replay, a mixture of experts): the engine records the
    experts each layer chose for every position it fed (Completion.routes), and the trainer's
    forward uses them in place of its router's top k, weighted by its own router's probabilities
    of them: the policy ratio is then computed on the experts that drew each token (R3, Ma et al.
    2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference Routers"; as
    Megatron-Core's RouterReplay does for verl). With turns, a position keeps the experts of the
    turn that first fed it. The reference model replays them too; the completion's last token,
    never fed, and the padding route freely."""

    def __init__(self, cfg: Config, rewards):
        self.cfg, self.rollout, self.rewards = cfg, cfg.training.rollout, rewards
        self.multi_turn = bool(self.rollout.tools) or self.rollout.environment is not None
        if self.multi_turn:  # conversations with tools or an environment (tunix_train/envs/)
            from tunix_train.envs import environment_for
            from tunix_train.envs.tools import load_tools

            self.environment_class = environment_for(self.rollout)
            self.tools = {
                **dict(getattr(self.environment_class, "tools", {}) or {}),
                **load_tools(self.rollout.tools),
            }
        self.syncs: dict[str, float] = {}
        self.speculated: collections.Counter = collections.Counter()  # this rollout's drafts (complete)
        self.rows, self.global_rows = range(0), 0
        self.images: dict[int, np.ndarray] = {}  # each prompt's images, by id(doc) (read())
        self.streaming = None  # asynchronous rollouts (streaming.Streaming), set by the objective
        self._params_lock = threading.Lock()  # replicas' threads copy the weights (params) in turn

    def close(self) -> None:
        """Stops an environment server started for the run (training.rollout.openenv.app)."""
        getattr(getattr(self, "environment_class", None), "stop_server", lambda: None)()

    def figures(self, rollout: Rollout) -> dict[str, float]:
        """What the log shows of a rollout beside its rewards (GKD's sampler: whose samples;
        asynchronous rollouts: lag, installs, buffer, idle time)."""
        return {**(self.streaming.figures if self.streaming else {}), **(rollout.speculation or {})}

    def read(self, data) -> None:
        """Tokenizes the prompts once (the held-out ones too, for training.eval_every); a prompt with
        no room for max_new_tokens is a ConfigError."""
        self.tokenizer, self.stop_ids = data.tokenizer, [data.tokenizer.eos_id]
        self.rewards.stop_ids = self.stop_ids  # the same list: an end of turn appended below counts
        if self.multi_turn:
            from tunix_train.envs.rollout import Turns

            g = self.rollout
            self.turns = Turns(
                data.chat,
                self.tools,
                g.max_new_tokens,
                g.max_turns,
                self.cfg.data.seq_len,
                g.tool_timeout_s,
                g.max_tool_calls,
                g.max_tool_result_tokens,
                g.tool_processes,
            )
        self.docs = data.train_docs
        self.eval_docs = data.eval_docs if self.cfg.training.eval_every else []
        # each prompt's images, opened now (a bad one stops the run before it starts)
        source = prompt_source(self.cfg.data)
        for what, docs in ((source, self.docs), ("the held-out prompts", self.eval_docs)):
            for number, doc in enumerate(docs, start=1):
                if isinstance(doc["prompt"], list) and has_images(doc["prompt"]):
                    self.images[id(doc)] = self._read_images(doc, f"{what}: prompt {number}")
        self.prompts = self._tokenized(data, self.docs, source)
        self.eval_prompts = self._tokenized(data, self.eval_docs, "the held-out prompts")
        if self.multi_turn or any(isinstance(doc["prompt"], list) for doc in data.train_docs):
            self.stop_ids.append(data.chat.end_of_turn_id())  # answers in turns

    def _read_images(self, doc: dict, where: str) -> np.ndarray:
        """A prompt's images [n, *image_shape] (conversation_pixels': its parts', then its record's list)."""
        from tunix_train.data.images import conversation_pixels

        if self.cfg.model.vision is None:
            raise ConfigError(f"{where}: images need a model with an image tower (model.vision)")
        per_row = self.cfg.data.images_per_row
        return conversation_pixels(
            doc["prompt"], doc.get("images") or [], self.cfg.model.vision, per_row, None, where
        )

    def _tokenized(self, data, docs, what: str) -> list:
        """Each prompt's ids (with turns: of the conversation's start, None where an environment
        makes it: at the rollout)."""
        if self.multi_turn:
            from tunix_train.envs.environment import Environment

            if self.rollout.environment is not None:
                return [None] * len(docs)
            return [
                self.turns.start(Environment(), doc, "Environment", self.images.get(id(doc))).prompt
                for doc in docs
            ]
        limit, prompts = self.cfg.data.seq_len - self.rollout.max_new_tokens, []
        for number, doc in enumerate(docs, start=1):
            chat = data.chat if isinstance(doc["prompt"], list) else None
            ids = prompt_ids(doc["prompt"], data.tokenizer, chat, self.images.get(id(doc)))
            if len(ids) > limit:
                raise ConfigError(
                    f"{what}: prompt {number} is {len(ids)} tokens; with "
                    f"training.rollout.max_new_tokens={self.rollout.max_new_tokens} it needs "
                    f"data.seq_len >= {len(ids) + self.rollout.max_new_tokens}"
                )
            prompts.append(ids)
        return prompts

    def connect(self, link) -> None:
        """What sampling needs of the run (train/setup.Connection): the engine on its mesh (the
        rollout mesh, else the training mesh), and the parameters there: under LoRA the base is
        copied once and only the adapters for each rollout, merged on the rollout side."""
        from tunix_train.generate import Engine, Tuning

        self.link, weights, plan = link, link.program.weights, link.program.plan
        to_engine = weights.for_engine
        if self.rollout.dtype is RolloutDtype.bf16:  # the engine computes in bf16

            def to_engine(p, f, merge=weights.for_engine):
                return quant.cast(merge(p, f), jnp.bfloat16)

        self.to_engine = to_engine  # (params, frozen) -> what the engine draws with
        self._merged = jax.jit(to_engine)  # LoRA: the adapters merged into the base, compiled once
        self.meshes = link.rollout_meshes or (link.mesh,)  # one per replica (asynchronous)
        self.mesh = self.meshes[0]
        if self.rewards.models:  # GRPO's reward models, on the (first) engine's mesh
            self.rewards.models.connect(link.plan_frozen, self.mesh)
        # every completion of a rollout at once, in one batch of slots, or rollout_slots at a time
        speculation, self.draft_params = self._speculation()  # the draft's, one per mesh
        self.engines = [
            Engine(
                self.cfg.model,
                mesh,
                stop_ids=self.stop_ids,
                slots=self.rollout.slots,
                tuning=Tuning(speculation=speculation),
                lora=weights.engine_lora,
                record_routes=self.rollout.routing_replay,
            )
            for mesh in self.meshes
        ]
        self.engine = self.engines[0]
        self.distillation = None  # training.rollout.draft_distill_every's (train/draft_distill.py)
        if self.rollout.draft_distill_every:
            from tunix_train.train.draft_distill import OnRollouts

            self.distillation = OnRollouts(self, link.resumed_from)
        if link.rollout_mesh is not None:
            # (several replicas run in one process, where the copier is the same for each mesh)
            self._copy = cross_mesh_copier(link.mesh, link.rollout_mesh)
            # full fine-tuning: the reference stays
            parts = ("params", "frozen") if weights.lora else ("params",)
            self._rollout_shardings = [
                {part: state_shardings(getattr(plan.abstract, part), mesh) for part in parts}
                for mesh in self.meshes
            ]
            self._frozen_copies: list = [None] * len(self.meshes)

    def _speculation(self):
        """training.rollout's speculative decoding (a Speculation or None) and the draft model's
        parameters on each engine's mesh (Nones without one). The draft stays as loaded."""
        from tunix_train.generate.speculative import Speculation
        from tunix_train.interop import loader

        g, none = self.rollout, [None] * len(self.meshes)
        k, adaptive = g.num_speculative_tokens, g.adaptive_speculation
        if g.draft is None:
            return (
                Speculation(k, lookup=g.prompt_lookup, adaptive=adaptive) if g.prompt_lookup else None
            ), none
        try:  # the draft on each engine's mesh, or on draft_mesh_shape's split of its devices
            source = loader.source(g.draft)
            spec = Speculation(k, source.cfg.model, adaptive=adaptive, draft_mesh_shape=g.draft_mesh_shape)
            meshes = [spec.draft_mesh(m, "training.rollout.draft_mesh_shape") for m in self.meshes]
            return spec, [loader.load(source, mesh).params for mesh in meshes]
        except ConfigError as err:
            raise ConfigError(f"training.rollout.draft={g.draft}: {err}") from None

    def draft_for(self, engine):
        """The draft model's parameters for `engine` (one of the policy's), else None."""
        if engine.speculation is None or engine.draft is None:
            return None
        return next(p for e, p in zip(self.engines, self.draft_params) if e is engine)

    def params(self, state, replica: int = 0):
        """The merged parameters engine `replica` draws with, on its mesh (the time and bytes
        copied there are added to the step's figures). Replicas' threads call it one at a time."""
        with self._params_lock:
            return self._params(state, replica)

    def _params(self, state, replica: int):
        # from host memory if offloaded
        on_device = jax.device_put(state.params, self.link.program.plan.on_device.params)
        if self.link.rollout_mesh is None:
            return self._merged(on_device, state.frozen)
        start, shardings = time.perf_counter(), self._rollout_shardings[replica]
        params = jax.block_until_ready(self._copy(on_device, shardings["params"]))
        moved = sum(x.nbytes for x in jax.tree.leaves(params))
        if "frozen" in shardings and self._frozen_copies[replica] is None:  # LoRA's base, once per process
            frozen = jax.block_until_ready(self._copy(state.frozen, shardings["frozen"]))
            self._frozen_copies[replica] = frozen
            moved += sum(x.nbytes for x in jax.tree.leaves(frozen))
        self.syncs["weight_sync_s"] += time.perf_counter() - start
        self.syncs["weight_sync_bytes"] += moved
        with jax.set_mesh(self.meshes[replica]):
            return self._merged(params, self._frozen_copies[replica])

    def rollout_for(self, rollouts: Rollouts, state) -> tuple[Rollout, float]:
        """The rollout of `state`'s step, step // iterations, drawing the rollouts up to
        max_staleness ahead of it that are not drawn yet, by the current parameters; and the
        seconds it took. With a rollout mesh, those this step does not train on are drawn once the
        step is running (the objective's hook calls rollouts.draw_deferred): their parameters are
        copied now, before the step takes the state."""
        if self.streaming:
            return self.streaming.rollout_for(rollouts, state)
        step, start = int(state.step), time.perf_counter()
        index = step // self.rollout.iterations
        self.syncs = (
            dict.fromkeys(("weight_sync_s", "weight_sync_bytes"), 0.0) if self.link.rollout_mesh else {}
        )
        if rollouts.current is None or rollouts.current.index != index:
            rollouts.draw_deferred()
            if rollouts.next_index is None:
                rollouts.next_index = index
            params = None  # copied once for the rollouts this step draws
            while rollouts.next_index <= index + self.rollout.max_staleness:
                params = self.params(state) if params is None else params

                def more_prompts():
                    return self.gathered(next(rollouts.prompts)["index"][..., 0])

                draw = functools.partial(
                    self.roll_out, more_prompts(), more_prompts, rollouts.next_index, params, step
                )
                if rollouts.next_index > index and self.link.rollout_mesh is not None:
                    rollouts.deferred.append(draw)
                else:
                    rollouts.queued.append(draw())
                rollouts.next_index += 1
            rollouts.current = rollouts.queued.popleft()
        rollout = rollouts.current
        if rollout.index != index:
            raise RuntimeError(f"step {step} needs rollout {index}, the queue holds {rollout.index}")
        return rollout, time.perf_counter() - start

    def gathered(self, indices: np.ndarray) -> np.ndarray:
        """This process's prompt indices [A, prompts] -> every process's, in row order: every
        process samples every prompt (the engine is one program)."""
        if jax.process_count() == 1:
            return indices
        from jax.experimental import multihost_utils

        per_process = np.asarray(multihost_utils.process_allgather(indices))  # [processes, A, prompts]
        starts = np.asarray(multihost_utils.process_allgather(np.array(self.rows.start)))
        return np.concatenate([per_process[p] for p in np.argsort(starts)], axis=1)

    def roll_out(
        self, indices: np.ndarray, more_prompts: Callable[[], np.ndarray], index: int, params, version: int
    ) -> Rollout:
        """Rollout number `index` of the prompts `indices` [A, prompts], drawn with `params` (those
        of step `version`, on the engine's mesh), scored. Under dynamic sampling, the groups without
        signal are set aside and more_prompts() are rolled out in their place."""
        wanted, self.speculated = indices.size, collections.Counter()
        groups, sampling_s = self.sample(indices.reshape(-1), index, 0, params)
        kept, spare, rounds = [], [], 1
        while self.rollout.dynamic_sampling:
            for group in groups:
                (kept if self.rewards.informative(group["rewards"]) else spare).append(group)
            if len(kept) >= wanted or rounds == self.rollout.dynamic_sampling_rounds:
                groups = kept[:wanted] + spare[: wanted - len(kept)]
                break
            (groups, seconds), rounds = (
                self.sample(more_prompts().reshape(-1), index, rounds, params),
                rounds + 1,
            )
            sampling_s += seconds

        def total(field):
            return sum(g[field] for g in groups)

        speculation = speculative.figures(self.speculated) if self.engine.speculation else None
        rollout = Rollout(
            index,
            version,
            int(indices.shape[0]),
            [g["prompt"] for g in groups],
            joined(groups, "completions"),
            joined(groups, "logprobs"),
            np.concatenate([g["rewards"] for g in groups], 1).tolist(),
            sampling_s,
            rounds=rounds,
            filler_groups=max(wanted - len(kept), 0) if self.rollout.dynamic_sampling else 0,
            prompt_ids=joined(groups, "prompt_ids"),
            own=joined(groups, "own"),
            tool_calls=total("tool_calls"),
            tool_errors=total("tool_errors"),
            turns=total("turns"),
            routes=joined(groups, "routes"),
            speculation=speculation,
        )
        if self.distillation is not None:
            self.distillation.after(rollout, index, params)
        return rollout

    def checkpoint_items(self) -> dict:
        """The distilled draft and its Adam state (draft_distill_every), for the checkpoint."""
        return {} if self.distillation is None else {"draft": self.distillation.state()}

    def sample(
        self, order: np.ndarray, index: int, round_: int, params, engine=None
    ) -> tuple[list[dict[str, Any]], float]:
        """The G completions of each prompt of `order`, scored: one dict per group, and the seconds
        spent generating. Round r of a rollout draws from the streams after round r - 1's. `engine`:
        the one that draws with `params` (default the policy's)."""
        from tunix_train.generate import Sampling

        G, order = self.rollout.num_generations, [int(i) for i in order]
        docs = [self.docs[i] for i in order for _ in range(G)]
        prompts = [self.prompts[i] for i in order for _ in range(G)]
        out = self.complete(
            docs,
            prompts,
            params,
            Sampling(temperature=self.rollout.temperature),
            self.cfg.training.seed * 1_000_003 + index,
            round_ * len(docs) * self.rollout.max_turns,
            engine,
        )

        def group(field, i):
            return out[field][i * G : (i + 1) * G] if out[field] is not None else None

        return [
            {
                "prompt": p,
                **{f: group(f, i) for f in ("completions", "logprobs", "prompt_ids", "own", "routes")},
                "rewards": out["rewards"][:, i * G : (i + 1) * G],
                **{f: sum(group(f, i)) for f in ("tool_calls", "tool_errors", "turns")},
            }
            for i, p in enumerate(order)
        ], out["sampling_s"]

    def complete(
        self, docs: list[dict], prompts: list, params, sampling, seed: int, stream: int, engine=None
    ) -> dict[str, Any]:
        """Each record's completion, scored: its prompt's ids continued by `engine` (default the
        policy's; request i from stream + i), or with turns its conversation (envs/rollout.py;
        streams from `stream` on); and the seconds it took (`sampling_s`)."""
        from tunix_train.generate import Request

        T, start = self.cfg.data.seq_len, time.perf_counter()
        engine = self.engine if engine is None else engine
        drafted = self.draft_for(engine)
        counted = {k: engine.stats[k] for k in ("accepted", "drafted", "rounds", "plain_rounds")}

        def request(ids, n, k):  # with turns, k is turn * N + the conversation's index
            images = self.images.get(id(docs[k % len(docs)]))
            return Request(tuple(ids), n, sampling, seed, stream + k, images=images)

        if self.multi_turn:
            environments = [self.environment_class() for _ in docs]
            name = self.rollout.environment or "Environment"
            try:
                trajectories = self.turns.roll_out(
                    lambda requests: engine.generate(
                        params, [request(*r) for r in requests], max_len=T, draft_params=drafted
                    ),
                    [
                        self.turns.start(e, d, name, self.images.get(id(d)))
                        for e, d in zip(environments, docs)
                    ],
                    environments,
                )
            finally:  # an environment holding a session (an OpenEnv server's) lets it go
                for environment in environments:
                    getattr(environment, "close", lambda: None)()
            out = {
                "prompt_ids": [tr.prompt for tr in trajectories],
                "completions": [tr.tokens for tr in trajectories],
                "logprobs": [tr.logprobs for tr in trajectories],
                "own": [tr.own for tr in trajectories],
                "routes": [tr.routes for tr in trajectories],
                **{
                    f: [getattr(tr, f) for tr in trajectories] for f in ("tool_calls", "tool_errors", "turns")
                },
            }
            texts, extra = (
                [tr.last_turn for tr in trajectories],
                {
                    "trajectories": [tr.messages for tr in trajectories],
                    "environment": [tr.reward for tr in trajectories],
                },
            )
        else:
            requests = [request(p, self.rollout.max_new_tokens, i) for i, p in enumerate(prompts)]
            done = engine.generate(params, requests, max_len=T, draft_params=drafted)
            completions, logprobs = with_stop_tokens(done)
            out = {
                "prompt_ids": None,
                "own": None,
                "completions": completions,
                "logprobs": logprobs,
                "routes": [c.routes for c in done],
                **dict.fromkeys(("tool_calls", "tool_errors", "turns"), [0] * len(done)),
            }
            texts, extra = [self.tokenizer.decode(c.tokens) for c in done], {}
        out["routes"] = [pack_routes(r) for r in out["routes"]] if engine.record_routes else None
        out["sampling_s"] = time.perf_counter() - start  # the engine's time (and the tools')
        self.speculated.update({k: engine.stats[k] - v for k, v in counted.items()})  # this call's
        out["rewards"] = self.scored(docs, out["prompt_ids"] or prompts, texts, out["completions"], **extra)
        return out

    def scored(
        self, docs: list[dict], prompts: list, texts: list[str], completions: list, **extra
    ) -> np.ndarray:
        """The rewards [functions, rows] of each record's completion: `texts` as the reward
        functions read them, and prompt + completion whole for the reward models."""
        whole = [[*p, *c] for p, c in zip(prompts, completions)]
        return self.rewards.score(
            [d["prompt"] for d in docs], texts, docs, completions, sequences=whole, **extra
        )
