"""The training loop: set-up and the starting state (setup.py), then the step loop, with everything
periodic (logs, evaluation, checkpoints, signals, profiling) in hooks (hooks.py)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np

from tunix_train.checkpoint import Checkpointer, frozen_record
from tunix_train.config import BaseQuantization, Config, ConfigError, NanPolicy
from tunix_train.data import Data
from tunix_train.data.tokenizer import with_bos
from tunix_train.generate import Engine, Request
from tunix_train.observe.comms import CommunicationProfile
from tunix_train.observe.memory import MemoryErrors
from tunix_train.observe.metrics import MetricsWriter, setup_logging
from tunix_train.observe.mfu import Peak, train_flops_per_token
from tunix_train.sharding import data_parallel_size, describe_mesh, process_rows, to_global_batch
from tunix_train.state import TrainState
from tunix_train.train import hooks as h
from tunix_train.train.init import count_params
from tunix_train.train.objectives import make_objective
from tunix_train.train.setup import (
    Setup,
    check_same_run,
    data_state,
    initial_state,
    save_config,
    setup,
)
from tunix_train.train.signals import StopRequest

# logged with experts: the load-balancing loss, and the busiest and idlest experts' tokens over the even share
MOE_METRICS = ("moe_aux_loss", "moe_load_max", "moe_load_min")


def run_steps(
    state: TrainState,
    step_fn,
    first_batch,
    next_batch: Callable[[TrainState], dict],
    hooks: Sequence[h.Hook],
    max_steps: int,
) -> TrainState:
    """Steps from state.step to max_steps: a batch (made knowing the state: an RL objective samples
    with it), the compiled step, the hooks in order."""
    start = h.StepEnd(int(state.step), state, {})
    for hook in hooks:
        hook.at_start(start)
    batch = first_batch
    for step in range(int(state.step), max_steps):
        if batch is None:
            batch = next_batch(state)
        for hook in hooks:
            hook.before_step(step)
        state, metrics = step_fn(state, batch)
        batch = None
        end = h.StepEnd(step + 1, state, metrics)
        for hook in hooks:
            hook.after_step(end)
    for hook in hooks:
        hook.at_end(state)
    return state


def train(
    cfg: Config,
    run_dir: Path,
    overrides: list[str] = (),
    devices: list[jax.Device] | None = None,
    processes: str = "single process",
    extra_hooks: Sequence[h.Hook] = (),
) -> TrainState:
    """Trains until cfg.training.max_steps on `devices` (default: all), resuming from the run
    directory's latest checkpoint when there is one; returns the final state. `extra_hooks` run
    after the built-in ones that measure and evaluate, before the report: their scalars are logged.

    Raises ConfigError before anything is written when the config or its data is bad (OutOfMemory,
    a ConfigError, when the state, the compiled step or a step does not fit), and RunStopped when a
    signal or a non-finite step (nan_policy=stop) ends the run after saving a checkpoint.
    """
    t = cfg.training
    check_same_run(run_dir, cfg)
    checkpoints = run_dir / "checkpoints"
    start = _start(cfg, devices, checkpoints)
    run, data, train_batches, state = start.run, start.data, start.train_batches, start.state
    objective, eval_batches, mesh = run.objective, start.eval_batches, run.mesh

    run_dir.mkdir(parents=True, exist_ok=True)
    is_chief = jax.process_index() == 0
    log = setup_logging(run_dir) if is_chief else None
    writer = MetricsWriter(run_dir) if is_chief else None
    if is_chief:
        save_config(cfg, list(overrides), run_dir)
    say = log.info if log else (lambda *_: None)
    if log:
        for warning in start.skipped:
            log.warning(f"warning: {warning}")
    work = h.Work(
        t.gradient_accumulation_steps * run.micro_batch * cfg.data.seq_len,
        train_flops_per_token(cfg.model, cfg.data.seq_len),
        Peak.for_run(t.peak_flops_per_device, t.mixed_precision.value),
        mesh.devices.size,
    )
    for line in (
        f"run directory: {run_dir}",
        f"mesh: {describe_mesh(mesh)}; {processes}",
        f"model: {cfg.model.name}, {_describe_parameters(run, state)}; {start.origin}",
        *_describe(cfg, run, data, work),
    ):
        say(line)

    checkpointer = Checkpointer(checkpoints, cfg.checkpoint)
    objective.connect(dataclasses.replace(run.connection(writer), resumed_from=start.restored_from))

    def save(state: TrainState) -> None:  # data_state first: its deferred rollouts may change the items
        checkpointer.save(state, data_state(train_batches, run, start.frozen), objective.checkpoint_items())

    try:
        with MemoryErrors(cfg, mesh) as memory, jax.set_mesh(mesh), StopRequest() as stop:
            began = time.perf_counter()
            batch_figures = {}  # of this process's rows of the step's batch

            def next_batch(state):
                host = objective.prepare(train_batches, state)
                batch_figures["pad_fraction"] = pad_fraction(host["segment_ids"])
                return to_global_batch(host, mesh)

            batch = next_batch(state)
            step_fn = memory.compiled = run.step_fn.lower(state, batch).compile()
            say(f"compiled the train step in {time.perf_counter() - began:.1f} s")
            interval = h.Interval()
            hooks = [
                *objective.hooks(),  # first: GRPO draws rollouts on its own mesh while the step runs
                *_profile_hook(cfg, run_dir, int(state.step), step_fn, mesh, say, is_chief),
                *([h.StopOnNonFinite(save, checkpoints)] if t.nan_policy is NanPolicy.stop else []),
                h.TrainMetrics(
                    interval,
                    t.log_every,
                    t.max_steps,
                    work,
                    objective.metric_names + (MOE_METRICS if cfg.model.moe.experts else ()),
                    say,
                    batch_figures,
                ),
                *(
                    [h.Evaluate(run.eval_fn, eval_batches, t.eval_every, t.max_steps, objective.perplexity)]
                    if eval_batches
                    else []
                ),
                *_reading_hooks(cfg, run, data, writer, say),
                *extra_hooks,
                h.Report(writer, log, interval, t.max_steps),
                h.StopOnSignal(stop, save, checkpointer.wait, checkpoints, mesh),
                h.SaveCheckpoints(checkpointer.due, save),
            ]
            state = run_steps(state, step_fn, batch, next_batch, hooks, t.max_steps)
    finally:
        checkpointer.wait()
        checkpointer.close()
        train_batches.close()
        if writer:
            writer.close()
    say(f"done: step {int(state.step)}, final checkpoint in {checkpoints / str(int(state.step))}")
    return state


@dataclasses.dataclass
class _Start:
    """What a run starts from: its data, set-up (the objective among it) and state, before anything
    is written."""

    data: Data
    run: Setup
    train_batches: Any
    state: TrainState
    origin: str  # where the state came from
    skipped: list[str]  # warnings about damaged checkpoints set aside
    eval_batches: list
    frozen: Any  # the record of the frozen weights a checkpoint keeps
    restored_from: tuple | None  # the checkpoint (folder, step) the state came from


def _start(cfg: Config, devices: list[jax.Device] | None, checkpoints: Path) -> _Start:
    """The objective reads the data, the run is set up on `devices`, and the state is restored
    (or started) from `checkpoints`; the data's read-ahead stops if that fails."""
    objective = make_objective(cfg)
    data = Data(cfg, objective.record_fields)
    objective.read(data)
    run = setup(cfg, devices, objective)
    _check_benchmarks(cfg.training, run)
    rows = process_rows(run.mesh, run.micro_batch)
    train_batches = objective.train_batches(data, run.micro_batch, rows)
    try:
        with MemoryErrors(cfg, run.mesh):
            state, origin, skipped, restored_from = initial_state(cfg, run, checkpoints, train_batches)
            eval_batches = (
                [to_global_batch(b, run.mesh) for b in objective.eval_batches(data, run.micro_batch, rows)]
                if cfg.training.eval_every
                else []
            )
            frozen = frozen_record(cfg, state)
    except BaseException:
        train_batches.close()
        raise
    return _Start(data, run, train_batches, state, origin, skipped, eval_batches, frozen, restored_from)


def _describe(cfg: Config, run, data: Data, work: h.Work) -> list[str]:
    """The log's lines on the objective, the batch, the layout, the MFU basis and the data."""
    t = cfg.training
    family = f" (advantage {t.objective.advantage.value})" if t.objective.on_policy else ""
    lines = [
        f"objective: {t.objective.value}{family}",
        f"global batch: {t.gradient_accumulation_steps * run.micro_batch} sequences "
        f"({t.micro_batch_size} per data-parallel shard x {data_parallel_size(run.mesh)} shards x "
        f"{t.gradient_accumulation_steps} accumulation steps) = {work.tokens_per_step:,} tokens",
        *(run.parallel.describe() if run.parallel else ()),
        f"MFU basis: {work.flops_per_token / 1e9:.3f} GFLOP per token, peak "
        f"{work.peak.value / 1e12:.3f} TFLOP/s per device ({work.peak.source}) x {work.devices} devices",
    ]
    if not data.synthetic:
        lines.append(
            f"data: {len(data.train_docs):,} training and {len(data.eval_docs):,} held-out documents, "
            f"tokenizer {data.tokenizer.path.name} ({data.tokenizer.vocab_size} tokens)"
        )
    return lines


def pad_fraction(segment_ids_ABT: np.ndarray) -> float:
    """The share of padding among the positions of this process's micro-batches that hold a
    sequence (a packed rollout's empty micro-batches are skipped, not computed)."""
    live = segment_ids_ABT.reshape(len(segment_ids_ABT), -1).any(axis=1)
    return float(np.mean(segment_ids_ABT[live] == 0)) if live.any() else 1.0


def _base_format(lora) -> str:
    if lora.base_quantization is BaseQuantization.none:
        return lora.base_dtype.value
    return f"{lora.base_quantization.value} (projections; {lora.base_dtype.value} elsewhere)"


def _describe_parameters(run, state: TrainState) -> str:
    trainable = f"{count_params(state.params):,} parameters"
    if run.weights.lora is not None:
        lora = run.weights.lora
        return (
            f"{trainable} in LoRA adapters (rank {lora.rank}, alpha {lora.alpha:g}, on "
            f"{', '.join(lora.targets)}) "
            f"over a frozen {_base_format(lora)} base of {count_params(state.frozen):,}"
        )
    if state.frozen is not None:
        return f"{trainable}, and a frozen reference copy of them"
    return trainable


def _reading_hooks(cfg: Config, run, data: Data, writer: MetricsWriter | None, say) -> list[h.Hook]:
    """The hooks that read the parameters only: samples and lm-eval's tasks."""
    return [*_samples_hook(cfg, run, data, writer, say), *_benchmarks_hook(cfg, run, data)]


def _samples_hook(cfg: Config, run, data: Data, writer: MetricsWriter | None, say) -> list[h.Hook]:
    """training.sample_every: greedy continuations of training.sample_prompts, by the engine on
    the training mesh, from the parameters moved to the devices where they are offloaded."""
    t = cfg.training
    if not t.sample_every:
        return []
    tokenizer = data.tokenizer
    engine = Engine(cfg.model, run.mesh, stop_ids=(tokenizer.eos_id,), lora=run.weights.engine_lora)
    merged = jax.jit(run.weights.for_engine)  # LoRA: the adapters merged into the base

    def generate(state, prompts: list[str]) -> list[str]:
        params = merged(jax.device_put(state.params, run.plan.on_device.params), state.frozen)
        done = engine.generate(
            params,
            [
                Request(tuple(with_bos(tokenizer, tokenizer.encode(p))), t.sample_max_new_tokens)
                for p in prompts
            ],
        )
        return [tokenizer.decode(c.tokens) for c in done]

    def write(step: int, samples: list[tuple[str, str]]) -> None:
        for prompt, text in samples:
            say(f"sample at step {step}: {prompt!r} -> {text!r}")
        if writer:
            writer.write_samples(step, samples)

    return [h.Samples(generate, list(t.sample_prompts), t.sample_every, t.max_steps, write)]


def _check_benchmarks(t, run) -> None:
    """training.eval_tasks' one-line errors, before the run writes anything: lm-eval missing, a task
    it does not know (its index, made here, serves the evaluations), a quantized LoRA base."""
    if not t.eval_tasks:
        return
    from tunix_train.evaluate import lm_eval_module, task_manager

    lm_eval_module()
    task_manager(tuple(t.eval_tasks), t.eval_tasks_include_path)
    if run.weights.engine_lora is not None:
        raise ConfigError(
            "training.eval_tasks reads merged parameters: it does not take a quantized LoRA base yet"
        )


def _benchmarks_hook(cfg: Config, run, data: Data) -> list[h.Hook]:
    """training.eval_tasks: lm-eval's tasks on the parameters as the engine reads them (LoRA's
    merged), through one LoadedModel whose parameters each evaluation replaces."""
    t = cfg.training
    if not t.eval_tasks:
        return []
    from tunix_train.evaluate import logged_metrics, run_tasks
    from tunix_train.generate.loaded import LoadedModel

    tokenizer, merged = data.tokenizer, jax.jit(run.weights.for_engine)
    model = None

    def evaluate(state) -> dict[str, float]:
        nonlocal model
        params = merged(jax.device_put(state.params, run.plan.on_device.params), state.frozen)
        if model is None:
            model = LoadedModel(cfg.model, run.mesh, params, tokenizer, (tokenizer.eos_id,))
        model.params = params
        results = run_tasks(model, t.eval_tasks, t.eval_tasks_include_path, None, t.eval_tasks_limit)
        return logged_metrics(results)

    return [h.Benchmarks(evaluate, t.eval_every, t.max_steps)]


def _profile_hook(cfg: Config, run_dir: Path, start: int, step_fn, mesh, say, is_chief: bool) -> list[h.Hook]:
    """training.profile_communication: process 0 traces profile_steps steps after two warm-up steps."""
    t = cfg.training
    if not (t.profile_communication and is_chief):
        return []
    first = max(min(start + 2, t.max_steps - t.profile_steps), start)
    return [
        h.ProfileCommunication(
            CommunicationProfile(run_dir, first, t.profile_steps, step_fn, dict(mesh.shape)), say, t.max_steps
        )
    ]
