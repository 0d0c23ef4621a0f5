"""Vision speed on this machine: images per second through the image tower, and training tokens/s of
the vision demo's rows with their images beside the same rows without them.

    python scripts/benchmark_vision.py [--out outputs/vision_demo] [--rounds 3] [--steps 20] [--cpu-devices 2]

The rows are scripts/vision_demo.py's conversations (written if missing), one per row of 64
positions, 16 rows per device. "With images": gemma3_vision_tiny, its tower trainable, each row's
image through the tower and its 16 embeddings merged at the placeholders. "Without": the same
config with model.vision=null on the same conversations less their image parts, so the rows hold
16 + 4 fewer tokens but as many positions (the rest is padding, computed all the same). Each round
runs both train steps (scripts/benchmark.py's timing, every batch on the devices), alternating; the
figures are medians over rounds. The tower's rate: jit of the tower alone over 256 images. The
last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="outputs/vision_demo")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cpu-devices", type=int, default=2)
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.cpu_devices}"

    import jax
    import numpy as np
    from benchmark import benchmark
    from flax import nnx
    from vision_demo import PIECES, write_task

    from tunix_train.compose import load_config
    from tunix_train.data.tokenizer import bundled_with_pieces
    from tunix_train.model.vision import VisionTower

    out = Path(args.out).resolve()
    train_file, _ = write_task(out)
    text_file = out / "train_text_only.jsonl"
    if not text_file.is_file():
        records = [json.loads(line) for line in train_file.read_text().splitlines()]
        for r in records:
            r["messages"][0]["content"] = r["messages"][0]["content"][-1]["text"]
        text_file.write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer = bundled_with_pieces(out / "tokenizer" / "tokenizer.model", PIECES)
    common = [
        "model=gemma3_vision_tiny",
        "model.vocab_size=4104",
        "model.vision.image_token_id=4100",
        f'model.mesh_shape=[[{args.cpu_devices}],["fsdp"]]',
        "data=chat",
        f"data.tokenizer={tokenizer}",
        "data.seq_len=64",
        "data.eval_fraction=0",
        "training.micro_batch_size=16",
    ]
    sides = {
        "with_images": [*common, "model.vision.trainable=true", f"data.train_files=[{train_file}]"],
        "without_images": [*common, "model.vision=null", f"data.train_files=[{text_file}]"],
    }
    tokens_per_sec = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, overrides in sides.items():
            tokens_per_sec[name].append(benchmark(overrides, args.steps, 3)["tokens_per_sec"])
    figures = {name: statistics.median(v) for name, v in tokens_per_sec.items()}

    cfg, _ = load_config(sides["with_images"])
    tower = VisionTower(cfg.model.vision, cfg.model.embed_dim, nnx.Rngs(0))
    graphdef, state = nnx.split(tower)
    encode = jax.jit(lambda state, pixels: nnx.merge(graphdef, state)(pixels))
    pixels = np.random.default_rng(0).standard_normal((256, 3, 32, 32)).astype(np.float32)
    jax.block_until_ready(encode(state, pixels))
    rates = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(encode(state, pixels))
        rates.append(len(pixels) / (time.perf_counter() - start))
    print(
        json.dumps(
            {
                "devices": args.cpu_devices,
                "train_tokens_per_sec": figures,
                "train_tokens_per_sec_rounds": tokens_per_sec,
                "with_over_without": figures["with_images"] / figures["without_images"],
                "tower_images_per_sec": statistics.median(rates),
            }
        )
    )


if __name__ == "__main__":
    main()
