"""tunix_train against Tunix's PeftTrainer on the same Gemma 3 architecture, batch, sequence and mesh.

    python scripts/compare_tunix.py [--rounds 3] [--steps 10] [--dtype fp32] [--gpu] [--same-xla-flags]

Installs google-tunix from PyPI into its own virtual environment (--venv, never this one), with
the jax and flax versions installed here, then runs the two trainers alternately, each in a fresh
process: scripts/benchmark.py for tunix_train, scripts/tunix_worker.py for Tunix. Both time their
compiled train step after warm-up with the batches already on the devices; the report is the
ratio of median tokens/s over the rounds. Without --gpu both run on --cpu-devices fake CPU devices.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

from tunix_train.config import TrainingConfig
from tunix_train.platform import flags_for

SCRIPTS = Path(__file__).resolve().parent
TUNIX_VERSION = "0.1.7"
# The CPU configuration: a 4-layer Gemma 3 (all layers local in Tunix's 5:1 pattern).
ARCH = {
    "num_layers": 4,
    "embed_dim": 256,
    "hidden_dim": 1024,
    "num_heads": 4,
    "head_dim": 64,
    "num_kv_heads": 4,
    "vocab_size": 4096,
    "sliding_window": 64,
}


def ensure_tunix_venv(venv: Path, gpu: bool) -> Path:
    python = venv / "bin" / "python"
    if python.exists():
        return python
    print(f"installing google-tunix=={TUNIX_VERSION} into {venv} (once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    jax = f"jax[cuda12]=={version('jax')}" if gpu else f"jax=={version('jax')}"
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "-q",
            f"google-tunix=={TUNIX_VERSION}",
            jax,
            f"flax=={version('flax')}",
        ],
        check=True,
    )
    return python


def run_ours(spec: dict, args, env: dict) -> dict:
    overrides = [
        "model=gemma3_small",
        "data=synthetic",
        f"data.seq_len={spec['seq_len']}",
        f"model.mesh_shape=[[{spec['fsdp']},{spec['tp']}],[fsdp,tp]]",
        f"training.micro_batch_size={spec['global_batch'] // spec['fsdp']}",
        f"training.mixed_precision={spec['dtype']}",
        "model.local_layers_per_global=5",
        *(f"model.{k}={v}" for k, v in ARCH.items()),
        *args.ours,
    ]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [
            sys.executable,
            str(SCRIPTS / "benchmark.py"),
            "--steps",
            str(spec["steps"]),
            "--warmup",
            str(spec["warmup"]),
            "--json",
            out.name,
            *overrides,
        ]
        if not args.gpu:
            command[2:2] = ["--cpu-devices", str(spec["fsdp"] * spec["tp"])]
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
        return json.load(open(out.name))


def run_tunix(python: Path, spec: dict, env: dict) -> dict:
    result = subprocess.run(
        [str(python), str(SCRIPTS / "tunix_worker.py"), json.dumps(spec)],
        check=True,
        env=env,
        capture_output=True,
        text=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--fsdp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--gpu", action="store_true", help="run both on the GPUs instead of fake CPU devices")
    parser.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "tunix_train" / "tunix-venv")
    parser.add_argument("--json", help="also write the rounds and the ratio here")
    parser.add_argument(
        "--same-xla-flags",
        action="store_true",
        help="give Tunix the XLA flags tunix_train adds by default (tunix_train/platform.py)",
    )
    parser.add_argument(
        "ours", nargs="*", help="extra hydra overrides for tunix_train (e.g. training.scan_unroll=4)"
    )
    args = parser.parse_args()
    spec = {
        **ARCH,
        "seq_len": args.seq_len,
        "global_batch": args.global_batch,
        "fsdp": args.fsdp,
        "tp": args.tp,
        "dtype": args.dtype,
        "steps": args.steps,
        "warmup": args.warmup,
        "xla_flags": " ".join(flags_for(TrainingConfig())) if args.same_xla_flags else "",
    }
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["JAX_PLATFORMS"] = "cuda" if args.gpu else "cpu"
    python = ensure_tunix_venv(args.venv, args.gpu)
    rounds = []
    for i in range(args.rounds):
        ours, theirs = run_ours(spec, args, env), run_tunix(python, spec, env)
        rounds.append(
            {
                "tunix_train": ours["tokens_per_sec"],
                "tunix": theirs["tokens_per_sec"],
                "tunix_train_compile_s": ours["compile_time_s"],
                "tunix_compile_s": theirs["compile_time_s"],
            }
        )
        print(
            f"round {i + 1}: tunix_train {ours['tokens_per_sec']:,.0f} tokens/s, "
            f"Tunix {theirs['tokens_per_sec']:,.0f} tokens/s",
            flush=True,
        )
    ours_median = statistics.median(r["tunix_train"] for r in rounds)
    theirs_median = statistics.median(r["tunix"] for r in rounds)
    print(
        f"median over {args.rounds} rounds: tunix_train {ours_median:,.0f} tokens/s, Tunix "
        f"{theirs_median:,.0f} "
        f"tokens/s, ratio {ours_median / theirs_median:.2f}x"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "spec": spec,
                    "extra_overrides": args.ours,
                    "rounds": rounds,
                    "ratio": ours_median / theirs_median,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
