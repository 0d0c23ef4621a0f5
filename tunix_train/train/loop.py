"""The training loop: data -> compiled step -> logs, metrics and evaluation."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh
from omegaconf import OmegaConf

from tunix_train import hf
from tunix_train.checkpoint import Checkpointer, restore_from, restore_latest
from tunix_train.config import Config, ConfigError, NanPolicy
from tunix_train.data import Data
from tunix_train.host_malloc import keep_freed_memory_on_cpu
from tunix_train.observe.comms import CommunicationProfile
from tunix_train.observe.metrics import MetricsWriter, setup_logging
from tunix_train.observe.mfu import device_memory_in_use, peak_for_run, train_flops_per_token
from tunix_train.sharding import (data_parallel_size, describe_mesh, make_mesh, process_rows, to_global_batch,
                                  validate_model_for_mesh, validate_training_for_mesh)
from tunix_train.train.optimizer import make_optimizer
from tunix_train.train.signals import RunStopped, StopRequest
from tunix_train.train.state import StatePlan, TrainState, count_params, model_graphdef, plan_train_state
from tunix_train.train.step import compile_eval_step, compile_train_step
from tunix_train.xla_flags import avoid_cache_for_cpu_collectives


def _save_config(cfg: Config, overrides: list[str], run_dir: Path) -> None:
    """The resolved config and the overrides, where hydra keeps them (.hydra/)."""
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), hydra_dir / "config.yaml")
    OmegaConf.save(OmegaConf.create(overrides), hydra_dir / "overrides.yaml")


@dataclasses.dataclass
class Setup:
    """What a run is built from: the mesh, the planned state, and the jitted (uncompiled) steps."""

    mesh: Mesh
    plan: StatePlan
    step_fn: Any
    eval_fn: Any
    micro_batch: int  # rows per micro-step, over all data-parallel shards


def setup(cfg: Config, devices: list[jax.Device] | None = None) -> Setup:
    """Mesh, validated model, state plan and steps on `devices` (default: all); allocates nothing.

    Raises ConfigError when the config does not fit the devices."""
    t = cfg.training
    mesh = make_mesh(cfg.model.mesh_shape, devices)
    validate_model_for_mesh(cfg.model, mesh)
    validate_training_for_mesh(t, mesh)
    avoid_cache_for_cpu_collectives(mesh)
    keep_freed_memory_on_cpu(mesh)
    optimizer, schedule = make_optimizer(t)
    plan = plan_train_state(cfg.model, optimizer, mesh, t.seed, t.sharding_strategy)
    graphdef = model_graphdef(cfg.model, t.remat, t.scan_unroll, t.attention)
    step_fn = compile_train_step(plan, mesh, graphdef=graphdef, optimizer=optimizer, schedule=schedule, training=t)
    eval_fn = compile_eval_step(plan, mesh, graphdef=graphdef, training=t)
    return Setup(mesh, plan, step_fn, eval_fn, t.micro_batch_size * data_parallel_size(mesh))


# Keys that may change when a run directory is resumed; any other difference means another run.
_RESUMABLE_CHANGES = ("model.mesh_shape", "training.micro_batch_size", "training.max_steps", "training.log_every",
                      "training.eval_every", "training.eval_batches", "training.nan_policy", "checkpoint.",
                      "training.sharding_strategy", "training.loss_chunk_size", "training.profile_",
                      "training.scan_unroll", "training.remat", "training.reduce_gradients_in_compute_dtype",
                      "training.sync_gradients_every", "training.attention", "training.xla_gpu_overlap",
                      "data.prefetch_batches")


def _check_same_run(run_dir: Path, cfg: Config) -> None:
    """A run directory holding another run's config is never reused (its checkpoints are safe)."""
    saved_file = run_dir / ".hydra" / "config.yaml"
    if not saved_file.is_file():
        return
    saved = _flatten(OmegaConf.to_container(OmegaConf.load(saved_file)))
    current = _flatten(OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True))
    for key in sorted(saved.keys() | current.keys()):
        if saved.get(key) != current.get(key) and not key.startswith(_RESUMABLE_CHANGES):
            raise ConfigError(f"hydra.run.dir={run_dir} holds a run with {key}={saved.get(key)!r}, not "
                              f"{current.get(key)!r}; resume it with the same settings or choose a new hydra.run.dir")


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def _initial_state(cfg: Config, run: Setup, checkpoints: Path, train_batches):
    """The run directory's latest checkpoint, else checkpoint.resume_from, else the Hugging Face
    checkpoint model.init_from, else a fresh state.

    Returns the state, where it came from, and warnings about damaged checkpoints skipped."""
    restored, skipped = restore_latest(checkpoints, run.plan.abstract)
    origin = f"resumed from {checkpoints}"
    if restored is None and cfg.checkpoint.resume_from:
        restored = restore_from(cfg.checkpoint.resume_from, run.plan.abstract)
        origin = f"started from checkpoint.resume_from={cfg.checkpoint.resume_from}"
    if restored is None and cfg.model.init_from:
        params = hf.load_params(Path(cfg.model.init_from), cfg.model, run.plan.abstract.params)
        return run.plan.from_params(params), f"initialized from model.init_from={cfg.model.init_from}", skipped
    if restored is None:
        return run.plan.create(), "initialized from training.seed", skipped
    state, data_state = restored
    if data_state["global_micro_batch"] != run.micro_batch:
        raise ConfigError(f"the checkpoint was written with {data_state['global_micro_batch']} rows per "
                          f"micro-step (training.micro_batch_size x dp x fsdp), this run has {run.micro_batch}; "
                          f"set training.micro_batch_size so that the global batch is the same")
    train_batches.set_state(data_state["iterator"])
    return state, f"{origin} at step {int(state.step)}", skipped


def _data_state(train_batches, run: Setup) -> dict[str, Any]:
    return {"iterator": train_batches.get_state(), "global_micro_batch": run.micro_batch}


def _evaluate(eval_fn, params, eval_batches) -> dict[str, float]:
    sums = [eval_fn(params, batch) for batch in eval_batches]
    loss_sum, weight = (sum(float(s[k]) for s in sums) for k in ("loss_sum", "weight"))
    loss = loss_sum / max(weight, 1.0)
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0))}


def train(cfg: Config, run_dir: Path, overrides: list[str] = (),
          devices: list[jax.Device] | None = None, processes: str = "single process") -> TrainState:
    """Trains until cfg.training.max_steps on `devices` (default: all), resuming from the run
    directory's latest checkpoint when there is one; returns the final state.

    Raises ConfigError before anything is written when the config or its data is bad, and RunStopped
    when a signal or a non-finite step (nan_policy=stop) ends the run after saving a checkpoint.
    """
    t = cfg.training
    _check_same_run(run_dir, cfg)
    data = Data(cfg)
    run = setup(cfg, devices)
    mesh = run.mesh
    rows = process_rows(mesh, run.micro_batch)
    train_batches = data.train_batches(run.micro_batch, rows)
    checkpoints = run_dir / "checkpoints"
    try:
        state, origin, skipped = _initial_state(cfg, run, checkpoints, train_batches)
    except BaseException:
        train_batches.close()
        raise
    eval_batches = ([to_global_batch(b, mesh) for b in data.eval_batches(run.micro_batch, rows)]
                    if t.eval_every else [])

    run_dir.mkdir(parents=True, exist_ok=True)
    is_chief = jax.process_index() == 0
    log = setup_logging(run_dir) if is_chief else None
    writer = MetricsWriter(run_dir) if is_chief else None
    if is_chief:
        _save_config(cfg, list(overrides), run_dir)
    tokens_per_step = t.gradient_accumulation_steps * run.micro_batch * cfg.data.seq_len
    say = log.info if log else (lambda *_: None)
    if log:
        for warning in skipped:
            log.warning(f"warning: {warning}")
    say(f"run directory: {run_dir}")
    say(f"mesh: {describe_mesh(mesh)}; {processes}")
    say(f"model: {cfg.model.name}, {count_params(state.params):,} parameters; {origin}")
    say(f"global batch: {t.gradient_accumulation_steps * run.micro_batch} sequences "
        f"({t.micro_batch_size} per data-parallel shard x {data_parallel_size(mesh)} shards x "
        f"{t.gradient_accumulation_steps} accumulation steps) = {tokens_per_step:,} tokens")
    flops_per_token = train_flops_per_token(cfg.model, cfg.data.seq_len)
    peak, peak_source = peak_for_run(t.peak_flops_per_device, t.mixed_precision.value)
    say(f"MFU basis: {flops_per_token / 1e9:.3f} GFLOP per token, peak {peak / 1e12:.3f} TFLOP/s "
        f"per device ({peak_source}) x {mesh.devices.size} devices")
    if not data.synthetic:
        say(f"data: {len(data.train_docs):,} training and {len(data.eval_docs):,} held-out documents, "
            f"tokenizer {data.tokenizer.path.name} ({data.tokenizer.vocab_size} tokens)")

    checkpointer = Checkpointer(checkpoints, cfg.checkpoint)
    try:
        with jax.set_mesh(mesh), StopRequest() as stop:
            start = time.perf_counter()
            batch = to_global_batch(next(train_batches), mesh)
            step_fn = run.step_fn.lower(state, batch).compile()
            say(f"compiled the train step in {time.perf_counter() - start:.1f} s")
            if eval_batches:  # the starting point, so that the first eval of a run has a reference
                scalars = _evaluate(run.eval_fn, state.params, eval_batches)
                if writer:
                    writer.write(int(state.step), scalars)
                say(f"step {int(state.step)}  " + _format(scalars))

            profile = None
            if t.profile_communication and is_chief:  # after two warm-up steps
                first = max(min(int(state.step) + 2, t.max_steps - t.profile_steps), int(state.step))
                profile = CommunicationProfile(run_dir, first, t.profile_steps, step_fn)
            interval_start, interval_steps = time.perf_counter(), 0
            for step in range(int(state.step), t.max_steps):
                if batch is None:
                    batch = to_global_batch(next(train_batches), mesh)
                if profile:
                    profile.before_step(step)
                state, metrics = step_fn(state, batch)
                if profile and (report := profile.after_step(step, state, final=step + 1 == t.max_steps)):
                    say(report)
                batch = None
                interval_steps += 1
                done = step + 1
                if t.nan_policy is NanPolicy.stop and not bool(metrics["finite"]):
                    checkpointer.save(state, _data_state(train_batches, run))
                    raise RunStopped(f"non-finite loss or gradient at step {done} (training.nan_policy=stop); "
                                     f"its update was dropped and the last good state saved to "
                                     f"{checkpoints / str(done)}", exit_code=3)
                scalars = {}
                if done % t.log_every == 0 or done == t.max_steps:
                    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}  # waits for the step
                    elapsed = time.perf_counter() - interval_start
                    tokens_per_sec = tokens_per_step * interval_steps / elapsed
                    scalars.update(loss=metrics["loss"], learning_rate=metrics["learning_rate"],
                                   grad_norm=metrics["grad_norm"], step_time_s=elapsed / interval_steps,
                                   tokens_per_sec=tokens_per_sec,
                                   mfu=tokens_per_sec * flops_per_token / (peak * mesh.devices.size),
                                   nonfinite_steps=metrics["nonfinite_steps"])
                    if (memory := device_memory_in_use()) is not None:
                        scalars["device_memory_gb"] = memory / 1e9
                if eval_batches and (done % t.eval_every == 0 or done == t.max_steps):
                    scalars.update(_evaluate(run.eval_fn, state.params, eval_batches))
                if scalars:
                    if writer:
                        writer.write(done, scalars)
                    eta = ""
                    if "step_time_s" in scalars:
                        eta = f"  ETA {_duration(scalars['step_time_s'] * (t.max_steps - done))}"
                    progress = not any(name.startswith("eval") for name in scalars)  # evals stay on screen
                    if log:
                        log.info(f"step {done}/{t.max_steps}  " + _format(scalars) + eta,
                                 extra={"progress": progress})
                    interval_start, interval_steps = time.perf_counter(), 0
                if stop.requested:
                    checkpointer.save(state, _data_state(train_batches, run))
                    checkpointer.wait()
                    raise RunStopped(f"{stop.requested}: stopped after step {done}; checkpoint saved to "
                                     f"{checkpoints / str(done)}", exit_code=0)
                if checkpointer.due(done):
                    checkpointer.save(state, _data_state(train_batches, run))
            checkpointer.save(state, _data_state(train_batches, run))
    finally:
        checkpointer.wait()
        checkpointer.close()
        train_batches.close()
        if writer:
            writer.close()
    say(f"done: step {int(state.step)}, final checkpoint in {checkpoints / str(int(state.step))}")
    return state


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}"


def _format(scalars: dict[str, float]) -> str:
    parts = []
    for name, value in scalars.items():
        if name == "step_time_s":
            parts.append(f"{value * 1000:.0f} ms/step")
        elif name == "tokens_per_sec":
            parts.append(f"{value:,.0f} tokens/s")
        elif name == "nonfinite_steps":
            if value:
                parts.append(f"{value:.0f} non-finite steps skipped")
        elif name == "mfu":
            parts.append(f"MFU {value:.1%}")
        elif name == "learning_rate":
            parts.append(f"lr {value:.2e}")
        else:
            parts.append(f"{name} {value:.4f}")
    return "  ".join(parts)
