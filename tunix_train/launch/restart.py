"""--max_restarts for the launchers (local.py, ray.py): when a worker fails, the whole job is
stopped and started again; it resumes from the run directory's last complete checkpoint, as any
rerun does (bit-identically), or from scratch with the same seed before the first one.

Not restarted (exit_codes.NOT_RESTARTED): success, a config error and a nan_policy=stop ending, which
would fail the same way again, and a job the launcher itself was told to stop (SIGTERM, SIGINT).
Each restart appends a line to <run_dir>/restarts.jsonl: when, the failed rank, the cause, and the
step the job resumes from (the last complete checkpoint; null: from scratch).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tunix_train import exit_codes

RUN_DIR_KEY = "hydra.run.dir="


@dataclass(frozen=True)
class Ended:
    """How one start of the job ended: `exit_code` of the job, and if a worker failed, its rank and
    why, in words."""

    exit_code: int
    failed_rank: int | None = None
    cause: str = ""

    @classmethod
    def exited(cls, rank: int, code: int) -> "Ended":
        return cls(code, rank, describe_exit(code))


def first_failure(codes: dict[int, int]) -> Ended:
    """How a job whose workers have all ended (rank: exit code) ended: as its lowest failed rank, or
    successfully."""
    failed = sorted((rank, code) for rank, code in codes.items() if code)
    return Ended.exited(*failed[0]) if failed else Ended(0)


def add_arguments(parser) -> None:
    """What every launcher takes besides its own flags: how to stop and restart, and the command."""
    parser.add_argument(
        "--grace_period_s",
        type=float,
        default=10.0,
        help="SIGTERM to SIGKILL when stopping the other workers after a failure",
    )
    parser.add_argument(
        "--max_restarts",
        type=int,
        default=0,
        help="restart the whole job this many times after a failure (default 0: none)",
    )
    parser.add_argument("--restart_backoff_s", type=float, default=10.0, help="wait before each restart")
    parser.add_argument("-m", "--module", action="store_true", help="run `script` as a module (python -m)")
    parser.add_argument("script", help="a Python script, e.g. run_training.py, or a module with -m")
    parser.add_argument("args", nargs=argparse.REMAINDER)


def describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by signal {code_name(-code)}"
    return f"exited with code {code}" + {
        exit_codes.PREEMPTED: " (preempted)",
        exit_codes.CONFIG_ERROR: " (config error)",
        exit_codes.NON_FINITE: " (non-finite step)",
    }.get(code, "")


def code_name(signum: int) -> str:
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def job_exit_code(code: int) -> int:
    """A worker's code as the launcher's own: killed by a signal is a plain failure."""
    return exit_codes.FAILED if code < 0 else code


def run_directory(script: str, args: list[str]) -> tuple[list[str], Path | None]:
    """(args, run directory): the job's run directory fixed for every start, so that a restart finds
    the checkpoints. hydra.run.dir when given; for run_training.py without it, the directory its
    config names now (the default is timestamped: each start would get a new one), appended to
    args; None for other scripts (restarts are not logged). Raises ConfigError for a bad config."""
    given = [a[len(RUN_DIR_KEY) :] for a in args if a.startswith(RUN_DIR_KEY)]
    if given:
        return args, Path(given[-1])
    if os.path.basename(script) != "run_training.py":
        return args, None
    from tunix_train.compose import load_config

    run_dir = load_config(args)[1]["run_dir"]
    return [*args, f"{RUN_DIR_KEY}{run_dir}"], Path(run_dir)


def last_checkpoint(run_dir: Path | None) -> int | None:
    """The newest complete checkpoint's step (orbax renames a step's folder to its number when the
    save is complete), or None."""
    folder = run_dir / "checkpoints" if run_dir else None
    steps = (
        [int(p.name) for p in folder.iterdir() if p.name.isdigit() and p.is_dir()]
        if folder and folder.is_dir()
        else []
    )
    return max(steps, default=None)


def supervise(
    start: Callable[[], Ended],
    max_restarts: int,
    backoff_s: float,
    run_dir: Path | None,
    stopping: Callable[[], bool],
    say: Callable[[str], None],
) -> int:
    """Starts the job (`start` runs it to its end) until it succeeds, fails in a way a restart
    cannot mend, is told to stop (`stopping()`), or has been restarted max_restarts times; returns
    the launcher's exit code."""
    restarts = 0
    while True:
        ended = start()
        code = job_exit_code(ended.exit_code)
        if code in exit_codes.NOT_RESTARTED or stopping():
            return code
        if restarts == max_restarts:
            if max_restarts:
                say(
                    f"rank {ended.failed_rank} failed ({ended.cause}); {max_restarts} restarts used, giving "
                    f"up"
                )
            return code
        restarts += 1
        resumed = last_checkpoint(run_dir)
        record = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "restart": restarts,
            "failed_rank": ended.failed_rank,
            "cause": ended.cause,
            "exit_code": ended.exit_code,
            "resumed_step": resumed,
        }
        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            with open(run_dir / "restarts.jsonl", "a", encoding="utf-8") as file:
                file.write(json.dumps(record) + "\n")
        say(
            f"restart {restarts} of {max_restarts} in {backoff_s:g} s: rank {ended.failed_rank} "
            f"{ended.cause}; "
            f"resuming from "
            f"{f'the checkpoint at step {resumed}' if resumed is not None else 'scratch (no checkpoint yet)'}"
        )
        deadline = time.monotonic() + backoff_s
        while time.monotonic() < deadline and not stopping():
            time.sleep(0.1)
        if stopping():
            return code
