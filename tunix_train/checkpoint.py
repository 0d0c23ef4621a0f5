"""Checkpoints with orbax: asynchronous, sharded, resumable on any mesh.

A checkpoint is one step's folder under <run_dir>/checkpoints/ holding `state` (the TrainState:
parameters, optimizer state, step and counters, written by every process for its own shards; not
the frozen weights, which the run rebuilds from where it started) and `data` (the data iterator's
position, and what the frozen weights were, JSON). orbax writes into a temporary folder and renames it
when complete, so an interrupted save never looks like a checkpoint; a damaged one is skipped with a
warning when restoring. The train step uses no random numbers, so there is no RNG state to keep:
initialization comes from training.seed and data order from the iterator state.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from tunix_train.config import CheckpointConfig, ConfigError
from tunix_train.state import TrainState

log = logging.getLogger("tunix_train")


@functools.partial(jax.jit, static_argnums=1)
def _all_finite_leaves(leaves, on_device) -> jax.Array:
    leaves = [x if s is None else jax.device_put(x, s) for x, s in zip(leaves, on_device)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _all_finite(params) -> bool:
    """Whether every parameter is finite; offloaded ones (in pinned host memory) are read on the
    devices, where computations run."""
    leaves = jax.tree.leaves(params)
    on_device = tuple(None if x.sharding.memory_kind in (None, "device") else x.sharding.with_memory_kind("device")
                      for x in leaves)
    return bool(_all_finite_leaves(leaves, on_device))


class Checkpointer:
    """Saves every `every_steps` steps or `every_seconds` seconds; keeps the last `keep`."""

    def __init__(self, directory: Path, cfg: CheckpointConfig):
        self.directory, self.cfg = directory.resolve(), cfg
        options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, enable_async_checkpointing=True,
                                               cleanup_tmp_directories=True, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._last_save_time = time.monotonic()
        self._last_saved_step = None

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def due(self, step: int) -> bool:
        c = self.cfg
        return bool((c.every_steps and step % c.every_steps == 0)
                    or (c.every_seconds and time.monotonic() - self._last_save_time >= c.every_seconds))

    def save(self, state: TrainState, data_state: dict[str, Any]) -> int:
        """Starts an asynchronous save of `state` at its step; returns the step. Returns once the
        arrays are copied off the devices, so the caller may donate them to the next step."""
        step = int(state.step)
        if step == self._last_saved_step:
            return step  # e.g. the final save right after a periodic one
        if not _all_finite(state.params):
            raise FloatingPointError(f"refusing to write non-finite parameters at step {step}")
        if step in self._manager.all_steps():  # only a damaged one, skipped when this run resumed
            log.warning(f"warning: replacing the damaged checkpoint {self.directory / str(step)}")
            self._manager.delete(step)
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_saved(state)),
                                                         data=ocp.args.JsonSave(data_state)))
        self._last_save_time, self._last_saved_step = time.monotonic(), step
        return step

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


def _saved(state: TrainState) -> dict[str, Any]:
    """What a checkpoint holds of the state: every field but the frozen weights, as a dict (the tree
    that checkpoints written before TrainState had `frozen` hold too)."""
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state,
            "nonfinite_steps": state.nonfinite_steps}


def _restore_step(manager: ocp.CheckpointManager, step: int, target: TrainState):
    """The state (its frozen weights None: the caller rebuilds them) and the data record of one step."""
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(_saved(target)), data=ocp.args.JsonRestore()))
    return TrainState(**restored.state), restored.data


def _reader(directory: Path) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=False))


def restore_latest(directory: Path, target: TrainState
                   ) -> tuple[tuple[TrainState, dict[str, Any]] | None, list[str]]:
    """The newest complete checkpoint in `directory` restored into `target`'s shapes and shardings
    (any mesh), or None; and a warning for each damaged checkpoint skipped on the way."""
    directory, skipped = directory.resolve(), []
    if not directory.is_dir():
        return None, skipped
    manager = _reader(directory)
    try:
        for step in sorted(manager.all_steps(), reverse=True):
            try:
                return _restore_step(manager, step, target), skipped
            except Exception as err:  # orbax/tensorstore raise many types for missing or cut files
                skipped.append(f"checkpoint {directory / str(step)} is damaged, skipping it "
                               f"({type(err).__name__}: {str(err).splitlines()[0][:200]})")
        return None, skipped
    finally:
        manager.close()


def resolve_resume_path(path: str) -> tuple[Path, int | None]:
    """checkpoint.resume_from -> (checkpoints folder, a specific step or None for the latest)."""
    p = Path(path).expanduser().resolve()
    if (p / "checkpoints").is_dir():
        return p / "checkpoints", None
    if p.is_dir() and p.name.isdigit() and (p / "state").is_dir():
        return p.parent, int(p.name)
    if p.is_dir():
        return p, None
    raise ConfigError(f"checkpoint.resume_from: no checkpoint at {p}")


def restore_params(path: str, target: Any) -> tuple[Any, dict[str, Any]]:
    """The parameters alone (`target`: the abstract trainable parameters) and the data record of a
    checkpoint (a run, its checkpoints folder, or one step's): the optimizer state is not read."""
    directory, step = resolve_resume_path(path)
    manager = _reader(directory)
    try:
        step = manager.latest_step() if step is None else step
        if step is None:
            raise ConfigError(f"{path}: no checkpoint under {directory}")
        item = {"params": target}
        restored = manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                                         partial_restore=True),
            data=ocp.args.JsonRestore()))
        return restored.state["params"], restored.data
    finally:
        manager.close()


def restore_from(path: str, target: TrainState) -> tuple[TrainState, dict[str, Any]]:
    directory, step = resolve_resume_path(path)
    if step is None:
        restored, skipped = restore_latest(directory, target)
        for warning in skipped:
            log.warning(f"warning: {warning}")
        if restored is None:
            raise ConfigError(f"checkpoint.resume_from: no complete checkpoint under {directory}")
        return restored
    manager = _reader(directory)
    try:
        return _restore_step(manager, step, target)
    except Exception as err:
        raise ConfigError(f"checkpoint.resume_from: cannot restore {directory / str(step)} "
                          f"({type(err).__name__})") from None
    finally:
        manager.close()
