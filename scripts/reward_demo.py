"""A reward model end to end on a CPU: it learns a preference, and GRPO with it as the only reward
raises the rate of the answers it prefers.

    python scripts/reward_demo.py [--out DIR] [--reward-steps 60] [--sft-steps 100] [--grpo-steps 40]

1. Writes the bundled preference task (tunix_train/rewards/words.py): prompts "Speak of W." whose
   preferred answer names W ("Then speak of W and be gone."), the rejected another word.
2. Trains a reward model (gemma3_tiny at the corpus's 4096 tokens, objective=reward) on 1024 pairs
   for --reward-steps; reports its held-out accuracy on 64 other pairs (eval_accuracy), at the start
   and at the end, and exports it (Gemma3TextForSequenceClassification).
3. Fine-tunes the policy (gemma3_small) for --sft-steps on the prompts with answers that name the
   prompt's word with probability --sft-copy-rate (0.3), otherwise a word drawn at random: it
   learns the form, and that copying the word is one thing an answer may do, not that it is the
   preferred one (about 0.3 + 0.7/10 of its answers name the prompt's word). A start that has not
   learned to copy (--sft-copy-rate 0, or too few steps) is one that GRPO does not teach in 40
   steps, even with the true reward (docs/objectives/reward.md).
4. Trains it with objective=grpo for --grpo-steps, the reward model its only reward
   (training.rollout.reward_models; reward_weights 0 for the function names_the_word, which is
   logged to measure the rate and adds nothing to the advantages). Reports, per block of steps,
   the rate of sampled answers that name the prompt's word and the reward model's mean score.

Every stage is the real command line (run_training.py), so its logs and metrics.jsonl are in DIR.
The last line is JSON with every figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from grpo_demo import run  # noqa: E402  (a stage as the command line, its log in DIR)

from tunix_train.rewards.words import write_task  # noqa: E402


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="where the runs go (default: a new temporary folder)"
    )
    parser.add_argument("--reward-steps", type=int, default=60)
    parser.add_argument("--sft-steps", type=int, default=100)
    parser.add_argument("--grpo-steps", type=int, default=40)
    parser.add_argument("--sft-copy-rate", type=float, default=0.3)
    parser.add_argument("--block", type=int, default=10, help="steps per row of the rate table")
    parser.add_argument("--missing-eos-penalty", type=float, default=4.0)
    parser.add_argument("--learning-rate", type=float, default=2e-4, help="GRPO's")
    parser.add_argument("--beta", type=float, default=0.04, help="GRPO's KL weight to the fine-tuned policy")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="reward_demo_"))
    out.mkdir(parents=True, exist_ok=True)
    task, held_out = (
        write_task(out / "task", 1024, 0, args.sft_copy_rate),
        write_task(out / "held_out", 64, 1),
    )
    print(f"runs in {out}")

    run(
        "run_training.py",
        "objective=reward",
        "model=gemma3_tiny",
        "model.vocab_size=4096",
        "data=jsonl",
        f"data.train_files=[{task['pairs']}]",
        f"data.eval_files=[{held_out['pairs']}]",
        "data.seq_len=32",
        "training.micro_batch_size=16",
        f"training.max_steps={args.reward_steps}",
        "training.learning_rate=3e-3",
        "training.warmup_steps=0",
        f"training.eval_every={args.reward_steps}",
        "training.eval_batches=4",
        "checkpoint.every_steps=0",
        f"hydra.run.dir={out / 'reward_model'}",
        log=out / "reward_model.log",
    )
    evals = [m for m in metrics(out / "reward_model") if "eval_accuracy" in m]
    run(
        "-m",
        "tunix_train.export",
        str(out / "reward_model"),
        str(out / "reward_model_hf"),
        log=out / "export_rm.log",
    )

    run(
        "run_training.py",
        "model=gemma3_small",
        "data=jsonl",
        f"data.train_files=[{task['sft']}]",
        "data.prompt_field=prompt",
        "data.completion_field=completion",
        "data.seq_len=32",
        f"training.max_steps={args.sft_steps}",
        "training.micro_batch_size=16",
        "training.warmup_steps=5",
        "training.eval_every=0",
        "checkpoint.every_steps=0",
        f"hydra.run.dir={out / 'sft'}",
        log=out / "sft.log",
    )
    run("-m", "tunix_train.export", str(out / "sft"), str(out / "sft_hf"), log=out / "export_sft.log")

    run(
        "run_training.py",
        "model=gemma3_small",
        "objective=grpo",
        "data=jsonl",
        f"data.train_files=[{task['prompts']}]",
        f"model.init_from={out / 'sft_hf'}",
        "data.seq_len=32",
        f"training.max_steps={args.grpo_steps}",
        "training.log_every=1",
        "training.micro_batch_size=128",
        "training.rollout.num_generations=8",
        "training.rollout.max_new_tokens=12",
        "training.rollout.reward=[tunix_train.rewards.words:names_the_word]",
        f"training.rollout.reward_models=[{out / 'reward_model_hf'}]",
        "training.rollout.reward_weights=[0,1]",  # the function measures; the reward model rewards
        # the model reads a completion at its last token, trained on endings: not ending is penalized
        f"training.rollout.missing_eos_penalty={args.missing_eos_penalty}",
        "training.lr_schedule=constant",
        f"training.learning_rate={args.learning_rate}",
        f"training.grpo.beta={args.beta}",
        "checkpoint.every_steps=0",
        f"hydra.run.dir={out / 'grpo'}",
        log=out / "grpo.log",
    )
    steps = [m for m in metrics(out / "grpo") if "reward" in m]
    print(
        f"\nreward model: held-out accuracy {evals[0]['eval_accuracy']:.3f} at the start, "
        f"{evals[-1]['eval_accuracy']:.3f} after {args.reward_steps} steps (64 pairs)\n"
    )
    print(f"GRPO, the reward model its only reward: {len(steps)} steps of 16 prompts x 8 completions\n")
    print("| steps | answers naming the prompt's word | reward model's mean score |")
    print("|---|---|---|")
    rates, scores = [], []
    for first in range(0, len(steps), args.block):
        block = steps[first : first + args.block]
        rates.append(round(sum(m["reward_names_the_word"] for m in block) / len(block), 4))
        scores.append(round(sum(m["reward_reward_model_0"] for m in block) / len(block), 4))
        print(f"| {block[0]['step']}-{block[-1]['step']} | {rates[-1]:.3f} | {scores[-1]:.3f} |")
    print(
        json.dumps(
            {
                "reward_model_accuracy_start": evals[0]["eval_accuracy"],
                "reward_model_accuracy_end": evals[-1]["eval_accuracy"],
                "block_rates": rates,
                "block_scores": scores,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
