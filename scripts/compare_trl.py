"""One GRPO step, ours against TRL's GRPOTrainer, side by side on this machine's CPU or GPU.

    python scripts/compare_trl.py [--model tiny] [--rounds 3] [--steps 3] [--prompts 16]
    [--generations 8] [--max-new-tokens 32] [--dtype float32|bf16]

Both train the same random Gemma 3 (--model: tiny, gemma3_tiny; small, the CPU architecture of
compare_tunix.py), written once as a Hugging Face checkpoint and loaded by both, with the same
tokenizer (a character-level tokenizer.json, made here with the `tokenizers` package), on the same
arithmetic prompts (tunix_train/rewards/arithmetic.py), with the same reward function (exact_match),
G completions per prompt, max completion length, beta, epsilon, learning rate and temperature, in
float32 or (--dtype bf16) each side's bf16 mixed precision over float32 weights (ours:
training.mixed_precision=bf16 and rollout_dtype=bf16; TRL: bf16=True, torch's autocast), on one GPU
where there is one, else the CPU. TRL: use_vllm=False (its only way on a CPU), its token-mean loss
("bnpo", ours), no gradient checkpointing, rows padded to the longest of the batch. Ours: its
defaults (remat save_matmul_outputs), rows padded to data.seq_len = the longest prompt (8 tokens
with BOS) plus the max completion length. A step is the whole of it: sampling, scoring, the
reference's and the policy's forward passes, backward, the update, and the step's logging. Both are
timed the same way: the wall time between the ends of consecutive steps (TRL: its on_step_end
callback; ours: a hook's after_step), after one warm-up step, so each interval holds one step and
one step's logging on both sides; no evaluation runs (ours: training.eval_every=0) and both train on
every prompt (ours: data.eval_fraction=0). The sides alternate, --rounds times each (ours, TRL,
ours, TRL, ...), each run a fresh trainer in this process; the figures are the median and the spread
(min, max) of every timed step of each side, and the ratio of the medians. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

REWARD = "tunix_train.rewards.arithmetic:exact_match"
# --model tiny: gemma3_tiny (2 layers of width 64, 256 tokens); small: widened to compare_tunix.py's
# CPU architecture (4 layers of width 256, 4096 tokens), where the matmuls take most of a step
MODELS = {
    "tiny": {"vocab_size": 256},
    "small": {
        "num_layers": 4,
        "embed_dim": 256,
        "hidden_dim": 1024,
        "num_heads": 4,
        "head_dim": 64,
        "num_kv_heads": 4,
        "vocab_size": 4096,
        "sliding_window": 64,
    },
}


def model_overrides(name: str) -> list[str]:
    return ["model=gemma3_tiny", *(f"model.{k}={v}" for k, v in MODELS[name].items())]


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A character-level tokenizer.json over the task's characters, padded with unused tokens to
    the model's vocabulary (random weights sample any id), BOS put in front of every text."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    characters = list("0123456789+= ")
    vocab = {token: i for i, token in enumerate(specials + characters)}
    vocab.update({f"<unused{i}>": i for i in range(len(vocab), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "pad_token": "<pad>",
                "unk_token": "<unk>",
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )


def write_model(directory: Path, model: str) -> None:
    import jax

    from tunix_train.compose import load_config
    from tunix_train.interop import hf
    from tunix_train.sharding import make_mesh
    from tunix_train.train.init import plan_train_state
    from tunix_train.train.optimizer import make_optimizer

    cfg, _ = load_config([*model_overrides(model), "data=synthetic"])
    mesh = make_mesh([[1], ["fsdp"]], jax.devices()[:1])
    params = plan_train_state(cfg.model, make_optimizer(cfg.training)[0], mesh, seed=0).create().params
    hf.export(params, cfg.model, directory)


def run_ours(checkpoint: Path, prompts: Path, out: Path, args) -> list[float]:
    from tunix_train.compose import load_config
    from tunix_train.train.loop import train

    rows = args.prompts * args.generations
    cfg, overrides = load_config(
        [
            *model_overrides(args.model),
            f"model.init_from={checkpoint}",
            "model.mesh_shape=[[1],[fsdp]]",
            "objective=grpo",
            "data=jsonl",
            f"data.train_files=[{prompts}]",
            f"data.seq_len={args.max_new_tokens + 8}",
            f"training.micro_batch_size={rows}",
            f"training.max_steps={args.steps + 1}",
            "training.log_every=1",
            f"training.learning_rate={args.learning_rate}",
            "training.warmup_steps=0",
            "training.lr_schedule=constant",
            f"training.rollout.num_generations={args.generations}",
            f"training.rollout.max_new_tokens={args.max_new_tokens}",
            f"training.grpo.beta={args.beta}",
            f"training.grpo.epsilon={args.epsilon}",
            f"training.rollout.reward=[{REWARD}]",
            "checkpoint.every_steps=1000000",
            "training.eval_every=0",
            "data.eval_fraction=0",
            *(
                ["training.mixed_precision=bf16", "training.rollout.dtype=bf16"]
                if args.dtype == "bf16"
                else []
            ),
        ]
    )
    import jax

    from tunix_train.train.hooks import Hook

    ends: list[float] = []

    class StepEnds(Hook):
        def after_step(self, end) -> None:
            ends.append(time.perf_counter())

    train(cfg, out, overrides, devices=jax.devices()[:1], extra_hooks=[StepEnds()])
    return [b - a for a, b in zip(ends, ends[1:])]


def run_trl(checkpoint: Path, rows: list[dict], out: Path, args) -> list[float]:
    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from tunix_train.rewards.arithmetic import exact_match

    torch.set_num_threads(os.cpu_count() or 1)
    ends: list[float] = []

    class StepTimes(transformers.TrainerCallback):
        def on_step_end(self, *_, **__):
            ends.append(time.perf_counter())

    config = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=args.prompts * args.generations,
        gradient_accumulation_steps=1,
        num_generations=args.generations,
        max_completion_length=args.max_new_tokens,
        beta=args.beta,
        epsilon=args.epsilon,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        temperature=1.0,
        loss_type="bnpo",
        use_vllm=False,
        max_steps=args.steps + 1,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=args.dtype == "bf16",
        use_cpu=not torch.cuda.is_available(),
        gradient_checkpointing=False,
        seed=0,
        dataloader_num_workers=0,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=exact_match,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[StepTimes()],
    )
    trainer.train()
    return [b - a for a, b in zip(ends, ends[1:])]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side, alternating")
    parser.add_argument("--steps", type=int, default=3, help="timed steps of a run, after one warm-up step")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="G completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="max completion length")
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--epsilon", type=float, default=0.2)
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--dtype", choices=["float32", "bf16"], default="float32")
    args = parser.parse_args(argv)
    # both frameworks share one GPU in this process: JAX takes memory as it needs it, not 75% up front
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    from tunix_train.rewards.arithmetic import problems

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        checkpoint = tmp / "checkpoint"
        checkpoint.mkdir()
        write_model(checkpoint, args.model)
        write_tokenizer(checkpoint, MODELS[args.model]["vocab_size"])
        rows = problems(args.prompts * (args.steps + 1), seed=0)
        prompts = tmp / "prompts.jsonl"
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
        ours, trl = [], []
        for round_ in range(args.rounds):
            times = run_ours(checkpoint, prompts, tmp / f"ours{round_}", args)
            print(f"round {round_ + 1} ours: step times {[round(t, 3) for t in times]} s", flush=True)
            ours.append(times)
            times = run_trl(checkpoint, rows, tmp / f"trl{round_}", args)
            print(f"round {round_ + 1} TRL:  step times {[round(t, 3) for t in times]} s", flush=True)
            trl.append(times)
    ours_all, trl_all = [t for r in ours for t in r], [t for r in trl for t in r]
    ours_s, trl_s = statistics.median(ours_all), statistics.median(trl_all)
    from importlib.metadata import version

    print(
        json.dumps(
            {
                "ours_step_s": ours_s,
                "trl_step_s": trl_s,
                "ratio": trl_s / ours_s,
                "ours_spread_s": [min(ours_all), max(ours_all)],
                "trl_spread_s": [min(trl_all), max(trl_all)],
                "ratio_per_round": [statistics.median(t) / statistics.median(o) for o, t in zip(ours, trl)],
                "rounds": args.rounds,
                "steps_per_round": args.steps,
                "model": args.model,
                "prompts": args.prompts,
                "generations": args.generations,
                "max_new_tokens": args.max_new_tokens,
                "dtype": args.dtype,
                "device": jax.devices()[0].device_kind,
                "trl_version": version("trl"),
                "torch_threads": os.cpu_count(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
