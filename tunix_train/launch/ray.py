"""Start a job on a Ray cluster: one training process per worker, each in a placement group bundle.

    python -m tunix_train.launch.ray --num_workers=4 --gpus_per_worker=1 run_training.py <overrides>
    python -m tunix_train.launch.ray --num_workers=2 --cpus_per_worker=1 --cpu_devices_per_worker=2 \\
        --address=127.0.0.1:6379 run_training.py <overrides>

The placement group holds one bundle per worker (--gpus_per_worker GPUs, --cpus_per_worker CPUs),
packed onto few nodes, or one per node with --spread (STRICT_SPREAD). In each bundle a Ray actor
starts the training process with MASTER_ADDR (worker 0's node IP), MASTER_PORT (a free port found on
that node), RANK, WORLD_SIZE and LOCAL_RANK, which launch/distributed.py reads as it reads the local
launcher's, and RAY_ADDRESS (the cluster, for the run's own actors: training.rollout.ray_replicas).
One-GPU workers of a node all see that node's job GPUs (CUDA_VISIBLE_DEVICES) and LOCAL_RANK picks
each one's, as under the local launcher; a worker with several GPUs drives all its
own and gets no LOCAL_RANK (it would pin the process to one). The process runs the command with the
node's own Python in the launcher's working directory, with the launcher's JAX_*, XLA_*, NCCL_* and
PYTHONPATH variables: nodes need the code at the same path, and the run directory on storage they all
see.

Output comes back line by line, prefixed by rank. When a worker fails (a non-zero exit, killed, its
actor or node lost), the others are stopped (SIGTERM, then SIGKILL after --grace_period_s) and the
launcher names the rank and the cause; --max_restarts restarts the whole job from its last
checkpoint (restart.py). SIGTERM and SIGINT to the launcher are passed on to every worker.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from tunix_train import exit_codes
from tunix_train.config import ConfigError
from tunix_train.cpu_devices import cpu_devices_env
from tunix_train.launch import restart

FORWARDED_ENV = ("JAX_", "XLA_", "NCCL_", "PYTHONPATH")


class Worker:
    """A Ray actor in one bundle: runs the training process and reports its output and its end."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.lines: collections.deque[str] = collections.deque()

    def place(self) -> dict:
        import ray

        return {
            "ip": ray.util.get_node_ip_address(),
            "node": ray.get_runtime_context().get_node_id(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
        }

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def start(self, command: list[str], env: dict[str, str], cwd: str) -> int:
        self.proc = subprocess.Popen(
            command,
            env={**os.environ, **env},
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        return self.proc.pid

    def _read(self) -> None:
        for line in iter(self.proc.stdout.readline, ""):
            self.lines.append(line)

    def poll(self) -> tuple[list[str], int | None]:
        """(the output lines since the last poll, the exit code or None while running)."""
        code = self.proc.poll()
        if code is not None:
            self.reader.join(timeout=5)  # its last lines
        lines = [self.lines.popleft() for _ in range(len(self.lines))]
        return lines, code

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signum)

    def stop(self, grace_period_s: float) -> int | None:
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(grace_period_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num_workers", type=int, required=True, help="training processes, one per bundle")
    parser.add_argument("--gpus_per_worker", type=int, default=0)
    parser.add_argument("--cpus_per_worker", type=float, default=1.0)
    parser.add_argument(
        "--cpu_devices_per_worker",
        type=int,
        default=None,
        help="K fake CPU devices per worker (JAX on CPU), for tests and trials",
    )
    parser.add_argument(
        "--address", default="auto", help="the Ray cluster (default: the one this node is in)"
    )
    parser.add_argument(
        "--spread", action="store_true", help="one worker per node (STRICT_SPREAD); default PACK"
    )
    parser.add_argument("--placement_timeout_s", type=float, default=300.0)
    restart.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.num_workers < 1 or args.gpus_per_worker < 0 or args.cpus_per_worker <= 0:
        parser.error("need --num_workers >= 1, --gpus_per_worker >= 0 and --cpus_per_worker > 0")
    if args.gpus_per_worker and args.cpu_devices_per_worker:
        parser.error("--cpu_devices_per_worker is for CPU workers: leave it out with --gpus_per_worker")
    try:
        import ray
    except ImportError:
        print(
            "tunix_train.launch.ray: error: Ray is not installed: pip install -e '.[ray]' "
            "(or pip install 'ray>=2.40')",
            file=sys.stderr,
        )
        return exit_codes.CONFIG_ERROR
    try:
        script_args, run_dir = restart.run_directory("" if args.module else args.script, args.args)
        _connect(ray, args.address)
    except ConfigError as err:
        print(f"tunix_train.launch.ray: error: {err}", file=sys.stderr)
        return exit_codes.CONFIG_ERROR
    command = [sys.executable, *(["-m"] if args.module else []), args.script, *script_args]
    job = _Job(ray, args, command)
    signal.signal(signal.SIGTERM, job.forward)
    signal.signal(signal.SIGINT, job.forward)
    try:
        return restart.supervise(
            job.run,
            args.max_restarts,
            args.restart_backoff_s,
            run_dir,
            lambda: job.signalled is not None,
            _say,
        )
    except ConfigError as err:
        print(f"tunix_train.launch.ray: error: {err}", file=sys.stderr)
        return exit_codes.CONFIG_ERROR
    finally:
        ray.shutdown()


def _say(text: str) -> None:
    print(f"[ray] {text}", flush=True)


def _connect(ray, address: str) -> None:
    """ray.init(address), after checking that the cluster's port answers: Ray itself retries an
    unreachable address for many minutes."""
    import logging

    # "auto": RAY_ADDRESS, or this node's cluster
    from ray._private.services import (
        canonicalize_bootstrap_address,
    )

    try:
        target = canonicalize_bootstrap_address(address)
    except (ValueError, ConnectionError):  # "auto" and no cluster: ConnectionError
        target = None
    if target is None:
        raise ConfigError(
            f"no Ray cluster found at --address={address} (for auto: RAY_ADDRESS, or one started "
            f"on this node): start one with `ray start --head`, or pass its host:port"
        )
    host, _, port = target.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
    except OSError as err:
        raise ConfigError(
            f"the Ray cluster at {target} (--address={address}) does not answer: "
            f"{err.strerror or err}; check that its head is running"
        ) from None
    ray.init(address=target, logging_level=logging.WARNING, log_to_driver=False)


class _Job:
    """One start of the job per `run`: a placement group, its actors, their processes; `forward`
    (the launcher's signal handler) notes a signal, which the polling loop passes on."""

    def __init__(self, ray, args, command: list[str]):
        self.ray, self.args, self.command = ray, args, command
        self.signalled: int | None = None

    def forward(self, signum, frame) -> None:
        self.signalled = signum

    def run(self) -> restart.Ended:
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, args, n = self.ray, self.args, self.args.num_workers
        bundle = {
            "CPU": args.cpus_per_worker,
            **({"GPU": args.gpus_per_worker} if args.gpus_per_worker else {}),
        }
        group = placement_group([bundle] * n, strategy="STRICT_SPREAD" if args.spread else "PACK")
        actors = []
        try:
            try:
                ray.get(group.ready(), timeout=args.placement_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise ConfigError(
                    f"the cluster did not place {n} bundles of {bundle} "
                    f"({'one per node, ' if args.spread else ''}--placement_timeout_s="
                    f"{args.placement_timeout_s:g}); `ray status` shows what it has"
                ) from None
            actor = ray.remote(Worker)
            actors = [
                actor.options(
                    num_cpus=args.cpus_per_worker,
                    num_gpus=args.gpus_per_worker,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, i),
                ).remote()
                for i in range(n)
            ]
            places = ray.get([a.place.remote() for a in actors])
            port = ray.get(actors[0].free_port.remote())
            pids = ray.get(
                [
                    a.start.remote(self.command, self._environment(rank, places, port), os.getcwd())
                    for rank, a in enumerate(actors)
                ]
            )
            for rank, (place, pid) in enumerate(zip(places, pids)):
                gpus = f" with GPUs {','.join(place['gpus'])}" if place["gpus"] else ""
                _say(f"rank {rank}: pid {pid} on {place['ip']}{gpus}")
            return self._watch(actors)
        finally:
            self._stop(actors)
            remove_placement_group(group)

    def _environment(self, rank: int, places: list[dict], port: int) -> dict[str, str]:
        args, place = self.args, places[rank]
        env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV)}
        env.update(
            MASTER_ADDR=places[0]["ip"],
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(len(places)),
            PYTHONUNBUFFERED="1",
            # the cluster, for the run's own actors (training.rollout.ray_replicas: ray.init("auto"))
            RAY_ADDRESS=self.ray.get_runtime_context().gcs_address,
        )
        same_node = [r for r, p in enumerate(places) if p["node"] == place["node"]]
        if args.gpus_per_worker == 1:  # the node's job GPUs, LOCAL_RANK the index of this worker's
            node_gpus = sorted({g for r in same_node for g in places[r]["gpus"]}, key=int)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus)
            env["LOCAL_RANK"] = str(node_gpus.index(place["gpus"][0]))
        elif not args.gpus_per_worker:
            env["LOCAL_RANK"] = str(same_node.index(rank))
            if args.cpu_devices_per_worker:
                env = cpu_devices_env(args.cpu_devices_per_worker, env)
        return env

    def _watch(self, actors) -> restart.Ended:
        """Streams the workers' output until all have ended or one fails; says which and why."""
        ray, done, forwarded = self.ray, {}, None
        while True:
            if self.signalled is not None and forwarded is None:
                forwarded = self.signalled
                _say(f"{signal.Signals(forwarded).name}: passing it on to every worker")
                for a in actors:
                    a.signal.remote(forwarded)
            polls = [a.poll.remote() for a in actors]
            for rank, ref in enumerate(polls):
                if rank in done:
                    continue
                try:
                    lines, code = ray.get(ref, timeout=60)
                except ray.exceptions.RayError as err:
                    first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
                    ended = restart.Ended(exit_codes.FAILED, rank, f"lost (its actor or node died: {first})")
                    _say(f"rank {rank} {ended.cause}; stopping the others")
                    return ended
                for line in lines:
                    sys.stdout.write(f"[{rank}] {line}")
                sys.stdout.flush()
                if code is not None:
                    done[rank] = code
                    if code != 0 and forwarded is None:
                        ended = restart.Ended.exited(rank, code)
                        _say(f"rank {rank} {ended.cause}; stopping the others")
                        return ended
            if len(done) == len(actors):  # after a signal each stops by itself: no deadline but the sender's
                return restart.first_failure(done)
            time.sleep(0.2)

    def _stop(self, actors) -> None:
        ray = self.ray
        stops = [a.stop.remote(self.args.grace_period_s) for a in actors]
        for ref in stops:
            try:
                ray.get(ref, timeout=self.args.grace_period_s + 30)
            except ray.exceptions.RayError:
                pass  # its actor or node is gone, and the process with it
        for a in actors:
            ray.kill(a)


if __name__ == "__main__":
    sys.exit(main())
