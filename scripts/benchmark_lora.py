"""Device memory of LoRA against full fine-tuning, from the planner (the compiled train step on fake
CPU devices; no accelerator needed).

    python scripts/benchmark_lora.py [--model gemma3_1b] [--mesh '[[8],["fsdp"]]'] [--rank 16] [overrides...]

For each of full fine-tuning, LoRA with an fp32 base and LoRA with a bf16 base: per device, the
trainable parameters, the optimizer state, the frozen weights, the compiler's temporaries and the
total, as tunix_train.plan computes them.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3_1b")
    parser.add_argument("--mesh", default='[[8],["fsdp"]]')
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("overrides", nargs="*", help="more hydra overrides, e.g. training.micro_batch_size=2")
    args = parser.parse_args()
    import json

    devices = math.prod(json.loads(args.mesh)[0])
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from tunix_train.plan import plan

    base = [f"model={args.model}", f"model.mesh_shape={args.mesh}", "data=synthetic", "data.seq_len=1024",
            "training.micro_batch_size=1", "training.mixed_precision=bf16", *args.overrides]
    lora = [f"training.lora.rank={args.rank}", "training.lora.targets=[q,k,v,o,gate,up,down]"]
    runs = {"full fine-tuning": base, f"LoRA r{args.rank}, fp32 base": [*base, *lora],
            f"LoRA r{args.rank}, bf16 base": [*base, *lora, "training.lora.base_dtype=bf16"]}
    rows = {name: plan(overrides)[0] for name, overrides in runs.items()}
    columns = ["parameters", "optimizer state", "frozen weights", "temporaries (compiler)", "total"]
    print(f"{args.model} on {args.mesh}, per device, GiB ({' '.join(base[2:])})\n")
    print("| | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name, figures in rows.items():
        print(f"| {name} | " + " | ".join(f"{figures.get(c, 0) / 2**30:.3f}" for c in columns) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
