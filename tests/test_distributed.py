"""Multi-process runs on one machine: the launcher, 2 processes x 2 fake CPU devices, gloo collectives."""

import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import (
    REPO,
    checkpoint_arrays,
    config,
    cpu_env,
    made_once,
    run_python,
    run_training,
    start_python,
    train_losses,
    wait_until_gone,
)

RUN = [
    "model=gemma3_tiny",
    "data=synthetic",
    "data.seq_len=32",
    "training.max_steps=5",
    "training.log_every=1",
    "training.eval_every=5",
    "checkpoint.every_steps=5",
    "distributed.initialization_timeout_s=60",
]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def _launch(run_dir, *overrides, nprocs=2, timeout=300):
    return run_python(
        "-m",
        "tunix_train.launch",
        f"--nprocs={nprocs}",
        "--cpu_devices_per_process=2",
        str(REPO / "run_training.py"),
        *RUN,
        *overrides,
        f"hydra.run.dir={run_dir}",
        env=ENV,
        timeout=timeout,
    )


def _single(run_dir, *overrides, devices=4):
    return run_training(*RUN, *overrides, f"hydra.run.dir={run_dir}", devices=devices)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    def run(run_dir):
        result = _single(run_dir, 'model.mesh_shape=[[4,1],["fsdp","tp"]]', "training.micro_batch_size=2")
        assert result.returncode == 0, result.stdout + result.stderr

    return made_once(tmp_path_factory, "distributed_one_process", run)


@pytest.mark.parametrize(
    "mesh, micro, extra",
    [
        pytest.param('[[4,1],["fsdp","tp"]]', 2, [], marks=pytest.mark.slow),
        ('[[2,2],["fsdp","tp"]]', 4, []),
        # pipeline stages, and sequence shards, on different processes (the first axis spans them)
        pytest.param(
            '[[2,2],["pp","fsdp"]]', 4, ["training.pipeline_microbatches=2"], marks=pytest.mark.slow
        ),
        pytest.param(
            '[[2,2],["cp","fsdp"]]', 4, ["model.context_parallel_strategy=ring"], marks=pytest.mark.slow
        ),
    ],
)
def test_two_processes_give_the_losses_of_one(tmp_path, one_process, mesh, micro, extra):
    result = _launch(tmp_path, f"model.mesh_shape={mesh}", f"training.micro_batch_size={micro}", *extra)
    assert result.returncode == 0, result.stdout
    assert "[0] " in result.stdout and "process 0 of 2" in result.stdout
    np.testing.assert_allclose(train_losses(tmp_path), train_losses(one_process), rtol=1e-5)
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1  # only process 0 logs
    assert len(list(tmp_path.glob("train.log"))) == 1


@pytest.mark.slow
def test_checkpoints_move_between_one_and_two_processes(tmp_path, one_process):
    """Learning rate 0 after the restore, so a saved state must equal the one it came from bit for bit."""
    frozen = [
        "training.learning_rate=0",
        'model.mesh_shape=[[4,1],["fsdp","tp"]]',
        "training.micro_batch_size=2",
    ]
    two, one = tmp_path / "two", tmp_path / "one"
    result = _launch(two, *frozen, f"checkpoint.resume_from={one_process}", "training.max_steps=6")
    assert result.returncode == 0, result.stdout
    assert "started from checkpoint.resume_from" in result.stdout and "at step 5" in result.stdout
    result = _single(one, *frozen, f"checkpoint.resume_from={two}", "training.max_steps=7")
    assert result.returncode == 0, result.stdout + result.stderr
    written_by_one = checkpoint_arrays(one_process / "checkpoints" / "5")
    written_by_two = checkpoint_arrays(two / "checkpoints" / "6")
    reloaded_by_one = checkpoint_arrays(one / "checkpoints" / "7")
    params = [k for k in written_by_one if "params" in k]
    assert len(params) > 10
    for key in params:
        # 1 -> 2 processes
        np.testing.assert_array_equal(written_by_two[key], written_by_one[key], err_msg=key)
        np.testing.assert_array_equal(reloaded_by_one[key], written_by_two[key], err_msg=key)  # 2 -> 1


def test_tensor_parallelism_must_stay_within_a_host(tmp_path):
    result = _launch(tmp_path, 'model.mesh_shape=[[1,4],["fsdp","tp"]]')
    assert result.returncode == 2
    assert "tp=4 must divide the 2 devices of each host" in result.stdout


@pytest.mark.slow
def test_killing_one_process_stops_the_launcher(tmp_path):
    proc = start_python(
        "-m",
        "tunix_train.launch",
        "--nprocs=2",
        "--cpu_devices_per_process=2",
        "--grace_period_s=5",
        "--max_restarts=0",
        str(REPO / "run_training.py"),
        *RUN,
        "training.max_steps=100000",
        "training.eval_every=0",
        "checkpoint.every_steps=0",
        'model.mesh_shape=[[4,1],["fsdp","tp"]]',
        f"hydra.run.dir={tmp_path}",
        env=ENV,
    )
    for line in proc.stdout:
        if "step 3/" in line:
            break
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(children) == 2
    os.kill(int(children[1]), signal.SIGKILL)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode != 0
    assert "[launch] rank 1 killed by signal SIGKILL; stopping the others" in out
    assert "restart" not in out and not (tmp_path / "restarts.jsonl").exists()  # --max_restarts=0: the end
    assert not wait_until_gone(children)


def test_unreachable_coordinator_is_a_clear_error_not_a_hang(tmp_path):
    env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9", "RANK": "1", "WORLD_SIZE": "2"}
    result = run_training(
        *RUN,
        "distributed.initialization_timeout_s=5",
        f"hydra.run.dir={tmp_path / 'run'}",
        env=env,
        timeout=120,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(
        "tunix_train: error: could not reach the coordinator at 127.0.0.1:9 within 5 s"
    )
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_mpi4py_installed_is_not_a_cluster(tmp_path, monkeypatch):
    """JAX detects an mpi4py cluster only when asked for it by name (find_spec("mpi4py") holds
    wherever mpi4py is installed, as on many GPU images); a plain run there is one process."""
    from jax._src.clusters import Mpi4pyCluster

    from tunix_train.config import DistributedConfig
    from tunix_train.launch.distributed import initialize

    (tmp_path / "mpi4py").mkdir()
    (tmp_path / "mpi4py" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert Mpi4pyCluster.is_env_present()
    assert initialize(DistributedConfig()) == "single process"


def test_xla_flags_are_added_and_a_users_own_value_wins(monkeypatch):
    from tunix_train.platform import CPU_MULTI_OUTPUT_FUSION, GPU_DETERMINISTIC, GPU_OVERLAP, add_flags

    monkeypatch.setenv(
        "XLA_FLAGS", "--xla_force_host_platform_device_count=2 --xla_gpu_enable_pipelined_all_gather=false"
    )
    add_flags(config().training)
    flags = os.environ["XLA_FLAGS"].split()
    assert flags[:2] == [
        "--xla_force_host_platform_device_count=2",
        "--xla_gpu_enable_pipelined_all_gather=false",
    ]
    assert sorted(flags[2:]) == sorted(
        [
            *(f for f in GPU_OVERLAP if "pipelined_all_gather" not in f),
            GPU_DETERMINISTIC,
            CPU_MULTI_OUTPUT_FUSION,
        ]
    )
    add_flags(config().training)  # nothing twice
    assert os.environ["XLA_FLAGS"].split() == flags

    monkeypatch.setenv("XLA_FLAGS", "")
    add_flags(
        config(
            "training.xla_gpu_overlap=false",
            "training.xla_cpu_multi_output_fusion=false",
            "training.deterministic=false",
        ).training
    )
    assert os.environ["XLA_FLAGS"] == ""


def test_the_cpu_fusion_flag_reaches_xla():
    # Adam's two moment updates read the same gradient: one loop with two outputs when XLA reads the
    # option, two loops otherwise. An option XLA no longer knows would leave two.
    from tunix_train.platform import CPU_MULTI_OUTPUT_FUSION

    program = (
        "import jax, jax.numpy as jnp; x = jnp.ones((64, 64)); "
        "print(jax.jit(lambda g, m, v: (0.9 * m + 0.1 * g, 0.99 * v + 0.01 * g * g))"
        ".lower(x, x, x).compile().as_text())"
    )

    def fusion_outputs(flags: str) -> list[int]:
        env = cpu_env(1)
        env["XLA_FLAGS"] += f" {flags}"
        hlo = subprocess.run(
            [sys.executable, "-c", program], env=env, capture_output=True, text=True, check=True
        ).stdout
        return [
            line.split("=")[1].count("f32[64,64]")
            for line in hlo.splitlines()
            if " fusion(" in line and "ENTRY" not in line
        ]

    assert fusion_outputs("") == [1, 1]
    assert fusion_outputs(CPU_MULTI_OUTPUT_FUSION) == [2]


def test_the_compilation_cache_is_turned_off_for_collectives_between_cpu_devices():
    # A cached multi-device CPU step deadlocks (docs/performance.md); test_checkpoint's reruns of
    # one 2-device config through the CLI would hang without this.
    from tunix_train.platform import avoid_cache_for_cpu_collectives
    from tunix_train.sharding import make_mesh

    try:
        jax.config.update("jax_enable_compilation_cache", True)
        avoid_cache_for_cpu_collectives(make_mesh([[1], ["fsdp"]], jax.devices()[:1]))
        assert jax.config.jax_enable_compilation_cache  # one device: no collectives, cache kept
        avoid_cache_for_cpu_collectives(make_mesh([[2], ["fsdp"]], jax.devices()[:2]))
        assert not jax.config.jax_enable_compilation_cache
    finally:
        jax.config.update("jax_enable_compilation_cache", False)  # as conftest.py leaves it


def test_freed_cpu_memory_is_reused_without_page_faults(monkeypatch):
    # XLA's CPU temporaries above 32 MiB were mmapped and page-faulted anew every step.
    import ctypes
    import resource

    from tunix_train.platform import keep_freed_memory_on_cpu
    from tunix_train.sharding import make_mesh

    mesh = make_mesh([[1], ["fsdp"]], jax.devices()[:1])
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_count=0")
    assert not keep_freed_memory_on_cpu(mesh)  # the user's own malloc settings win
    monkeypatch.delenv("GLIBC_TUNABLES")
    assert keep_freed_memory_on_cpu(mesh)

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]

    def faults_of_a_48_mib_buffer() -> int:  # malloc as XLA's runtime does; numpy asks for huge pages
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        buffer = libc.malloc(48 << 20)
        ctypes.memset(buffer, 1, 48 << 20)
        libc.free(buffer)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    faults_of_a_48_mib_buffer()  # the heap grows once
    assert faults_of_a_48_mib_buffer() < 1000  # a fresh mapping faults 12,288 pages each time
