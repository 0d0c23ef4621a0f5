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
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from side_by_side import add_arguments, alternate, report, run_benchmark

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
    devices = None if args.gpu else spec["fsdp"] * spec["tp"]
    figures = run_benchmark(sys.executable, overrides, spec["steps"], spec["warmup"], env, devices)
    return {"tokens_per_sec": figures["tokens_per_sec"], "compile_s": figures["compile_time_s"]}


def run_tunix(python: Path, spec: dict, env: dict) -> dict:
    result = subprocess.run(
        [str(python), str(SCRIPTS / "tunix_worker.py"), json.dumps(spec)],
        check=True,
        env=env,
        capture_output=True,
        text=True,
    )
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    return {"tokens_per_sec": figures["tokens_per_sec"], "compile_s": figures["compile_time_s"]}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser, steps=10, warmup=2, venv="tunix-venv")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--gpu", action="store_true", help="run both on the GPUs instead of fake CPU devices")
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
    rounds = alternate(
        args.rounds,
        {"tunix_train": lambda: run_ours(spec, args, env), "tunix": lambda: run_tunix(python, spec, env)},
    )
    report(rounds, "tunix_train", "tunix", {"spec": spec, "extra_overrides": args.ours}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
