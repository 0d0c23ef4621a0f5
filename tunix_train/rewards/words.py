"""A bundled preference task for reward models: each prompt asks to speak of a word, and the
preferred answer names it.

    {"prompt": "Speak of crown.", "word": "crown"}                                  (prompts)
    {"prompt": "Speak of crown.", "chosen": "Then speak of crown and be gone.",
     "rejected": "Then speak of night and be gone."}                                (pairs)
    {"prompt": "Speak of crown.", "completion": "Then speak of night and be gone."}  (sft)

`write_task` writes the three: the pairs for objective=reward, prompt/completion records whose
answer names the prompt's word with probability `copy_rate` and otherwise a word drawn at random (a
supervised start that learns the form, and, when copy_rate > 0, that copying the word is one thing
an answer may do), and the prompts for GRPO. `names_the_word` is the preference as a reward
function (1.0 when the completion names the prompt's word), for measuring what a reward model taught
(scripts/reward_demo.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

WORDS = ["king", "love", "night", "blood", "crown", "heart", "death", "sword", "queen", "fool"]
ANSWER = "Then speak of {} and be gone."


def names_the_word(prompts: list[str], completions: list[str], word: list[str], **fields) -> list[float]:
    return [float(bool(re.search(rf"\b{re.escape(w)}\b", c))) for c, w in zip(completions, word)]


def write_task(directory: Path, count: int, seed: int, copy_rate: float = 0.0) -> dict[str, Path]:
    """pairs.jsonl, sft.jsonl and prompts.jsonl, `count` records each, drawn with `seed`."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    copier = np.random.default_rng([seed, 1])  # its own draws: the pairs are the same at any copy_rate
    files = {name: directory / f"{name}.jsonl" for name in ("pairs", "sft", "prompts")}
    rows = {name: [] for name in files}
    for _ in range(count):
        word, other = (str(w) for w in rng.choice(WORDS, 2, replace=False))
        prompt = f"Speak of {word}."
        rows["pairs"].append(
            {"prompt": prompt, "chosen": ANSWER.format(word), "rejected": ANSWER.format(other)}
        )
        drawn = str(rng.choice(WORDS))
        named = word if copier.random() < copy_rate else drawn
        rows["sft"].append({"prompt": prompt, "completion": ANSWER.format(named)})
        rows["prompts"].append({"prompt": prompt, "word": word})
    for name, path in files.items():
        path.write_text("".join(json.dumps(r) + "\n" for r in rows[name]))
    return files
