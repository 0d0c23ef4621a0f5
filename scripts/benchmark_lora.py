"""Device memory of LoRA against full fine-tuning, from the planner (the compiled train step on fake
CPU devices; no accelerator needed).

    python scripts/benchmark_lora.py [--model gemma3_1b] [--mesh '[[8],["fsdp"]]'] [--rank 16] [overrides...]
    python scripts/benchmark_lora.py --fit gemma3_1b,gemma3_4b,gemma3_12b,gemma3_27b
    python scripts/benchmark_lora.py --speed gemma3_tiny,gemma3_small [--rounds 3]
    python scripts/benchmark_lora.py --load gemma3_1b

For each of full fine-tuning and LoRA over an fp32, a bf16, an int8 and an nf4 base: per device, the
trainable parameters, the optimizer state, the frozen weights, the compiler's temporaries and the
total, as tunix_train.plan computes them. --fit: each model's LoRA r16 at seq 2048, one row, remat
full, on one device, with each base; whether it fits 24 GB and 80 GB. --speed: LoRA r16 step time
over a bf16, an int8 and an nf4 base, and a gguf base of Q8_0 and of Q4_0 blocks (our GGUF export
of the random model; scripts/benchmark.py's timing; one CPU device, the bases alternating in each
round), medians over rounds and their ratio to the bf16 base's. --load: a LoRA run's start from a
Hugging Face checkpoint of the random model (model.init_from), each base in a process of its own:
its peak resident memory and time. The last line is one JSON object of the figures (GiB; seconds).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/benchmark.py


def _fits(gib: float) -> str:
    """The smallest of a 24 GB and an 80 GB device that holds `gib`, or '-'."""
    return "24" if gib * 2**30 <= 24e9 else "80" if gib * 2**30 <= 80e9 else "-"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="gemma3_1b")
    parser.add_argument("--mesh", default='[[8],["fsdp"]]')
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--speed", default="", help="comma-separated models: step time per base")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fit", default="", help="comma-separated models: the largest that fits one device")
    parser.add_argument("--load", default="", help="a model: the start from its checkpoint, per base")
    parser.add_argument("--start", nargs=2, metavar=("CHECKPOINT", "BASE"), help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="more hydra overrides, e.g. training.micro_batch_size=2")
    args = parser.parse_args()
    import json

    devices = 1 if args.fit or args.speed or args.load or args.start else math.prod(json.loads(args.mesh)[0])
    os.environ["XLA_FLAGS"] = (
        f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from tunix_train.plan import plan

    lora = [f"training.lora.rank={args.rank}", "training.lora.targets=[q,k,v,o,gate,up,down]"]
    bases = {
        "fp32 base": [],
        "bf16 base": ["training.lora.base_dtype=bf16"],
        "int8 base": ["training.lora.base_dtype=bf16", "training.lora.base_quantization=int8"],
        "nf4 base": ["training.lora.base_dtype=bf16", "training.lora.base_quantization=nf4"],
    }
    columns = ["parameters", "optimizer state", "frozen weights", "temporaries (compiler)", "total"]
    if args.start:
        return _start(args.start[0], bases[args.start[1]], lora, args.overrides)
    if args.load:
        return _load(args.load, [name for name in bases if name != "fp32 base"])
    if args.speed:
        return _speed(
            args.speed.split(","), lora, {k: v for k, v in bases.items() if k != "fp32 base"}, args.rounds
        )
    if args.fit:
        return _fit(
            plan, args.fit.split(","), lora, {k: v for k, v in bases.items() if k != "fp32 base"}, columns
        )
    base = [
        f"model={args.model}",
        f"model.mesh_shape={args.mesh}",
        "data=synthetic",
        "data.seq_len=1024",
        "training.micro_batch_size=1",
        "training.mixed_precision=bf16",
        *args.overrides,
    ]
    runs = {
        "full fine-tuning": base,
        **{f"LoRA r{args.rank}, {name}": [*base, *lora, *extra] for name, extra in bases.items()},
    }
    rows = {name: plan(overrides)[0] for name, overrides in runs.items()}
    print(f"{args.model} on {args.mesh}, per device, GiB ({' '.join(base[2:])})\n")
    _table(rows, columns)
    print(
        json.dumps(
            {
                name: {c: round(figures.get(c, 0) / 2**30, 4) for c in columns}
                for name, figures in rows.items()
            }
        )
    )
    return 0


def _table(rows, columns):
    print("| | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name, figures in rows.items():
        print(f"| {name} | " + " | ".join(f"{figures.get(c, 0) / 2**30:.3f}" for c in columns) + " |")


def _random_params(cfg):
    """The model of `cfg`'s parameters as a run from training.seed=0 starts them (no optimizer state)."""
    import jax

    from tunix_train.model.params import model_params
    from tunix_train.model.weights import FULL_FINE_TUNING

    return jax.jit(lambda key: model_params(cfg.model, key, FULL_FINE_TUNING))(jax.random.key(0))


def _random_gguf(overrides, path, dtype):
    """A GGUF file (our exporter's `dtype`) of a random model of `overrides`, with the bundled tokenizer."""
    from tunix_train.compose import load_config
    from tunix_train.data import Data
    from tunix_train.interop import gguf_export

    cfg, _ = load_config([*overrides, "model.mesh_shape=[[1],[fsdp]]"])
    gguf_export.export(_random_params(cfg), cfg.model, Data(cfg).tokenizer, None, path, dtype)
    return path


def _load(model: str, bases: list[str]) -> int:
    """Each base's start from one checkpoint, in a process of its own (its peak RSS is its own)."""
    import json
    import subprocess
    import tempfile

    from tunix_train.compose import load_config
    from tunix_train.interop import hf

    figures = {}
    with tempfile.TemporaryDirectory() as checkpoint:
        cfg, _ = load_config([f"model={model}", "data=synthetic"])
        hf.export(_random_params(cfg), cfg.model, Path(checkpoint))
        for name in bases:
            out = subprocess.run(
                [sys.executable, __file__, "--start", checkpoint, name, f"model={model}"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            figures[name] = json.loads(out.strip().splitlines()[-1])
            print(f"{model}, {name}: {figures[name]}", flush=True)
    print(json.dumps({"model": model, "start": figures}))
    return 0


def _start(checkpoint: str, base: list[str], lora: list[str], overrides: list[str]) -> int:
    """setup and starting_state alone, from `checkpoint`: their time and this process's peak RSS."""
    import json
    import time

    import jax

    from tunix_train.compose import load_config
    from tunix_train.train.setup import setup, starting_state

    cfg, _ = load_config(
        [
            *overrides,
            "model.mesh_shape=[[1],[fsdp]]",
            f"model.init_from={checkpoint}",
            "data=synthetic",
            "data.seq_len=256",
            *lora,
            *base,
        ]
    )
    run = setup(cfg, jax.devices()[:1])
    start = time.perf_counter()
    with jax.set_mesh(run.mesh):
        jax.block_until_ready(starting_state(cfg, run)[0])
    # VmHWM, not ru_maxrss: that one keeps the parent's resident size from before the exec
    peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(
        json.dumps({"start_s": round(time.perf_counter() - start, 2), "peak_rss_gib": round(peak / 2**20, 2)})
    )
    return 0


def _speed(models, lora, bases, rounds) -> int:
    """Median step time per base, the bases alternating within each round."""
    import json
    import statistics
    import tempfile

    from benchmark import benchmark

    times, folder = {}, Path(tempfile.mkdtemp())
    for model in models:
        # nf4's blocks of 64 along head_dim; the bundled 4k tokenizer, which a GGUF file carries
        size = ["model.head_dim=64", "model.vocab_size=4096"] if model == "gemma3_tiny" else []
        size += [
            "model.query_pre_attn_scalar=256",
            "model.local_layers_per_global=5",
        ]  # what a GGUF reader assumes
        common = [
            f"model={model}",
            *size,
            "model.mesh_shape=[[1],[fsdp]]",
            "data.seq_len=256",
            "training.micro_batch_size=4",
            *lora,
        ]
        files = {
            dtype: _random_gguf([f"model={model}", *size], folder / f"{model}-{dtype}.gguf", dtype)
            for dtype in ("q8_0", "q4_0")
        }
        runs = {
            **bases,
            **{
                f"gguf {dtype} base": [
                    "training.lora.base_dtype=bf16",
                    f"model.init_from={path}",
                    "training.lora.base_quantization=gguf",
                ]
                for dtype, path in files.items()
            },
        }
        for _ in range(rounds):
            for name, extra in runs.items():
                step = benchmark([*common, *extra], steps=10, warmup=2)["step_time_s"]["median"]
                times.setdefault(model, {}).setdefault(name, []).append(step)
    medians = {m: {name: statistics.median(ts) for name, ts in by.items()} for m, by in times.items()}
    names = list(next(iter(medians.values())))
    print("| model | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for model, by in medians.items():
        bf16 = by["bf16 base"]
        print(f"| {model} | " + " | ".join(f"{t * 1e3:.1f} ms ({t / bf16:.2f}x)" for t in by.values()) + " |")
    print(json.dumps({"step_s": medians, "rounds": rounds}))
    return 0


def _fit(plan, models, lora, bases, columns) -> int:
    """Each model's LoRA at seq 2048, one row, remat full, on one device, with each base."""
    import json

    fit = [
        "model.mesh_shape=[[1],[fsdp]]",
        "data=synthetic",
        "data.seq_len=2048",
        "training.micro_batch_size=1",
        "training.mixed_precision=bf16",
        "training.remat=full",
        "training.loss_chunk_size=512",
        *lora,
    ]
    rows, totals = {}, {}
    for model in models:
        for name, extra in bases.items():
            figures = plan([f"model={model}", *fit, *extra])[0]
            rows[f"{model}, {name}"] = figures
            totals.setdefault(model, {})[name] = round(figures["total"] / 2**30, 3)
            print(f"{model}, {name}: {figures['total'] / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    print(f"one device, per device, GiB ({' '.join(fit)})\n")
    _table(rows, columns)
    print("\n| base | " + " | ".join(models) + " |")
    print("|---" * (len(models) + 1) + "|")
    for name in bases:
        cells = [f"{totals[m][name]:.1f} ({_fits(totals[m][name])})" for m in models]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(json.dumps({"fit_total_gib": totals}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
