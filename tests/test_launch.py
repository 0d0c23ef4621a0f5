"""The launchers: jobs of 2 processes x 2 fake CPU devices that restart themselves (--max_restarts)
and stop on preemption, under the local launcher and on a Ray cluster that the Ray tests start on
127.0.0.1 (and stop, by its own process group, at the end)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from conftest import REPO, made_once, read_metrics, run_python, run_training, start_python, wait_until_gone

from tunix_train import exit_codes

# 20 steps of about half a second on this machine: time to kill a worker between two checkpoints
RUN = [
    "model=gemma3_tiny",
    "data=synthetic",
    "data.seq_len=256",
    "training.micro_batch_size=4",
    "training.max_steps=20",
    "training.log_every=1",
    "training.eval_every=0",
    "checkpoint.every_steps=4",
    "checkpoint.keep=10",
    'model.mesh_shape=[[4,1],["fsdp","tp"]]',
    "distributed.initialization_timeout_s=60",
]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def _launcher(run_dir, *flags, overrides=()):
    """The local launcher's arguments after `python`."""
    return [
        "-m",
        "tunix_train.launch",
        "--nprocs=2",
        "--cpu_devices_per_process=2",
        "--grace_period_s=5",
        *flags,
        str(REPO / "run_training.py"),
        *RUN,
        *overrides,
        f"hydra.run.dir={run_dir}",
    ]


def _start(run_dir, *flags, overrides=()):
    return start_python(*_launcher(run_dir, *flags, overrides=overrides), env=ENV)


def losses_by_step(run_dir) -> dict[int, list[float]]:
    losses = {}
    for m in read_metrics(run_dir):
        if "loss" in m:
            losses.setdefault(m["step"], []).append(m["loss"])
    return losses


def _wait_for(proc, text, timeout=300):
    deadline, lines = time.monotonic() + timeout, []
    for line in proc.stdout:
        lines.append(line)
        if text in line:
            return "".join(lines)
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"{text!r} never printed:\n{''.join(lines)}")


def _workers(launcher_pid) -> list[int]:
    return [
        int(p)
        for p in subprocess.run(
            ["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True
        ).stdout.split()
    ]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    def run(run_dir):
        proc = _start(run_dir)
        out = proc.communicate(timeout=600)[0]
        assert proc.returncode == 0, out

    return losses_by_step(made_once(tmp_path_factory, "launch_uninterrupted", run))


def kill_after_checkpoint(proc, run_dir, step: int, pid_of) -> str:
    """Waits until the job's checkpoint at `step` is complete, then SIGKILLs the process
    `pid_of(output so far)` names; returns the job's whole output once it has ended."""
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    while not (run_dir / "checkpoints" / str(step)).is_dir():
        assert proc.poll() is None, "".join(lines)
        time.sleep(0.05)
    os.kill(pid_of("".join(lines)), signal.SIGKILL)
    proc.wait(timeout=600)
    reader.join(timeout=10)
    return "".join(lines)


def assert_restarted_and_same_losses(run_dir, out, uninterrupted, cause):
    """One restart, logged, after the checkpoint at step 8 (at least), and every logged loss (a step
    logged twice, before the failure and after the restart, both times) equals the uninterrupted
    run's, bit for bit."""
    [record] = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert record["failed_rank"] == 1 and record["cause"] == cause and record["restart"] == 1, record
    assert 8 <= record["resumed_step"] < 20
    assert f"resumed from {run_dir / 'checkpoints'} at step {record['resumed_step']}" in out
    assert_same_losses(run_dir, uninterrupted)


def assert_same_losses(run_dir, uninterrupted):
    losses = losses_by_step(run_dir)
    assert sorted(losses) == sorted(uninterrupted) == list(range(1, 21))
    for step in range(1, 21):
        assert all(loss == uninterrupted[step][0] for loss in losses[step]), (
            step,
            losses[step],
            uninterrupted[step],
        )


@pytest.mark.slow
def test_a_killed_worker_restarts_the_job_from_its_checkpoint(tmp_path, uninterrupted):
    proc = _start(tmp_path, "--max_restarts=2", "--restart_backoff_s=1")
    out = kill_after_checkpoint(proc, tmp_path, 8, lambda out: _workers(proc.pid)[1])
    assert proc.returncode == 0, out
    assert "[launch] rank 1 killed by signal SIGKILL; stopping the others" in out
    assert_restarted_and_same_losses(tmp_path, out, uninterrupted, "killed by signal SIGKILL")


@pytest.mark.slow
def test_sigterm_to_the_job_saves_and_exits_preempted_and_the_next_launch_resumes(tmp_path, uninterrupted):
    proc = _start(tmp_path, "--max_restarts=3")
    _wait_for(proc, "step 5/")
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == exit_codes.PREEMPTED, out
    # both processes stopped after the same step (they agree on it), and the job was not restarted
    stops = [line for line in out.splitlines() if "SIGTERM: stopped after step" in line]
    assert (
        len(stops) == 2 and len({line.split("stopped after step ")[1].split(";")[0] for line in stops}) == 1
    ), out
    step = int(stops[0].split("stopped after step ")[1].split(";")[0])
    assert (tmp_path / "checkpoints" / str(step)).is_dir() and not (tmp_path / "restarts.jsonl").exists()
    proc = _start(tmp_path)
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out
    assert f"at step {step}" in out
    assert_same_losses(tmp_path, uninterrupted)


def test_a_config_error_is_not_restarted(tmp_path):
    proc = _start(tmp_path, "--max_restarts=3", "--restart_backoff_s=0", overrides=["training.no_such_key=1"])
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == exit_codes.CONFIG_ERROR == 2, out
    # one start: the first rank to fail is reported once, and no process was started twice (the other
    # rank may be stopped before it prints the error itself)
    assert out.count("unknown config key 'training.no_such_key'") in (1, 2), out
    assert out.count("exited with code 2 (config error)") == 1, out
    assert "restart" not in out and not (tmp_path / "restarts.jsonl").exists()


def test_the_launcher_reports_a_config_error_it_finds_itself_in_one_line(tmp_path):
    """Without hydra.run.dir the launcher composes the config to fix the run directory for every
    start, and so meets a bad key before starting anything."""
    result = run_python(
        "-m",
        "tunix_train.launch",
        "--nprocs=2",
        str(REPO / "run_training.py"),
        "model=gemma3_tiny",
        "training.no_such_key=1",
        cwd=tmp_path,
        env=ENV,
        timeout=60,
    )
    assert result.returncode == exit_codes.CONFIG_ERROR
    assert result.stderr.strip() == (
        "tunix_train.launch: error: unknown config key 'training.no_such_key': "
        "check its spelling against tunix_train/configs/"
    )
    assert result.stdout == "" and not any(tmp_path.iterdir())


def test_the_restart_policy(tmp_path):
    """restart.supervise on a job whose starts end as scripted: what is restarted, what is logged."""
    from tunix_train.launch.restart import Ended, supervise

    def job(*ends):
        ends = iter(ends)
        return lambda: next(ends)

    said = []
    # a failure before the first checkpoint: a restart from scratch, logged with resumed_step null
    assert (
        supervise(
            job(Ended(-9, 1, "killed by signal SIGKILL"), Ended(0)),
            1,
            0,
            tmp_path,
            lambda: False,
            said.append,
        )
        == 0
    )
    (tmp_path / "checkpoints" / "8").mkdir(parents=True)
    (tmp_path / "checkpoints" / "12.orbax-checkpoint-tmp-1").mkdir()  # a save cut short: not complete
    # restarts until max_restarts are spent; the last failure's code (a signal: 1) is the job's
    assert (
        supervise(
            job(
                Ended(1, 0, "exited with code 1"),
                Ended(75, 1, "exited with code 75 (preempted)"),
                Ended(-15, 0, "killed by signal SIGTERM"),
            ),
            2,
            0,
            tmp_path,
            lambda: False,
            said.append,
        )
        == 1
    )
    records = [json.loads(line) for line in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    assert [(r["restart"], r["failed_rank"], r["exit_code"], r["resumed_step"]) for r in records] == [
        (1, 1, -9, None),
        (1, 0, 1, 8),
        (2, 1, 75, 8),
    ]
    assert said[-1] == "rank 0 failed (killed by signal SIGTERM); 2 restarts used, giving up"
    # never restarted: a config error, a non-finite stop, a job the launcher was told to stop
    for code in (2, 3):
        assert supervise(job(Ended(code, 0, "")), 5, 0, tmp_path, lambda: False, said.append) == code
    assert supervise(job(Ended(75, 0, "")), 5, 0, tmp_path, lambda: True, said.append) == 75
    assert len((tmp_path / "restarts.jsonl").read_text().splitlines()) == 3


# Ray ----------------------------------------------------------------------------------------------
# One worker of the parallel suite runs every Ray test: one cluster (the module's fixture) at a time.
RAY_TESTS = pytest.mark.xdist_group("ray")
LOOPBACK = {
    **ENV,
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}  # Ray keeps head, workers and driver on 127.0.0.1


@pytest.fixture(scope="module")
def ray_cluster():
    """A one-node Ray cluster on 127.0.0.1 with 4 CPUs; yields its address."""
    pytest.importorskip("ray", reason="the Ray tests need the ray extra: pip install -e '.[ray]'")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    log = open(os.path.join(temp, "head.log"), "w+")
    head = subprocess.Popen(
        [
            os.path.join(os.path.dirname(sys.executable), "ray"),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--num-cpus=4",
            "--num-gpus=0",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={temp}",
        ],
        env=LOOPBACK,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in open(log.name).read():
            assert head.poll() is None and time.monotonic() < deadline, open(log.name).read()
            time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:  # this head's processes only (its process group), never `ray stop`
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        head.wait()
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _ray_launcher(address, run_dir, *flags, run=RUN):
    return start_python(
        "-m",
        "tunix_train.launch.ray",
        f"--address={address}",
        "--num_workers=2",
        "--cpus_per_worker=1",
        "--cpu_devices_per_worker=2",
        "--grace_period_s=5",
        *flags,
        str(REPO / "run_training.py"),
        *run,
        f"hydra.run.dir={run_dir}",
        env=LOOPBACK,
    )


def _pid_of_rank(out: str, rank: int) -> int:
    line = next(line for line in out.splitlines() if line.startswith(f"[ray] rank {rank}: pid "))
    return int(line.split("pid ")[1].split()[0])


@pytest.mark.slow
@RAY_TESTS
def test_ray_two_workers_give_the_losses_of_one_process(tmp_path, ray_cluster):
    run = [
        *RUN[:-2],
        "training.max_steps=5",
        "data.seq_len=32",
        'model.mesh_shape=[[2,2],["fsdp","tp"]]',
        "distributed.initialization_timeout_s=60",
    ]
    proc = _ray_launcher(ray_cluster, tmp_path / "ray", run=run)
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out
    # both workers on loopback, and the coordinator there too
    for rank in (0, 1):
        assert any(
            line.startswith(f"[ray] rank {rank}: pid ") and line.endswith(" on 127.0.0.1")
            for line in out.splitlines()
        ), out
    assert "process 0 of 2 (from MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE), coordinator 127.0.0.1:" in out
    single = run_training(*run, f"hydra.run.dir={tmp_path / 'one'}", devices=4, timeout=600)
    assert single.returncode == 0, single.stdout + single.stderr
    got, want = losses_by_step(tmp_path / "ray"), losses_by_step(tmp_path / "one")
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5]
    for step in want:
        assert abs(got[step][0] - want[step][0]) <= 1e-6, (step, got[step], want[step])


@pytest.mark.slow
@RAY_TESTS
def test_a_launched_asynchronous_run_finds_its_cluster_for_ray_actor_replicas(tmp_path, ray_cluster):
    """training.rollout.ray_replicas under this launcher: the training process connects to the
    launcher's cluster (RAY_ADDRESS, which ray.init(address="auto") reads), its actor replica starts
    there within the deadline (warmed) beside the local one, and the run finishes its steps."""
    from test_async import _async_run

    run = _async_run(
        tmp_path,
        "training.max_steps=4",
        'training.rollout.mesh_shape=[[1],["fsdp"]]',
        "training.rollout.ray_replicas=1",
        "training.rollout.replica_timeout_s=300",
    )
    proc = start_python(
        "-m",
        "tunix_train.launch.ray",
        f"--address={ray_cluster}",
        "--num_workers=1",
        "--cpu_devices_per_worker=3",  # 2 training, 1 the local replica's
        str(REPO / "run_training.py"),
        *run,
        env=LOOPBACK,
    )
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out
    assert f"training.rollout.ray_replicas=1: engine actors on the Ray cluster at {ray_cluster}" in out
    assert sorted(losses_by_step(tmp_path / "run")) == [1, 2, 3, 4]


@pytest.mark.slow
@RAY_TESTS
def test_ray_killing_a_worker_stops_the_job_and_names_its_rank(tmp_path, ray_cluster):
    proc = _ray_launcher(
        ray_cluster, tmp_path, run=[*RUN, "training.max_steps=100000", "checkpoint.every_steps=0"]
    )
    out = _wait_for(proc, "step 3/")
    victim, other = _pid_of_rank(out, 1), _pid_of_rank(out, 0)
    os.kill(victim, signal.SIGKILL)
    out += proc.communicate(timeout=120)[0]
    assert proc.returncode == exit_codes.FAILED, out
    assert "[ray] rank 1 killed by signal SIGKILL; stopping the others" in out
    assert not wait_until_gone([other])  # rank 0 is gone


@pytest.mark.slow
@RAY_TESTS
def test_ray_a_killed_worker_restarts_the_job_from_its_checkpoint(tmp_path, ray_cluster, uninterrupted):
    proc = _ray_launcher(ray_cluster, tmp_path, "--max_restarts=1", "--restart_backoff_s=1")
    out = kill_after_checkpoint(proc, tmp_path, 8, lambda out: _pid_of_rank(out, 1))
    assert proc.returncode == 0, out
    assert "[ray] rank 1 killed by signal SIGKILL; stopping the others" in out
    assert_restarted_and_same_losses(tmp_path, out, uninterrupted, "killed by signal SIGKILL")


@pytest.mark.slow
@RAY_TESTS
def test_ray_without_a_cluster_is_a_one_line_error(tmp_path):
    pytest.importorskip("ray", reason="the Ray tests need the ray extra: pip install -e '.[ray]'")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    result = run_python(
        "-m",
        "tunix_train.launch.ray",
        f"--address=127.0.0.1:{port}",
        "--num_workers=2",
        str(REPO / "run_training.py"),
        f"hydra.run.dir={tmp_path}",
        env=LOOPBACK,
        timeout=60,
    )
    assert result.returncode == exit_codes.CONFIG_ERROR
    assert result.stderr.strip() == (
        f"tunix_train.launch.ray: error: the Ray cluster at 127.0.0.1:{port} "
        f"(--address=127.0.0.1:{port}) does not answer: Connection refused; "
        "check that its head is running"
    )


@pytest.mark.slow
def test_a_job_that_lost_a_host_resumes_on_fewer_with_the_mesh_adjusted_by_hand(tmp_path):
    """3 workers, one lost: the same run directory restarted on 2, model.mesh_shape and
    micro_batch_size changed by hand so the global batch (6) stays; the launcher guesses nothing."""
    run = [
        "model=gemma3_tiny",
        "data=synthetic",
        "data.seq_len=32",
        "training.log_every=1",
        "training.eval_every=0",
        "distributed.initialization_timeout_s=60",
    ]
    three = [*run, 'model.mesh_shape=[[3],["dp"]]', "training.micro_batch_size=2"]
    two = [*run, 'model.mesh_shape=[[2],["dp"]]', "training.micro_batch_size=3"]

    def launch(nprocs, overrides):
        return run_python(
            "-m",
            "tunix_train.launch",
            f"--nprocs={nprocs}",
            "--cpu_devices_per_process=1",
            str(REPO / "run_training.py"),
            *overrides,
            f"hydra.run.dir={tmp_path / 'job'}",
            env=ENV,
            timeout=600,
        )

    first = launch(3, [*three, "training.max_steps=4"])
    assert first.returncode == 0, first.stdout
    second = launch(2, [*two, "training.max_steps=8"])
    assert second.returncode == 0, second.stdout
    assert f"resumed from {tmp_path / 'job' / 'checkpoints'} at step 4" in second.stdout
    assert "process 0 of 2" in second.stdout
    reference = run_training(
        *three,
        "training.max_steps=8",
        f"hydra.run.dir={tmp_path / 'reference'}",
        devices=3,
        timeout=600,
    )
    assert reference.returncode == 0, reference.stdout + reference.stderr
    got, want = losses_by_step(tmp_path / "job"), losses_by_step(tmp_path / "reference")
    assert sorted(got) == sorted(want) == list(range(1, 9))
    for step in want:
        assert abs(got[step][0] - want[step][0]) <= 1e-5, (step, got[step], want[step])
