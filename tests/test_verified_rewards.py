"""The math_verify reward against math-verify itself (its parse and verify at their defaults, in
the main thread where its timeouts work) on a table of equivalent forms, wrong answers and
garbage, each row's expected reward written out."""

import re

import pytest

math_verify = pytest.importorskip("math_verify", reason="needs math-verify: pip install -e '.[tasks]'")

from tunix_train.rewards import verified  # noqa: E402

TABLE = [  # (gold answer, completion, reward)
    ("81", "81", 1.0),
    ("81", "The answer is 81.", 1.0),
    ("81", "23 + 58 = 81", 1.0),
    ("81", "\\boxed{81}", 1.0),
    ("81", "First 20+50=70, then 3+8=11, so \\boxed{81}.", 1.0),
    ("81", "$81.0$", 1.0),
    ("81", "I think 18, no wait, 81", 1.0),  # the last number
    ("81", "81 apples, then 3 left", 0.0),  # the last number is 3
    ("81", "\\boxed{18} or maybe 81", 0.0),  # \boxed{} first
    ("81", "82", 0.0),
    ("81", "-81", 0.0),
    ("-3", "x = -3", 1.0),
    ("\\frac{1}{2}", "0.5", 1.0),
    ("\\frac{1}{2}", "$\\boxed{\\frac{1}{2}}$", 1.0),
    ("\\frac{1}{2}", "\\boxed{\\dfrac{2}{4}}", 1.0),
    ("\\frac{1}{2}", "1/3", 0.0),
    ("1/2", "\\boxed{0.5}", 1.0),
    ("0.75", "\\boxed{\\frac{3}{4}}", 1.0),
    ("0.5", "\\boxed{50\\%}", 0.0),  # 50% is read as 50
    ("1,000", "1000", 1.0),
    ("1000", "\\boxed{1{,}000}", 1.0),
    ("2\\sqrt{2}", "\\boxed{\\sqrt{8}}", 1.0),
    ("2\\sqrt{2}", "\\boxed{2.8284}", 0.0),
    ("x+1", "\\boxed{1+x}", 1.0),
    ("x+1", "\\boxed{x-1}", 0.0),
    ("[1,2]", "\\boxed{[1,2]}", 1.0),
    ("\\pi", "\\boxed{\\pi}", 1.0),
    ("\\pi", "\\boxed{3.14159}", 0.0),
    ("$\\frac{3}{4}$", "so it is 0.75", 1.0),
    ("\\boxed{7}", "the result: $7$", 1.0),
    ("7", "seven", 0.0),
    ("7", "", 0.0),
    ("7", "}}}{{\\boxed{", 0.0),
    ("7", "\\boxed{}", 0.0),
    ("7", "\u200b\x00\ufffd", 0.0),
    ("7", "!" * 10_000, 0.0),
    ("7", "!" * 10_000 + " 7", 1.0),  # read from the last MAX_CHARS characters
]


def _itself(gold: str, completion: str) -> float:
    wrapped = gold if "$" in gold or "\\boxed" in gold else f"${gold}$"
    return float(math_verify.verify(math_verify.parse(wrapped), math_verify.parse(completion)))


def test_math_verify_rewards_as_math_verify_verifies():
    golds, completions, want = zip(*TABLE)
    got = verified.math_verify(["?"] * len(TABLE), list(completions), answer=list(golds))
    assert got == list(want)
    assert got == [_itself(g, c) for g, c in zip(golds, completions)]


def test_a_gold_answer_it_cannot_read_is_an_error_naming_it():
    for gold in ("", "\\boxed{}"):
        with pytest.raises(ValueError, match=re.escape(f"reads no answer in {gold!r}")):
            verified.math_verify(["?"], ["7"], answer=[gold])
