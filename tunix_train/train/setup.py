"""What a run is built from before its first step: the mesh, the planned state and the jitted
steps (`setup`), the run directory's identity (`check_same_run`, `save_config`), and the state
it starts from (`initial_state`: resumed, started from a checkpoint, imported or fresh)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import jax
from jax.sharding import Mesh
from omegaconf import OmegaConf

from tunix_train import parallel, platform
from tunix_train.checkpoint import (
    frozen_as_recorded,
    resolve_resume_path,
    restore_from,
    restore_latest,
    set_aside,
    starting_point,
)
from tunix_train.config import Config, ConfigError, Objective, changeable_on_resume, upgraded
from tunix_train.files import write_text
from tunix_train.interop import loader
from tunix_train.model.weights import Weights
from tunix_train.sharding import (
    LOGICAL_RULES,
    data_parallel_size,
    make_mesh,
    split_devices,
    validate_model_for_mesh,
)
from tunix_train.state import TrainState
from tunix_train.train.init import StatePlan, offloaded_parts, plan_frozen_models, plan_train_state
from tunix_train.train.objectives import make_objective
from tunix_train.train.optimizer import make_optimizer
from tunix_train.train.program import Program, program_for
from tunix_train.train.scoring import compile_score_step
from tunix_train.train.step import compile_eval_step, compile_train_step


@dataclasses.dataclass(frozen=True)
class Connection:
    """What an objective may use of its run once the run is set up (Objective.connect), and
    nothing more: the meshes, the program (what trains, the extra models, the state's shardings),
    frozen models planned on a mesh, the scoring pass, and where samples are written."""

    mesh: Mesh
    # the engines' meshes, on devices of their own (training.rollout.mesh_shape; one per replica)
    rollout_meshes: tuple[Mesh, ...]
    program: Program
    plan_frozen: Callable  # (ExtraModel specs, mesh) -> their FrozenModels (GRPO's reward models)
    score: Callable  # (params, frozen, batch) -> the objective's per-token figures (PPO's critic)
    write_samples: Callable[[int, list[tuple[str, str]]], None]  # to the log, samples.jsonl, TensorBoard
    write_rollout: Callable[[int, dict], None] = lambda *_: None  # a step's record in rollouts.jsonl
    # the checkpoint (folder, step) the state was restored from, None for a fresh start: where an
    # objective's own checkpoint items are read back (checkpoint.restore_item)
    resumed_from: tuple | None = None

    @property
    def rollout_mesh(self) -> Mesh | None:
        """The first engine's mesh (the reward models'), None without one of its own."""
        return self.rollout_meshes[0] if self.rollout_meshes else None


@dataclasses.dataclass
class Setup:
    """What a run is built from: the mesh, the planned state, and the jitted (uncompiled) steps."""

    # the engines' meshes, on devices of their own (training.rollout.mesh_shape; one per replica)
    rollout_meshes: tuple[Mesh, ...]
    plan: StatePlan
    program: Program  # what the steps trace: the model, the objective, the layout (train/program.py)
    step_fn: Any
    eval_fn: Any
    score_fn: Any  # (params, frozen, batch) -> the objective's per-token figures (PPO's critic)
    micro_batch: int  # rows per micro-step, over all data-parallel shards
    plan_frozen: Any  # (ExtraModel specs, mesh) -> their FrozenModels (GRPO's reward models)

    @property
    def mesh(self) -> Mesh:  # the training mesh, the one the state is planned on
        return self.plan.mesh

    @property
    def objective(self) -> Any:  # what the step minimizes (train/objectives/)
        return self.program.objective

    @property
    def weights(self) -> Weights:  # which parameters train and which are frozen
        return self.program.weights

    @property
    def parallel(self) -> parallel.Parallelism | None:  # how the layer stack runs over pp and cp
        return self.program.parallel

    @property
    def extras(self) -> Any:  # the objective's extra models (FrozenModels: a teacher, ...), None without
        return self.program.extras

    def connection(self, writer=None) -> Connection:
        """writer: the chief's MetricsWriter (None: nothing is written)."""
        return Connection(
            self.mesh,
            self.rollout_meshes,
            self.program,
            self.plan_frozen,
            self.score_fn,
            writer.write_samples if writer else lambda *_: None,
            writer.write_rollout if writer else lambda *_: None,
        )


def _rollout_meshes(cfg: Config, devices: list[jax.Device]) -> tuple[tuple[Mesh, ...], list[jax.Device]]:
    """The engines' meshes (training.rollout.mesh_shape, one per replica) and the devices left to
    train on."""
    r, key = cfg.training.rollout, "training.rollout.mesh_shape"
    if r.asynchronous and jax.process_count() > 1:
        # not yet: the engine's collectives across processes went out of step (tests/test_async.py)
        raise ConfigError(
            f"training.rollout.asynchronous=true runs in one process for now (this run has "
            f"{jax.process_count()}): add engines on other hosts with training.rollout.ray_replicas, "
            f"or set asynchronous=false"
        )
    devices, apart = split_devices(devices, cfg.model.mesh_shape, r.mesh_shape, key, r.replicas)
    each = len(apart) // r.replicas
    meshes = tuple(make_mesh(r.mesh_shape, apart[i * each : (i + 1) * each], key) for i in range(r.replicas))
    for mesh in meshes:
        validate_model_for_mesh(cfg.model, mesh)
    return meshes, devices


def setup(cfg: Config, devices: list[jax.Device] | None = None, objective: Any = None) -> Setup:
    """Mesh, validated model, state plan and steps on `devices` (default: all) for `objective`
    (default: training.objective's); allocates nothing.

    Raises ConfigError when the config does not fit the devices."""
    t = cfg.training
    devices = list(jax.devices() if devices is None else devices)
    objective = objective or make_objective(cfg)
    # reads a GGUF base's layout: before the devices start
    weights = loader.weights_for_run(cfg, objective.needs_reference)
    rollout_meshes = ()
    if t.objective.on_policy and t.rollout.mesh_shape is not None:
        rollout_meshes, devices = _rollout_meshes(cfg, devices)
    mesh = make_mesh(cfg.model.mesh_shape, devices)
    validate_model_for_mesh(cfg.model, mesh)
    layout = parallel.for_run(mesh, cfg.model, t, cfg.data.seq_len)
    platform.prepare(t, mesh)
    optimizer, schedule = make_optimizer(t, cfg.model)
    plan = plan_train_state(
        cfg.model,
        optimizer,
        mesh,
        t.seed,
        t.sharding_strategy,
        LOGICAL_RULES,
        offloaded_parts(t),
        weights,
    )

    def plan_frozen(specs: dict, on_mesh: Mesh):
        """Frozen models (ExtraModel specs) on a mesh, sharded and compiled as the trained one."""
        return plan_frozen_models(
            specs,
            on_mesh,
            plan.rules,
            lambda model_cfg: parallel.model_graphdef(
                model_cfg, t.remat, t.scan_unroll, t.attention, plan.rules
            ),
        )

    extras = plan_frozen(objective.extra_models(), mesh)
    program = program_for(
        plan,
        cfg.model,
        t,
        (optimizer, schedule),
        parallel=layout,
        objective=objective,
        weights=weights,
        extras=extras,
    )
    return Setup(
        rollout_meshes,
        plan,
        program,
        compile_train_step(program),
        compile_eval_step(program),
        compile_score_step(program),  # jitted, compiled on its first call: only objectives that score do
        t.micro_batch_size * data_parallel_size(mesh),
        plan_frozen,
    )


def save_config(cfg: Config, overrides: list[str], run_dir: Path) -> None:
    """The resolved config and the overrides, where hydra keeps them (.hydra/)."""
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    write_text(hydra_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    write_text(hydra_dir / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(overrides)))


def check_same_run(run_dir: Path, cfg: Config) -> None:
    """A run directory holding another run's config is never reused (its checkpoints are safe): a
    key that differs from the saved config must be marked changeable on resume (tunix_train/config/)."""
    saved_file = run_dir / ".hydra" / "config.yaml"
    if not saved_file.is_file():
        return
    saved = _flatten(upgraded(OmegaConf.to_container(OmegaConf.load(saved_file))))
    current = _flatten(OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True))
    defaults = _flatten(OmegaConf.to_container(OmegaConf.structured(Config), enum_to_str=True))
    changeable = changeable_on_resume()
    for key in sorted(saved.keys() | current.keys()):
        if key not in saved and current.get(key) == defaults.get(key):
            continue  # a key added since the run was saved, at its default: what the run did
        if key == "training.objective" and _computes(saved.get(key)) == _computes(current.get(key)):
            continue  # DAPO, Dr. GRPO, GSPO: GRPO's loss with their settings, compared key by key
        if saved.get(key) != current.get(key) and not changeable.get(key, False):
            raise ConfigError(
                f"hydra.run.dir={run_dir} holds a run with {key}={saved.get(key)!r}, not "
                f"{current.get(key)!r}; resume it with the same settings or choose a new hydra.run.dir"
            )


def _computes(name: Any) -> Any:
    """The objective an objective's name computes (Objective.computes), or the name if it is none."""
    return Objective(name).computes if name in {o.value for o in Objective} else name


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: leaf}; an empty dict (data.reasoning_gym.settings' default) is a leaf."""
    if isinstance(tree, dict) and tree:
        return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def starting_state(cfg: Config, run: Setup) -> tuple[TrainState, str]:
    """The state a run starts from without a checkpoint: the Hugging Face or GGUF checkpoint
    model.init_from (a QLoRA base quantized as its layers are read), else fresh from
    training.seed; and where it came from."""
    plan = run.plan
    if cfg.model.init_from:
        params = loader.init_from(cfg, plan.base, run.weights.layer_by_layer(plan.abstract.frozen))
        return plan.from_params(params), starting_point(cfg)
    return plan.create(), starting_point(cfg)


def initial_state(
    cfg: Config, run: Setup, checkpoints: Path, train_batches
) -> tuple[TrainState, str, list[str]]:
    """The run directory's latest checkpoint, else checkpoint.resume_from, else the Hugging Face
    checkpoint model.init_from, else a fresh state. A restored checkpoint also restores the data
    iterator's position into `train_batches`; frozen weights (LoRA's base, a reference model) are
    rebuilt from where the run started and checked against the checkpoint's record of them.

    Returns the state, where it came from, warnings about damaged checkpoints skipped, and the
    checkpoint (folder, step) it was restored from (None: not restored)."""
    restored, damaged = restore_latest(checkpoints, run.plan.abstract)
    if damaged and restored is None and not cfg.checkpoint.start_over_if_unreadable:
        steps = ", ".join(map(str, sorted(damaged)))
        raise ConfigError(
            f"{checkpoints} holds checkpoints of which none can be read (steps {steps}: "
            f"{damaged[max(damaged)]}); rather than start over at step 0 beside them, this run stops: "
            f"repair or move them, or set checkpoint.start_over_if_unreadable=true (they are then kept "
            f"as unreadable-<step>)"
        )
    skipped = set_aside(checkpoints, damaged)
    origin, folder = f"resumed from {checkpoints}", checkpoints
    if restored is None and cfg.checkpoint.resume_from:
        restored = restore_from(cfg.checkpoint.resume_from, run.plan.abstract)
        origin = f"started from checkpoint.resume_from={cfg.checkpoint.resume_from}"
        folder = resolve_resume_path(cfg.checkpoint.resume_from)[0]
    if restored is None:
        state, source = starting_state(cfg, run)
        return state, f"initialized from {source}", skipped, None
    state, data_state = restored
    if data_state["global_micro_batch"] != run.micro_batch:
        raise ConfigError(
            f"the checkpoint was written with {data_state['global_micro_batch']} rows per "
            f"micro-step (training.micro_batch_size x dp x fsdp), this run has {run.micro_batch}; "
            f"set training.micro_batch_size so that the global batch is the same"
        )
    if run.plan.abstract.frozen is not None:
        state = state.replace(
            frozen=frozen_as_recorded(
                cfg, data_state.get("frozen"), lambda: starting_state(cfg, run)[0].frozen
            )
        )
    train_batches.set_state(data_state["iterator"])
    return state, f"{origin} at step {int(state.step)}", skipped, (folder.resolve(), int(state.step))


def data_state(train_batches, run: Setup, frozen: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a checkpoint keeps beside the train state: the data iterator's position, and
    frozen_record when there are frozen weights."""
    record = {"iterator": train_batches.get_state(), "global_micro_batch": run.micro_batch}
    return record if frozen is None else {**record, "frozen": frozen}
