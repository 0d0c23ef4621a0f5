"""Fault tolerance: kill -9 and rerun, SIGTERM, damaged checkpoints, another mesh, nan_policy."""

import errno
import os
import shlex
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import REPO, config, cpu_env, made_once, read_metrics, start_python, train_losses

from tunix_train import exit_codes
from tunix_train.checkpoint import restore_from
from tunix_train.config import ConfigError
from tunix_train.data import Data
from tunix_train.train.loop import train
from tunix_train.train.setup import setup
from tunix_train.train.signals import RunStopped

# A tiny model on the bundled corpus, so the data iterator's state is exercised too.
RUN = [
    "model=gemma3_tiny",
    "model.vocab_size=4096",
    "data.seq_len=64",
    "training.max_steps=12",
    "training.log_every=1",
    "training.eval_every=6",
    "checkpoint.every_steps=3",
    "checkpoint.keep=10",
]


def _start(run_dir, *extra):
    mesh = 'model.mesh_shape=[[2],["fsdp"]]'
    return start_python(REPO / "run_training.py", *RUN, *extra, mesh, f"hydra.run.dir={run_dir}", devices=2)


def _run(run_dir, *extra):
    proc = _start(run_dir, *extra)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return out


def _wait_for_line(proc, text):
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"{text!r} never printed:\n{''.join(lines)}")


def _saved_arrays(run_dir, step):
    restored = ocp.StandardCheckpointer().restore((run_dir / "checkpoints" / str(step) / "state").resolve())
    return jax.tree.leaves(restored)


def _assert_bit_identical(run_dir, reference_dir, step=12):
    got, want = _saved_arrays(run_dir, step), _saved_arrays(reference_dir, step)
    assert len(got) == len(want) > 10
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run."""
    return made_once(tmp_path_factory, "checkpoint_reference", _run)


# before the first checkpoint (in the slow suite: the rerun starts over) and after it
@pytest.mark.parametrize("kill_after", [pytest.param("step 2/", marks=pytest.mark.slow), "step 7/"])
def test_kill_9_then_rerun_gives_bit_identical_parameters(tmp_path, reference, kill_after):
    proc = _start(tmp_path)
    _wait_for_line(proc, kill_after)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    out = _run(tmp_path)
    assert "resumed from" in out or kill_after == "step 2/"  # before the first checkpoint: starts over
    _assert_bit_identical(tmp_path, reference)
    # Losses after the restart equal the uninterrupted run's, bit for bit.
    ref = {m["step"]: m["loss"] for m in read_metrics(reference) if "loss" in m}
    assert all(m["loss"] == ref[m["step"]] for m in read_metrics(tmp_path) if "loss" in m)


@pytest.mark.slow
def test_sigterm_saves_the_current_step_and_the_rerun_continues(tmp_path, reference):
    proc = _start(tmp_path)
    _wait_for_line(proc, "step 4/")
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == exit_codes.PREEMPTED == 75, rest  # preempted: a launcher restarts it
    last = rest.strip().splitlines()[-1]
    assert last.startswith("tunix_train: SIGTERM: stopped after step") and "checkpoint saved to" in last
    stopped_at = int(last.split("stopped after step ")[1].split(";")[0])
    assert (tmp_path / "checkpoints" / str(stopped_at)).is_dir() and stopped_at % 3  # not a periodic save
    out = _run(tmp_path)
    assert f"at step {stopped_at}" in out
    _assert_bit_identical(tmp_path, reference)


def test_a_damaged_checkpoint_is_skipped_for_the_previous_one(tmp_path, reference):
    shutil.copytree(reference, tmp_path / "run")
    run_dir = tmp_path / "run"
    for path in (run_dir / "checkpoints" / "12" / "state").rglob("*"):
        if path.is_file() and path.stat().st_size > 0 and "ocdbt" in str(path):
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # a save cut midway
    out = _run(run_dir)
    assert f"warning: checkpoint {(run_dir / 'checkpoints' / '12').resolve()} is damaged (" in out
    assert f"skipped, and kept as {(run_dir / 'checkpoints' / 'unreadable-12').resolve()}" in out
    assert "resumed from" in out and "at step 9" in out
    assert (run_dir / "checkpoints" / "unreadable-12" / "state").is_dir()  # kept as it was
    _assert_bit_identical(run_dir, reference)


def _cut_every_checkpoint(run_dir):
    for path in (run_dir / "checkpoints").rglob("*"):
        if path.is_file() and path.stat().st_size > 0 and "ocdbt" in str(path):
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_a_folder_of_unreadable_checkpoints_is_refused_rather_than_started_over(tmp_path, reference):
    shutil.copytree(reference, tmp_path / "run")
    run_dir = tmp_path / "run"
    _cut_every_checkpoint(run_dir)
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    proc = _start(run_dir)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == exit_codes.CONFIG_ERROR, out
    # no traceback of the reads the failed restores left in flight (checkpoint._drop_reads_left_in_flight)
    assert not any(noise in out for noise in ("Traceback", "never retrieved", "never awaited")), out
    [line] = [line for line in out.splitlines() if line.startswith("tunix_train: error:")]
    assert "holds checkpoints of which none can be read (steps 3, 6, 9, 12:" in line
    assert "checkpoint.start_over_if_unreadable=true" in line
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before  # untouched


@pytest.mark.slow
def test_start_over_if_unreadable_keeps_them_aside_and_trains_as_a_fresh_run(tmp_path, reference):
    shutil.copytree(reference, tmp_path / "run")
    run_dir = tmp_path / "run"
    _cut_every_checkpoint(run_dir)
    out = _run(run_dir, "checkpoint.start_over_if_unreadable=true")
    assert "initialized from" in out
    assert {p.name for p in (run_dir / "checkpoints").iterdir()} >= {"unreadable-3", "unreadable-12", "12"}
    _assert_bit_identical(run_dir, reference)


def test_the_reads_a_failed_restore_leaves_in_flight_are_dropped_and_nothing_else(
    tmp_path, monkeypatch, caplog
):
    """A tensorstore read that ends after orbax closed its event loop raises "Event loop is closed"
    through sys.unraisablehook, and a failed read's task logs "exception was never retrieved" on
    the asyncio logger: once a checkpoint reader has opened, those are dropped when they name its
    folder; any other unraisable error or asyncio record still comes through."""
    import asyncio
    import gc
    import logging

    import tensorstore as ts

    from tunix_train import checkpoint

    seen = []
    monkeypatch.setattr(
        sys, "unraisablehook", lambda u: seen.append(f"{type(u.exc_value).__name__}: {u.exc_value}")
    )
    checkpoint._reader(tmp_path).close()

    def left_in_flight():
        promise, future = ts.Promise.new()
        loop = asyncio.new_event_loop()

        async def awaiting():
            asyncio.ensure_future(future)
            await asyncio.sleep(0)

        loop.run_until_complete(awaiting())
        loop.close()
        promise.set_result(1)  # its callback calls loop.call_soon_threadsafe on the closed loop

    class Other:
        def __del__(self):
            raise ValueError("another error")

    left_in_flight()
    Other()
    gc.collect()
    assert seen == ["ValueError: another error"]
    asyncio_log = logging.getLogger("asyncio")
    for folder in (tmp_path / "3" / "state", "/elsewhere"):
        error = ValueError(f'DATA_LOSS: Error reading local file "{folder}/manifest.ocdbt"')
        asyncio_log.error(
            "Task exception was never retrieved\nfuture: <Task>", exc_info=(ValueError, error, None)
        )
    assert [r.exc_info[1].args[0] for r in caplog.records if "never retrieved" in r.getMessage()] == [
        'DATA_LOSS: Error reading local file "/elsewhere/manifest.ocdbt"'
    ]


def test_restore_retries_transient_errors_and_skips_damaged_checkpoints(monkeypatch, reference):
    """Reads of the reference's checkpoints (3, 6, 9, 12), failing as told: a timeout once is
    retried and the latest restored; a timeout every time is an error (the checkpoint may be fine),
    never a skip; a damaged latest is skipped for the one before and reported."""
    from tunix_train import checkpoint

    monkeypatch.setattr(checkpoint.time, "sleep", lambda s: None)
    reads = []

    def reading(failures):
        def read(manager, step, target):
            reads.append(step)
            failure = failures.get(step)
            if failure is not None and (
                not isinstance(failure, TimeoutError) or reads.count(step) == 1 or failures.get("always")
            ):
                raise failure
            return f"state {step}"

        return read

    directory = reference / "checkpoints"
    monkeypatch.setattr(checkpoint, "_restore_step", reading({12: TimeoutError("read timed out")}))
    assert checkpoint.restore_latest(directory, None) == ("state 12", {})
    assert reads == [12, 12]
    reads.clear()
    monkeypatch.setattr(checkpoint, "_restore_step", reading({12: TimeoutError("slow disk"), "always": True}))
    with pytest.raises(
        ConfigError, match="could not be read in 3 tries .TimeoutError: slow disk.; it may be intact"
    ):
        checkpoint.restore_latest(directory, None)
    assert reads == [12, 12, 12]
    reads.clear()
    monkeypatch.setattr(
        checkpoint,
        "_restore_step",
        reading({12: ValueError("bad metadata"), 9: OSError(errno.ENOENT, "no such file")}),
    )
    assert checkpoint.restore_latest(directory, None) == (
        "state 6",
        {12: "ValueError: bad metadata", 9: "FileNotFoundError: [Errno 2] no such file"},
    )
    assert reads == [12, 9, 6]


def _state(step, size=4):
    """A small TrainState; size > 4: random weights (which do not compress) of size x size floats."""
    from tunix_train.state import TrainState

    w = jnp.ones(4) if size == 4 else jnp.asarray(np.random.default_rng(0).normal(size=(size, size)))
    return TrainState(jnp.asarray(step, jnp.int32), {"w": w}, {}, jnp.asarray(0, jnp.int32))


def test_a_save_orbax_refuses_is_an_error(tmp_path):
    from tunix_train.checkpoint import Checkpointer
    from tunix_train.config import CheckpointConfig

    state = _state
    first = Checkpointer(tmp_path, CheckpointConfig())
    first.save(state(9), {"iterator": {}})
    first.wait()
    first.close()
    again = Checkpointer(tmp_path, CheckpointConfig())
    assert again.save(state(9), {"iterator": {}}) == 9  # the checkpoint it resumed from: kept, not rewritten
    with pytest.raises(ConfigError, match=r"orbax refused to save step 6 .*\(its latest step is 9\)"):
        again.save(state(6), {"iterator": {}})
    again.close()


def test_another_runs_directory_is_refused(tmp_path, reference):
    before = sorted(p.name for p in (reference / "checkpoints").iterdir())
    proc = _start(reference, "training.seed=1")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "holds a run with training.seed=0, not 1" in out
    assert sorted(p.name for p in (reference / "checkpoints").iterdir()) == before


MESHES = {
    "fsdp4": ([[4, 1], ["fsdp", "tp"]], 4, 2),
    "fsdp2_tp2": ([[2, 2], ["fsdp", "tp"]], 4, 4),
    "fsdp8": ([[8, 1], ["fsdp", "tp"]], 8, 1),
}


def _mesh_run(tmp_path, name, max_steps, *extra):
    mesh_shape, n_devices, micro = MESHES[name]
    cfg = config(
        "training.max_steps=%d" % max_steps,
        "training.log_every=1",
        "checkpoint.every_steps=3",
        f"training.micro_batch_size={micro}",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        *extra,
    )
    cfg.model.mesh_shape = mesh_shape
    run_dir = tmp_path / f"{name}_{max_steps}"
    return train(cfg, run_dir, devices=jax.devices()[:n_devices]), run_dir


@pytest.mark.slow  # four trainings, 24 s
def test_restore_on_another_mesh_and_device_count(tmp_path):
    final, first = _mesh_run(tmp_path, "fsdp4", 3)
    _, continued = _mesh_run(tmp_path, "fsdp4", 6)  # the uninterrupted run
    reference = train_losses(continued)[3:]
    saved = jax.tree.leaves(final)  # the state in memory when the checkpoint was written
    for name in ("fsdp2_tp2", "fsdp8"):  # tp resharding, and another device count
        mesh_shape, n_devices, micro = MESHES[name]
        cfg = config(f"training.micro_batch_size={micro}", "model.num_heads=4", "model.num_kv_heads=2")
        cfg.model.mesh_shape = mesh_shape
        run = setup(cfg, jax.devices()[:n_devices])
        state, _ = restore_from(str(first), run.plan.abstract)
        for a, b in zip(jax.tree.leaves(state), saved):  # identical parameters and optimizer state
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert state.params["embedding_VD"][...].sharding.mesh.shape == dict(zip(*reversed(mesh_shape)))
        _, resumed = _mesh_run(tmp_path, name, 6, f"checkpoint.resume_from={first}")
        np.testing.assert_allclose(train_losses(resumed), reference, rtol=1e-5, err_msg=name)


def test_a_checkpoint_needs_the_same_global_batch(tmp_path):
    _, first = _mesh_run(tmp_path, "fsdp4", 3)
    cfg = config(
        "training.micro_batch_size=1",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        f"checkpoint.resume_from={first}",
    )
    cfg.model.mesh_shape = MESHES["fsdp4"][0]
    with pytest.raises(ConfigError, match="the global batch is the same"):
        train(cfg, tmp_path / "other", devices=jax.devices()[:4])


class _PoisonedBatches:
    """The training batches with a NaN loss weight in batch `bad` (counted from 1)."""

    def __init__(self, batches, bad):
        self._batches, self._bad, self._seen = batches, bad, 0

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self._batches)
        self._seen += 1
        if self._seen == self._bad:
            batch = dict(batch, loss_mask=np.full_like(batch["loss_mask"], np.nan))
        return batch

    def __getattr__(self, name):  # get_state, set_state, close
        return getattr(self._batches, name)


@pytest.fixture
def poison_batch(monkeypatch):
    def poison(bad):
        original = Data.train_batches
        monkeypatch.setattr(
            Data, "train_batches", lambda self, *a, **k: _PoisonedBatches(original(self, *a, **k), bad)
        )

    return poison


EVERY_STEP_SAVED = (
    "training.max_steps=5",
    "training.log_every=1",
    "checkpoint.every_steps=1",
    "checkpoint.keep=10",
)


def test_nan_policy_skip_drops_the_update_and_counts_it(tmp_path, poison_batch):
    poison_batch(3)
    cfg = config(*EVERY_STEP_SAVED, "training.nan_policy=skip")
    state = train(cfg, tmp_path)
    assert int(state.nonfinite_steps) == 1 and int(state.step) == 5
    step = {s: _saved_arrays(tmp_path, s) for s in (2, 3, 4)}
    for a, b in zip(step[2], step[3]):
        if a.ndim:  # parameters and moments unchanged; only counters moved
            np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(step[3], step[4]) if a.ndim)  # training goes on
    metrics = read_metrics(tmp_path)
    assert [m["nonfinite_steps"] for m in metrics if "loss" in m] == [0, 0, 1, 1, 1]
    assert np.isnan([m["loss"] for m in metrics if m["step"] == 3][0])


def test_nan_policy_stop_saves_the_last_good_state_and_fails(tmp_path, poison_batch):
    poison_batch(3)
    cfg = config(*EVERY_STEP_SAVED, "training.nan_policy=stop")
    with pytest.raises(RunStopped, match="non-finite loss or gradient at step 3") as stopped:
        train(cfg, tmp_path)
    assert stopped.value.exit_code != 0
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [1, 2, 3]
    for a, b in zip(_saved_arrays(tmp_path, 2), _saved_arrays(tmp_path, 3)):
        assert np.all(np.isfinite(b))
        if a.ndim:
            np.testing.assert_array_equal(a, b)


def test_a_checkpoint_written_before_frozen_weights_existed_restores(tmp_path):
    """Checkpoints hold the state's fields but its frozen weights; one written when TrainState had
    only those four fields (before LoRA) restores, instead of being skipped as damaged."""
    import flax.struct

    from tunix_train.checkpoint import restore_latest

    @flax.struct.dataclass
    class StateBeforeLoRA:
        step: jax.Array
        params: object
        opt_state: object
        nonfinite_steps: jax.Array

    cfg = config()
    cfg.model.mesh_shape = [[2], ["fsdp"]]
    run = setup(cfg, jax.devices()[:2])
    state = run.plan.create()
    old = StateBeforeLoRA(state.step + 7, state.params, state.opt_state, state.nonfinite_steps)
    manager = ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(create=True))
    manager.save(
        7,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(old), data=ocp.args.JsonSave({"global_micro_batch": 8})
        ),
    )
    manager.wait_until_finished()
    manager.close()
    (restored, data), skipped = restore_latest(tmp_path, run.plan.abstract)
    assert skipped == {} and int(restored.step) == 7 and restored.frozen is None
    assert jax.tree.all(
        jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), restored.params, state.params)
    )


def test_read_errors_are_classified_by_their_whole_chain():
    """orbax wraps tensorstore's errors: the cause decides. Permission and other system errors
    are never damage; only a missing, cut or unparsable record is."""
    from tunix_train.checkpoint import damaged, denied, transient

    def wrapped(cause):
        try:
            try:
                raise cause
            except BaseException as inner:
                raise Exception("Failed to restore the checkpoint") from inner
        except Exception as outer:
            return outer

    cases = {  # error: (denied, transient, damaged)
        "permission, tensorstore's": (wrapped(ValueError("PERMISSION_DENIED: Error opening file")), 1, 0, 0),
        "permission, the OS's": (wrapped(PermissionError(errno.EACCES, "Permission denied")), 1, 0, 0),
        "unavailable": (wrapped(ValueError("UNAVAILABLE: bucket unreachable")), 0, 1, 0),
        "deadline": (wrapped(ValueError("DEADLINE_EXCEEDED: read")), 0, 1, 0),
        "too many files": (wrapped(OSError(errno.EMFILE, "Too many open files")), 0, 0, 0),
        "a runtime error": (wrapped(RuntimeError("something else")), 0, 0, 0),
        "cut": (wrapped(ValueError("DATA_LOSS: Error decoding manifest")), 0, 0, 1),
        "missing": (wrapped(FileNotFoundError(errno.ENOENT, "No such file")), 0, 0, 1),
    }
    for name, (err, *expected) in cases.items():
        assert [denied(err), transient(err), damaged(err)] == [bool(x) for x in expected], name


def _dropped(*command):
    """command run as root without the capabilities that let root read and write any file."""
    if os.geteuid() != 0 or shutil.which("capsh") is None:
        pytest.skip("needs root and capsh to drop root's file capabilities")
    return ["capsh", "--drop=cap_dac_override,cap_dac_read_search", "--", "-c", shlex.join(command)]


@pytest.mark.slow  # two runs of the trainer in subprocesses
@pytest.mark.parametrize("unreadable", ["a folder", "its files"])
def test_an_unreadable_checkpoint_is_an_error_and_nothing_is_renamed_or_deleted(
    tmp_path, reference, unreadable
):
    """Step 12 intact but unreadable (its state folder, or every file of it, without read
    permission, as root without its capabilities): one line naming it, exit 2, every checkpoint
    where it was (none set aside, none deleted by retention)."""
    shutil.copytree(reference, tmp_path / "run")
    run_dir = tmp_path / "run"
    state = run_dir / "checkpoints" / "12" / "state"
    for path in [state] if unreadable == "a folder" else [p for p in state.rglob("*") if p.is_file()]:
        path.chmod(0)
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    command = [sys.executable, str(REPO / "run_training.py"), *RUN, 'model.mesh_shape=[[2],["fsdp"]]']
    proc = subprocess.run(
        _dropped(*command, f"hydra.run.dir={run_dir}", "checkpoint.keep=2"),
        env=cpu_env(2),
        capture_output=True,
        text=True,
        timeout=300,
    )
    state.chmod(0o755)
    assert proc.returncode == exit_codes.CONFIG_ERROR, proc.stdout + proc.stderr
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("tunix_train: error:")]
    assert (
        f"checkpoint {(run_dir / 'checkpoints' / '12').resolve()} cannot be read: permission denied" in line
    )
    assert "nothing was renamed or deleted" in line and "Traceback" not in proc.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before


def _tmpfs(folder, *options):
    """A tmpfs at folder (its options), or a skip where this machine may not mount one."""
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(folder)])
    if mounted.returncode != 0:
        pytest.skip("mounting a tmpfs needs root with CAP_SYS_ADMIN")
    return folder


def test_a_full_disk_a_read_only_folder_and_a_refused_one_are_one_line_each(tmp_path):
    """Saves into a 256 KiB tmpfs (a 1 MiB state), a read-only tmpfs (where a damaged checkpoint
    cannot be set aside either), and a folder this user may not write (as root without its
    capabilities): each a ConfigError naming the folder and the cause."""
    from tunix_train.checkpoint import Checkpointer, set_aside
    from tunix_train.config import CheckpointConfig

    full = _tmpfs(tmp_path / "full", "size=256k")
    try:
        saver = Checkpointer(full / "checkpoints", CheckpointConfig())
        with pytest.raises(ConfigError, match=r"in .*full/checkpoints: no space left on device: free space"):
            saver.save(_state(2, 512), {"iterator": {}})
            saver.wait()
    finally:
        subprocess.run(["umount", "-l", str(full)])
    frozen = _tmpfs(tmp_path / "frozen", "size=1m")
    try:
        (frozen / "checkpoints" / "12").mkdir(parents=True)
        subprocess.run(["mount", "-o", "remount,ro", str(frozen)], check=True)
        with pytest.raises(ConfigError, match=r"cannot open .*frozen/new: the file system is read-only"):
            Checkpointer(frozen / "new", CheckpointConfig())
        with pytest.raises(
            ConfigError, match=r"checkpoints/12 is damaged \(cut\) but cannot be set aside as"
        ):
            set_aside(frozen / "checkpoints", {12: "cut"})
    finally:
        subprocess.run(["umount", "-l", str(frozen)])
    refused = tmp_path / "refused"
    refused.mkdir(mode=0o555)
    script = (
        "from pathlib import Path; from tunix_train.checkpoint import Checkpointer; "
        "from tunix_train.config import CheckpointConfig, ConfigError\n"
        f"try: Checkpointer(Path({str(refused / 'checkpoints')!r}), CheckpointConfig())\n"
        "except ConfigError as err: print(err)"
    )
    said = subprocess.run(
        _dropped(sys.executable, "-c", script), env=cpu_env(1), capture_output=True, text=True
    )
    assert f"cannot open {refused / 'checkpoints'}: permission denied" in said.stdout, (
        said.stdout + said.stderr
    )


def test_retention_pauses_while_a_checkpoint_is_set_aside(tmp_path, monkeypatch):
    """With unreadable-6 beside steps 2 and 4, checkpoint.keep=2 deletes nothing: 2, 4, 8 and 10
    are all kept (a warning says why); without it, keep=2 keeps the last two."""
    from tunix_train import checkpoint
    from tunix_train.checkpoint import Checkpointer
    from tunix_train.config import CheckpointConfig

    warned = []
    monkeypatch.setattr(checkpoint.log, "warning", warned.append)

    def saved(folder, steps):
        saver = Checkpointer(folder, CheckpointConfig(keep=2))
        for step in steps:
            saver.save(_state(step), {"iterator": {}})
            saver.wait()
        saver.close()
        return sorted(p.name for p in folder.iterdir())

    assert saved(tmp_path / "a", [2, 4]) == ["2", "4"]
    shutil.copytree(tmp_path / "a" / "4", tmp_path / "a" / "unreadable-6")  # as set_aside leaves one
    assert saved(tmp_path / "a", [8, 10]) == ["10", "2", "4", "8", "unreadable-6"]
    assert len(warned) == 1 and "unreadable-6): checkpoint.keep=2 is paused" in warned[0]
    assert saved(tmp_path / "b", [2, 4, 8, 10]) == ["10", "8"]
