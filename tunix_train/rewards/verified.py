"""Rewards checked by a verifier rather than by string match (the `tasks` extra):

    training.rollout.reward=[tunix_train.rewards.verified:math_verify]
    training.rollout.reward=[tunix_train.rewards.verified:reasoning_gym]  # with data=reasoning_gym

`reasoning_gym` scores a completion with its task's own verifier (reasoning-gym's score_answer, in
[0, 1]) on the record's `entry`; the answer is the text in <answer></answer> where the completion
writes those tags, else the whole completion stripped.

`math_verify` gives 1.0 to a completion whose answer Hugging Face's math-verify finds equal to the
record's `answer` (1/2 = 0.5 = \\frac{1}{2}, 1,000 = 1000, x+1 = 1+x), else 0.0. The answer read is
math-verify's own extraction: the last \\boxed{} first, else the last expression in the text. A
gold answer without $ or \\boxed is read as LaTeX math ($answer$), as open-r1 and TRL write theirs.

math-verify's own timeouts use signals, which only the main thread has; rewards run on a thread of
their own, bounded as a batch by training.rollout.reward_timeout_s, so they are off here. A
completion is read from its last MAX_CHARS characters (where its answer is), which bounds the parse.
"""

from __future__ import annotations

import json
import logging

MAX_CHARS = 2000


def _verifier():
    try:
        import math_verify
    except ImportError:
        raise ImportError("the math_verify reward needs math-verify: pip install -e '.[tasks]'") from None
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout is disabled" notice, each call
    return math_verify


def gold(answer: str):
    """The parsed gold answer; a ValueError naming an answer math-verify cannot read."""
    verifier = _verifier()
    text = str(answer)
    parsed = verifier.parse(text if "$" in text or "\\boxed" in text else f"${text}$", parsing_timeout=None)
    if not parsed:
        raise ValueError(f"math-verify reads no answer in {text[:80]!r}")
    return parsed


def math_verify(prompts: list, completions: list[str], answer: list[str], **fields) -> list[float]:
    verifier = _verifier()
    rewards = []
    for completion, expected in zip(completions, answer):
        found = verifier.parse(completion[-MAX_CHARS:], parsing_timeout=None)
        rewards.append(float(bool(found) and verifier.verify(gold(expected), found, timeout_seconds=None)))
    return rewards


def reasoning_gym(prompts: list, completions: list[str], entry: list[str], **fields) -> list[float]:
    try:
        from reasoning_gym import get_score_answer_fn
        from reasoning_gym.utils import extract_answer
    except ImportError:
        raise ImportError("the reasoning_gym reward needs reasoning-gym: pip install -e '.[tasks]'") from None
    rewards = []
    for completion, record in zip(completions, entry):
        task = json.loads(record)
        answer = extract_answer(completion) if "<answer>" in completion else completion.strip()
        score = get_score_answer_fn(task["metadata"]["source_dataset"])
        rewards.append(float(score(answer, task)))
    return rewards
