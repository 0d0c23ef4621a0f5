"""Vision learning on a CPU: a tiny vision Gemma trained from scratch to answer questions about
pictures it has never seen.

    python scripts/vision_demo.py [--out outputs/vision_demo] [--steps 600] [--devices 2]

Writes once (kept across runs) 32 x 32 PNGs of one coloured shape in a corner (4 colours, 3 shapes,
4 corners) and conversations asking its colour, its shape or its corner, with the one-word
answer: 2,000 to train on, 120 held out. Trains gemma3_vision_tiny (its tower trainable) with
run_training.py on them: the first step (its learning rate is 0 in warm-up) leaves the
parameters as initialized, then training goes on to --steps. Held-out accuracy is the share of
questions whose right answer the model finds the likeliest among that question's candidates (its
log-probability of each answer's tokens after the image and question): 1/3 to 1/4 by chance.
Then GRPO on the same questions (--grpo_steps, 0: none) with an exact-answer reward, from the
supervised run after --grpo_warmup steps (exported to Hugging Face's format, read back with
model.init_from): the held-out prompts' greedy reward before and after, and the sampled reward
of the first and last 10 steps. Each run's directories are new (outputs/vision_demo/runs/TIME).
The last line is JSON with the first and last accuracy and rewards.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (230, 200, 20)}
SHAPES = ("circle", "square", "triangle")
CORNERS = ("top left", "top right", "bottom left", "bottom right")
QUESTIONS = {
    "What colour is the shape?": tuple(COLOURS),
    "What shape is it?": SHAPES,
    "Where is the shape?": CORNERS,
}
SIZE = 32  # gemma3_vision_tiny's image_size
PIECES = ("<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>")


def draw(colour: str, shape: str, corner: str, rng):
    """One shape of side 13 to 16 pixels in a corner of a white square, jittered by up to 2 pixels."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    side = int(rng.integers(13, 17))
    x0 = (2 if "left" in corner else SIZE - side - 2) + int(rng.integers(-2, 3))
    y0 = (2 if "top" in corner else SIZE - side - 2) + int(rng.integers(-2, 3))
    x0, y0 = min(max(x0, 0), SIZE - side), min(max(y0, 0), SIZE - side)
    box, fill = (x0, y0, x0 + side - 1, y0 + side - 1), COLOURS[colour]
    pen = ImageDraw.Draw(image)
    if shape == "circle":
        pen.ellipse(box, fill=fill)
    elif shape == "square":
        pen.rectangle(box, fill=fill)
    else:
        pen.polygon([(x0 + side // 2, y0), (x0, y0 + side - 1), (x0 + side - 1, y0 + side - 1)], fill=fill)
    return image


def write_task(out: Path, train: int = 2000, held_out: int = 120, seed: int = 0) -> tuple[Path, Path]:
    """The pictures and the train.jsonl / eval.jsonl conversations (written once)."""
    import numpy as np

    train_file, eval_file = out / "train.jsonl", out / "eval.jsonl"
    if train_file.is_file() and eval_file.is_file():
        return train_file, eval_file
    rng = np.random.default_rng(seed)
    (out / "pictures").mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(train + held_out):
        colour, shape, corner = (
            list(COLOURS)[rng.integers(4)],
            SHAPES[rng.integers(3)],
            CORNERS[rng.integers(4)],
        )
        draw(colour, shape, corner, rng).save(out / "pictures" / f"{i}.png")
        question = list(QUESTIONS)[rng.integers(3)]
        answer = {0: colour, 1: shape, 2: corner}[list(QUESTIONS).index(question)]
        user = [{"type": "image", "image": f"pictures/{i}.png"}, {"type": "text", "text": question}]
        records.append(
            {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}
        )
    for path, part in ((train_file, records[:train]), (eval_file, records[train:])):
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
    return train_file, eval_file


def accuracy(run_dir: Path, eval_file: Path) -> float:
    """The share of held-out questions whose answer is the likeliest of the question's candidates."""
    import numpy as np

    from tunix_train import api
    from tunix_train.data.images import split_images

    model = api.load(run_dir, mesh_shape=[[1], ["fsdp"]], devices=None)
    chat, right = model.chat, 0
    records = [json.loads(line) for line in eval_file.read_text().splitlines()]
    for record in records:
        user, answer = record["messages"][0], record["messages"][1]["content"]
        plain, payloads = split_images([user])
        pixels = model.pixel_values(payloads, eval_file.parent, str(eval_file))
        prompt, _ = chat.encode(plain, add_generation_prompt=True)
        candidates = QUESTIONS[user["content"][1]["text"]]
        rows = [chat.encode([*plain, {"role": "assistant", "content": c}])[0] for c in candidates]
        length = max(map(len, rows))
        tokens = np.zeros((len(rows), length), np.int32)
        for r, ids in enumerate(rows):
            tokens[r, : len(ids)] = ids
        logits = model.logits(tokens, images=np.repeat(pixels[None], len(rows), axis=0))
        logprobs = (
            logits
            - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
            - logits.max(-1, keepdims=True)
        )
        scores = [
            sum(logprobs[r, t - 1, ids[t]] for t in range(len(prompt), len(ids)))
            for r, ids in enumerate(rows)
        ]
        right += candidates[int(np.argmax(scores))] == answer
    return right / len(records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="outputs/vision_demo")
    parser.add_argument("--steps", type=int, default=600, help="supervised steps (0: only the GRPO part)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--grpo_steps", type=int, default=150, help="0: no GRPO run")
    parser.add_argument("--grpo_warmup", type=int, default=50, help="supervised steps before GRPO")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    train_file, eval_file = write_task(out)
    from tunix_train.data.tokenizer import bundled_with_pieces

    tokenizer = bundled_with_pieces(out / "tokenizer" / "tokenizer.model", PIECES)
    # this run's directories, new each time (the pictures and conversations are kept)
    runs = out / "runs" / time.strftime("%Y-%m-%d_%H-%M-%S")
    runs.mkdir(parents=True)
    run_dir = runs / "supervised"
    overrides = [
        "model=gemma3_vision_tiny",
        "model.vocab_size=4104",  # the tokenizer's 4101, padded
        "model.vision.image_token_id=4100",
        "model.vision.trainable=true",
        f'model.mesh_shape=[[{args.devices}],["fsdp"]]',
        "data=chat",
        f"data.train_files=[{train_file}]",
        f"data.eval_files=[{eval_file}]",
        f"data.tokenizer={tokenizer}",
        "data.seq_len=64",
        "training.micro_batch_size=16",
        "training.learning_rate=0.003",
        "training.warmup_steps=20",
        "training.eval_every=0",
        "training.log_every=50",
        "checkpoint.every_steps=100",
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}"}
    figures = {}
    for steps in (1, args.steps) if args.steps else ():  # step 1's learning rate is 0: the initial parameters
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, str(REPO / "run_training.py"), *overrides, f"training.max_steps={steps}"],
            env=env,
            cwd=REPO,
        )
        if done.returncode:
            sys.exit(done.returncode)
        figures[f"train_s_to_step_{steps}"] = round(time.perf_counter() - start, 1)
        name = "first_accuracy" if steps == 1 else "last_accuracy"
        figures[name] = round(accuracy(run_dir, eval_file), 3)
        print(f"after step {steps}: held-out accuracy {figures[name]}", flush=True)
    if args.grpo_steps:
        figures.update(grpo(runs, train_file, overrides, env, args))
    print(json.dumps({"steps": args.steps, "held_out": 120, **figures}))


def grpo(out: Path, train_file: Path, overrides: list[str], env: dict, args) -> dict:  # out: this run's
    """GRPO on the same questions with an exact-answer reward (1 for the right word, else 0), from
    a model after --grpo_warmup steps of the supervised run above (exported to Hugging Face's
    format and read back with model.init_from): the held-out prompts' greedy reward before and
    after, and the sampled reward of the first and last 10 steps."""
    prompts = {}
    for name in ("train", "eval"):  # beside the pictures they name
        records = [
            json.loads(line) for line in (train_file.parent / f"{name}.jsonl").read_text().splitlines()
        ]
        prompts[name] = train_file.parent / f"grpo_{name}.jsonl"
        prompts[name].write_text(
            "".join(
                json.dumps({"prompt": r["messages"][:1], "answer": r["messages"][1]["content"]}) + "\n"
                for r in records
            )
        )
    runs = {name: out / name for name in ("warmup", "warmup_hf", "grpo")}
    steps = [f"training.max_steps={args.grpo_warmup}", f"hydra.run.dir={runs['warmup']}"]
    for command in (
        [str(REPO / "run_training.py"), *overrides[:-1], *steps],  # overrides[-1]: the run's directory
        ["-m", "tunix_train.export", str(runs["warmup"]), str(runs["warmup_hf"])],
    ):
        subprocess.run([sys.executable, *command], env=env, cwd=REPO, check=True)
    grpo_overrides = [
        o
        for o in overrides
        if not o.startswith(("data=", "data.train_files", "data.eval_files", "data.tokenizer", "hydra."))
    ]
    subprocess.run(
        [
            sys.executable,
            str(REPO / "run_training.py"),
            *grpo_overrides,
            "objective=grpo",
            "data=jsonl",
            f"data.train_files=[{prompts['train']}]",
            f"data.eval_files=[{prompts['eval']}]",
            f"training.eval_every={args.grpo_steps}",  # at the start and the end
            "training.eval_batches=30",  # 30 x 32 rows / 8 completions: the 120 held-out prompts
            f"model.init_from={runs['warmup_hf']}",
            "training.rollout.num_generations=8",
            "training.rollout.max_new_tokens=4",
            "training.rollout.reward=[tunix_train.rewards.calculator:exact_answer]",
            "training.learning_rate=0.005",
            "training.warmup_steps=0",
            f"training.max_steps={args.grpo_steps}",
            "training.log_every=1",
            f"hydra.run.dir={runs['grpo']}",
        ],
        env=env,
        cwd=REPO,
        check=True,
    )
    metrics = [json.loads(line) for line in (runs["grpo"] / "metrics.jsonl").read_text().splitlines()]
    held_out = [m["eval_reward"] for m in metrics if "eval_reward" in m]
    rewards = [m["reward"] for m in metrics if "reward" in m and "loss" in m]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(
        f"GRPO: held-out greedy reward {held_out[0]:.3f} before, {held_out[-1]:.3f} after; sampled "
        f"reward {first:.3f} over the first 10 steps, {last:.3f} over the last 10",
        flush=True,
    )
    return {
        "grpo_first_reward": round(held_out[0], 3),
        "grpo_last_reward": round(held_out[-1], 3),
        "grpo_sampled_reward_first_10": round(first, 3),
        "grpo_sampled_reward_last_10": round(last, 3),
    }


if __name__ == "__main__":
    main()
