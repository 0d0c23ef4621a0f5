"""GRPO with a tool, end to end on a CPU: products of 3-digit numbers, which a small model cannot
work out in its head, with a calculator it learns to rely on.

    python scripts/tool_demo.py [--out DIR] [--sft-steps 300] [--grpo-steps 80]

1. Writes the bundled calculator task (tunix_train/rewards/calculator.py): "What is 347 times 812?",
   and the bundled tokenizer with Gemma's turn tokens and the tool tags as tokens of their own.
2. Fine-tunes gemma3_small from scratch on conversations in Gemma's turn format (data=chat, the
   `multiply` tool offered through the template): a few (--with-tool, 15%) call the tool and answer
   with its result, the others answer at once with a guess (the product's first two digits, then
   zeros: always wrong). The model learns both habits, mostly the second, the call's format, and to
   copy numbers.
3. Exports it and trains it with objective=grpo and training.rollout.tools=[...:multiply]: each of G
   conversations per prompt runs up to 3 turns, the tool's results appended between them, the
   reward exact_answer of the last turn, the loss on the model's own tokens.
4. Prints the mean reward and tool-call rate per block of steps; its last line is one JSON object
   with the first and last blocks' figures.

Every stage is the real command line (run_training.py), so its logs and metrics.jsonl are in DIR.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.grpo_demo import run  # noqa: E402
from tunix_train.rewards.calculator import SYMBOLS, write_task, write_tokenizer  # noqa: E402

VOCAB = 4096 + len(SYMBOLS)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="where the runs go (default: a new temporary folder)"
    )
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--grpo-steps", type=int, default=80)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument(
        "--block", type=int, default=8, help="steps per row of the table (the first and last: the JSON's)"
    )
    parser.add_argument(
        "--with-tool",
        type=float,
        default=0.15,
        help="the share of the warm-up conversations that call the tool",
    )
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="tool_demo_"))
    out.mkdir(parents=True, exist_ok=True)
    prompts, sft = write_task(out / "task", count=4000, seed=0, with_tool=args.with_tool)
    tokenizer = write_tokenizer(out / "tokenizer" / "tokenizer.model")
    print(f"runs in {out}")
    model = ["model=gemma3_small", f"model.vocab_size={VOCAB}", f"data.tokenizer={tokenizer}"]

    run(
        "run_training.py",
        *model,
        "data=chat",
        f"data.train_files=[{sft}]",
        "data.seq_len=192",
        f"training.max_steps={args.sft_steps}",
        "training.micro_batch_size=16",
        "training.learning_rate=3e-3",
        "training.warmup_steps=20",
        "training.eval_every=0",
        "checkpoint.every_steps=0",
        f"hydra.run.dir={out / 'sft'}",
        log=out / "sft.log",
    )
    run("-m", "tunix_train.export", str(out / "sft"), str(out / "sft_hf"), log=out / "export.log")
    G = args.generations
    run(
        "run_training.py",
        *model,
        "objective=grpo",
        "data=jsonl",
        f"data.train_files=[{prompts}]",
        f"model.init_from={out / 'sft_hf'}",
        "data.seq_len=192",
        "data.eval_fraction=0",
        f"training.max_steps={args.grpo_steps}",
        "training.log_every=1",
        f"training.micro_batch_size={args.prompts_per_step * G}",
        f"training.rollout.num_generations={G}",
        "training.rollout.max_new_tokens=48",
        "training.rollout.max_turns=3",
        "training.rollout.tools=[tunix_train.rewards.calculator:multiply]",
        "training.rollout.reward=[tunix_train.rewards.calculator:exact_answer]",
        "training.lr_schedule=constant",
        f"training.learning_rate={args.learning_rate}",
        "training.grpo.beta=0.0",
        "checkpoint.every_steps=0",
        f"hydra.run.dir={out / 'grpo'}",
        log=out / "grpo.log",
    )

    steps = [
        m for m in map(json.loads, (out / "grpo" / "metrics.jsonl").read_text().splitlines()) if "reward" in m
    ]
    print(
        f"\nGRPO with a calculator: {len(steps)} steps, G={G}, {args.prompts_per_step} prompts per step "
        f"(the step's {args.prompts_per_step * G} conversations, sampled at temperature 1)\n"
    )
    print("| steps | mean reward | tool calls per conversation | tool errors | turns |")
    print("|---|---|---|---|---|")
    blocks = [steps[first : first + args.block] for first in range(0, len(steps), args.block)]

    def mean(block, key):
        return sum(m[key] for m in block) / len(block)

    for block in blocks:
        print(
            f"| {block[0]['step']}-{block[-1]['step']} | {mean(block, 'reward'):.3f} | "
            f"{mean(block, 'tool_calls'):.2f} | {mean(block, 'tool_errors'):.2f} | "
            f"{mean(block, 'turns'):.2f} |"
        )
    first, last = blocks[0], blocks[-1]
    print(
        json.dumps(
            {
                "first_reward": round(mean(first, "reward"), 4),
                "last_reward": round(mean(last, "reward"), 4),
                "first_tool_calls": round(mean(first, "tool_calls"), 4),
                "last_tool_calls": round(mean(last, "tool_calls"), 4),
                "steps": len(steps),
                "block": args.block,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
