"""Distillation end to end on a CPU: a student taught by a teacher beats the same student taught
by the data alone, and on-policy distillation moves a student's reward toward its teacher's.

    python scripts/distill_demo.py [--out DIR] [--teacher-steps 600] [--student-steps 300]
        [--on-policy-steps 60]

1. Logit distillation on the bundled corpus (Shakespeare): trains the teacher (gemma3_small, 4 x 256
   wide) for --teacher-steps, then the same student (gemma3_tiny at the corpus's 4096 tokens, 2 x
   64) twice for --student-steps, on the same batches in the same order: once on the
   cross-entropy alone (objective=lm), once with objective=distill (the teacher's distributions,
   GKD's beta 0.5, plus the cross-entropy at weight 1). Both report the held-out cross-entropy
   (eval_loss of the first, eval_ce of the second) over the same held-out batches.
2. On-policy distillation on the bundled arithmetic task: a teacher (gemma3_small) fine-tuned on
   the sums, a student (gemma3_tiny) fine-tuned briefly (it learns the format, few sums); then
   --on-policy-objective for --on-policy-steps: objective=gkd (default; lmbda 1: the divergence of
   the teacher's distributions on the student's samples) or objective=distill_on_policy (the
   teacher's log-ratio of each sampled token as its advantage). Each model's greedy reward on the
   held-out prompts (eval_reward) is reported:
   the teacher's, and the student's before and after; and over the first and last quarters of the
   steps, the divergence (GKD's JSD, or the sampled tokens' reverse KL) and the sampled reward.

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

from tunix_train.rewards.arithmetic import write_task  # noqa: E402

STUDENT = ["model=gemma3_tiny", "model.vocab_size=4096"]
EXACT = "training.rollout.reward=[tunix_train.rewards.arithmetic:exact_match]"


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def last(run_dir: Path, key: str) -> float:
    return [m[key] for m in metrics(run_dir) if key in m][-1]


def first(run_dir: Path, key: str) -> float:
    return [m[key] for m in metrics(run_dir) if key in m][0]


def logit_distillation(out: Path, args) -> dict:
    """Part 1: held-out cross-entropy of the student with and without the teacher."""
    run(
        "run_training.py",
        "model=gemma3_small",
        f"training.max_steps={args.teacher_steps}",
        f"training.eval_every={args.teacher_steps}",
        f"hydra.run.dir={out / 'teacher'}",
        log=out / "teacher.log",
    )
    common = [
        *STUDENT,
        f"training.max_steps={args.student_steps}",
        f"training.eval_every={args.student_steps}",
        "checkpoint.every_steps=0",
    ]
    run("run_training.py", *common, f"hydra.run.dir={out / 'student_ce'}", log=out / "student_ce.log")
    run(
        "run_training.py",
        *common,
        "objective=distill",
        f"training.distill.teacher={out / 'teacher'}",
        "training.distill.ce_weight=1.0",
        f"hydra.run.dir={out / 'student_kd'}",
        log=out / "student_kd.log",
    )
    figures = {
        "teacher_eval_ce": last(out / "teacher", "eval_loss"),
        "student_ce_only_eval_ce": last(out / "student_ce", "eval_loss"),
        "student_distilled_eval_ce": last(out / "student_kd", "eval_ce"),
    }
    print(
        f"\nheld-out cross-entropy after {args.student_steps} steps of the same batches: student on the "
        f"data alone {figures['student_ce_only_eval_ce']:.4f}, distilled "
        f"{figures['student_distilled_eval_ce']:.4f} "
        f"(the teacher, {args.teacher_steps} steps: {figures['teacher_eval_ce']:.4f})"
    )
    return figures


def on_policy(out: Path, args) -> dict:
    """Part 2: the student's greedy reward on held-out sums, before and after, and the teacher's."""
    prompts, sft = write_task(out / "task", count=2000, seed=0, largest=args.largest)
    for name, model, steps in (
        ("sft_teacher", ["model=gemma3_small"], args.teacher_sft_steps),
        ("sft_student", STUDENT, args.student_sft_steps),
    ):
        run(
            "run_training.py",
            *model,
            "data=jsonl",
            f"data.train_files=[{sft}]",
            "data.prompt_field=prompt",
            "data.completion_field=completion",
            "data.seq_len=32",
            f"training.max_steps={steps}",
            "training.micro_batch_size=16",
            "training.warmup_steps=10",
            "training.eval_every=0",
            f"hydra.run.dir={out / name}",
            log=out / f"{name}.log",
        )
        run(
            "-m",
            "tunix_train.export",
            str(out / name),
            str(out / f"{name}_hf"),
            log=out / f"{name}_export.log",
        )
    rl = [
        "data=jsonl",
        f"data.train_files=[{prompts}]",
        "data.seq_len=16",
        "training.log_every=1",
        "training.rollout.max_new_tokens=4",
        EXACT,
        "training.lr_schedule=constant",
        "checkpoint.every_steps=0",
    ]
    # the teacher's greedy held-out reward: an evaluation before a step that does not move it
    run(
        "run_training.py",
        "model=gemma3_small",
        "objective=grpo",
        *rl,
        f"model.init_from={out / 'sft_teacher_hf'}",
        "training.max_steps=1",
        "training.learning_rate=0",
        "training.eval_every=1",
        "training.micro_batch_size=16",
        "training.rollout.num_generations=4",
        f"hydra.run.dir={out / 'teacher_reward'}",
        log=out / "teacher_reward.log",
    )
    G = 8 if args.on_policy_objective == "distill_on_policy" else 1  # GKD samples one per prompt
    run(
        "run_training.py",
        *STUDENT,
        f"objective={args.on_policy_objective}",
        *rl,
        f"model.init_from={out / 'sft_student_hf'}",
        f"training.distill.teacher={out / 'sft_teacher_hf'}",
        f"training.max_steps={args.on_policy_steps}",
        f"training.eval_every={args.on_policy_steps}",
        f"training.learning_rate={args.learning_rate}",
        f"training.micro_batch_size={args.prompts_per_step * 8}",
        f"training.rollout.num_generations={G}",
        *(["training.distill.lmbda=1.0"] if G == 1 else []),  # GKD wholly on the student's samples
        f"hydra.run.dir={out / 'on_policy'}",
        log=out / "on_policy.log",
    )
    key = "teacher_reverse_kl" if G > 1 else "divergence"  # GKD's: its JSD (beta 0.5)
    kl = [m[key] for m in metrics(out / "on_policy") if key in m]
    sampled = [m["reward"] for m in metrics(out / "on_policy") if key in m]
    block = max(len(kl) // 4, 1)
    figures = {
        "teacher_eval_reward": first(out / "teacher_reward", "eval_reward"),
        "student_eval_reward_before": first(out / "on_policy", "eval_reward"),
        "student_eval_reward_after": last(out / "on_policy", "eval_reward"),
        "divergence_first_quarter": sum(kl[:block]) / block,
        "divergence_last_quarter": sum(kl[-block:]) / block,
        "sampled_reward_first_quarter": sum(sampled[:block]) / block,
        "sampled_reward_last_quarter": sum(sampled[-block:]) / block,
    }
    print(
        f"\n{args.on_policy_objective}, {args.on_policy_steps} steps: the student's greedy held-out reward "
        f"{figures['student_eval_reward_before']:.3f} -> {figures['student_eval_reward_after']:.3f} "
        f"(the teacher's {figures['teacher_eval_reward']:.3f}); {key} on the samples "
        f"{figures['divergence_first_quarter']:.3f} (first quarter) -> "
        f"{figures['divergence_last_quarter']:.3f} (last); its sampled completions' reward (temperature 1) "
        f"{figures['sampled_reward_first_quarter']:.3f} -> {figures['sampled_reward_last_quarter']:.3f}"
    )
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="where the runs go (default: a new temporary folder)"
    )
    parser.add_argument("--teacher-steps", type=int, default=600)
    parser.add_argument("--student-steps", type=int, default=300)
    parser.add_argument("--teacher-sft-steps", type=int, default=300)
    parser.add_argument("--student-sft-steps", type=int, default=60)
    parser.add_argument("--on-policy-steps", type=int, default=60)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--largest", type=int, default=5, help="the sums' terms go from 0 to this")
    parser.add_argument(
        "--on-policy-objective",
        choices=["distill_on_policy", "gkd"],
        default="gkd",
        help="part 2's: the teacher's log-ratio as advantages (8 samples a prompt), or GKD at lmbda 1 "
        "(the divergence on the student's samples, one a prompt, as many samples a step)",
    )
    parser.add_argument("--skip", choices=["logit", "on_policy"], default=None, help="leave one part out")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="distill_demo_"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"runs in {out}")
    figures = {}
    if args.skip != "logit":
        figures.update(logit_distillation(out, args))
    if args.skip != "on_policy":
        figures.update(on_policy(out, args))
    print(json.dumps({k: round(v, 4) for k, v in figures.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
