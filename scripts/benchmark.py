"""Train-step benchmark: throughput, step-time spread, compile time, MFU, memory and communication.

    python scripts/benchmark.py [--steps 20] [--warmup 3] [--cpu-devices 4] [--json out.json] overrides...

Runs the config (hydra overrides, as for run_training.py) for --warmup then --steps steps with every
batch already on the devices, timing each step. Before every PEAK_EVERY-th timed step, and after
the last, it times a large matmul on every device at once in the compute dtype for PEAK_SECONDS:
the median of those samples is the machine's measured peak, against which the model's FLOP/s is a
fraction. Sampled side by side with the steps, the ratio does not move when a shared machine speeds
up or slows down. On a machine without accelerators, --cpu-devices N runs on N fake CPU devices
(they share the machine's cores, and so does the peak matmul).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

PEAK_EVERY = 5  # steps between samples of the peak matmul
PEAK_SECONDS = 0.4  # length of each sample


def peak_memory(devices) -> float | None:
    stats = [d.memory_stats() or {} for d in devices]
    peaks = [s["peak_bytes_in_use"] for s in stats if "peak_bytes_in_use" in s]
    return float(max(peaks)) if peaks else None


def benchmark(overrides: list[str], steps: int, warmup: int) -> dict:
    import jax

    from tunix_train.compose import load_config
    from tunix_train.data import Data
    from tunix_train.observe.comms import collective_volume
    from tunix_train.observe.mfu import matmul_sampler, peak_flops_per_device, train_flops_per_token
    from tunix_train.platform import add_flags
    from tunix_train.sharding import to_global_batch
    from tunix_train.train.setup import setup

    cfg, _ = load_config(overrides)
    t = cfg.training
    add_flags(t)  # before setup() starts the backend
    run = setup(cfg)
    devices = list(run.mesh.devices.flat)
    data = Data(cfg)
    batches = data.train_batches(run.micro_batch)
    try:
        with jax.set_mesh(run.mesh):
            device_batches = [to_global_batch(next(batches), run.mesh) for _ in range(min(steps + warmup, 8))]
            state = run.plan.create()
            start = time.perf_counter()
            step = run.step_fn.lower(state, device_batches[0]).compile()
            compile_s = time.perf_counter() - start
            # all devices at once; an accelerator reaches its peak only on a larger matmul (at 2048 an
            # H200 sampled 150 TFLOP/s, under a sixth of its bf16 peak, the launch between calls counting)
            size = 2048 if devices[0].platform == "cpu" else 8192
            peak_matmul = matmul_sampler(t.mixed_precision.value, devices, size=size)
            times, peaks = [], []
            for i in range(warmup + steps):
                if i >= warmup and (i - warmup) % PEAK_EVERY == 0:
                    peaks.append(peak_matmul(PEAK_SECONDS))
                start = time.perf_counter()
                state, metrics = step(state, device_batches[i % len(device_batches)])
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - start)
            peaks.append(peak_matmul(PEAK_SECONDS))
    finally:
        batches.close()
    times = times[warmup:]
    tokens_per_step = t.gradient_accumulation_steps * run.micro_batch * cfg.data.seq_len
    median = statistics.median(times)
    quantiles = statistics.quantiles(times, n=10) if len(times) > 1 else [median] * 9
    tokens_per_sec = tokens_per_step / median
    model_flops = tokens_per_sec * train_flops_per_token(cfg.model, cfg.data.seq_len)
    peak = statistics.median(peaks)
    sheet = peak_flops_per_device(devices[0].device_kind, t.mixed_precision.value)
    memory = step.memory_analysis()
    return {
        "config": overrides,
        "devices": len(devices),
        "device_kind": devices[0].device_kind,
        "mesh": dict(run.mesh.shape),
        "tokens_per_step": tokens_per_step,
        "tokens_per_sec": tokens_per_sec,
        "tokens_per_sec_per_device": tokens_per_sec / len(devices),
        "step_time_s": {"median": median, "p10": quantiles[0], "p90": quantiles[-1]},
        "compile_time_s": compile_s,
        "model_flops_per_sec": model_flops,
        "measured_peak_flops_per_sec": peak,
        "measured_peak_samples": peaks,
        "fraction_of_measured_peak": model_flops / peak,
        "mfu_data_sheet": model_flops / (sheet * len(devices)) if sheet else None,
        "peak_device_memory_bytes": peak_memory(devices),
        "compiled_temp_bytes_per_device": memory.temp_size_in_bytes if memory else None,
        "collective_bytes_per_step": collective_volume(step.as_text()).bytes,
        "loss_after": float(metrics["loss"]),
    }


def table(result: dict) -> str:
    s = result["step_time_s"]
    rows = [
        ("devices", f"{result['devices']} x {result['device_kind']}, mesh {result['mesh']}"),
        (
            "tokens/s",
            f"{result['tokens_per_sec']:,.0f} ({result['tokens_per_sec_per_device']:,.0f} per device)",
        ),
        (
            "step time",
            f"median {s['median'] * 1e3:.1f} ms, p10 {s['p10'] * 1e3:.1f}, p90 {s['p90'] * 1e3:.1f}",
        ),
        ("compile", f"{result['compile_time_s']:.1f} s"),
        ("model FLOP/s", f"{result['model_flops_per_sec'] / 1e9:,.1f} GFLOP/s"),
        (
            "measured peak",
            f"{result['measured_peak_flops_per_sec'] / 1e9:,.1f} GFLOP/s (matmul, all devices; median "
            f"of {len(result['measured_peak_samples'])} samples between steps, "
            f"{min(result['measured_peak_samples']) / 1e9:,.0f} to "
            f"{max(result['measured_peak_samples']) / 1e9:,.0f})",
        ),
        ("of measured peak", f"{result['fraction_of_measured_peak']:.1%}"),
        (
            "MFU (data sheet)",
            "n/a (no table entry)" if result["mfu_data_sheet"] is None else f"{result['mfu_data_sheet']:.1%}",
        ),
        (
            "peak memory",
            "n/a (backend does not report)"
            if result["peak_device_memory_bytes"] is None
            else f"{result['peak_device_memory_bytes'] / 2**30:.2f} GiB per device",
        ),
        (
            "compiled temporaries",
            f"{(result['compiled_temp_bytes_per_device'] or 0) / 2**20:,.1f} MiB per device",
        ),
        (
            "collectives/step",
            ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in result["collective_bytes_per_step"].items() if v)
            or "none",
        ),
    ]
    return "\n".join(f"{name:<22}{value}" for name, value in rows)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cpu-devices", type=int, help="run on this many fake CPU devices")
    parser.add_argument("--json", help="also write the result here")
    args, overrides = parser.parse_known_args()
    if args.cpu_devices:
        from tunix_train.cpu_devices import use_cpu_devices

        use_cpu_devices(args.cpu_devices)
    from tunix_train.config import ConfigError

    try:
        result = benchmark(overrides, args.steps, args.warmup)
    except ConfigError as err:
        print(f"benchmark: error: {err}", file=sys.stderr)
        return 2
    print(table(result))
    print(json.dumps(result))  # a benchmark's last line: its figures
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
