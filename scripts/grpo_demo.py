"""GRPO on a verifiable task, end to end on a CPU: the reward rises.

    python scripts/grpo_demo.py [--out DIR] [--sft-steps 8] [--grpo-steps 150] [--largest 5]
        [--objective grpo|rloo|reinforce_pp|dr_grpo|ppo|...] [--task arithmetic|reasoning_gym] [OVERRIDE ...]

--task reasoning_gym takes reasoning-gym's basic_arithmetic instead (sums of two terms of one digit,
"Calculate 3 + 5.", data=reasoning_gym) with the task's own verifier as the reward (the `tasks` extra).

1. Writes the bundled arithmetic task (tunix_train/rewards/arithmetic.py): sums a+b, 0 <= a, b <= --largest
(5).
2. Fine-tunes the default small model (gemma3_small, from scratch) with the next-token objective on
   prompt/completion pairs, for a few steps: it learns the format (a number, then EOS), few of the sums.
3. Exports it (python -m tunix_train.export) and trains it with objective=grpo from there, the reward
   being exact_match of the sum; G completions per prompt at temperature 1.
   (--objective: another of the family, e.g. RLOO's or REINFORCE++'s advantages, or PPO's critic,
   on the same task; OVERRIDEs go to this run, e.g. training.rollout.iterations=2.)
4. Prints the mean reward per block of steps, and GRPO's time split between sampling and the step;
   its last line is JSON (the first and last blocks' mean reward).

Every stage is the real command line (run_training.py), so its logs and metrics.jsonl are in DIR.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tunix_train.rewards.arithmetic import write_task  # noqa: E402


def run(*args: str, log: Path) -> None:
    start = time.perf_counter()
    with open(log, "w") as out:
        result = subprocess.run([sys.executable, *args], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    if result.returncode:
        sys.exit(f"{' '.join(args[:2])} failed; see {log}")
    print(f"  {log.name}: {time.perf_counter() - start:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="where the runs go (default: a new temporary folder)"
    )
    parser.add_argument("--sft-steps", type=int, default=8)
    parser.add_argument("--grpo-steps", type=int, default=150)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--beta", type=float, default=0.04, help="KL weight (0: no reference model)")
    parser.add_argument("--largest", type=int, default=5, help="the sums' terms go from 0 to this")
    parser.add_argument("--block", type=int, default=15, help="steps per row of the reward table")
    parser.add_argument("--objective", default="grpo", help="grpo or another of its family (rloo, ...)")
    parser.add_argument("--task", choices=("arithmetic", "reasoning_gym"), default="arithmetic")
    parser.add_argument("overrides", nargs="*", help="more overrides of the RL run")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="grpo_demo_"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"runs in {out}")
    if args.task == "arithmetic":
        prompts, sft = write_task(out / "task", count=2000, seed=0, largest=args.largest)
        sft_data = [
            "data=jsonl",
            f"data.train_files=[{sft}]",
            "data.prompt_field=prompt",
            "data.completion_field=completion",
        ]
        grpo_data = ["data=jsonl", f"data.train_files=[{prompts}]", "data.seq_len=16"]
        reward = "tunix_train.rewards.arithmetic:exact_match"
    else:
        sums = "+data.reasoning_gym.settings.basic_arithmetic"
        sft_data = grpo_data = [
            "data=reasoning_gym",
            "data.reasoning_gym.size=2000",
            "data.reasoning_gym.eval_size=64",
            f"{sums}.min_terms=2",
            f"{sums}.max_terms=2",
            f"{sums}.min_digits=1",
            f"{sums}.max_digits=1",
            f'{sums}.operators=["+"]',
            f"{sums}.allow_negation=false",
            f"{sums}.allow_parentheses=false",
        ]
        grpo_data = [*grpo_data, "data.seq_len=32"]
        reward = "tunix_train.rewards.verified:reasoning_gym"

    run(
        "run_training.py",
        "model=gemma3_small",
        *sft_data,
        "data.seq_len=32",
        f"training.max_steps={args.sft_steps}",
        "training.micro_batch_size=16",
        "training.warmup_steps=10",
        "training.eval_every=0",
        f"hydra.run.dir={out / 'sft'}",
        log=out / "sft.log",
    )
    run("-m", "tunix_train.export", str(out / "sft"), str(out / "sft_hf"), log=out / "export.log")
    G = args.generations
    run(
        "run_training.py",
        "model=gemma3_small",
        f"objective={args.objective}",
        *grpo_data,
        f"model.init_from={out / 'sft_hf'}",
        f"training.max_steps={args.grpo_steps}",
        "training.log_every=1",
        f"training.micro_batch_size={args.prompts_per_step * G}",
        f"training.rollout.num_generations={G}",
        "training.rollout.max_new_tokens=4",
        f"training.rollout.reward=[{reward}]",
        "training.lr_schedule=constant",
        f"training.learning_rate={args.learning_rate}",
        # PPO's KL is in its reward (training.ppo.kl_coef), not a term of the loss
        f"training.{'ppo.kl_coef' if args.objective == 'ppo' else 'grpo.beta'}={args.beta}",
        "checkpoint.every_steps=0",
        f"hydra.run.dir={out / 'grpo'}",
        *args.overrides,
        log=out / "grpo.log",
    )

    steps = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "reward" in m]
    print(
        f"\n{args.objective}: {len(steps)} steps, G={G}, {args.prompts_per_step} prompts per step "
        f"(mean reward of the step's {args.prompts_per_step * G} completions, sampled at temperature 1)\n"
    )
    print("| steps | mean reward | KL | completion tokens |")
    print("|---|---|---|---|")
    rewards = []
    for first in range(0, len(steps), args.block):
        block = steps[first : first + args.block]

        def mean(key):
            return sum(m.get(key, m.get("kl_reward")) for m in block) / len(block)  # PPO: kl_reward

        rewards.append(round(mean("reward"), 4))
        print(
            f"| {block[0]['step']}-{block[-1]['step']} | {mean('reward'):.3f} | {mean('kl'):.4f} | "
            f"{mean('completion_tokens'):.2f} |"
        )
    later = steps[2:]  # past compilation
    sampling = sum(m["rollout_s"] for m in later) / len(later)
    step = sum(m["step_time_s"] for m in later) / len(later)
    print(
        f"\ntime per GRPO step: rollout (sampling + rewards) {sampling * 1e3:.0f} ms, train step "
        f"{step * 1e3:.0f} ms: sampling takes {sampling / (sampling + step):.0%} of it"
    )
    print(
        json.dumps(
            {
                "objective": args.objective,
                "task": args.task,
                "steps": len(steps),
                "first_block_reward": rewards[0],
                "last_block_reward": rewards[-1],
                "block_rewards": rewards,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
