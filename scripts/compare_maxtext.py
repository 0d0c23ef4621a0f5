"""tunix_train against MaxText's own trainer on the same tiny Llama 3, batch, sequence, mesh and XLA flags.

    python scripts/compare_maxtext.py [--rounds 3] [--remat full|save_matmul_outputs|defaults]
                                       [--fsdp 2 --tp 2]

Installs maxtext from PyPI (MAXTEXT_VERSION, which needs Python 3.12 and jax >= 0.11.1) into its
own virtual environment (--venv, never this one) with the modules its trainer imports, and this
checkout into the same environment, so both sides run on one jax, jaxlib and flax. Then it runs the
two alternately, each in a fresh process on --fsdp x --tp fake CPU devices with the same XLA_FLAGS
(tunix_train's defaults, tunix_train/platform.py): scripts/benchmark.py for tunix_train, and
`python -m maxtext.trainers.pre_train.train` (its synthetic data, no checkpoints) for MaxText.

Like for like: the Llama 3 block of both (RMSNorm, GQA with RoPE, SwiGLU, an output layer of its
own), float32 weights and compute, the same global batch of --global-batch rows of --seq-len
tokens, XLA's dot-product attention, the layers scanned, AdamW, and the same rematerialization
(--remat): full recomputes each layer in the backward pass (our training.remat=full; MaxText's
remat_policy=full, its default); save_matmul_outputs keeps the projections' outputs (ours, our
default; MaxText's remat_policy=minimal, which saves its q/k/v/out and MLP projections' outputs);
defaults runs each side as it comes (ours save_matmul_outputs, MaxText's full): what a user who
sets neither gets, not the same work.
A side's figure is the median step time of its steps after the warm-up: benchmark.py times each
compiled step with the batch on the devices; MaxText's is its own `perf/step_time_seconds`, the
time between consecutive steps of its loop (its synthetic batches are made on the devices). The
ratio is of tokens/s, ours over MaxText's, the median over the rounds. What it does not say:
anything about a GPU or TPU, larger models, or MaxText's other remat policies and kernels.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from side_by_side import add_arguments, alternate, report, run_benchmark

from tunix_train.config import Remat, TrainingConfig
from tunix_train.platform import flags_for

SCRIPTS = Path(__file__).resolve().parent
# --remat -> (our training.remat, MaxText's remat_policy): the same activations kept, or each
# side's default (MaxText's configs/base.yml: remat_policy 'full')
REMAT = {
    Remat.full.value: (Remat.full.value, "full"),
    Remat.save_matmul_outputs.value: (Remat.save_matmul_outputs.value, "minimal"),
    "defaults": (TrainingConfig().remat.value, "full"),
}
REPO = SCRIPTS.parent
MAXTEXT_VERSION = "0.2.5"
JAX_VERSION = "0.11.1"
# What maxtext's trainer imports beyond jax (its wheel declares its requirements only under extras
# that pull TPU and GPU stacks); found by importing maxtext.trainers.pre_train.train.
MAXTEXT_IMPORTS = [
    "flax>=0.12.9,<0.13",
    "optax",
    "orbax-checkpoint",
    "grain",
    "absl-py",
    "etils",
    "omegaconf",
    "pydantic",
    "jinja2",
    "psutil",
    "pyyaml",
    "tensorboardX",
    "sentencepiece",
    "tiktoken",
    "pathwaysutils",
    "jaxtyping",
    "aqtp",
    "qwix",
    "tokamax",
    "huggingface_hub",
    "transformers",
    "drjax",
    "pillow",
    "sympy",
    "ml_collections",
]
# A tiny Llama 3: 4 layers, GQA (4 query heads, 2 key/value heads), SwiGLU, its own output layer.
ARCH = {
    "num_layers": 4,
    "embed_dim": 256,
    "hidden_dim": 1024,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 64,
    "vocab_size": 4096,
}


def python312() -> str:
    """A Python 3.12: $PYTHON312, pyenv's, or python3.12 on the PATH."""
    candidates = [os.environ.get("PYTHON312", "")]
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates += sorted(str(p / "bin" / "python3.12") for p in pyenv_root.glob("3.12*"))
    candidates.append("python3.12")
    for candidate in filter(None, candidates):
        try:
            found = subprocess.run(
                [candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"],
                capture_output=True,
                text=True,
            )
        except OSError:
            continue
        if found.stdout.strip() == "True":
            return candidate
    sys.exit("compare_maxtext: maxtext needs Python 3.12; set PYTHON312=/path/to/python3.12")


def ensure_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if python.exists():
        return python
    print(f"installing maxtext=={MAXTEXT_VERSION} and this checkout into {venv} (once)", flush=True)
    subprocess.run([python312(), "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"maxtext=={MAXTEXT_VERSION}", "--no-deps"], check=True)
    subprocess.run([*pip, f"jax=={JAX_VERSION}", f"jaxlib=={JAX_VERSION}", *MAXTEXT_IMPORTS], check=True)
    subprocess.run([*pip, "-e", str(REPO)], check=True)
    return python


def run_ours(python: Path, spec: dict, env: dict) -> dict:
    overrides = [
        "model=llama_tiny",
        "model.rope_scaling.type=none",  # MaxText's llama2 block: plain RoPE
        "data=synthetic",
        f"data.seq_len={spec['seq_len']}",
        f"model.mesh_shape=[[{spec['fsdp']},{spec['tp']}],[fsdp,tp]]",
        f"training.micro_batch_size={spec['global_batch'] // spec['fsdp']}",
        "training.mixed_precision=fp32",
        f"training.remat={REMAT[spec['remat']][0]}",
        *(f"model.{k}={v}" for k, v in ARCH.items()),
    ]
    figures = run_benchmark(
        str(python), overrides, spec["steps"], spec["warmup"], env, spec["fsdp"] * spec["tp"]
    )
    return {"tokens_per_sec": figures["tokens_per_sec"], "compile_s": figures["compile_time_s"]}


STEP_LINE = re.compile(r"completed step: (\d+), seconds: ([0-9.]+)")


def run_maxtext(python: Path, spec: dict, env: dict, workdir: Path) -> dict:
    base = subprocess.run(
        [str(python), "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    devices = spec["fsdp"] * spec["tp"]
    keys = {
        "run_name": "compare",
        "base_output_directory": str(workdir),
        "hardware": "cpu",
        "skip_jax_distributed_system": "true",
        "dataset_type": "synthetic",
        "enable_checkpointing": "false",
        "enable_tensorboard": "false",
        "steps": spec["warmup"] + spec["steps"],
        "per_device_batch_size": spec["global_batch"] / devices,
        "max_target_length": spec["seq_len"],
        "ici_fsdp_parallelism": spec["fsdp"],
        "ici_tensor_parallelism": spec["tp"],
        "base_num_decoder_layers": ARCH["num_layers"],
        "base_emb_dim": ARCH["embed_dim"],
        "base_mlp_dim": ARCH["hidden_dim"],
        "base_num_query_heads": ARCH["num_heads"],
        "base_num_kv_heads": ARCH["num_kv_heads"],
        "head_dim": ARCH["head_dim"],
        "vocab_size": ARCH["vocab_size"],
        "decoder_block": "llama2",  # MaxText's Llama 3 block (its llama3-8b.yml says so)
        "mlp_activations": '["silu","linear"]',
        "logits_via_embedding": "false",
        "rope_max_timescale": 500_000,
        "normalization_layer_epsilon": 1e-5,
        "dtype": "float32",
        "weight_dtype": "float32",
        "attention": "dot_product",
        "remat_policy": REMAT[spec["remat"]][1],
        "scan_layers": "true",
    }
    result = subprocess.run(
        [
            str(python),
            "-m",
            "maxtext.trainers.pre_train.train",
            os.path.join(base, "configs", "base.yml"),
            *(f"{k}={v}" for k, v in keys.items()),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    log = result.stdout + result.stderr
    times = {int(step): float(s) for step, s in STEP_LINE.findall(log)}
    timed = [times[s] for s in sorted(times) if s >= spec["warmup"]]
    if result.returncode or len(timed) < spec["steps"]:
        sys.exit(f"compare_maxtext: MaxText's run failed (exit {result.returncode}):\n{log[-3000:]}")
    tokens = spec["global_batch"] * spec["seq_len"]
    return {"tokens_per_sec": tokens / statistics.median(timed), "first_step_s": times.get(0)}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser, steps=12, warmup=4, venv="maxtext-venv")
    parser.add_argument("--remat", choices=list(REMAT), default=Remat.full.value)
    args = parser.parse_args()
    spec = {
        "seq_len": args.seq_len,
        "global_batch": args.global_batch,
        "fsdp": args.fsdp,
        "tp": args.tp,
        "steps": args.steps,
        "warmup": args.warmup,
        "remat": args.remat,
    }
    python = ensure_venv(args.venv)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "PYTHONPATH")}
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = " ".join(
        [*flags_for(TrainingConfig()), f"--xla_force_host_platform_device_count={args.fsdp * args.tp}"]
    )
    with tempfile.TemporaryDirectory() as workdir:
        rounds = alternate(
            args.rounds,
            {
                "tunix_train": lambda: run_ours(python, spec, env),
                "maxtext": lambda: run_maxtext(python, spec, env, Path(workdir)),
            },
        )
    figures = {"spec": spec, "arch": ARCH, "maxtext_version": MAXTEXT_VERSION, "jax": JAX_VERSION}
    report(rounds, "tunix_train", "maxtext", figures, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
