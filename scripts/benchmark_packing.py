"""Padding-free batches against padded ones: the train step's time per sequence.

    python scripts/benchmark_packing.py [--objective dpo|grpo] [--rounds 4] [--steps 6]
        [--seq-len 128] [--rows 8] [--accumulation 1] overrides...

dpo: writes pairs whose prompt and answers each run from 1 to --max-words words (rows of very
different lengths) and compiles the DPO train step twice on one device: padded (data.padding_free
false: --rows rows, --rows / 2 pairs a micro-batch) and packed (true: --rows rows of pairs packed
whole). grpo: rollouts made by hand (the bundled arithmetic prompts, G=4, completions of 1 to
--max-words tokens), laid out by the GRPO objective padded (one row each) and packed (into the
front micro-batches, the step skipping the empty rest; use --accumulation > 1).

In alternating rounds it times --steps steps of each on batches already on the device, counting
the sequences each batch holds (pairs, or completions). Reported: each layout's mean time per
step and per sequence, its padding fraction over the micro-batches it computes, and the ratio of
the time per sequence (packed / padded) beside what the padding predicts,
(1 - pad_padded) / (1 - pad_packed): the share of computed positions that hold tokens, if a
step's time were proportional to the positions it computes. Attention costs the square of a
row's length, and a packed row is full where a padded row is short, so the prediction is not
exact either way. The last line is JSON.
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


def compiled(run, host: list[dict]):
    """(the compiled step, its state, the batches on the device)."""
    import jax

    from tunix_train.sharding import to_global_batch

    with jax.set_mesh(run.mesh):
        device = [to_global_batch(b, run.mesh) for b in host]
        state = run.plan.create()
        step = run.step_fn.lower(state, device[0]).compile()
    return step, state, device


def live_padding(host: list[dict]) -> tuple[float, float]:
    """The batches' padding over all the positions of the micro-batches they compute, and those
    micro-batches' share of all."""
    import numpy as np

    segments = [b["segment_ids"].reshape(len(b["segment_ids"]), -1) for b in host]
    live = [s[s.any(axis=1)] for s in segments]
    pad = sum(int((s == 0).sum()) for s in live) / sum(s.size for s in live)
    return pad, float(np.mean([len(s) / len(all_) for s, all_ in zip(live, segments)]))


def dpo_layout(overrides: list[str], packed: bool, steps: int):
    """(the run, its host batches, the pairs in each)."""
    from tunix_train.compose import load_config
    from tunix_train.train.setup import setup

    cfg, _ = load_config([*overrides, f"data.padding_free={str(packed).lower()}"])
    run = setup(cfg)
    objective = run.objective
    batches = objective.train_batches(objective_data(objective, cfg), run.micro_batch, range(run.micro_batch))
    host = [next(batches) for _ in range(steps)]
    batches.close()
    if packed:
        pairs = [int(((b["segment_ids"] % 2 == 1) & (b["positions"] == 0)).sum()) for b in host]
    else:
        pairs = [b["inputs"].shape[0] * b["inputs"].shape[1] // 2 for b in host]
    return run, host, pairs


def objective_data(objective, cfg):
    from tunix_train.data import Data

    data = Data(cfg, objective.record_fields)
    objective.read(data)
    return data


def grpo_layout(overrides: list[str], packed: bool, steps: int, max_tokens: int):
    """(the run, its host batches: rollouts made by hand, the same ones for either layout, and the
    completions in each)."""
    import numpy as np

    from tunix_train.compose import load_config
    from tunix_train.train.rollouts import Rollout
    from tunix_train.train.setup import setup

    cfg, _ = load_config([*overrides, f"data.padding_free={str(packed).lower()}"])
    run = setup(cfg)
    objective, G = run.objective, cfg.training.rollout.num_generations
    objective_data(objective, cfg)
    objective.sampler.rows = range(run.micro_batch)
    A = cfg.training.gradient_accumulation_steps
    rng, host = np.random.default_rng(0), []
    for index in range(steps):
        order = rng.choice(len(objective.sampler.prompts), A * run.micro_batch // G, replace=False).tolist()
        completions = [
            rng.integers(5, 4000, rng.integers(1, max_tokens + 1)).tolist()
            for _ in range(A * run.micro_batch)
        ]
        logprobs = [[-1.0] * len(c) for c in completions]
        rewards = [rng.normal(size=len(completions)).tolist()]
        host.append(objective._rows_of(Rollout(index, index, A, order, completions, logprobs, rewards, 0.0)))
    return run, host, [A * run.micro_batch] * steps


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--objective", choices=("dpo", "grpo"), default="dpo")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument(
        "--max-words", type=int, default=20, help="dpo: words a part; grpo: completion tokens"
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    import jax

    common = [
        "model=gemma3_small",
        f"objective={args.objective}",
        "data=jsonl",
        f"data.seq_len={args.seq_len}",
        f"training.micro_batch_size={args.rows}",
        f"training.gradient_accumulation_steps={args.accumulation}",
        "model.mesh_shape=[[1],[fsdp]]",
    ]
    folder = Path(tempfile.mkdtemp())
    if args.objective == "dpo":
        pairs_file = write_pairs(folder / "pairs.jsonl", 2000, args.max_words)
        overrides = [*common, f"data.train_files=[{pairs_file}]", *args.overrides]

        def make(packed):
            return dpo_layout(overrides, packed, args.steps)
    else:
        from tunix_train.rewards.arithmetic import write_task

        prompts, _ = write_task(folder / "task", count=512, seed=0)
        overrides = [
            *common,
            f"data.train_files=[{prompts}]",
            "training.rollout.reward=[tunix_train.rewards.arithmetic:exact_match]",
            f"training.rollout.max_new_tokens={args.max_words}",
            *args.overrides,
        ]

        def make(packed):
            return grpo_layout(overrides, packed, args.steps, args.max_words)

    layouts = {}
    for name in ("padded", "packed"):
        run, host, sequences = make(name == "packed")
        layouts[name] = (run.mesh, *compiled(run, host), sequences, *live_padding(host))
    times = {name: [] for name in layouts}
    for _ in range(args.rounds):
        for name, (mesh, step, state, device, *_) in layouts.items():
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
    for name, (_, _, _, _, sequences, pad, live) in layouts.items():
        # the mean: a packed rollout's steps compute different numbers of micro-batches
        step_s, per_step = statistics.mean(times[name]), statistics.mean(sequences)
        figures[name] = {
            "step_s": step_s,
            "sequences_per_step": per_step,
            "sequence_ms": 1e3 * step_s / per_step,
            "pad_fraction": pad,
            "computed_micro_batches": live,
        }
        print(
            f"{name}: {step_s * 1e3:.0f} ms a step, {per_step:.1f} sequences a step, "
            f"{figures[name]['sequence_ms']:.2f} ms a sequence, padding {pad:.1%} over the "
            f"{live:.0%} of micro-batches computed"
        )
    packed, padded = figures["packed"], figures["padded"]
    measured = packed["sequence_ms"] / padded["sequence_ms"]
    predicted = (1 - padded["pad_fraction"]) / (1 - packed["pad_fraction"])
    print(f"time per sequence, packed / padded: {measured:.3f} (the padding predicts {predicted:.3f})")
    print(
        json.dumps(
            {"objective": args.objective, **figures, "time_ratio": measured, "predicted_ratio": predicted}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
