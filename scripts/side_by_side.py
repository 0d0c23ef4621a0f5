"""What the side-by-side comparisons share (compare_tunix.py, compare_maxtext.py): their common
arguments, benchmark.py run in a fresh process, the rounds that alternate the two sides, and the
report: each side's median tokens/s over the rounds, their ratio, and one JSON line of figures."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

SCRIPTS = Path(__file__).resolve().parent


def add_arguments(parser: argparse.ArgumentParser, steps: int, warmup: int, venv: str) -> None:
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--fsdp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "tunix_train" / venv)
    parser.add_argument("--json", help="also write the rounds and the ratio here")


def run_benchmark(
    python: str, overrides: list[str], steps: int, warmup: int, env: dict, cpu_devices: int | None
) -> dict:
    """scripts/benchmark.py's figures for `overrides`, in a fresh process of `python` (on
    cpu_devices fake CPU devices, or the accelerators when None)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [python, str(SCRIPTS / "benchmark.py"), "--steps", str(steps), "--warmup", str(warmup)]
        if cpu_devices:
            command += ["--cpu-devices", str(cpu_devices)]
        subprocess.run(
            [*command, "--json", out.name, *overrides], check=True, env=env, stdout=subprocess.DEVNULL
        )
        return json.load(open(out.name))


def alternate(rounds: int, sides: dict[str, Callable[[], dict]]) -> list[dict]:
    """`rounds` rounds, each running every side once in turn: per round, each side's tokens/s under
    its name and its other figures as name_figure."""
    results = []
    for i in range(rounds):
        row = {}
        for name, run in sides.items():
            figures = run()
            row[name] = figures.pop("tokens_per_sec")
            row.update({f"{name}_{key}": value for key, value in figures.items()})
        results.append(row)
        print(
            f"round {i + 1}: " + ", ".join(f"{name} {row[name]:,.0f} tokens/s" for name in sides), flush=True
        )
    return results


def report(results: list[dict], ours: str, theirs: str, figures: dict, json_path: str | None) -> None:
    """The medians and their ratio, printed; `figures` with the rounds and the ratio written to
    json_path (if given) and printed as the last line."""
    ours_median = statistics.median(r[ours] for r in results)
    theirs_median = statistics.median(r[theirs] for r in results)
    ratio = ours_median / theirs_median
    print(
        f"median over {len(results)} rounds: {ours} {ours_median:,.0f} tokens/s, {theirs} "
        f"{theirs_median:,.0f} tokens/s, ratio {ratio:.2f}x"
    )
    figures = {**figures, "rounds": results, "ratio": ratio}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(figures, f, indent=1)
    print(json.dumps(figures))
    sys.stdout.flush()
