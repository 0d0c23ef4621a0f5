"""jax.distributed initialization: one process per host or per GPU.

Sources, in order:
  1. config: distributed.coordinator_address, distributed.num_processes, distributed.process_id;
  2. the environment variables MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE (and LOCAL_RANK, which
     picks this process's GPU), as torchrun and our launcher (python -m tunix_train.launch) set them;
  3. JAX's own cluster detection: SLURM, Open MPI, Kubernetes and TPU pods (not the opt-in mpi4py);
  4. otherwise a single process.
On CPU, collectives go through gloo so multi-process CPU runs work.
"""

from __future__ import annotations

import os
import socket
import time

from tunix_train.config import ConfigError, DistributedConfig

ENV_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def _detected_cluster() -> str | None:
    """The name of the cluster jax.distributed.initialize() would detect, as it does: the opt-in
    types (mpi4py, present wherever mpi4py is installed) only when asked for by name."""
    from jax._src import clusters

    found = (
        env
        for env in clusters.ClusterEnv._cluster_types
        if not env.opt_in_only_method and env.is_env_present()
    )
    return next((env.__name__ for env in found), None)


def _from_environment() -> dict | None:
    present = [v for v in ENV_VARS if v in os.environ]
    if not present:
        return None
    if len(present) != len(ENV_VARS):
        missing = sorted(set(ENV_VARS) - set(present))
        raise ConfigError(
            f"multi-process environment incomplete: {', '.join(present)} set but not {', '.join(missing)}"
        )
    try:
        args = {
            "coordinator_address": f"{os.environ['MASTER_ADDR']}:{int(os.environ['MASTER_PORT'])}",
            "num_processes": int(os.environ["WORLD_SIZE"]),
            "process_id": int(os.environ["RANK"]),
        }
        if "LOCAL_RANK" in os.environ and _wants_gpu():
            args["local_device_ids"] = [int(os.environ["LOCAL_RANK"])]
    except ValueError as err:
        raise ConfigError(f"MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK must be integers ({err})") from None
    return args


def _wants_gpu() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", "")
    return "cuda" in platforms or "gpu" in platforms or (not platforms and os.path.exists("/dev/nvidia0"))


def _wait_for_coordinator(address: str, timeout_s: float) -> None:
    """A process other than 0 first checks that the coordinator accepts connections: JAX's client
    aborts the whole process, with no Python exception, when it cannot register."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(2.0, timeout_s)):
                return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"could not reach the coordinator at {address} within {timeout_s} s "
                    f"(distributed.initialization_timeout_s): {err.strerror or err}; check "
                    f"MASTER_ADDR/MASTER_PORT (or distributed.coordinator_address) and that "
                    f"process 0 is running"
                ) from None
            time.sleep(0.5)


def initialize(cfg: DistributedConfig) -> str:
    """Initializes jax.distributed when this is one of several processes; says how, in words.

    Must run before anything asks JAX for its devices."""
    import jax

    explicit = [cfg.coordinator_address, cfg.num_processes, cfg.process_id]
    if any(v is not None for v in explicit) and not all(v is not None for v in explicit):
        raise ConfigError(
            "distributed.coordinator_address, num_processes and process_id go together: set all three"
        )
    if all(v is not None for v in explicit):
        args, source = (
            {
                "coordinator_address": cfg.coordinator_address,
                "num_processes": cfg.num_processes,
                "process_id": cfg.process_id,
            },
            "config",
        )
    elif (env := _from_environment()) is not None:
        args, source = env, "MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE"
    elif cluster := _detected_cluster():
        args, source = {}, f"{cluster} detection"
    else:
        return "single process"
    if args.get("num_processes") == 1:
        return "single process"
    if args.get("process_id", 0) != 0:
        _wait_for_coordinator(args["coordinator_address"], cfg.initialization_timeout_s)
    if not (_wants_gpu() or os.environ.get("JAX_PLATFORMS", "").startswith("tpu")):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            **args,
            initialization_timeout=cfg.initialization_timeout_s,
            heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
        )
    except Exception as err:  # XLA raises plain RuntimeError/XlaRuntimeError with multi-line text
        where = args.get("coordinator_address", f"the address {source} gives")
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"could not join the run through the coordinator at {where} within "
            f"{cfg.initialization_timeout_s} s (distributed.initialization_timeout_s): {first}; "
            f"check the address and port and that every process started"
        ) from None
    return (
        f"process {jax.process_index()} of {jax.process_count()} (from {source}), "
        f"coordinator {args.get('coordinator_address', 'detected')}"
    )


def check_devices() -> None:
    """All devices of a run must be of one kind."""
    import jax

    kinds = sorted({d.device_kind for d in jax.devices()})
    if len(kinds) > 1:
        raise ConfigError(f"devices are not homogeneous: {kinds}; run each kind of device as its own job")
