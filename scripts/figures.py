"""The measured figures the docs cite: docs/figures.md, written from the benchmarks' own JSON lines.

    python scripts/figures.py run [NAME ...]   # run these benchmarks (default: all) and record them
    python scripts/figures.py write            # docs/figures.md from docs/figures.json
    python scripts/figures.py list             # the benchmarks by name, with their commands

Every benchmark ends with one JSON line of its figures. `run` runs each named benchmark in a fresh
process, keeps that line in docs/figures.json with the command, the date, the commit and the
machine (replacing the benchmark's earlier record), and rewrites docs/figures.md. On an
accelerator, `run --device gpu NAME ...` records under `NAME (gpu)` with the command's CPU flags
dropped. tests/test_docs.py fails when figures.md is not the rendering of figures.json, and when
another doc states a throughput, an MFU or a speed ratio: the docs link here instead.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECORDS = REPO / "docs" / "figures.json"
PAGE = REPO / "docs" / "figures.md"
CPU_ONLY = {"--cpu-devices"}  # flags (with their value) left out on an accelerator

# name: (what it measures, the command after `python`)
BENCHMARKS = {
    "train_step": (
        "The train step: tokens/s, step-time spread, MFU against a matmul peak sampled between steps, "
        "memory and collective bytes (gemma3_small's CPU configuration, fsdp 2 x tp 2).",
        [
            "scripts/benchmark.py",
            "--cpu-devices",
            "4",
            "model=gemma3_small",
            "model.num_kv_heads=4",
            'model.mesh_shape=[[2,2],["fsdp","tp"]]',
            "data=synthetic",
            "data.seq_len=128",
            "training.micro_batch_size=4",
        ],
    ),
    "generate": (
        "Prefill and decode tokens/s of the engine beside transformers' generate on the same weights "
        "(gemma3_270m, random weights, one device).",
        ["scripts/benchmark_generate.py", "--repeats", "2"],
    ),
    "rollout": (
        "Useful tokens/s of static batching against the engine's continuous batching on mixed "
        "lengths, and a GRPO rollout's prefill with and without shared prompt prefixes.",
        ["scripts/benchmark_rollout.py", "--model", "gemma3_tiny"],
    ),
    "serve": (
        "The OpenAI-compatible server: 32 streaming requests at once against 32 one after another.",
        ["scripts/benchmark_serve.py"],
    ),
    "packing": (
        "Padding-free DPO pairs against padded ones: the train step's time per sequence.",
        ["scripts/benchmark_packing.py", "--rounds", "2"],
    ),
    "async_rl": (
        "Asynchronous against synchronous GRPO on long-tailed completions (the tiny model, 2 training "
        "and 2 rollout CPU devices, alternating rounds): completion tokens trained per second and the "
        "final held-out reward.",
        ["scripts/benchmark_async.py"],
    ),
    "speculative": (
        "Speculative decoding against the plain engine, alternating calls: a distilled 2 x 64 draft of "
        "gemma3_small at batch 1 and 8, greedy and sampled; prompt lookup with the real gemma3_270m "
        "(the `examples` extra) on a copying task and on sampled prose; each with k fixed and adaptive; "
        "acceptance, greedy equality, and a round's pieces timed inside a compiled loop (round_parts).",
        ["scripts/benchmark_speculative.py"],
    ),
    "speculative_parts_270m": (
        "A speculative round's pieces with gemma3_270m's random weights (as costly as the real ones) and "
        "a 2 x 64 draft at its vocabulary, timed inside a compiled loop: the speedup of a round keeping "
        "every draft, and the acceptance 1.2 and 1.6 times need.",
        ["scripts/benchmark_speculative.py", "--parts-only", "--parts-model", "gemma3_270m"],
    ),
    "compare_tunix": (
        "tunix_train against Tunix's PeftTrainer, alternating fresh processes: the ratio of median tokens/s.",
        ["scripts/compare_tunix.py", "--rounds", "3"],
    ),
}


def flat(figures, prefix: str = "") -> dict:
    """Scalars by dotted key; a list of records by its index (`runs[0].batch`). Lists of scalars
    (samples, rounds, a config's overrides) are left to the JSON."""
    out = {}
    for key, value in figures.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat(value, f"{name}."))
        elif isinstance(value, list) and all(isinstance(v, dict) for v in value):
            for i, record in enumerate(value):
                out.update(flat(record, f"{name}[{i}]."))
        elif isinstance(value, (int, float, str, bool)) or value is None:
            out[name] = value
    return out


def shown(value) -> str:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, int):
        return f"{value:,}"
    if value == 0 or 1e-3 <= abs(value) < 1e6:
        return f"{value:,.4g}" if abs(value) >= 1000 else f"{value:.4g}"
    return f"{value:.3e}"


def render(records: dict) -> str:
    lines = [
        "# Figures",
        "",
        "Written by `python scripts/figures.py` from the benchmarks' JSON lines (docs/figures.json);",
        "do not edit by hand. Each table is one run of one benchmark, on the machine it names: compare",
        "figures within a table, and across tables only where machine and commit agree. A ratio is",
        "measured side by side in one run; a figure alone says nothing about another machine.",
    ]
    for name in sorted(records):
        record = records[name]
        lines += ["", f"## {name}", "", record["what"], ""]
        lines += [f"    python {' '.join(record['command'])}", ""]
        lines += [f"{record['date']}, commit {record['commit']}, {record['machine']}.", ""]
        lines += ["| figure | value |", "|---|---|"]
        lines += [f"| {key} | {shown(value)} |" for key, value in flat(record["figures"]).items()]
    return "\n".join(lines) + "\n"


def machine(device: str) -> str:
    if device == "gpu":
        import jax

        return f"{jax.device_count()} x {jax.devices()[0].device_kind}"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def run(name: str, device: str) -> dict:
    what, command = BENCHMARKS[name]
    if device == "gpu":
        command = [c for i, c in enumerate(command) if c not in CPU_ONLY and command[i - 1] not in CPU_ONLY]
    print(f"figures: {name}: python {' '.join(command)}", flush=True)
    done = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise SystemExit(f"figures: {name} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return {
        "what": what,
        "command": command,
        "date": datetime.date.today().isoformat(),
        "commit": commit.stdout.strip() or "unknown",
        "machine": machine(device),
        "figures": json.loads(lines[-1]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("action", choices=["run", "write", "list"])
    parser.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    args = parser.parse_args()
    if args.action == "list":
        for name, (what, command) in BENCHMARKS.items():
            print(f"{name}: python {' '.join(command)}\n    {what}")
        return 0
    unknown = sorted(set(args.names) - set(BENCHMARKS))
    if unknown:
        print(f"figures: unknown benchmark {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
        return 2
    records = json.loads(RECORDS.read_text()) if RECORDS.exists() else {}
    for name in args.names or (BENCHMARKS if args.action == "run" else []):
        key = name if args.device == "cpu" else f"{name} (gpu)"
        records[key] = run(name, args.device)
        RECORDS.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
    PAGE.write_text(render(records))
    print(f"figures: {PAGE.relative_to(REPO)} from {len(records)} records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
