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

from tunix_train.config import Config
from tunix_train.data import Data
from tunix_train.observe.metrics import MetricsWriter, setup_logging
from tunix_train.sharding import (data_parallel_size, describe_mesh, make_mesh, to_global_batch,
                                  validate_model_for_mesh)
from tunix_train.train.optimizer import make_optimizer
from tunix_train.train.state import TrainState, count_params, create_train_state, model_graphdef
from tunix_train.train.step import compile_eval_step, compile_train_step


def _save_config(cfg: Config, overrides: list[str], run_dir: Path) -> None:
    """The resolved config and the overrides, where hydra keeps them (.hydra/)."""
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), hydra_dir / "config.yaml")
    OmegaConf.save(OmegaConf.create(overrides), hydra_dir / "overrides.yaml")


@dataclasses.dataclass
class Setup:
    """What a run is built from: the mesh, the sharded state, and the jitted (uncompiled) steps."""

    mesh: Mesh
    state: TrainState
    shardings: Any
    step_fn: Any
    eval_fn: Any
    micro_batch: int  # rows per micro-step, over all data-parallel shards


def setup(cfg: Config, devices: list[jax.Device] | None = None) -> Setup:
    """Mesh, validated model, sharded train state and steps on `devices` (default: all).

    Raises ConfigError when the config does not fit the devices."""
    t = cfg.training
    mesh = make_mesh(cfg.model.mesh_shape, devices)
    validate_model_for_mesh(cfg.model, mesh)
    optimizer, schedule = make_optimizer(t)
    state, shardings = create_train_state(cfg.model, optimizer, mesh, t.seed)
    graphdef = model_graphdef(cfg.model, t.remat)
    step_fn = compile_train_step(shardings, mesh, graphdef=graphdef, optimizer=optimizer,
                                 schedule=schedule, mixed_precision=t.mixed_precision)
    eval_fn = compile_eval_step(shardings, mesh, graphdef=model_graphdef(cfg.model, t.remat),
                                mixed_precision=t.mixed_precision)
    return Setup(mesh, state, shardings, step_fn, eval_fn, t.micro_batch_size * data_parallel_size(mesh))


def _evaluate(eval_fn, params, eval_batches) -> dict[str, float]:
    sums = [eval_fn(params, batch) for batch in eval_batches]
    loss_sum, weight = (sum(float(s[k]) for s in sums) for k in ("loss_sum", "weight"))
    loss = loss_sum / max(weight, 1.0)
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0))}


def train(cfg: Config, run_dir: Path, overrides: list[str] = (),
          devices: list[jax.Device] | None = None) -> TrainState:
    """Trains for cfg.training.max_steps steps on `devices` (default: all); returns the final state.

    Raises ConfigError before anything is written when the config or its data is bad.
    """
    t = cfg.training
    data = Data(cfg)
    run = setup(cfg, devices)
    mesh, state = run.mesh, run.state
    process = dict(process_index=jax.process_index(), process_count=jax.process_count())
    train_batches = data.train_batches(run.micro_batch, **process)
    eval_batches = ([to_global_batch(b, mesh) for b in data.eval_batches(run.micro_batch, **process)]
                    if t.eval_every else [])

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
    if not data.synthetic:
        say(f"data: {len(data.train_docs):,} training and {len(data.eval_docs):,} held-out documents, "
            f"tokenizer {data.tokenizer.path.name} ({data.tokenizer.vocab_size} tokens)")

    try:
        with jax.set_mesh(mesh):
            start = time.perf_counter()
            batch = to_global_batch(next(train_batches), mesh)
            step_fn = run.step_fn.lower(state, batch).compile()
            say(f"compiled the train step in {time.perf_counter() - start:.1f} s")
            if eval_batches:  # the starting point, so that the first eval of a run has a reference
                scalars = _evaluate(run.eval_fn, state.params, eval_batches)
                if writer:
                    writer.write(int(state.step), scalars)
                say(f"step {int(state.step)}  " + _format(scalars))

            interval_start, interval_steps = time.perf_counter(), 0
            for step in range(int(state.step), t.max_steps):
                if batch is None:
                    batch = to_global_batch(next(train_batches), mesh)
                state, metrics = step_fn(state, batch)
                batch = None
                interval_steps += 1
                done = step + 1
                scalars = {}
                if done % t.log_every == 0 or done == t.max_steps:
                    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}  # waits for the step
                    elapsed = time.perf_counter() - interval_start
                    scalars.update(loss=metrics["loss"], learning_rate=metrics["learning_rate"],
                                   grad_norm=metrics["grad_norm"], step_time_s=elapsed / interval_steps,
                                   tokens_per_sec=tokens_per_step * interval_steps / elapsed)
                if eval_batches and (done % t.eval_every == 0 or done == t.max_steps):
                    scalars.update(_evaluate(run.eval_fn, state.params, eval_batches))
                if not scalars:
                    continue
                if writer:
                    writer.write(done, scalars)
                say(f"step {done}/{t.max_steps}  " + _format(scalars))
                interval_start, interval_steps = time.perf_counter(), 0
    finally:
        train_batches.close()
        if writer:
            writer.close()
    return state


def _format(scalars: dict[str, float]) -> str:
    parts = []
    for name, value in scalars.items():
        if name == "step_time_s":
            parts.append(f"{value * 1000:.0f} ms/step")
        elif name == "tokens_per_sec":
            parts.append(f"{value:,.0f} tokens/s")
        elif name == "learning_rate":
            parts.append(f"lr {value:.2e}")
        else:
            parts.append(f"{name} {value:.4f}")
    return "  ".join(parts)
