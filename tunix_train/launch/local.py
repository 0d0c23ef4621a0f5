"""Start a multi-process run on this machine (and, with --nnodes, on each of several machines).

    python -m tunix_train.launch --nprocs=4 run_training.py <overrides>
    python -m tunix_train.launch --nprocs=2 --cpu_devices_per_process=4 -m tunix_train.launch.devices
    python -m tunix_train.launch --nnodes=2 --node_rank=0 --master_addr=10.0.0.1 --master_port=29500 \\
        --nprocs=8 run_training.py <overrides>            # the same on node 1 with --node_rank=1

Each process gets MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK (launch/distributed.py
reads them). Output lines are prefixed with the rank; SIGTERM and SIGINT are forwarded; when one
process fails, the others are stopped (SIGTERM, then SIGKILL after --grace_period_s) and the launcher
exits with the failed process's code. --cpu_devices_per_process=K gives each process K fake CPU devices.
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, required=True, help="processes on this node")
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node_rank", type=int, default=0)
    parser.add_argument("--master_addr", default="127.0.0.1")
    parser.add_argument("--master_port", type=int, default=None, help="default: a free port (single node only)")
    parser.add_argument("--cpu_devices_per_process", type=int, default=None)
    parser.add_argument("--grace_period_s", type=float, default=10.0)
    parser.add_argument("-m", "--module", action="store_true", help="run `script` as a module (python -m)")
    parser.add_argument("script", help="a Python script, e.g. run_training.py, or a module with -m")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.nnodes > 1 and args.master_port is None:
        parser.error("--master_port is required with --nnodes > 1 (every node must use the same one)")
    if not 0 <= args.node_rank < args.nnodes or args.nprocs < 1:
        parser.error("need --nprocs >= 1 and 0 <= --node_rank < --nnodes")
    port = args.master_port or _free_port()
    world = args.nnodes * args.nprocs

    procs, pumps, lock = [], [], threading.Lock()
    for local_rank in range(args.nprocs):
        rank = args.node_rank * args.nprocs + local_rank
        env = {**os.environ, "MASTER_ADDR": args.master_addr, "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank), "PYTHONUNBUFFERED": "1"}
        if args.cpu_devices_per_process:
            env["JAX_PLATFORMS"] = "cpu"
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                                f" --xla_force_host_platform_device_count={args.cpu_devices_per_process}").strip()
        command = [sys.executable, *(["-m"] if args.module else []), args.script, *args.args]
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        procs.append(proc)
        pumps.append(threading.Thread(target=_pump, args=(proc.stdout, f"[{rank}] ", lock), daemon=True))
        pumps[-1].start()

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)

    exit_code = 0
    while any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.poll() not in (None, 0)]
        if failed:
            exit_code = failed[0].returncode
            rank = args.node_rank * args.nprocs + procs.index(failed[0])
            with lock:
                print(f"[launch] rank {rank} exited with code {exit_code}; stopping the others", flush=True)
            _stop(procs, args.grace_period_s)
            break
        time.sleep(0.1)
    for t in pumps:
        t.join(timeout=5)
    if exit_code == 0:
        exit_code = next((p.returncode for p in procs if p.returncode), 0)
    return 1 if exit_code < 0 else exit_code  # killed by a signal: report a plain failure

