"""Pipeline and context parallelism on 8 fake CPU devices: step time, bubble and memory.

    python scripts/benchmark_parallel.py [--steps 5] [--seq-len 8192] [--only pipeline|context] [--json
    out.json]

Part 1, pp: gemma3_tiny with 8 layers, 64 rows x 128 tokens a step, on fsdp=8, pp=2 x fsdp=4 and
pp=4 x fsdp=2 with M = 4, 8, 16 pipeline micro-batches: the median step time, and the schedule's
idle fraction counted from the schedule itself (idle stage-steps / all stage-steps) beside the
formula (S-1)/(R*M+S-1), and the bytes each device's collectives move per step, by mesh axis. Eight
fake devices share this machine's two cores, and a stage in the bubble computes on placeholder
data rather than waiting: the wall-clock figures are reported, not a target.

Part 2, cp: gemma3_tiny on one row of --seq-len tokens, cp = 1, 2, 4 (all_gather and ring): the
compiled step's temporaries per device (XLA's memory analysis), which hold the activations.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402

from tunix_train.compose import load_config  # noqa: E402
from tunix_train.data.synthetic import SyntheticBatches  # noqa: E402
from tunix_train.observe.comms import collective_volume  # noqa: E402
from tunix_train.parallel import pipeline  # noqa: E402
from tunix_train.sharding import to_global_batch  # noqa: E402
from tunix_train.train.setup import setup  # noqa: E402
from tunix_train.train.step import abstract_batch  # noqa: E402

TINY = ["model=gemma3_tiny", "data=synthetic", "training.eval_every=0", "training.warmup_steps=1"]


def _compiled(overrides: list[str], mesh_shape, seq_len: int):
    cfg, _ = load_config([*TINY, f"data.seq_len={seq_len}", *overrides])
    cfg.model.mesh_shape = mesh_shape
    run = setup(cfg, jax.devices()[: math.prod(mesh_shape[0])])
    batch = abstract_batch(run.mesh, 1, run.micro_batch, seq_len)
    with jax.set_mesh(run.mesh):
        return cfg, run, run.step_fn.lower(run.plan.abstract, batch).compile()


def pipeline_runs(steps: int) -> list[dict]:
    rows, seq_len, results = 64, 128, []
    layouts = [(1, 8, [1])] + [(pp, 8 // pp, [4, 8, 16]) for pp in (2, 4)]
    for pp, fsdp, microbatches in layouts:
        for M in microbatches:
            mesh_shape = [[pp, fsdp], ["pp", "fsdp"]] if pp > 1 else [[fsdp], ["fsdp"]]
            overrides = [
                "model.num_layers=8",
                f"training.micro_batch_size={rows // fsdp}",
                f"training.pipeline_microbatches={M}",
            ]
            cfg, run, step = _compiled(overrides, mesh_shape, seq_len)
            data = SyntheticBatches(
                seq_len=seq_len,
                vocab_size=cfg.model.vocab_size,
                accumulation_steps=1,
                global_micro_batch=run.micro_batch,
                seed=0,
            )
            with jax.set_mesh(run.mesh):
                state, batch = run.plan.create(), to_global_batch(next(data), run.mesh)
                times = []
                for _ in range(steps + 1):  # the first step warms up
                    start = time.perf_counter()
                    state, metrics = step(state, batch)
                    jax.block_until_ready(metrics)
                    times.append(time.perf_counter() - start)
            schedule = run.parallel.schedule if run.parallel else pipeline.Schedule(1, 1, 1)
            traffic = collective_volume(step.as_text(), dict(run.mesh.shape)).bytes_by_axes
            results.append(
                {
                    "mesh": dict(run.mesh.shape),
                    "microbatches": M,
                    "step_ms": statistics.median(times[1:]) * 1e3,
                    "idle_counted": schedule.idle_fraction(),
                    "bubble_formula": schedule.bubble,
                    "collective_bytes_by_axes": traffic,
                }
            )

            def over(axis):
                return sum(v for k, v in traffic.items() if k.endswith(f" over {axis}")) / 1e6

            print(
                f"{str(dict(run.mesh.shape)):<22} M={M:<3} step {results[-1]['step_ms']:8.1f} ms   idle "
                f"counted {results[-1]['idle_counted']:.4f}  formula {results[-1]['bubble_formula']:.4f}   "
                f"MB/step over fsdp {over('fsdp'):7.2f}, over pp {over('pp'):6.2f}",
                flush=True,
            )
    return results


def context_runs(seq_len: int) -> list[dict]:
    results = []
    for cp, strategy in ((1, "all_gather"), (2, "all_gather"), (2, "ring"), (4, "all_gather"), (4, "ring")):
        mesh_shape = [[cp], ["cp"]] if cp > 1 else [[1], ["fsdp"]]
        overrides = [
            "training.micro_batch_size=1",
            f"model.context_parallel_strategy={strategy}",
            "training.loss_chunk_size=512",
        ]
        _, run, step = _compiled(overrides, mesh_shape, seq_len)
        temp = step.memory_analysis().temp_size_in_bytes
        results.append({"cp": cp, "strategy": strategy, "seq_len": seq_len, "temp_bytes_per_device": temp})
        print(
            f"cp={cp} {strategy:<10} seq_len={seq_len}: temporaries {temp / 2**20:9.1f} MiB per device",
            flush=True,
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--only", choices=("pipeline", "context"))
    parser.add_argument("--json")
    args = parser.parse_args()
    report = {}
    if args.only != "context":
        report["pipeline"] = pipeline_runs(args.steps)
    if args.only != "pipeline":
        report["context"] = context_runs(args.seq_len)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(json.dumps(report))  # the last line: scripts/figures.py records it


if __name__ == "__main__":
    main()
