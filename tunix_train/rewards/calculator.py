"""A bundled task that needs a tool: products of two 3-digit numbers, which a small model cannot
work out in its head, with a calculator (scripts/tool_demo.py, docs/objectives/tools.md).

    {"prompt": "What is 347 times 812?", "answer": "281764"}

`multiply` is the tool (training.rollout.tools=[tunix_train.rewards.calculator:multiply]);
`exact_answer` gives 1.0 to a conversation whose last turn is the answer; `write_task` writes the
prompts and, for a first supervised fine-tuning, conversations in Gemma's turn format with tool
calls; `write_tokenizer` writes the bundled SentencePiece tokenizer with Gemma's turn tokens and
the tool tags as tokens of their own (a turn must end at one token).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tunix_train.data.tokenizer import bundled_with_pieces

SYMBOLS = (
    "<start_of_turn>",
    "<end_of_turn>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def exact_answer(prompts: list, completions: list[str], answer: list[str], **fields) -> list[float]:
    """1.0 where the last turn is the answer (surrounding whitespace aside)."""
    return [float(c.strip() == expected) for c, expected in zip(completions, answer)]


def problems(count: int, seed: int) -> list[dict[str, str]]:
    a, b = np.random.default_rng(seed).integers(100, 1000, (2, count))
    return [
        {"prompt": f"What is {x} times {y}?", "answer": str(x * y), "a": x, "b": y}
        for x, y in zip(a.tolist(), b.tolist())
    ]


def call(a: int, b: int) -> str:
    """The model's call of the tool, as the built-in Gemma template asks for it."""
    return (
        "<tool_call>"
        + json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}}, separators=(",", ":"))
        + "</tool_call>"
    )


def write_task(
    directory: Path, count: int, seed: int, with_tool: float = 0.5, call: Callable[[int, int], str] = call
) -> tuple[Path, Path]:
    """prompts.jsonl (prompt, answer) for GRPO and sft.jsonl (messages, tools) for a warm start, in which
    a share `with_tool` of the conversations call the tool (written by `call`, as the template asks)
    and the others answer at once (with a guess: the product's leading digits, then zeros)."""
    from tunix_train.envs.tools import schema

    directory.mkdir(parents=True, exist_ok=True)
    rows, coin, tools = (
        problems(count, seed),
        np.random.default_rng(seed + 1).random(count),
        [schema(multiply)],
    )
    prompts, sft = directory / "prompts.jsonl", directory / "sft.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows)
    )
    with open(sft, "w") as f:
        for r, c in zip(rows, coin):
            user = {"role": "user", "content": r["prompt"]}
            if c < with_tool:
                turns = [
                    {"role": "assistant", "content": call(r["a"], r["b"])},
                    {"role": "tool", "name": "multiply", "content": r["answer"]},
                    {"role": "assistant", "content": r["answer"]},
                ]
            else:
                turns = [{"role": "assistant", "content": r["answer"][:2] + "0" * (len(r["answer"]) - 2)}]
            f.write(json.dumps({"messages": [user, *turns], "tools": tools}) + "\n")
    return prompts, sft


def write_tokenizer(path: Path) -> Path:
    """The bundled SentencePiece model with SYMBOLS as tokens of their own (bundled_with_pieces)."""
    return bundled_with_pieces(path, SYMBOLS)
