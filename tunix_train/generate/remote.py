"""A session in a Ray actor: an engine on another process's devices (on a Ray cluster, perhaps
another host's), driven by a GroupStream (groups.py) as a local Session is. Asynchronous RL's
replicas beyond the training process (training.rollout.ray_replicas).

The actor builds its Engine from the model's config on its own devices, a mesh of
training.rollout.mesh_shape; the parameters travel as host arrays through Ray's object store when
the session starts and at every install. A request goes with the next step; a completion comes
back once it has finished (the stream reads nothing else of the ones running). An actor that dies
makes its step raise (RayActorError) and one that hangs misses the stream's deadline: either way
the stream drops the replica and admits its groups again to the others.
"""

from __future__ import annotations

import collections
import logging
import types
from typing import Any, Sequence

import jax

from tunix_train.generate.session import Completion, Request


class SessionActor:
    """The actor's side (made a Ray actor by `start`): an Engine and one Session on the devices
    its process sees."""

    def __init__(self, model_cfg, mesh_shape, engine_options: dict, session: dict, to_engine, frozen):
        """session: Engine.session's arguments (max_len, slots, kinds, version) and the trainer's
        parameters as host arrays (params; under LoRA its adapters; draft_params: a draft model's,
        where engine_options' tuning speculates with one); to_engine(params, frozen): what the
        engine draws with (Sampler.to_engine: under LoRA the adapters merged into `frozen`, the
        base, which comes once, here)."""
        from tunix_train.generate.engine import Engine
        from tunix_train.sharding import make_mesh

        self.mesh = make_mesh(mesh_shape, jax.devices(), "training.rollout.mesh_shape")
        self.engine = Engine(model_cfg, self.mesh, **engine_options)
        self.to_engine = jax.jit(to_engine)
        self.frozen = None if frozen is None else self._placed(frozen)
        session = dict(session)
        draft = self._placed_draft(session.pop("draft_params", None))
        self.session = self.engine.session(
            self._for_engine(session.pop("params")), **session, draft_params=draft
        )
        self.ids: dict[int, int] = {}  # the caller's request id -> the session's

    def _placed(self, tree, mesh=None):
        """Host arrays onto `mesh` (default this one), sharded along their logical axes."""
        from tunix_train.sharding import state_shardings

        return jax.device_put(tree, state_shardings(tree, mesh or self.mesh))

    def _placed_draft(self, draft_params):
        """A draft model's host arrays onto its mesh (Speculation.draft_mesh), or None."""
        return None if draft_params is None else self._placed(draft_params, self.engine.draft.mesh)

    def _for_engine(self, params):
        with jax.set_mesh(self.mesh):
            return self.to_engine(self._placed(params), self.frozen)

    def warm(self, prompt_lengths: Sequence[int]) -> None:
        self.session.warm(prompt_lengths)

    def install(self, params, version: int, draft_params=None) -> None:
        self.session.install(self._for_engine(params), version, self._placed_draft(draft_params))

    def step(self, added: list[tuple[int, Request]]):
        """Queues `added`, decodes one chunk; the completions that finished (caller's id,
        Completion), the requests waiting or running, and the engine's figures so far (its busy
        seconds as decode_s, and speculative decoding's counts)."""
        for rid, request in added:
            self.ids[rid] = self.session.add(request)
        if self.session.busy:
            self.session.step()
        finished = []
        for rid, sid in list(self.ids.items()):
            if self.session.completions[sid].finish is not None:
                finished.append((rid, self.session.completions.pop(sid)))
                del self.ids[rid]
        stats = self.engine.stats
        figures = {k: stats[k] for k in ("accepted", "drafted", "rounds", "plain_rounds") if k in stats}
        return (
            finished,
            self.session.unfinished,
            {**figures, "decode_s": stats["decode_s"] + stats["prefill_s"]},
        )


class RemoteSession:
    """What GroupStream calls of a Session (slots, version, unfinished, busy, add, step, install,
    warm, completions, engine.stats: the actor's busy seconds and drafts), each step one round trip
    to `actor` (a SessionActor)."""

    def __init__(self, actor, slots: int, version: int, start_timeout_s: float, asks: dict):
        """start_timeout_s: the actor's deadline to start (warm); asks: the resources it asked."""
        self.actor, self.slots, self.version = actor, slots, version
        self.start_timeout_s, self.asks = start_timeout_s, asks
        self.completions: dict[int, Completion] = {}
        self.engine = types.SimpleNamespace(stats=collections.Counter())  # SessionActor.step's figures
        self._added: list[tuple[int, Request]] = []
        self._running, self._next_id = 0, 0  # requests the actor holds, waiting or running

    @property
    def unfinished(self) -> int:
        return len(self._added) + self._running

    @property
    def busy(self) -> bool:
        return self.unfinished > 0

    def add(self, request: Request) -> int:
        rid, self._next_id = self._next_id, self._next_id + 1
        self._added.append((rid, request))
        self.completions[rid] = Completion()
        return rid

    def step(self) -> None:
        import ray

        added, self._added = self._added, []
        finished, self._running, figures = ray.get(self.actor.step.remote(added))
        self.completions.update(finished)
        for name, value in figures.items():  # the actor's totals so far (Counter.update would add them)
            self.engine.stats[name] = value

    def install(self, params, version: int, draft_params=None) -> None:
        import ray

        ray.get(self.actor.install.remote(jax.device_get(params), version, jax.device_get(draft_params)))
        self.version = version

    def warm(self, prompt_lengths: Sequence[int]) -> None:
        """The actor started (placed on the cluster, its engine made) and its admissions' programs
        compiled, within start_timeout_s: else a one-line error (a cluster without the actor's
        resources would leave it pending for ever)."""
        import ray

        from tunix_train.config import ConfigError

        try:
            ray.get(self.actor.warm.remote(list(prompt_lengths)), timeout=self.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.kill(self.actor)
            raise ConfigError(
                f"training.rollout.ray_replicas: an actor replica did not start within "
                f"replica_timeout_s={self.start_timeout_s:g} s (placed, its engine built and compiled): "
                f"does the Ray cluster have room for {self.asks} (free: {ray.available_resources()})? "
                f"Else raise replica_timeout_s"
            ) from None


def start(
    count: int,
    model_cfg,
    mesh_shape,
    engine_options: dict,
    session: dict,
    to_engine,
    frozen,
    timeout_s: float,
) -> list[RemoteSession]:
    """`count` sessions in Ray actors on the cluster this process is connected to (ray.init; else
    the one ray.init(address="auto") finds), each with as many devices as mesh_shape takes: GPUs
    where the training runs on GPUs, else CPU devices of a process of its own (XLA's host
    platform). session: Engine.session's arguments (max_len, slots, kinds, version) and the
    trainer's parameters (params; draft_params, with a draft model); to_engine and frozen:
    SessionActor's; timeout_s: each actor's deadline to start."""
    import math

    from tunix_train.config import ConfigError
    from tunix_train.sharding import _parse_mesh_shape

    key = f"training.rollout.ray_replicas={count}"
    try:
        import ray
    except ImportError:
        raise ConfigError(f"{key} needs Ray: pip install -e '.[ray]'") from None
    if not ray.is_initialized():  # a run on a Ray node (launch/ray.py's workers) finds its cluster
        try:
            ray.init(address="auto", log_to_driver=False)
        except ConnectionError as err:
            raise ConfigError(f"{key} needs a Ray cluster to connect to ({err})") from None

    devices = math.prod(_parse_mesh_shape(mesh_shape, None, "training.rollout.mesh_shape")[0])
    if jax.devices()[0].platform == "gpu":
        options: dict[str, Any] = {"num_gpus": devices, "num_cpus": 1}
    else:
        flags = f"--xla_force_host_platform_device_count={devices}"
        options = {"num_cpus": 1, "runtime_env": {"env_vars": {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}}}
    actor_class = ray.remote(max_restarts=0, max_concurrency=1, **options)(SessionActor)
    on_host = {name: jax.device_get(session.get(name)) for name in ("params", "draft_params")}
    session = {**session, **on_host}
    args = (model_cfg, mesh_shape, engine_options, session, to_engine, jax.device_get(frozen))
    actors = [actor_class.remote(*args) for _ in range(count)]
    address = ray.get_runtime_context().gcs_address
    logging.getLogger("tunix_train").info(f"{key}: engine actors on the Ray cluster at {address}")
    asks = {k: v for k, v in options.items() if k.startswith("num_")}
    return [RemoteSession(actor, session["slots"], session["version"], timeout_s, asks) for actor in actors]
