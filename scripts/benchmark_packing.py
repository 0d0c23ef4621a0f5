"""Padding-free preference pairs against padded ones: the DPO step's time per pair.

    python scripts/benchmark_packing.py [--rounds 4] [--steps 6] [--seq-len 128] [--rows 8] overrides...

Writes pairs whose prompt and answers each run from 1 to --max-words words (so rows of very
different lengths), then compiles the DPO train step twice on one device: padded (data.padding_free
false: --rows rows, --rows / 2 pairs a step) and packed (true: --rows rows of pairs packed whole).
In alternating rounds it times --steps steps of each on batches already on the device, counting
the pairs each batch holds. Reported: each layout's median time per step and per pair, its padding
fraction, and the ratio of the time per pair (packed / padded) beside what the padding predicts,
(1 - pad_padded) / (1 - pad_packed): the share of positions that hold tokens, if a step's time
were proportional to its positions. Attention costs the square of a row's length, and a packed
row is full where a padded row is short, so the prediction is not exact either way. The last
line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def write_pairs(path: Path, count: int, max_words: int, seed: int = 0) -> Path:
    import numpy as np

    words = ["king", "queen", "night", "day", "love", "sword", "crown", "fool", "heart", "blood"]
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(count):
            parts = [" ".join(rng.choice(words, rng.integers(1, max_words + 1))) for _ in range(3)]
            f.write(json.dumps(dict(zip(("prompt", "chosen", "rejected"), parts))) + "\n")
    return path


def layout(overrides: list[str], packed: bool, steps: int):
    """(the compiled step, its state, `steps` batches on the device, pairs in each)."""
    import jax
    import numpy as np

    from tunix_train.compose import load_config
    from tunix_train.data import Data
    from tunix_train.sharding import to_global_batch
    from tunix_train.train.setup import setup

    cfg, _ = load_config([*overrides, f"data.padding_free={str(packed).lower()}"])
    run = setup(cfg)
    objective = run.objective
    data = Data(cfg, objective.record_fields)
    objective.read(data)
    batches = objective.train_batches(data, run.micro_batch, range(run.micro_batch))
    host = [next(batches) for _ in range(steps)]
    batches.close()
    if packed:
        pairs = [int(((b["segment_ids"] % 2 == 1) & (b["positions"] == 0)).sum()) for b in host]
    else:
        pairs = [b["inputs"].shape[0] * b["inputs"].shape[1] // 2 for b in host]
    pad = float(np.mean([(b["segment_ids"] == 0).mean() for b in host]))
    with jax.set_mesh(run.mesh):
        device = [to_global_batch(b, run.mesh) for b in host]
        state = run.plan.create()
        step = run.step_fn.lower(state, device[0]).compile()
    return run.mesh, step, state, device, pairs, pad


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--max-words", type=int, default=20)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    import jax

    pairs_file = write_pairs(Path(tempfile.mkdtemp()) / "pairs.jsonl", 2000, args.max_words)
    overrides = [
        "model=gemma3_small",
        "objective=dpo",
        "data=jsonl",
        f"data.train_files=[{pairs_file}]",
        f"data.seq_len={args.seq_len}",
        f"training.micro_batch_size={args.rows}",
        "model.mesh_shape=[[1],[fsdp]]",
        *args.overrides,
    ]
    layouts = {name: layout(overrides, name == "packed", args.steps) for name in ("padded", "packed")}
    times = {name: [] for name in layouts}
    for _ in range(args.rounds):
        for name, (mesh, step, state, device, _, _) in layouts.items():
            with jax.set_mesh(mesh):
                state, metrics = step(state, device[0])  # warm, not timed
                jax.block_until_ready(metrics)
                for batch in device:
                    start = time.perf_counter()
                    state, metrics = step(state, batch)
                    jax.block_until_ready(metrics)
                    times[name].append(time.perf_counter() - start)
            layouts[name] = (mesh, step, state, device, *layouts[name][4:])
    figures = {}
    for name, (_, _, _, _, pairs, pad) in layouts.items():
        step_s = statistics.median(times[name])
        figures[name] = {
            "step_s": step_s,
            "pairs_per_step": statistics.mean(pairs),
            "pair_ms": 1e3 * step_s / statistics.mean(pairs),
            "pad_fraction": pad,
        }
        print(
            f"{name}: {step_s * 1e3:.0f} ms a step, {statistics.mean(pairs):.1f} pairs a step, "
            f"{figures[name]['pair_ms']:.1f} ms a pair, padding {pad:.1%}"
        )
    measured = figures["packed"]["pair_ms"] / figures["padded"]["pair_ms"]
    predicted = (1 - figures["padded"]["pad_fraction"]) / (1 - figures["packed"]["pad_fraction"])
    print(f"time per pair, packed / padded: {measured:.3f} (the padding predicts {predicted:.3f})")
    print(json.dumps({**figures, "pair_time_ratio": measured, "predicted_ratio": predicted}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
