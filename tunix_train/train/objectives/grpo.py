"""Group relative policy optimization (Shao et al. 2024, DeepSeekMath) with verifiable rewards.

One file: the objective and its rollouts (until the rollout becomes its own component).

A rollout (`prepare`, before the compiled step runs): every prompt of a batch is completed G times
by the engine (generate/engine.py) on the training mesh, at training.grpo.temperature, each token
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

import collections
import dataclasses
import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from tunix_train.config import Config, ConfigError, Overlong, RolloutDtype
from tunix_train.data.chat import prompt_ids
from tunix_train.data.pipeline import GroupBatches, padded_row
from tunix_train.model import quant
from tunix_train.sharding import cross_mesh_copier, state_shardings
from tunix_train.train.hooks import Hook
from tunix_train.train.objectives import grpo_family as family
from tunix_train.train.objectives.base import Objective
from tunix_train.train.objectives.grpo_rewards import Rewards
from tunix_train.train.objectives.lm import BATCH_DTYPES


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


class Rollouts:
    """GRPO's host batches: the prompt batches, and the rollouts drawn from them that have not yet
    been trained on for the last time (`current`, then `queued`), some of them perhaps still to be
    drawn (`deferred`: callables giving them). Checkpointed whole, the deferred ones drawn first."""

    def __init__(self, prompts: GroupBatches):
        self.prompts, self.next_index = prompts, 0
        self.current: Rollout | None = None
        self.queued: collections.deque[Rollout] = collections.deque()
        self.deferred: list[Callable[[], Rollout]] = []

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


class GroupRelative(Objective):
    batch_dtypes = {
        **BATCH_DTYPES,
        "advantages": jnp.float32,  # each row's, on every position
        "behaviour_logp": jnp.float32,
    }  # the engine's log-probability of each target token
    record_fields = ("prompt",)

    def __init__(self, cfg: Config):
        self.cfg, self.grpo = cfg, cfg.training.grpo
        self.needs_reference = self.grpo.beta > 0
        self.temperature = self.grpo.temperature
        self.off_policy = self.grpo.max_staleness > 0 or self.grpo.iterations > 1
        self.rewards = Rewards(self.grpo)
        self.multi_turn = bool(self.grpo.tools) or self.grpo.environment is not None
        if self.multi_turn:  # conversations with tools or an environment (tunix_train/envs/)
            from tunix_train.envs.environment import environment_class
            from tunix_train.envs.tools import load_tools

            self._environment_class = environment_class(self.grpo.environment)
            self._tools = {
                **dict(getattr(self._environment_class, "tools", {}) or {}),
                **load_tools(self.grpo.tools),
            }
        self.metric_names = ("kl", "clip_fraction", "logprob_mismatch_mean", "logprob_mismatch_max")
        self._rollout = None

    # the loss, inside the compiled step

    def weight(self, batch):
        return family.normalizers(batch["loss_mask"], self.grpo.max_new_tokens)

    def updates(self, batch):
        """Under dynamic sampling, a batch without one informative group does not update the weights."""
        if not self.grpo.dynamic_sampling:
            return True
        return jnp.any((batch["advantages"] != 0) & (batch["loss_mask"] > 0))

    def loss(self, policy, reference, micro, weight):
        g, mask = self.grpo, micro["loss_mask"]
        logp = -policy()
        ref_logp = -reference() if self.needs_reference else None
        behaviour = micro["behaviour_logp"]
        old_logp = behaviour if self.off_policy else jax.lax.stop_gradient(logp)
        objective, kl, clipped = family.token_objective(
            logp,
            old_logp,
            ref_logp,
            micro["advantages"],
            mask,
            epsilon=g.epsilon,
            epsilon_high=g.epsilon if g.epsilon_high is None else g.epsilon_high,
            beta=g.beta,
            cap=g.importance_cap,
            level=g.importance_sampling_level,
        )

        def mean(x):
            return jnp.sum(x * mask) / weight["tokens"]

        mismatch = jnp.abs(jax.lax.stop_gradient(logp) - behaviour) * mask
        return -family.aggregate(objective, mask, weight, g.loss_aggregation), {
            "kl": mean(kl),
            "clip_fraction": mean(clipped.astype(jnp.float32)),
            "logprob_mismatch_mean": mean(mismatch),
            "logprob_mismatch_max": jnp.max(mismatch),
        }

    # the batches, on the host

    def read(self, data) -> None:
        """Tokenizes the prompts once (the held-out ones too, for training.eval_every); a prompt with
        no room for max_new_tokens is a ConfigError."""
        self._tokenizer, self._stop_ids = data.tokenizer, [data.tokenizer.eos_id]
        if self.multi_turn:
            from tunix_train.envs.rollout import Turns

            g = self.grpo
            self._turns = Turns(
                data.chat,
                self._tools,
                g.max_new_tokens,
                g.max_turns,
                self.cfg.data.seq_len,
                g.tool_timeout_s,
                g.max_tool_calls,
                g.max_tool_result_tokens,
                g.tool_processes,
            )
        self._docs, self._prompts = (
            data.train_docs,
            self._tokenized(data, data.train_docs, "data.train_files"),
        )
        self._eval_docs = data.eval_docs if self.cfg.training.eval_every else []
        self._eval_prompts = self._tokenized(data, self._eval_docs, "the held-out prompts")
        if self.multi_turn or any(
            isinstance(doc["prompt"], list) for doc in data.train_docs
        ):  # answers in turns
            self._stop_ids.append(data.chat.end_of_turn_id())

    def _tokenized(self, data, docs, what: str) -> list:
        """Each prompt's ids (with turns: of the conversation's start, None where an environment
        makes it: at the rollout)."""
        if self.multi_turn:
            from tunix_train.envs.environment import Environment

            if self.grpo.environment is not None:
                return [None] * len(docs)
            return [self._turns.start(Environment(), doc, "Environment").prompt for doc in docs]
        limit, prompts = self.cfg.data.seq_len - self.grpo.max_new_tokens, []
        for number, doc in enumerate(docs, start=1):
            ids = prompt_ids(
                doc["prompt"], data.tokenizer, data.chat if isinstance(doc["prompt"], list) else None
            )
            if len(ids) > limit:
                raise ConfigError(
                    f"{what}: prompt {number} is {len(ids)} tokens; with "
                    f"training.grpo.max_new_tokens={self.grpo.max_new_tokens} it needs "
                    f"data.seq_len >= {len(ids) + self.grpo.max_new_tokens}"
                )
            prompts.append(ids)
        return prompts

    def train_batches(self, data, global_rows: int, rows: range) -> Rollouts:
        G = self.grpo.num_generations
        indices = [{"index": np.array([[i]], np.int32)} for i in range(len(self._prompts))]
        self._rows, self._global_rows = rows, global_rows
        return Rollouts(
            GroupBatches(
                indices,
                accumulation_steps=self.cfg.training.gradient_accumulation_steps,
                groups_per_micro_batch=global_rows // G,
                seed=self.cfg.training.seed,
                slots=range(rows.start // G, rows.stop // G),
                prefetch=self.cfg.data.prefetch_batches,
            )
        )

    def connect(self, run, write_samples: Callable[[int, list[tuple[str, str]]], None]) -> None:
        """What sampling needs of the run: the engine on its mesh (the rollout mesh, else the
        training mesh), and the parameters there: under LoRA the base is copied once and only the
        adapters for each rollout, merged on the rollout side."""
        from tunix_train.generate import Engine

        self._run, self._write_samples = run, write_samples
        to_engine = run.weights.for_engine
        if self.grpo.rollout_dtype is RolloutDtype.bf16:  # the engine computes in bf16

            def to_engine(p, f, merge=run.weights.for_engine):
                return quant.cast(merge(p, f), jnp.bfloat16)

        self._merged = jax.jit(to_engine)  # LoRA: the adapters merged into the base, compiled once
        self._mesh = run.rollout_mesh or run.mesh
        # every completion of a rollout at once, in one batch of slots, or rollout_slots at a time
        self._engine = Engine(
            self.cfg.model,
            self._mesh,
            stop_ids=self._stop_ids,
            slots=self.grpo.rollout_slots,
            lora=run.weights.engine_lora,
        )
        if run.rollout_mesh is not None:
            self._copy = cross_mesh_copier(run.mesh, run.rollout_mesh)
            # full fine-tuning: the reference stays
            parts = ("params", "frozen") if run.weights.lora else ("params",)
            self._rollout_shardings = {
                part: state_shardings(getattr(run.plan.abstract, part), run.rollout_mesh) for part in parts
            }
            self._frozen_copy = None

    def _rollout_params(self, state):
        """The merged parameters the engine draws with, on its mesh (the time and bytes copied there
        are added to the step's figures)."""
        # from host memory if offloaded
        on_device = jax.device_put(state.params, self._run.plan.on_device.params)
        if self._run.rollout_mesh is None:
            return self._merged(on_device, state.frozen)
        start = time.perf_counter()
        params = jax.block_until_ready(self._copy(on_device, self._rollout_shardings["params"]))
        moved = sum(x.nbytes for x in jax.tree.leaves(params))
        if "frozen" in self._rollout_shardings and self._frozen_copy is None:  # LoRA's base, once per process
            self._frozen_copy = jax.block_until_ready(
                self._copy(state.frozen, self._rollout_shardings["frozen"])
            )
            moved += sum(x.nbytes for x in jax.tree.leaves(self._frozen_copy))
        frozen = self._frozen_copy
        self._syncs["weight_sync_s"] += time.perf_counter() - start
        self._syncs["weight_sync_bytes"] += moved
        with jax.set_mesh(self._mesh):
            return self._merged(params, frozen)

    def prepare(self, rollouts: Rollouts, state) -> dict[str, np.ndarray]:
        """The step's rows: rollout step // iterations, drawing the rollouts up to max_staleness
        ahead of it that are not drawn yet, by the current parameters. With a rollout mesh, those
        this step does not train on are drawn once the step is running (the hook's after_step):
        their parameters are copied now, before the step takes the state."""
        step, start = int(state.step), time.perf_counter()
        index = step // self.grpo.iterations
        self._syncs = (
            dict.fromkeys(("weight_sync_s", "weight_sync_bytes"), 0.0) if self._run.rollout_mesh else {}
        )
        if rollouts.current is None or rollouts.current.index != index:
            rollouts.draw_deferred()
            if rollouts.next_index is None:
                rollouts.next_index = index
            params = None  # copied once for the rollouts this step draws
            while rollouts.next_index <= index + self.grpo.max_staleness:
                params = self._rollout_params(state) if params is None else params

                def more_prompts():
                    return self._gathered(next(rollouts.prompts)["index"][..., 0])

                draw = functools.partial(
                    self._roll_out, more_prompts(), more_prompts, rollouts.next_index, params, step
                )
                if rollouts.next_index > index and self._run.rollout_mesh is not None:
                    rollouts.deferred.append(draw)
                else:
                    rollouts.queued.append(draw())
                rollouts.next_index += 1
            rollouts.current = rollouts.queued.popleft()
        rollout = rollouts.current
        if rollout.index != index:
            raise RuntimeError(f"step {step} needs rollout {index}, the queue holds {rollout.index}")
        self._rollouts = rollouts
        self._rollout = self._figures(rollout, step, time.perf_counter() - start)
        return self._rows_of(rollout)

    def _gathered(self, indices: np.ndarray) -> np.ndarray:
        """This process's prompt indices [A, prompts] -> every process's, in row order: every
        process samples every prompt (the engine is one program)."""
        if jax.process_count() == 1:
            return indices
        from jax.experimental import multihost_utils

        per_process = np.asarray(multihost_utils.process_allgather(indices))  # [processes, A, prompts]
        starts = np.asarray(multihost_utils.process_allgather(np.array(self._rows.start)))
        return np.concatenate([per_process[p] for p in np.argsort(starts)], axis=1)

    def _roll_out(
        self, indices: np.ndarray, more_prompts: Callable[[], np.ndarray], index: int, params, version: int
    ) -> Rollout:
        """Rollout number `index` of the prompts `indices` [A, prompts], drawn with `params` (those
        of step `version`, on the engine's mesh), scored. Under dynamic sampling, the groups without
        signal are set aside and more_prompts() are rolled out in their place."""
        wanted = indices.size
        groups, sampling_s = self._sample(indices.reshape(-1), index, 0, params)
        kept, spare, rounds = [], [], 1
        while self.grpo.dynamic_sampling:
            for group in groups:
                (kept if self.rewards.informative(group["rewards"]) else spare).append(group)
            if len(kept) >= wanted or rounds == self.grpo.dynamic_sampling_rounds:
                groups = kept[:wanted] + spare[: wanted - len(kept)]
                break
            (groups, seconds), rounds = (
                self._sample(more_prompts().reshape(-1), index, rounds, params),
                rounds + 1,
            )
            sampling_s += seconds

        def rows(field):
            return None if groups[0][field] is None else [row for g in groups for row in g[field]]

        def total(field):
            return sum(g[field] for g in groups)

        return Rollout(
            index,
            version,
            int(indices.shape[0]),
            [g["prompt"] for g in groups],
            rows("completions"),
            rows("logprobs"),
            np.concatenate([g["rewards"] for g in groups], 1).tolist(),
            sampling_s,
            rounds=rounds,
            filler_groups=max(wanted - len(kept), 0) if self.grpo.dynamic_sampling else 0,
            prompt_ids=rows("prompt_ids"),
            own=rows("own"),
            tool_calls=total("tool_calls"),
            tool_errors=total("tool_errors"),
            turns=total("turns"),
        )

    def _sample(
        self, order: np.ndarray, index: int, round_: int, params
    ) -> tuple[list[dict[str, Any]], float]:
        """The G completions of each prompt of `order`, scored: one dict per group, and the seconds
        spent generating. Round r of a rollout draws from the streams after round r - 1's."""
        from tunix_train.generate import Sampling

        G, order = self.grpo.num_generations, [int(i) for i in order]
        docs = [self._docs[i] for i in order for _ in range(G)]
        prompts = [self._prompts[i] for i in order for _ in range(G)]
        out = self._complete(
            docs,
            prompts,
            params,
            Sampling(temperature=self.grpo.temperature),
            self.cfg.training.seed * 1_000_003 + index,
            round_ * len(docs) * self.grpo.max_turns,
        )

        def group(field, i):
            return out[field][i * G : (i + 1) * G] if out[field] is not None else None

        return [
            {
                "prompt": p,
                **{f: group(f, i) for f in ("completions", "logprobs", "prompt_ids", "own")},
                "rewards": out["rewards"][:, i * G : (i + 1) * G],
                **{f: sum(group(f, i)) for f in ("tool_calls", "tool_errors", "turns")},
            }
            for i, p in enumerate(order)
        ], out["sampling_s"]

    def _complete(
        self, docs: list[dict], prompts: list, params, sampling, seed: int, stream: int
    ) -> dict[str, Any]:
        """Each record's completion, scored: its prompt's ids continued by the engine (request i from
        stream + i), or with turns its conversation (envs/rollout.py; streams from `stream` on); and
        the seconds it took (`sampling_s`)."""
        from tunix_train.generate import Request

        T, start, request = (
            self.cfg.data.seq_len,
            time.perf_counter(),
            lambda ids, n, k: Request(tuple(ids), n, sampling, seed, stream + k),
        )
        if self.multi_turn:
            environments = [self._environment_class() for _ in docs]
            name = self.grpo.environment or "Environment"
            trajectories = self._turns.roll_out(
                lambda requests: self._engine.generate(params, [request(*r) for r in requests], max_len=T),
                [self._turns.start(e, d, name) for e, d in zip(environments, docs)],
                environments,
            )
            out = {
                "prompt_ids": [tr.prompt for tr in trajectories],
                "completions": [tr.tokens for tr in trajectories],
                "logprobs": [tr.logprobs for tr in trajectories],
                "own": [tr.own for tr in trajectories],
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
            requests = [request(p, self.grpo.max_new_tokens, i) for i, p in enumerate(prompts)]
            done = self._engine.generate(params, requests, max_len=T)
            stopped = [c.stop_token is not None for c in done]  # then the stop token is trained on too
            out = {
                "prompt_ids": None,
                "own": None,
                "completions": [c.tokens + [c.stop_token] * s for c, s in zip(done, stopped)],
                "logprobs": [c.logprobs + [c.stop_logprob] * s for c, s in zip(done, stopped)],
                **dict.fromkeys(("tool_calls", "tool_errors", "turns"), [0] * len(done)),
            }
            texts, extra = [self._tokenizer.decode(c.tokens) for c in done], {}
        out["sampling_s"] = time.perf_counter() - start  # the engine's time (and the tools')
        out["rewards"] = self.rewards.score(
            [d["prompt"] for d in docs], texts, docs, out["completions"], **extra
        )
        return out

    def _rows_of(self, rollout: Rollout) -> dict[str, np.ndarray]:
        """The rollout's rows of this process, [A, rows, seq_len] each."""
        g = self.grpo
        G, T, A = g.num_generations, self.cfg.data.seq_len, rollout.accumulation
        prompts = rollout.prompt_ids or [self._prompts[i] for i in rollout.order for _ in range(G)]
        rows = [padded_row(p, c, T) for p, c in zip(prompts, rollout.completions)]
        full = {name: np.stack([r[name] for r in rows]) for name in rows[0]}
        full["behaviour_logp"] = np.zeros((len(rows), T), np.float32)
        for row, (prompt, logprobs) in enumerate(zip(prompts, rollout.logprobs)):  # targets[i] = ids[i + 1]
            full["behaviour_logp"][row, len(prompt) - 1 : len(prompt) - 1 + len(logprobs)] = logprobs
            if rollout.own:  # the tool results and the environment's text are not the model's: no loss
                full["loss_mask"][row, len(prompt) - 1 : len(prompt) - 1 + len(logprobs)] *= rollout.own[row]
        advantages = family.advantages(
            np.asarray(rollout.rewards),
            G,
            self.rewards.weights,
            g.scale_rewards,
            g.multi_reward_normalization,
        )
        if rollout.filler_groups:  # the equal groups that filled the batch teach nothing
            advantages[len(advantages) - rollout.filler_groups * G :] = 0.0
        full["advantages"] = np.broadcast_to(advantages[:, None], (len(rows), T)).astype(np.float32)
        if (
            g.overlong is Overlong.filter
        ):  # a completion cut at max_new_tokens: no loss (TRL mask_truncated_completions)
            cut = np.array([not c or c[-1] not in self._stop_ids for c in rollout.completions])
            full["loss_mask"][cut] = 0.0
        local = self._rows
        return {
            name: np.ascontiguousarray(x.reshape(A, -1, T)[:, local.start : local.stop])
            for name, x in full.items()
        }

    def _figures(self, rollout: Rollout, step: int, rollout_s: float) -> dict[str, Any]:
        """What the log shows of the step's rollout; its samples (the first group) at its first step."""
        G, rewards = self.grpo.num_generations, np.asarray(rollout.rewards)
        weighted = self.rewards.total(rewards)
        first_use = step == rollout.index * self.grpo.iterations

        def text(c):
            return self._tokenizer.decode(c[:-1] if c and c[-1] in self._stop_ids else c)

        prompt = self._docs[rollout.order[0]]["prompt"]
        return {
            **{f"reward_{name}": float(r.mean()) for name, r in zip(self.rewards.names, rewards)},
            **{f"reward_{name}_std": float(r.std()) for name, r in zip(self.rewards.names, rewards)},
            "reward": float(weighted.mean()),
            **(
                {"dynamic_sampling_rounds": rollout.rounds, "groups_without_signal": rollout.filler_groups}
                if self.grpo.dynamic_sampling
                else {}
            ),
            **(
                {
                    "tool_calls": rollout.tool_calls / len(rollout.completions),
                    "tool_errors": rollout.tool_errors,
                    "turns": rollout.turns / len(rollout.completions),
                    "tool_timeouts": self._turns.toolbox.hung,
                }
                if self.multi_turn
                else {}
            ),
            "completion_tokens": float(np.mean([len(c) for c in rollout.completions])),
            "sampling_s": rollout.sampling_s,
            "rollout_s": rollout_s,
            "rollout_staleness": step - rollout.version,
            **self._syncs,  # the weights copied to the rollout mesh for the rollouts this step drew
            "samples": [
                (
                    prompt
                    if isinstance(prompt, str)
                    else self._tokenizer.decode((rollout.prompt_ids or [self._prompts[rollout.order[0]]])[0]),
                    text(rollout.completions[i]),
                    float(weighted[i]),
                )
                for i in range(G)
            ]
            if first_use
            else [],
        }

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
    """First of the hooks: draws the deferred rollouts while the step runs on the training mesh,
    before any hook waits for it; then the figures."""

    def __init__(self, objective: GroupRelative):
        self.objective = objective

    def after_step(self, end) -> None:
        self.objective._rollouts.draw_deferred()
        t = self.objective.cfg.training
        if end.step % t.log_every and end.step != t.max_steps:
            return
        rollout = dict(self.objective._rollout or {})
        samples = rollout.pop("samples", [])
        end.scalars.update(rollout)
        if samples:
            self.objective._write_samples(
                end.step, [(p, f"{text}  [reward {r:g}]") for p, text, r in samples]
            )
