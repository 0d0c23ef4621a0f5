"""A bundled verifiable task: sums of two numbers, rewarded by exact match.

    {"prompt": "23+58=", "answer": "81"}

`exact_match` gives 1.0 to a completion that is the answer (surrounding whitespace aside) and 0.0
to anything else; `write_task` writes the prompts, and prompt/completion pairs for a first
supervised fine-tuning on the format (scripts/grpo_demo.py does both).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def exact_match(prompts: list[str], completions: list[str], answer: list[str], **fields) -> list[float]:
    return [float(completion.strip() == expected) for completion, expected in zip(completions, answer)]


def problems(count: int, seed: int, largest: int = 9) -> list[dict[str, str]]:
    """`count` sums a+b with 0 <= a, b <= largest, drawn with `seed`."""
    a, b = np.random.default_rng(seed).integers(0, largest + 1, (2, count))
    return [{"prompt": f"{x}+{y}=", "answer": str(x + y)} for x, y in zip(a.tolist(), b.tolist())]


def write_task(directory: Path, count: int, seed: int, largest: int = 9) -> tuple[Path, Path]:
    """prompts.jsonl (prompt, answer) for GRPO and sft.jsonl (prompt, completion) for the format."""
    directory.mkdir(parents=True, exist_ok=True)
    rows = problems(count, seed, largest)
    prompts, sft = directory / "prompts.jsonl", directory / "sft.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sft.write_text(
        "".join(json.dumps({"prompt": r["prompt"], "completion": r["answer"]}) + "\n" for r in rows)
    )
    return prompts, sft
