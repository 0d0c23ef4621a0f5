"""The periodic parts of the training loop, each a small hook: the loop (loop.run_steps) calls every
hook, in order, around each step, and knows nothing of what they do. Something new that happens
every so many steps (a sample of generated text, say) is one more hook, not an edit to the loop.

A hook may add scalars to the step's record (`StepEnd.scalars`), which `Report` writes to
metrics.jsonl, TensorBoard and the log, or end the run by raising `RunStopped`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from tunix_train import exit_codes
from tunix_train.observe.comms import CommunicationProfile
from tunix_train.observe.metrics import MetricsWriter
from tunix_train.observe.mfu import Peak, device_memory_in_use
from tunix_train.state import TrainState
from tunix_train.train.signals import RunStopped, StopRequest


@dataclasses.dataclass
class StepEnd:
    """What the hooks see: the state after `step` steps, the step's metrics (device arrays, not
    fetched; empty before the first step), and the scalars logged for it, which hooks add to."""

    step: int
    state: TrainState
    metrics: dict[str, jax.Array]
    scalars: dict[str, float] = dataclasses.field(default_factory=dict)


class Hook:
    """A periodic part of the loop. Each method does nothing unless a hook overrides it."""

    def at_start(self, start: StepEnd) -> None:
        """Before the first step; `start.step` is the step the run starts from."""

    def before_step(self, step: int) -> None:
        """Step `step` (0-based) is about to run."""

    def after_step(self, end: StepEnd) -> None:
        """The step has been dispatched (not necessarily finished)."""

    def at_end(self, state: TrainState) -> None:
        """After the last step."""


class Interval:
    """Wall time and steps since the last report: the basis of tokens/s."""

    def __init__(self):
        self.restart()

    def restart(self) -> None:
        self.start, self.steps = time.perf_counter(), 0


class StopOnNonFinite(Hook):
    """training.nan_policy=stop: a step with a non-finite loss or gradient (its update was dropped)
    saves the last good state and ends the run with exit code NON_FINITE (3). Reads one flag every step."""

    def __init__(self, save: Callable[[TrainState], Any], checkpoints: Path):
        self.save, self.checkpoints = save, checkpoints

    def after_step(self, end: StepEnd) -> None:
        if not bool(end.metrics["finite"]):
            self.save(end.state)
            raise RunStopped(
                f"non-finite loss or gradient at step {end.step} (training.nan_policy=stop); "
                f"its update was dropped and the last good state saved to "
                f"{self.checkpoints / str(end.step)}",
                exit_code=exit_codes.NON_FINITE,
            )


@dataclasses.dataclass(frozen=True)
class Work:
    """What a step's MFU is computed from: its tokens, the FLOPs of one, and the peak FLOP/s of
    each of the devices."""

    tokens_per_step: int
    flops_per_token: float
    peak: Peak
    devices: int


class TrainMetrics(Hook):
    """Every `every` steps and at the last: loss, learning rate, gradient norm, step time, tokens/s,
    MFU, non-finite steps skipped and device memory. Fetching the metrics waits for the step."""

    def __init__(
        self,
        interval: Interval,
        every: int,
        max_steps: int,
        work: Work,
        objective_metrics: tuple[str, ...] = (),
        say: Callable[[str], None] = lambda line: None,
        batch_figures: dict[str, float] | None = None,
    ):
        """say: where a revised peak is told; batch_figures: what the loop measured of the step's
        host batch (pad_fraction: its padding positions' share)."""
        self.batch_figures = batch_figures if batch_figures is not None else {}
        self.interval, self.every, self.max_steps = interval, every, max_steps
        self.objective_metrics, self.say = objective_metrics, say
        self.work = work

    def after_step(self, end: StepEnd) -> None:
        self.interval.steps += 1
        if end.step % self.every and end.step != self.max_steps:
            return
        metrics = {k: float(v) for k, v in jax.device_get(end.metrics).items()}
        elapsed = time.perf_counter() - self.interval.start
        tokens_per_sec = self.work.tokens_per_step * self.interval.steps / elapsed
        per_device = tokens_per_sec * self.work.flops_per_token / self.work.devices
        if revised := self.work.peak.revise(per_device):
            self.say(revised)
        end.scalars.update(
            loss=metrics["loss"],
            learning_rate=metrics["learning_rate"],
            grad_norm=metrics["grad_norm"],
            step_time_s=elapsed / self.interval.steps,
            tokens_per_sec=tokens_per_sec,
            mfu=per_device / self.work.peak.value,
            nonfinite_steps=metrics["nonfinite_steps"],
            **{name: metrics[name] for name in self.objective_metrics},
            **self.batch_figures,
        )
        if (memory := device_memory_in_use()) is not None:
            end.scalars["device_memory_gb"] = memory / 1e9


class Evaluate(Hook):
    """Held-out loss and perplexity, and the objective's metrics (eval_<name>: DPO's and the
    reward model's accuracy, ...), at the start (a reference for the first evaluation), every
    `every` steps and at the last, over a fixed set of batches."""

    def __init__(self, eval_fn, batches: list, every: int, max_steps: int, perplexity: bool = True):
        """perplexity: the loss is a mean token cross-entropy (not so for preference objectives)."""
        self.eval_fn, self.batches, self.every, self.max_steps = eval_fn, batches, every, max_steps
        self.perplexity = perplexity

    def evaluate(self, state: TrainState) -> dict[str, float]:
        sums = [self.eval_fn(state.params, state.frozen, batch) for batch in self.batches]
        loss_sum, weight = (sum(float(s[k]) for s in sums) for k in ("loss_sum", "weight"))
        loss = loss_sum / max(weight, 1.0)
        metrics = {}
        for key in sums[0] if sums else ():
            if key.startswith("metric_"):
                name, values = key.removeprefix("metric_"), [float(s[key]) for s in sums]
                metrics[f"eval_{name}"] = (
                    max(values) if name.endswith("_max") else sum(values) / max(weight, 1.0)
                )
        return {
            "eval_loss": loss,
            **({"eval_perplexity": math.exp(min(loss, 700.0))} if self.perplexity else {}),
            **metrics,
        }

    def at_start(self, start: StepEnd) -> None:
        start.scalars.update(self.evaluate(start.state))

    def after_step(self, end: StepEnd) -> None:
        if end.step % self.every == 0 or end.step == self.max_steps:
            end.scalars.update(self.evaluate(end.state))


class Benchmarks(Hook):
    """lm-eval tasks (training.eval_tasks) at the start, every `every` steps and at the last:
    `evaluate(state)` -> {name: value}, logged with the step's scalars."""

    def __init__(self, evaluate: Callable[[TrainState], dict[str, float]], every: int, max_steps: int):
        self.evaluate, self.every, self.max_steps = evaluate, every, max_steps

    def at_start(self, start: StepEnd) -> None:
        start.scalars.update(self.evaluate(start.state))

    def after_step(self, end: StepEnd) -> None:
        if end.step % self.every == 0 or end.step == self.max_steps:
            end.scalars.update(self.evaluate(end.state))


class Samples(Hook):
    """The model's greedy continuations of `prompts` before the first step, every `every` steps and
    after the last: `generate(state, prompts)` -> texts, given to `write(step, [(prompt, text)])`.
    Reads the parameters only: the training trajectory is the same with or without it."""

    def __init__(
        self,
        generate: Callable[[Any, list[str]], list[str]],
        prompts: list[str],
        every: int,
        max_steps: int,
        write: Callable[[int, list[tuple[str, str]]], None],
    ):
        self.generate, self.prompts, self.every, self.max_steps, self.write = (
            generate,
            prompts,
            every,
            max_steps,
            write,
        )

    def _sample(self, step: int, state: TrainState) -> None:
        self.write(step, list(zip(self.prompts, self.generate(state, self.prompts))))

    def at_start(self, start: StepEnd) -> None:
        self._sample(start.step, start.state)

    def after_step(self, end: StepEnd) -> None:
        if end.step % self.every == 0 or end.step == self.max_steps:
            self._sample(end.step, end.state)


class Report(Hook):
    """Writes a step's scalars, when it has any, to metrics.jsonl and TensorBoard (`writer`) and as
    one log line; process 0 only (the others pass None). Restarts the tokens/s interval."""

    def __init__(
        self, writer: MetricsWriter | None, log: logging.Logger | None, interval: Interval, max_steps: int
    ):
        self.writer, self.log, self.interval, self.max_steps = writer, log, interval, max_steps

    def at_start(self, start: StepEnd) -> None:
        if start.scalars:
            if self.writer:
                self.writer.write(start.step, start.scalars)
            if self.log:
                self.log.info(f"step {start.step}  " + _format(start.scalars))
        self.interval.restart()

    def after_step(self, end: StepEnd) -> None:
        if not end.scalars:
            return
        if self.writer:
            self.writer.write(end.step, end.scalars)
        eta = ""
        if "step_time_s" in end.scalars:
            eta = f"  ETA {_duration(end.scalars['step_time_s'] * (self.max_steps - end.step))}"
        progress = not any(name.startswith("eval") for name in end.scalars)  # evals stay on screen
        if self.log:
            self.log.info(
                f"step {end.step}/{self.max_steps}  " + _format(end.scalars) + eta,
                extra={"progress": progress},
            )
        self.interval.restart()


class StopOnSignal(Hook):
    """SIGTERM (preemption) or SIGINT: saves a checkpoint after a step, waits for it to be written and
    ends the run, with exit code PREEMPTED after a SIGTERM (a launcher or scheduler restarts it) and
    OK after a SIGINT. Processes of one run stop after the same step, whichever of them got the
    signal: each step's requests are combined across processes by an all-reduce that is read one
    step later, so the host never waits for the devices on its account."""

    def __init__(
        self,
        stop: StopRequest,
        save: Callable[[TrainState], Any],
        wait: Callable[[], None],
        checkpoints: Path,
        mesh: jax.sharding.Mesh,
    ):
        self.stop, self.save, self.wait, self.checkpoints, self.mesh = stop, save, wait, checkpoints, mesh
        self.previous: jax.Array | None = None  # the previous step's combined request

    def after_step(self, end: StepEnd) -> None:
        if jax.process_count() == 1:
            request = SIGNAL_CODES.get(self.stop.requested, 0)
        else:
            request = int(self.previous) if self.previous is not None else 0
            self.previous = _max_over_processes(SIGNAL_CODES.get(self.stop.requested, 0), self.mesh)
        if request:
            self.save(end.state)
            self.wait()
            name = {code: name for name, code in SIGNAL_CODES.items()}[request]
            raise RunStopped(
                f"{name}: stopped after step {end.step}; checkpoint saved to "
                f"{self.checkpoints / str(end.step)}",
                exit_code=exit_codes.PREEMPTED if name == "SIGTERM" else exit_codes.OK,
            )


SIGNAL_CODES = {"SIGINT": 1, "SIGTERM": 2}  # SIGTERM wins: a preemption asks for a restart


def _max_over_processes(value: int, mesh: jax.sharding.Mesh) -> jax.Array:
    """The largest of every process's `value`, computed on the devices (not waited for)."""
    every_device = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(mesh.axis_names))
    local = np.full((len(mesh.local_devices),), value, np.int32)
    return _max_replicated(jax.make_array_from_process_local_data(every_device, local))


@jax.jit
def _max_replicated(values):
    return jnp.max(values)


class SaveCheckpoints(Hook):
    """A checkpoint when `due(step)` says so (checkpoint.every_steps, every_seconds), and after the
    last step."""

    def __init__(self, due: Callable[[int], bool], save: Callable[[TrainState], Any]):
        self.due, self.save = due, save

    def after_step(self, end: StepEnd) -> None:
        if self.due(end.step):
            self.save(end.state)

    def at_end(self, state: TrainState) -> None:
        self.save(state)


class ProfileCommunication(Hook):
    """training.profile_communication: traces the steps `profile` covers and logs its summary."""

    def __init__(self, profile: CommunicationProfile, say: Callable[[str], None], max_steps: int):
        self.profile, self.say, self.max_steps = profile, say, max_steps

    def before_step(self, step: int) -> None:
        self.profile.before_step(step)

    def after_step(self, end: StepEnd) -> None:
        if report := self.profile.after_step(end.step - 1, end.state, final=end.step == self.max_steps):
            self.say(report)


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
