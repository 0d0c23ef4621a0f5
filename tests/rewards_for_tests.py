"""Reward functions for test_grpo (imported by CLI subprocesses as tests.rewards_for_tests): one that
a random model's completions already vary under, and two that break the contract."""


def length(prompts, completions, **fields):
    return [len(c) / 10 for c in completions]


def bad_length(prompts, completions, **fields):
    return [0.0]


def not_a_number(prompts, completions, **fields):
    return ["yes"] * len(completions)


def length_for_even_answers(prompts, completions, answer, **fields):
    """Varies with the completion where the answer is even; 1 (every completion alike) where it is odd."""
    return [len(c) / 10 if int(a) % 2 == 0 else 1.0 for c, a in zip(completions, answer)]


def constant(prompts, completions, **fields):
    return [1.0] * len(completions)


def divides(prompts, completions, answer, **fields):
    """Raises where the answer is even: a reward function with a bug."""
    return [1.0 / (int(a) % 2) for a in answer]


def undocumented_tool(x):
    return x


def hang(seconds: float) -> str:
    """Sleeps, then answers: a tool that may hang (run in a process by the tools' test).

    Args:
        seconds: How long to sleep.
    """
    import os
    import time

    with open(os.environ["TUNIX_TEST_HANG_PIDS"], "a") as pids:
        pids.write(f"{os.getpid()}\n")
    time.sleep(seconds)
    return "awake"


def echo(text: str) -> str:
    """Answers with its argument.

    Args:
        text: What to answer.
    """
    return text


def hangs(prompts, completions, **fields):
    """Never answers (until the test's process ends): a reward function stuck on a lock or a socket."""
    import threading

    threading.Event().wait()


def nan_for_long(prompts, completions, **fields):
    return [float("nan") if len(c) > 1 else 0.0 for c in completions]
