"""training.rollout: what the on-policy objectives (Objective.on_policy: the GRPO family, RLOO,
REINFORCE++, PPO, GKD, on-policy distillation) sample and how it is rewarded: the groups, the
engine that samples them (train/rollout.py), the reward functions and models, tools and
environments over turns, the off-policy schedule, and the held-out prompts' evaluation."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, List, Optional

from tunix_train.config.fields import ConfigError, _changeable, _fixed
from tunix_train.config.objectives import AdvantageEstimator, Objective


class Overlong(enum.Enum):
    none = "none"
    filter = "filter"  # a completion cut at max_new_tokens gets no loss
    soft = "soft"  # DAPO's soft punishment over the last overlong_buffer tokens, added as a reward


class RolloutDtype(enum.Enum):  # training.rollout.dtype: the engine's weights, activations and KV cache
    fp32 = "fp32"
    bf16 = "bf16"


@dataclasses.dataclass
class OpenEnvConfig:
    """training.rollout.openenv, with training.rollout.environment=openenv: an OpenEnv environment
    server (openenv-core's client; the `envs` extra), one session per trajectory (envs/openenv.py)."""

    url: Optional[str] = _changeable(None)  # a running server's, e.g. http://127.0.0.1:8000
    # or one started here for the run: uvicorn's module:app (a create_app of openenv's), from app_dir
    app: Optional[str] = _changeable(None)
    app_dir: Optional[str] = _changeable(None)
    action_field: str = _fixed("message")  # the action's field that the model's turn fills
    # the observation's field shown to the model as a user message; null: the observation as JSON
    observation_field: Optional[str] = _fixed(None)
    start_timeout_s: float = _changeable(60.0)  # for a started server to answer /health


@dataclasses.dataclass
class RolloutConfig:
    num_generations: int = _fixed(4)  # G completions sampled per prompt: one group
    max_new_tokens: int = _fixed(32)
    temperature: float = _fixed(1.0)
    # Off-policy steps: rollouts drawn this many batches ahead, each trained on `iterations` times (mu);
    # beyond (0, 1) pi_old is the engine's recorded log-probability, the ratio truncated at
    # training.grpo.importance_cap.
    max_staleness: int = _fixed(0)
    iterations: int = _fixed(1)
    # Asynchronous RL (docs/objectives/async.md), on a rollout mesh of its own (mesh_shape): the
    # engine runs on while the trainer steps, prompts entering as slots free; a step trains on the
    # first groups to finish, whole. New weights enter the engine every weight_update_every steps
    # between two decode chunks, the requests in flight going on under them; a group with a token
    # drawn more than max_lag steps before the step that would train on it is drawn again. At most
    # buffer_steps steps' worth of groups are admitted and not yet trained on. Not bit-reproducible.
    asynchronous: bool = _fixed(False)
    max_lag: int = _changeable(2)
    weight_update_every: int = _changeable(1)
    buffer_steps: int = _changeable(2)
    # An install that fails, or takes longer than this, ends the run with one line (exit 1).
    weight_install_timeout_s: float = _changeable(600.0)
    # Asynchronous: engines each on a mesh of mesh_shape, on devices apart, fed by one prompt queue,
    # each given the new weights. One whose decode chunk fails or takes over replica_timeout_s (or
    # whose install fails or times out) is dropped with a warning, the groups it had in flight drawn
    # again by the others; the run stops with one line when none is left.
    replicas: int = _changeable(1)
    replica_timeout_s: float = _changeable(600.0)
    # Asynchronous: more replicas, each an engine in a Ray actor on the cluster this run is connected
    # to (ray.init; a node's GPUs, or CPU devices), the weights sent as host arrays at each install.
    ray_replicas: int = _changeable(0)
    # The engine's own mesh, [[sizes], [names]], on devices apart from the training mesh's (each
    # process's last ones), the weights copied to it for every rollout; null: the training mesh.
    mesh_shape: Any = _changeable(None)
    # The engine's slots for a rollout: null, every completion at once; N, at most N (continuous batching).
    slots: Optional[int] = _changeable(None)
    # What the engine computes in (bf16: half the bytes a decoded token reads, and a larger train-
    # inference mismatch, logged as logprob_mismatch_*); the trainer's forward is unchanged.
    dtype: RolloutDtype = _fixed(RolloutDtype.fp32)
    # Speculative decoding of the rollouts (docs/generation.md): a draft model's checkpoint sharing
    # the tokenizer (the policy moves away from it: watch acceptance_rate, or distill it), or prompt lookup
    # of n-grams up to prompt_lookup; num_speculative_tokens drafted a round. The completions are
    # the policy's distribution (greedy: its tokens) and their log-probabilities its own.
    draft: Optional[str] = _fixed(None)
    # The draft's own split of each engine's devices, [[sizes], [names]] (e.g. [[8], ["dp"]]: each
    # device drafts for its rows with the whole draft, no collectives); null: the engine's mesh.
    draft_mesh_shape: Any = _fixed(None)
    prompt_lookup: int = _fixed(0)
    num_speculative_tokens: int = _changeable(4)
    # Each chunk drafts as many of up to num_speculative_tokens as pay at the rows' acceptance, none
    # when none do (generate/adaptive.py). The choice reads timings, so a rollout's sampled tokens
    # are not repeated from run to run (a resumed run's differ from an uninterrupted one's).
    adaptive_speculation: bool = _changeable(False)
    # Every draft_distill_every-th rollout, one Adam step of the draft toward the policy that drew it
    # (forward KL on the completion positions, train/draft_distill.py; 0: the draft stays fixed).
    draft_distill_every: int = _fixed(0)
    draft_learning_rate: float = _fixed(1e-4)
    # Mixture of experts: the engine records the experts each layer chose for every token, and the
    # trainer's forward uses them instead of its router's top k (routing replay, train/rollout.py).
    routing_replay: bool = _fixed(False)
    # Reward functions, `module:function`, each fn(prompts, completions, **fields) -> list of floats;
    # the reward of a completion is their sum, weighted by reward_weights (empty: all 1).
    reward: List[str] = _fixed(factory=list)
    # A reward function's seconds for one batch, on a thread of its own; one that takes longer (hung)
    # stops the run with a line naming it, as one that raises or returns NaN does. 0: no bound, on
    # the run's own thread (for a function that needs the main thread, e.g. for signals)
    reward_timeout_s: float = _changeable(300.0)
    # Reward models (objective=reward's exports, or any ...ForSequenceClassification checkpoint the
    # loader reads), each scoring [BOS] prompt completion at its last token; their rewards follow
    # the functions', and reward_weights weighs functions then models.
    reward_models: List[str] = _fixed(factory=list)
    reward_weights: List[float] = _fixed(factory=list)
    # Subtracted from the reward of a completion that did not stop (its EOS or end of turn), as an
    # added reward row `missing_eos` (TRL's missing_eos_penalty): a reward model reads a completion
    # at its last token, trained on endings, and a policy can find higher scores by never ending.
    missing_eos_penalty: Optional[float] = _fixed(None)
    overlong: Overlong = _fixed(Overlong.none)
    # soft: the penalized last tokens; null: max_new_tokens // 5
    overlong_buffer: Optional[int] = _fixed(None)
    # Groups whose rewards are all equal are replaced by more prompts' (at most this many rollouts of a
    # batch's prompts; short of that they fill it, and a batch without signal does not update: DAPO).
    dynamic_sampling: bool = _fixed(False)
    dynamic_sampling_rounds: int = _fixed(4)
    # Conversations over turns (tunix_train/envs/, docs/objectives/tools.md): tools `module:function`,
    # an environment `module:Class`; at most max_turns turns of max_new_tokens, data.seq_len in all.
    tools: List[str] = _fixed(factory=list)
    environment: Optional[str] = _fixed(None)  # or `openenv`: an OpenEnv server (openenv below)
    openenv: OpenEnvConfig = dataclasses.field(default_factory=OpenEnvConfig)
    max_turns: int = _fixed(4)
    tool_timeout_s: float = _changeable(10.0)
    # a turn runs at most max_tool_calls calls; a result past max_tool_result_tokens is cut (and says so);
    # tool_processes: each call in a process of its own, killed when it hangs (threads: left, counted)
    max_tool_calls: int = _changeable(8)
    max_tool_result_tokens: int = _changeable(1024)
    tool_processes: bool = _changeable(False)
    # training.eval_every: held-out prompts' greedy reward, and pass@eval_k of eval_samples samples (a
    # sample passes when its reward reaches eval_pass_reward).
    eval_samples: int = _changeable(4)
    eval_k: int = _changeable(1)
    eval_pass_reward: float = _changeable(1.0)

    def check(self, objective: Objective, micro_batch_size: int) -> None:
        """A ConfigError naming the first bad key of training.rollout (and the micro-batch it needs)."""
        G = self.num_generations
        if G < 2 and objective.advantage not in (AdvantageEstimator.gae, AdvantageEstimator.none):
            raise ConfigError(
                f"training.rollout.num_generations={G} must be at least 2 under objective="
                f"{objective.value} (advantages compare a completion with the others of its group; "
                f"PPO's critic and GKD need no group)"
            )
        if G < 1:
            raise ConfigError(f"training.rollout.num_generations={G} must be at least 1")
        if micro_batch_size % G:
            raise ConfigError(
                f"training.micro_batch_size={micro_batch_size} must be a multiple of "
                f"training.rollout.num_generations={G}: a group never spans micro-batches or devices"
            )
        if not self.reward and not self.reward_models:
            raise ConfigError(
                "training.rollout.reward is empty: name at least one reward function, module:function "
                "(or a reward model in training.rollout.reward_models)"
            )
        _first_error(
            (
                not 0 < self.temperature < math.inf or self.max_new_tokens < 1,
                f"training.rollout.temperature={self.temperature} must be positive and finite and "
                f"training.rollout.max_new_tokens={self.max_new_tokens} >= 1",
            ),
            (
                not self.reward_timeout_s >= 0,
                f"training.rollout.reward_timeout_s={self.reward_timeout_s} must be >= 0 (0: no bound)",
            ),
            (
                self.max_staleness < 0 or self.iterations < 1,
                f"training.rollout.max_staleness={self.max_staleness} must be >= 0 and "
                f"training.rollout.iterations={self.iterations} >= 1",
            ),
            (
                bool(self.reward_weights)
                and len(self.reward_weights) != len(self.reward) + len(self.reward_models),
                f"training.rollout.reward_weights has {len(self.reward_weights)} weights for "
                f"{len(self.reward)} reward functions and {len(self.reward_models)} reward models; give "
                f"one per function then model, or none",
            ),
        )
        self._check_completions()
        self._check_asynchronous(objective)
        _first_error(
            (
                self.draft is not None and self.prompt_lookup > 0,
                "training.rollout.draft and training.rollout.prompt_lookup: give one drafter",
            ),
            (
                (self.draft is not None or self.prompt_lookup > 0) and self.routing_replay,
                "training.rollout.draft / prompt_lookup run without routing_replay: turn one off",
            ),
            (
                self.draft_mesh_shape is not None and self.draft is None,
                "training.rollout.draft_mesh_shape is the draft model's: set training.rollout.draft",
            ),
            (
                self.draft_distill_every and self.draft is None,
                "training.rollout.draft_distill_every needs training.rollout.draft",
            ),
            (
                self.draft_distill_every < 0 or not self.draft_learning_rate > 0,
                f"training.rollout.draft_distill_every={self.draft_distill_every} must be 0 or more and "
                f"draft_learning_rate={self.draft_learning_rate} positive",
            ),
            (
                self.adaptive_speculation and self.draft is None and self.prompt_lookup == 0,
                "training.rollout.adaptive_speculation needs a drafter: set training.rollout.draft or "
                "prompt_lookup",
            ),
            (
                not 1 <= self.num_speculative_tokens <= 64 or not 0 <= self.prompt_lookup <= 64,
                f"training.rollout.num_speculative_tokens={self.num_speculative_tokens} must be from 1 to 64 "
                f"and prompt_lookup={self.prompt_lookup} from 0 to 64",
            ),
        )

    def _check_asynchronous(self, objective: Objective) -> None:
        """What asynchronous rollouts need, and what they do not combine with (yet)."""
        _first_error(
            (
                self.replicas < 1 or self.ray_replicas < 0,
                f"training.rollout.replicas={self.replicas} must be at least 1 and ray_replicas="
                f"{self.ray_replicas} at least 0",
            ),
            (
                (self.replicas > 1 or self.ray_replicas > 0) and not self.asynchronous,
                f"training.rollout.replicas={self.replicas} and ray_replicas={self.ray_replicas} need "
                "asynchronous=true (a synchronous rollout runs on one engine)",
            ),
        )
        if not self.asynchronous:
            return
        _first_error(
            (
                self.mesh_shape is None,
                "training.rollout.asynchronous=true needs training.rollout.mesh_shape: the engine runs "
                "on devices of its own while the trainer steps",
            ),
            (
                self.max_staleness != 0 or self.iterations != 1,
                f"training.rollout.asynchronous=true replaces max_staleness={self.max_staleness} and "
                f"iterations={self.iterations}: set them to 0 and 1 (max_lag bounds the staleness)",
            ),
            (
                objective is Objective.gkd,
                "training.rollout.asynchronous=true streams the policy's completions: objective=gkd "
                "runs synchronously (set asynchronous=false)",
            ),
            (
                not (self.weight_install_timeout_s > 0 and self.replica_timeout_s > 0),
                f"training.rollout.weight_install_timeout_s={self.weight_install_timeout_s} and "
                f"replica_timeout_s={self.replica_timeout_s} must be positive",
            ),
            (
                self.weight_update_every < 1 or self.buffer_steps < 1,
                f"training.rollout.weight_update_every={self.weight_update_every} and "
                f"training.rollout.buffer_steps={self.buffer_steps} must be at least 1",
            ),
            (
                self.max_lag < self.weight_update_every - 1,
                f"training.rollout.max_lag={self.max_lag} must be >= weight_update_every - 1 = "
                f"{self.weight_update_every - 1}: a group drawn wholly by the newest weights can be that old",
            ),
        )

    def _check_completions(self) -> None:
        """How completions end, turn and are drawn again."""
        _first_error(
            (
                self.overlong_buffer is not None
                and (
                    self.overlong is not Overlong.soft or not 1 <= self.overlong_buffer <= self.max_new_tokens
                ),
                f"training.rollout.overlong_buffer={self.overlong_buffer} needs training.rollout.overlong="
                f"soft and a value in [1, max_new_tokens={self.max_new_tokens}]",
            ),
            (
                self.slots is not None and self.slots < 1,
                f"training.rollout.slots={self.slots} must be >= 1 (null: every completion at once)",
            ),
            (
                self.max_tool_calls < 1 or self.max_tool_result_tokens < 1,
                f"training.rollout.max_tool_calls={self.max_tool_calls} and "
                f"training.rollout.max_tool_result_tokens={self.max_tool_result_tokens} must be positive",
            ),
            (
                self.max_turns < 1 or self.tool_timeout_s <= 0,
                f"training.rollout.max_turns={self.max_turns} must be >= 1 and "
                f"training.rollout.tool_timeout_s={self.tool_timeout_s} positive",
            ),
            (
                bool(self.tools or self.environment) and self.overlong is Overlong.soft,
                "training.rollout.overlong=soft penalizes one completion's length; with tools or an "
                "environment a trajectory has several turns: use overlong=filter or none",
            ),
            (
                self.environment == "openenv" and (self.openenv.url is None) == (self.openenv.app is None),
                "training.rollout.environment=openenv needs one of training.rollout.openenv.url (a running "
                "server) and training.rollout.openenv.app (module:app, started for the run)",
            ),
            (
                self.openenv.url is not None and not self.openenv.url.startswith(("http://", "https://")),
                f"training.rollout.openenv.url={self.openenv.url!r} must start with http:// or https://",
            ),
            (
                self.dynamic_sampling_rounds < 1,
                f"training.rollout.dynamic_sampling_rounds={self.dynamic_sampling_rounds} must be >= 1",
            ),
            (
                not 1 <= self.eval_k <= self.eval_samples,
                f"training.rollout.eval_samples={self.eval_samples} must be >= training.rollout.eval_k="
                f"{self.eval_k} >= 1 (pass@k needs at least k samples per prompt)",
            ),
        )


def _first_error(*checks: tuple[bool, str]) -> None:
    """A ConfigError with the message of the first check that is bad."""
    for bad, message in checks:
        if bad:
            raise ConfigError(message)
