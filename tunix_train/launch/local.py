"""Start a multi-process run on this machine (and, with --nnodes, on each of several machines).

    python -m tunix_train.launch --nprocs=4 run_training.py <overrides>
    python -m tunix_train.launch --nprocs=2 --cpu_devices_per_process=4 -m tunix_train.launch.devices
    python -m tunix_train.launch --nnodes=2 --node_rank=0 --master_addr=10.0.0.1 --master_port=29500 \\
        --nprocs=8 run_training.py <overrides>            # the same on node 1 with --node_rank=1

Each process gets MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK (launch/distributed.py
reads them). Output lines are prefixed with the rank; SIGTERM and SIGINT are forwarded; when one
process fails, the others are stopped (SIGTERM, then SIGKILL after --grace_period_s) and the launcher
exits with the failed process's code. --cpu_devices_per_process=K gives each process K fake CPU devices.
--max_restarts=R restarts the whole job after a failure, from its last checkpoint (restart.py); the
launcher pins the run directory (hydra.run.dir) so that every start finds it.
"""

from __future__ import annotations

import argparse
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, prefix: str, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            sys.stdout.write(f"{prefix}{line}")
            sys.stdout.flush()
    stream.close()


def _stop(procs: list[subprocess.Popen], grace_period_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_period_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nprocs", type=int, required=True, help="processes on this node")
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node_rank", type=int, default=0)
    parser.add_argument("--master_addr", default="127.0.0.1")
    parser.add_argument(
        "--master_port", type=int, default=None, help="default: a free port (single node only)"
    )
    parser.add_argument("--cpu_devices_per_process", type=int, default=None)
    restart.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.nnodes > 1 and args.master_port is None:
        parser.error("--master_port is required with --nnodes > 1 (every node must use the same one)")
    if not 0 <= args.node_rank < args.nnodes or args.nprocs < 1:
        parser.error("need --nprocs >= 1 and 0 <= --node_rank < --nnodes")
    lock = threading.Lock()

    def say(text: str) -> None:
        with lock:
            print(f"[launch] {text}", flush=True)

    try:
        script_args, run_dir = restart.run_directory("" if args.module else args.script, args.args)
    except ConfigError as err:
        print(f"tunix_train.launch: error: {err}", file=sys.stderr)
        return exit_codes.CONFIG_ERROR
    command = [sys.executable, *(["-m"] if args.module else []), args.script, *script_args]
    job = _Job(args, command, lock, say)
    signal.signal(signal.SIGTERM, job.forward)
    signal.signal(signal.SIGINT, job.forward)
    return restart.supervise(
        job.run, args.max_restarts, args.restart_backoff_s, run_dir, lambda: job.signalled is not None, say
    )


class _Job:
    """This node's processes of the job: `run` starts them and waits for their end; `forward`
    passes a signal the launcher got on to them."""

    def __init__(self, args, command: list[str], lock: threading.Lock, say):
        self.args, self.command, self.lock, self.say = args, command, lock, say
        self.procs: list[subprocess.Popen] = []
        self.signalled: int | None = None

    def forward(self, signum, frame) -> None:
        self.signalled = signum
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signum)

    def run(self) -> restart.Ended:
        args = self.args
        port = args.master_port or _free_port()  # a fresh one for each start
        world = args.nnodes * args.nprocs
        self.procs, pumps = [], []
        for local_rank in range(args.nprocs):
            rank = args.node_rank * args.nprocs + local_rank
            env = {
                **os.environ,
                "MASTER_ADDR": args.master_addr,
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(local_rank),
                "PYTHONUNBUFFERED": "1",
            }
            if args.cpu_devices_per_process:
                env = cpu_devices_env(args.cpu_devices_per_process, env)
            proc = subprocess.Popen(
                self.command,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            self.procs.append(proc)
            pumps.append(
                threading.Thread(target=_pump, args=(proc.stdout, f"[{rank}] ", self.lock), daemon=True)
            )
            pumps[-1].start()
        ended = None
        while any(p.poll() is None for p in self.procs):
            failed = [p for p in self.procs if p.poll() not in (None, 0)]
            # after a signal each process stops by itself (saving a checkpoint): no deadline but the sender's
            if failed and ended is None and self.signalled is None:
                rank = args.node_rank * args.nprocs + self.procs.index(failed[0])
                ended = restart.Ended.exited(rank, failed[0].returncode)
                self.say(f"rank {rank} {ended.cause}; stopping the others")
                _stop(self.procs, args.grace_period_s)
            time.sleep(0.1)
        for t in pumps:
            t.join(timeout=5)
        if ended is None:  # every process ended before the loop saw one fail
            ended = restart.first_failure(
                {args.node_rank * args.nprocs + i: p.returncode for i, p in enumerate(self.procs)}
            )
            if ended.failed_rank is not None and self.signalled is None:
                self.say(f"rank {ended.failed_rank} {ended.cause}")
        return ended
