"""The training loop: data -> compiled step -> logs and metrics."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh
from omegaconf import OmegaConf

from tunix_train.config import Config
from tunix_train.data.synthetic import SyntheticData
from tunix_train.observe.metrics import MetricsWriter, setup_logging
from tunix_train.sharding import (data_parallel_size, describe_mesh, make_mesh, to_global_batch,
                                  validate_model_for_mesh)
from tunix_train.train.optimizer import make_optimizer
from tunix_train.train.state import TrainState, count_params, create_train_state, model_graphdef
from tunix_train.train.step import compile_train_step


def _save_config(cfg: Config, overrides: list[str], run_dir: Path) -> None:
    """The resolved config and the overrides, where hydra keeps them (.hydra/)."""
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), hydra_dir / "config.yaml")
    OmegaConf.save(OmegaConf.create(overrides), hydra_dir / "overrides.yaml")


@dataclasses.dataclass
class Setup:
    """What a run is built from: the mesh, the sharded state, and the jitted (uncompiled) step."""

    mesh: Mesh
    state: TrainState
    shardings: Any
    step_fn: Any
    micro_batch: int  # sequences per micro-step, over all data-parallel shards


def setup(cfg: Config, devices: list[jax.Device] | None = None) -> Setup:
    """Mesh, validated model, sharded train state and step on `devices` (default: all).

    Raises ConfigError when the config does not fit the devices."""
    t = cfg.training
    mesh = make_mesh(cfg.model.mesh_shape, devices)
    validate_model_for_mesh(cfg.model, mesh)
    optimizer, schedule = make_optimizer(t)
    state, shardings = create_train_state(cfg.model, optimizer, mesh, t.seed)
    step_fn = compile_train_step(shardings, mesh, graphdef=model_graphdef(cfg.model, t.remat),
                                 optimizer=optimizer, schedule=schedule, mixed_precision=t.mixed_precision)
    return Setup(mesh, state, shardings, step_fn, t.micro_batch_size * data_parallel_size(mesh))


def train(cfg: Config, run_dir: Path, overrides: list[str] = (),
          devices: list[jax.Device] | None = None) -> TrainState:
    """Trains for cfg.training.max_steps steps on `devices` (default: all); returns the final state.

    Raises ConfigError before anything is written when the config does not fit the devices.
    """
    t = cfg.training
    run = setup(cfg, devices)
    mesh, state = run.mesh, run.state
    run_dir.mkdir(parents=True, exist_ok=True)
    is_chief = jax.process_index() == 0
    log = setup_logging(run_dir) if is_chief else None
    writer = MetricsWriter(run_dir) if is_chief else None
    if is_chief:
        _save_config(cfg, list(overrides), run_dir)
    tokens_per_step = t.gradient_accumulation_steps * run.micro_batch * cfg.data.seq_len
    say = log.info if log else (lambda *_: None)
    say(f"run directory: {run_dir}")
    say(f"mesh: {describe_mesh(mesh)}")
    say(f"model: {cfg.model.name}, {count_params(state.params):,} parameters")
    say(f"global batch: {t.gradient_accumulation_steps * run.micro_batch} sequences "
        f"({t.micro_batch_size} per data-parallel shard x {data_parallel_size(mesh)} shards x "
        f"{t.gradient_accumulation_steps} accumulation steps) = {tokens_per_step:,} tokens")

    data = SyntheticData(seq_len=cfg.data.seq_len, vocab_size=cfg.model.vocab_size,
                         accumulation_steps=t.gradient_accumulation_steps,
                         global_micro_batch=run.micro_batch, seed=t.seed,
                         process_index=jax.process_index(), process_count=jax.process_count())
    with jax.set_mesh(mesh):
        start = time.perf_counter()
        step_fn = run.step_fn.lower(state, to_global_batch(data.batch(0), mesh)).compile()
        say(f"compiled the train step in {time.perf_counter() - start:.1f} s")

        first_step = int(state.step)
        interval_start, interval_steps = time.perf_counter(), 0
        for step in range(first_step, t.max_steps):
            state, metrics = step_fn(state, to_global_batch(data.batch(step), mesh))
            interval_steps += 1
            done = step + 1
            if done % t.log_every and done != t.max_steps:
                continue
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}  # waits for the step
            elapsed = time.perf_counter() - interval_start
            scalars = {
                "loss": metrics["loss"],
                "learning_rate": metrics["learning_rate"],
                "grad_norm": metrics["grad_norm"],
                "step_time_s": elapsed / interval_steps,
                "tokens_per_sec": tokens_per_step * interval_steps / elapsed,
            }
            if writer:
                writer.write(done, scalars)
            say(f"step {done}/{t.max_steps}  loss {scalars['loss']:.4f}  "
                f"grad_norm {scalars['grad_norm']:.3f}  lr {scalars['learning_rate']:.2e}  "
                f"{scalars['step_time_s'] * 1000:.0f} ms/step  {scalars['tokens_per_sec']:,.0f} tokens/s")
            interval_start, interval_steps = time.perf_counter(), 0
        if writer:
            writer.close()
    return state
