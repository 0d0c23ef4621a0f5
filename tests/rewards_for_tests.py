"""Reward functions for test_grpo (imported by CLI subprocesses as tests.rewards_for_tests): one that
a random model's completions already vary under, and two that break the contract."""


def length(prompts, completions, **fields):
    return [len(c) / 10 for c in completions]


def bad_length(prompts, completions, **fields):
    return [0.0]


def not_a_number(prompts, completions, **fields):
    return ["yes"] * len(completions)
