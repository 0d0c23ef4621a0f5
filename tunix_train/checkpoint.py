"""Checkpoints with orbax: asynchronous, sharded, resumable on any mesh.

A checkpoint is one step's folder under <run_dir>/checkpoints/ holding `state` (the TrainState:
parameters, optimizer state, step and counters, written by every process for its own shards; not
the frozen weights, which the run rebuilds from where it started) and `data` (the data iterator's
position, and what the frozen weights were, JSON). orbax writes into a temporary folder and renames it
when complete, so an interrupted save never looks like a checkpoint. Restoring tells a transient
error (storage unavailable, a timeout: retried, then an error) from a damaged checkpoint (skipped
for the one before, named in the log, and set aside as unreadable-<step> so that the run's next
saves are not refused); a folder whose every checkpoint is damaged is an error unless
checkpoint.start_over_if_unreadable. A save orbax refuses is an error. The train step uses no
random numbers, so there is no RNG state to keep: initialization comes from training.seed and
data order from the iterator state.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import math
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from tunix_train.config import CheckpointConfig, Config, ConfigError
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
    on_device = tuple(
        None if x.sharding.memory_kind in (None, "device") else x.sharding.with_memory_kind("device")
        for x in leaves
    )
    return bool(_all_finite_leaves(leaves, on_device))


class Checkpointer:
    """Saves every `every_steps` steps or `every_seconds` seconds; keeps the last `keep`."""

    def __init__(self, directory: Path, cfg: CheckpointConfig):
        self.directory, self.cfg = directory.resolve(), cfg
        keep = cfg.keep
        if aside := sorted(p.name for p in self.directory.glob("unreadable-*")):
            keep = None  # an older checkpoint may be all that is left if those prove lost
            log.warning(
                f"warning: {self.directory} holds checkpoints set aside as damaged ({', '.join(aside)}): "
                f"checkpoint.keep={cfg.keep} is paused and every checkpoint is kept until they are removed"
            )
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=True, cleanup_tmp_directories=True, create=True
        )
        with _writing(self.directory, "open"):
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._last_save_time = time.monotonic()
        self._last_saved_step = None

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def due(self, step: int) -> bool:
        c = self.cfg
        return bool(
            (c.every_steps and step % c.every_steps == 0)
            or (c.every_seconds and time.monotonic() - self._last_save_time >= c.every_seconds)
        )

    def save(self, state: TrainState, data_state: dict[str, Any], items: dict[str, Any] | None = None) -> int:
        """Starts an asynchronous save of `state` at its step and of `items` (restore_item's);
        returns the step, once the arrays are copied off the devices (the caller may donate them)."""
        step = int(state.step)
        if step == self._last_saved_step:
            return step  # e.g. the final save right after a periodic one
        if not _all_finite(state.params):
            raise FloatingPointError(f"refusing to write non-finite parameters at step {step}")
        if (
            step in self._manager.all_steps()
        ):  # the checkpoint this run resumed from (damaged ones are set aside)
            return step
        with _writing(self.directory, f"save step {step} (or finish the save before it) in"):
            saved = self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(_saved(state)),
                    data=ocp.args.JsonSave(data_state),
                    **{name: ocp.args.StandardSave(tree) for name, tree in (items or {}).items()},
                ),
            )
        if not saved:
            raise ConfigError(
                f"orbax refused to save step {step} in {self.directory} (its latest step is "
                f"{self._manager.latest_step()}); move the later checkpoints away or use another "
                f"run directory"
            )
        self._last_save_time, self._last_saved_step = time.monotonic(), step
        return step

    def wait(self) -> None:
        with _writing(self.directory, "finish a save in"):
            self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


class _SaidOnce(logging.Filter):
    """Drops orbax's own log records (with tracebacks, from its background threads) of a full disk,
    a read-only folder or a refused permission: _writing and restore_latest say those in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage() + (str(record.exc_info[1]) if record.exc_info else "")
        return not any(sign in text for sign in ("No space left", "Read-only file system", *DENIED_WORDS))


logging.getLogger("absl").addFilter(_SaidOnce())


@contextlib.contextmanager
def _writing(directory: Path, doing: str):
    """A full disk, a read-only folder or a refused permission while writing checkpoints: one line
    naming the folder (not memory advice, which a RESOURCE_EXHAUSTED would otherwise get)."""
    try:
        yield
    except Exception as err:
        numbers = _errnos(err)
        if errno.ENOSPC in numbers or _says(err, ("No space left", "ENOSPC")):
            why = "no space left on device: free space there or set hydra.run.dir on another disk"
        elif errno.EROFS in numbers or _says(err, ("Read-only file system",)):
            why = "the file system is read-only: make it writable or set hydra.run.dir elsewhere"
        elif denied(err):
            why = "permission denied: give this user write access to it"
        else:
            raise
        raise ConfigError(f"cannot {doing} {directory}: {why}") from None


def _saved(state: TrainState) -> dict[str, Any]:
    """What a checkpoint holds of the state: every field but the frozen weights, as a dict (the tree
    that checkpoints written before TrainState had `frozen` hold too)."""
    return {
        "step": state.step,
        "params": state.params,
        "opt_state": state.opt_state,
        "nonfinite_steps": state.nonfinite_steps,
    }


def _restore_step(manager: ocp.CheckpointManager, step: int, target: TrainState):
    """The state (its frozen weights None: the caller rebuilds them) and the data record of one step."""
    restored = manager.restore(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardRestore(_saved(target)), data=ocp.args.JsonRestore()),
    )
    return TrainState(**restored.state), restored.data


def _reader(directory: Path) -> ocp.CheckpointManager:
    _ReadsLeftInFlight.folders.add(str(directory))
    if not getattr(sys.unraisablehook, "drops_reads_left_in_flight", False):
        sys.unraisablehook = _ReadsLeftInFlight.unraisable(sys.unraisablehook)
    return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=False))


class _ReadsLeftInFlight(logging.Filter):
    """A failed restore leaves tensorstore reads in flight: orbax closes their event loop without
    waiting (asyncio_utils._run_sync_via_new_loop), so each, as it ends, raises "Event loop is
    closed" through sys.unraisablehook, and the failed ones log "exception was never retrieved"
    (asyncio), with tracebacks over restore_latest's one line: those alone are dropped."""

    folders: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        named = record.exc_info and any(folder in str(record.exc_info[1]) for folder in self.folders)
        return not (named and "exception was never retrieved" in record.getMessage())

    @staticmethod
    def unraisable(previous):
        def hook(unraisable):
            error, frames = unraisable.exc_value, traceback.extract_tb(unraisable.exc_traceback)
            closed = isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
            if not (closed and any(frame.name == "call_soon_threadsafe" for frame in frames)):
                previous(unraisable)

        hook.drops_reads_left_in_flight = True
        return hook


logging.getLogger("asyncio").addFilter(_ReadsLeftInFlight())
# and the metadata read a failed restore never awaited (orbax's array_metadata_store.Store)
warnings.filterwarnings("ignore", r"coroutine 'Store\._get_array_metadatas' was never", RuntimeWarning)


TRIES = 3  # reads of a checkpoint that fails with a transient error
TRANSIENT_ERRNOS = {errno.EAGAIN, errno.EBUSY, errno.EIO, errno.ETIMEDOUT, errno.ESTALE, errno.ENETDOWN}
TRANSIENT_ERRNOS |= {errno.ENETUNREACH, errno.ECONNRESET, errno.ECONNREFUSED}
# RESOURCE_EXHAUSTED: a bucket's rate limit, on a read (a write's is a full disk: _writing)
TRANSIENT_WORDS = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "Connection reset", "timed out")
DENIED_WORDS = ("PERMISSION_DENIED", "Permission denied", "Operation not permitted")
# what proves a checkpoint's content damaged: a file or a record missing, cut or unparsable
DAMAGE_TYPES = (ValueError, KeyError, TypeError, IndexError, EOFError, FileNotFoundError, NotADirectoryError)
DAMAGE_WORDS = ("NOT_FOUND", "DATA_LOSS", "OUT_OF_RANGE", "INVALID_ARGUMENT", "FAILED_PRECONDITION")


def _chain(err: BaseException) -> list[BaseException]:
    """The error and those it came from (__cause__, __context__), each once."""
    chain, todo = [], [err]
    while todo and len(chain) < 32:
        e = todo.pop(0)
        if e is not None and all(e is not seen for seen in chain):
            chain.append(e)
            todo += [e.__cause__, e.__context__]
    return chain


def _errnos(err: BaseException) -> set[int]:
    return {e.errno for e in _chain(err) if isinstance(e, OSError) and e.errno is not None}


def _says(err: BaseException, words) -> bool:
    return any(word in str(e) for e in _chain(err) for word in words)


def denied(err: BaseException) -> bool:
    """Whether a read or write failed for want of permission, anywhere in the error's chain."""
    return bool(_errnos(err) & {errno.EACCES, errno.EPERM}) or _says(err, DENIED_WORDS)


def transient(err: BaseException) -> bool:
    """Whether an error reading a checkpoint may pass if retried (storage or network), rather than
    say that the checkpoint is damaged; the whole chain is read (orbax wraps tensorstore's)."""
    kinds = (TimeoutError, ConnectionError, InterruptedError, BlockingIOError)
    if any(isinstance(e, kinds) for e in _chain(err)) or _errnos(err) & TRANSIENT_ERRNOS:
        return True
    return _says(err, TRANSIENT_WORDS)


def damaged(err: BaseException) -> bool:
    """Whether a read's error proves the checkpoint's content damaged (a file or record missing,
    cut or unparsable), rather than the storage refusing (permission, a transient error, another
    system error): only then is a checkpoint skipped and set aside."""
    if denied(err) or transient(err) or _errnos(err) - {errno.ENOENT, errno.ENOTDIR}:
        return False
    return any(isinstance(e, DAMAGE_TYPES) for e in _chain(err)) or _says(err, DAMAGE_WORDS)


def _unreadable(folder: Path) -> Path | None:
    """The first folder or file under `folder` (itself included) that this process may not read."""
    try:
        entries = list(os.scandir(folder))
    except PermissionError:
        return folder
    except OSError:
        return None
    for entry in entries:
        path = Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            if blocked := _unreadable(path):
                return blocked
            continue
        try:
            os.close(os.open(path, os.O_RDONLY))
        except PermissionError:
            return path
        except OSError:
            continue
    return None


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"


def _root_line(err: BaseException) -> str:
    """The first line of the innermost error of the chain that says something."""
    said = [e for e in _chain(err) if str(e).strip()]
    return _first_line(said[-1] if said else err)


def _restore_retried(manager: ocp.CheckpointManager, step: int, target, pause_s: float = 1.0):
    for attempt in range(TRIES):
        try:
            return _restore_step(manager, step, target)
        except Exception as err:  # noqa: BLE001 - orbax/tensorstore raise many types
            if denied(err) or not transient(err) or attempt == TRIES - 1:
                raise
            log.warning(
                f"warning: reading checkpoint {step} failed ({_first_line(err)}); retrying "
                f"({attempt + 2}/{TRIES})"
            )
            time.sleep(pause_s * 2**attempt)


def restore_latest(
    directory: Path, target: TrainState
) -> tuple[tuple[TrainState, dict[str, Any]] | None, dict[int, str]]:
    """The newest readable checkpoint in `directory` restored into `target`'s shapes and shardings
    (any mesh), or None; and the damaged ones newer than it (step -> why). A transient error that
    outlasts TRIES reads is a ConfigError: the checkpoint may be fine."""
    directory, found = directory.resolve(), {}
    if not directory.is_dir():
        return None, found
    manager = _reader(directory)
    try:
        for step in sorted(manager.all_steps(), reverse=True):
            try:
                return _restore_retried(manager, step, target), found
            except Exception as err:  # noqa: BLE001 - orbax/tensorstore raise many types for missing or cut files
                where = directory / str(step)
                if denied(err) or (blocked := _unreadable(where)):  # a folder it cannot list looks empty
                    said = _root_line(err) if denied(err) else f"{blocked} cannot be read"
                    raise ConfigError(
                        f"checkpoint {where} cannot be read: permission denied ({said}); nothing was "
                        f"renamed or deleted: give this user read access to it"
                    ) from None
                if transient(err):
                    raise ConfigError(
                        f"checkpoint {where} could not be read in {TRIES} tries "
                        f"({_first_line(err)}); it may be intact: rerun when the storage "
                        f"answers"
                    ) from None
                if not damaged(err):
                    raise ConfigError(
                        f"checkpoint {where} could not be read ({_root_line(err)}), for a reason that does "
                        f"not show it damaged; nothing was renamed or deleted"
                    ) from None
                found[step] = _first_line(err)
        return None, found
    finally:
        manager.close()


def set_aside(directory: Path, damaged: dict[int, str]) -> list[str]:
    """Renames each damaged checkpoint to unreadable-<step> beside the others (kept, and out of
    orbax's way: it refuses to save a step below its latest); a warning for each."""
    warnings = []
    for step, why in sorted(damaged.items()):
        aside = directory / f"unreadable-{step}"
        while aside.exists():
            aside = aside.with_name(aside.name + "-again")
        if jax.process_index() == 0:
            try:
                (directory / str(step)).rename(aside)
            except OSError as err:
                raise ConfigError(
                    f"checkpoint {directory / str(step)} is damaged ({why}) but cannot be set aside as "
                    f"{aside.name} ({err.strerror}): move it out of {directory} or make the folder writable"
                ) from None
        warnings.append(
            f"checkpoint {directory / str(step)} is damaged ({why}): skipped, and kept as {aside}"
        )
    if damaged and jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("tunix_train: damaged checkpoints set aside")
    return warnings


def restore_item(checkpoint: tuple[Path, int], name: str, target: Any) -> Any | None:
    """Item `name` of checkpoint (folder, step) restored into `target`'s shapes and shardings, or
    None where that checkpoint has none (written without it)."""
    directory, step = checkpoint
    if not (directory / str(step) / name).is_dir():
        return None
    manager, args = _reader(directory), ocp.args.Composite(**{name: ocp.args.StandardRestore(target)})
    try:
        return manager.restore(step, args=args)[name]
    except Exception as err:  # noqa: BLE001 - orbax/tensorstore raise many types
        raise ConfigError(f"checkpoint {directory / str(step)}: its {name} ({_root_line(err)})") from None
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
        restored = manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True
                ),
                data=ocp.args.JsonRestore(),
            ),
        )
        return restored.state["params"], restored.data
    finally:
        manager.close()


def restore_from(path: str, target: TrainState) -> tuple[TrainState, dict[str, Any]]:
    directory, step = resolve_resume_path(path)
    if step is None:
        restored, damaged = restore_latest(directory, target)
        for step_, why in sorted(damaged.items()):  # another run's folder: named, not touched
            log.warning(f"warning: checkpoint {directory / str(step_)} is damaged ({why}), skipping it")
        if restored is None:
            raise ConfigError(f"checkpoint.resume_from: no complete checkpoint under {directory}")
        return restored
    manager = _reader(directory)
    try:
        return _restore_step(manager, step, target)
    except Exception as err:
        raise ConfigError(
            f"checkpoint.resume_from: cannot restore {directory / str(step)} ({_root_line(err)})"
        ) from None
    finally:
        manager.close()


# The frozen weights a checkpoint leaves out (LoRA's base, a reference model): where they came from
# and a checksum, so that a resumed run or a loaded checkpoint rebuilds the same ones.


def starting_point(cfg: Config) -> str:
    """Where a run without a checkpoint starts, and its frozen weights always come from."""
    return (
        f"model.init_from={cfg.model.init_from}"
        if cfg.model.init_from
        else f"training.seed={cfg.training.seed}"
    )


def frozen_as_recorded(cfg: Config, record: dict[str, Any] | None, rebuild: Callable[[], Any]):
    """The frozen weights rebuilt from where the run started (by `rebuild`), checked against the
    checkpoint's record."""
    if record is None:
        raise ConfigError(
            "the checkpoint holds no frozen weights' record (it was written without LoRA or a "
            "reference model): to start LoRA, DPO or GRPO from it, export it with "
            "`python -m tunix_train.export CHECKPOINT DIR` and set model.init_from=DIR"
        )
    source = starting_point(cfg)
    if source != record["source"]:
        raise ConfigError(
            f"the checkpoint's frozen weights came from {record['source']}, this run's from {source}"
        )
    frozen = rebuild()
    checksum = frozen_checksum(frozen)
    if not math.isclose(checksum, record["checksum"], rel_tol=1e-5):
        raise ConfigError(
            f"the frozen weights from {source} have changed since the checkpoint was written "
            f"(checksum {checksum:.9g}, recorded {record['checksum']:.9g}); restore the original files"
        )
    return frozen


@jax.jit
def _sum_of_magnitudes(tree) -> jax.Array:
    return sum(jnp.sum(jnp.abs(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))


def frozen_checksum(frozen) -> float:
    """A fingerprint of the frozen weights (the sum of their magnitudes), to tell a changed base."""
    return float(_sum_of_magnitudes(frozen))


def frozen_record(cfg: Config, state) -> dict[str, Any] | None:
    """What a checkpoint records of the frozen weights it leaves out: where they came from, their checksum."""
    if state.frozen is None:
        return None
    return {"source": starting_point(cfg), "checksum": frozen_checksum(state.frozen)}
