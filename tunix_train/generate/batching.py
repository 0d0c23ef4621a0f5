"""How admitted requests are batched for the engine's prefill and insert programs: prompts padded
to length buckets and batches to row counts that are powers of two, so that few programs compile
(session.py runs them)."""

from __future__ import annotations

import collections
import math
from typing import Optional

import numpy as np


def bucket(length: int) -> int:
    """Prompts are right-padded to a power of two (at least 16): few prefill compilations."""
    return max(16, 1 << math.ceil(math.log2(max(length, 1))))


def batch_rows(count: int, dp: int) -> int:
    """Rows of a prefill or insert batch of `count` requests: a power of two (few compilations),
    rounded up to a multiple of the data-parallel size."""
    return -(-(1 << math.ceil(math.log2(count))) // dp) * dp


def prefill_batches(prompts: list[tuple], dp: int) -> list[tuple[int, list[tuple]]]:
    """(key, prompt)s in prefill batches (bucket length, members): runs of consecutive bucket
    lengths, chosen to compute the fewest padded tokens (rows x length), fewer calls on a tie."""
    by_length = collections.defaultdict(list)
    for key, prompt in prompts:
        by_length[bucket(len(prompt))].append((key, prompt))
    lengths = sorted(by_length)
    if not lengths:  # every prompt's prefill was kept
        return []

    def split(cuts: int) -> list[tuple[int, list[tuple]]]:  # bit i set: a batch ends after lengths[i]
        batches, run = [], []
        for i, length in enumerate(lengths):
            run += by_length[length]
            if cuts >> i & 1 or i == len(lengths) - 1:
                batches, run = batches + [(length, run)], []
        return batches

    return min(
        (split(cuts) for cuts in range(1 << (len(lengths) - 1))),
        key=lambda batches: (
            sum(batch_rows(len(run), dp) * length for length, run in batches),
            len(batches),
        ),
    )


def prefill_images(images: list[Optional[np.ndarray]], rows: int) -> Optional[np.ndarray]:
    """A prefill batch's images [rows, I, C, H, W] (I: the most of any member; zeros past a row's
    own), or None when no member has any (the text-only program)."""
    if all(x is None for x in images):
        return None
    shape = next(x.shape[1:] for x in images if x is not None)
    per_row = max(len(x) for x in images if x is not None)
    batch = np.zeros((rows, per_row, *shape), np.float32)
    for row in range(rows):
        mine = images[min(row, len(images) - 1)]
        if mine is not None:
            batch[row, : len(mine)] = mine
    return batch
