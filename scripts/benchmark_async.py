"""Asynchronous against synchronous GRPO (training.rollout.asynchronous, docs/objectives/async.md):
tokens trained per second and the final held-out reward, side by side, alternating rounds.

    python scripts/benchmark_async.py [--steps 12] [--warmup 4] [--rounds 5] [--lr 1e-3]
        [--sft-steps 40] [--mean-words 40] [--max-new 256] [--micro-batch 4]
        [--sync-overrides ...] [--async-overrides ...]

The task: prompts "Words about X:" whose completions are lists of words; the reward is the share
of a completion's words that are "the". Its lengths are long-tailed: the tiny model is first
fine-tuned (--sft-steps) on completions of 8 + Geometric(1 / --mean-words) words (at most
--max-new tokens), so it samples lengths of about that spread, and a synchronous step waits for
its longest completion while the slots of the others sit idle.

Both modes start from that model, on 4 fake CPU devices (2 training, 2 generating: the same rollout
mesh and the same slots, a step's 32 completions), and run --steps steps of 8 prompts x 4
completions with the same seed per round (round r: training.seed=r), at learning rate --lr
(constant, no KL term). The rollouts are packed (data.padding_free) into micro-batches of
2 x --micro-batch rows of 288 positions, accumulated to the step's 32 rows: the packed completions
fill the first few, and the step skips the empty ones, so it trains on the completions rather
than on padding (with one micro-batch of 32 rows, about 70% of it was padding). The asynchronous
mode's max_lag is 4, above the steps its longest completions take (at the default 2 about a
tenth of the groups were drawn again). Rounds alternate which mode goes first. Measured per
run, after its first --warmup steps (compilation; the asynchronous engine compiles its
admissions' programs before its first step, Session.warm): completion tokens trained per second
of the steps' wall time (the log's step_time_s: from one step's end to the
next's, the rollout included; not the final save). The held-out reward: the mean reward of 4
samples (temperature 1, fixed seeds) on each of 32 held-out prompts, by the run's final weights.

What the figures do not mean: the CPU's two cores are shared by the training and the rollout
devices, so the overlap of training with generation is worth less here than on separate
accelerators; most of the gain on this CPU is the slots a synchronous rollout leaves idle in its
tail. The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORDS = ["the", "and", "of", "to", "in", "that", "is", "with"]
TOPICS = "sea king night love war bread river stone horse crown field storm winter garden sword letter"
TOPICS = TOPICS.split()


def word_share(prompts, completions, **fields):
    """The share of a completion's words that are "the" (0 for an empty one)."""
    return [c.split().count("the") / max(len(c.split()), 1) for c in completions]


def _write_task(directory: Path, mean_words: int, max_new: int, seed: int = 0) -> dict[str, Path]:
    import numpy as np

    rng = np.random.default_rng(seed)

    def prompt():
        return f"Words about {rng.choice(TOPICS)} and {rng.choice(TOPICS)}:"

    def completion():
        count = min(8 + int(rng.geometric(1 / mean_words)), max_new // 2)
        return " " + " ".join(rng.choice(WORDS, count))

    files = {name: directory / f"{name}.jsonl" for name in ("sft", "prompts", "held_out")}
    directory.mkdir(parents=True, exist_ok=True)
    files["sft"].write_text(
        "".join(json.dumps({"prompt": prompt(), "completion": completion()}) + "\n" for _ in range(2048))
    )
    for name, count in (("prompts", 512), ("held_out", 32)):
        files[name].write_text("".join(json.dumps({"prompt": prompt()}) + "\n" for _ in range(count)))
    return files


def _overrides(files, seq_len: int) -> list[str]:
    return ["model=gemma3_tiny", "model.vocab_size=4096", "data=jsonl", f"data.seq_len={seq_len}"]


def _fine_tune(files, work: Path, args, devices) -> Path:
    from tunix_train.api import load
    from tunix_train.compose import load_config
    from tunix_train.train.loop import train

    cfg, _ = load_config(
        [
            *_overrides(files, args.max_new + 32),
            "objective=lm",
            f"data.train_files=[{files['sft']}]",
            "data.prompt_field=prompt",
            "data.completion_field=completion",
            f"training.max_steps={args.sft_steps}",
            "training.micro_batch_size=16",
            "training.learning_rate=3e-3",
            "training.eval_every=0",
            "training.log_every=50",
            "checkpoint.every_steps=0",
        ]
    )
    train(cfg, work / "sft", devices=devices[:1])
    load(work / "sft", devices=devices[:1]).export(work / "sft_hf")
    return work / "sft_hf"


def _run(mode: str, seed: int, start: Path, files, work: Path, args, devices) -> dict:
    from tunix_train.compose import load_config
    from tunix_train.train.loop import train

    cfg, _ = load_config(
        [
            *_overrides(files, args.max_new + 32),
            "objective=grpo",
            f"model.init_from={start}",
            f"data.train_files=[{files['prompts']}]",
            f"data.eval_files=[{files['held_out']}]",
            'model.mesh_shape=[[2],["fsdp"]]',
            'training.rollout.mesh_shape=[[2],["fsdp"]]',
            f"training.micro_batch_size={args.micro_batch}",
            f"training.gradient_accumulation_steps={32 // (2 * args.micro_batch)}",
            "training.rollout.num_generations=4",
            f"training.rollout.max_new_tokens={args.max_new}",
            "training.rollout.reward=[benchmark_async:word_share]",
            f"training.rollout.asynchronous={mode == 'async'}",
            # above the steps a longest completion takes (about 3 here): at the default 2, about a
            # tenth of the groups, the longest, were drawn again (docs/objectives/async.md)
            *(["training.rollout.max_lag=4"] if mode == "async" else []),
            *(args.async_overrides if mode == "async" else args.sync_overrides),
            "data.padding_free=true",  # with accumulation: the micro-batches left empty are skipped
            "training.grpo.beta=0",
            f"training.learning_rate={args.lr}",
            "training.lr_schedule=constant",
            "training.warmup_steps=0",
            f"training.max_steps={args.steps}",
            f"training.seed={seed}",
            "training.eval_every=0",
            "training.log_every=1",
            "checkpoint.every_steps=0",
        ]
    )
    run_dir = work / f"{mode}_{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a run of an earlier call under --work would resume
    train(cfg, run_dir, devices=devices[:4])
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {m["step"]: m for m in steps if "completion_tokens" in m}
    rows = 32
    timed = range(args.warmup + 1, args.steps + 1)  # step_time_s: the wall time since the previous step
    tokens = sum(steps[s]["completion_tokens"] * rows for s in timed)
    lengths = [steps[s]["completion_tokens"] for s in steps]
    return {
        "tokens_per_s": tokens / sum(steps[s]["step_time_s"] for s in timed),
        "held_out_reward": _held_out(run_dir, files, args, devices),
        "train_reward_last4": sum(steps[s]["reward"] for s in range(args.steps - 3, args.steps + 1)) / 4,
        "mean_completion_tokens": sum(lengths) / len(lengths),
        **(
            {
                "mean_lag": sum(steps[s]["lag_mean"] for s in steps) / len(steps),
                "mixed_version_tokens": sum(steps[s]["mixed_version_tokens"] for s in steps),
            }
            if mode == "async"
            else {}
        ),
    }


def _held_out(run_dir: Path, files, args, devices) -> float:
    from tunix_train.api import load

    model = load(run_dir, devices=devices[2:4])
    prompts = [json.loads(line)["prompt"] for line in files["held_out"].read_text().splitlines()]
    texts = model.generate_text(
        [p for p in prompts for _ in range(4)], args.max_new, temperature=1.0, seed=12_345
    )
    rewards = word_share(None, texts)
    return sum(rewards) / len(rewards)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="steps before the timing starts")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seeds", type=int, nargs="*", help="one round each (default: 0 .. rounds - 1)")
    parser.add_argument("--sft-steps", type=int, default=40)
    parser.add_argument("--mean-words", type=int, default=40)
    parser.add_argument("--max-new", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--micro-batch", type=int, default=4, help="rows per training device per micro-step")
    parser.add_argument("--async-overrides", nargs="*", default=[], help="e.g. training.rollout.max_lag=1")
    parser.add_argument("--sync-overrides", nargs="*", default=[])
    parser.add_argument("--modes", nargs="+", default=["sync", "async"])
    parser.add_argument("--work", type=Path, default=None, help="default: a temporary directory")
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmark_async:word_share
    import jax

    devices = jax.devices()
    with tempfile.TemporaryDirectory() as scratch:
        work = args.work or Path(scratch)
        files = _write_task(work / "task", args.mean_words, args.max_new)
        start = _fine_tune(files, work, args, devices)
        runs = {"sync": [], "async": []}
        for r, seed in enumerate(args.seeds or range(args.rounds)):
            for mode in args.modes if r % 2 == 0 else args.modes[::-1]:
                runs[mode].append(_run(mode, seed, start, files, work, args, devices))
                print(f"round {r} {mode}: {json.dumps(runs[mode][-1])}", flush=True)

    def mean(mode, key):
        return sum(x[key] for x in runs[mode]) / len(runs[mode])

    def spread(mode, key):
        return max(x[key] for x in runs[mode]) - min(x[key] for x in runs[mode])

    figures = {}
    for mode in (m for m in ("sync", "async") if runs[m]):  # --modes may leave one out
        figures |= {
            f"{mode}_tokens_per_s": mean(mode, "tokens_per_s"),
            f"{mode}_final_reward": mean(mode, "held_out_reward"),
            f"{mode}_reward_spread": spread(mode, "held_out_reward"),
            f"{mode}_completion_tokens": mean(mode, "mean_completion_tokens"),
        }
    if runs["sync"] and runs["async"]:
        figures["speedup"] = mean("async", "tokens_per_s") / mean("sync", "tokens_per_s")
        # each seed's ratio: the two modes of a round run one after the other
        figures["speedup_by_seed"] = [
            a["tokens_per_s"] / s["tokens_per_s"] for s, a in zip(runs["sync"], runs["async"])
        ]
    if runs["async"]:
        figures["mean_lag"] = mean("async", "mean_lag")
    figures |= {"seeds": list(args.seeds or range(args.rounds)), "steps": args.steps, "runs": runs}
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
