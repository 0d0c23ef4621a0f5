"""Synthetic data for tests and benchmarks: random but learnable token sequences.

Each row is an arithmetic progression modulo the vocabulary, with a random start and stride, so a
model that has learned to continue it drives the loss well below log(vocab_size).
"""

from __future__ import annotations

from typing import Any

import numpy as np

MAX_STRIDE = 16


class SyntheticBatches:
    """Batch k is a function of (seed, k) alone; a process makes only its `rows` of each micro-batch."""

    def __init__(
        self,
        *,
        seq_len: int,
        vocab_size: int,
        accumulation_steps: int,
        global_micro_batch: int,
        seed: int,
        rows: range | None = None,
    ):
        self.seq_len, self.vocab_size, self.seed = seq_len, vocab_size, seed
        self.shape = (accumulation_steps, global_micro_batch)
        rows = range(global_micro_batch) if rows is None else rows
        self.rows = slice(rows.start, rows.stop)
        self.next_batch = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, self.next_batch])
        self.next_batch += 1
        start = rng.integers(0, self.vocab_size, self.shape + (1,))
        stride = rng.integers(1, MAX_STRIDE + 1, self.shape + (1,))
        tokens = (start + stride * np.arange(self.seq_len + 1)) % self.vocab_size
        tokens = tokens[:, self.rows].astype(np.int32)
        inputs, targets = tokens[..., :-1], tokens[..., 1:]
        return {
            "inputs": inputs,
            "targets": targets,
            "loss_mask": np.ones(inputs.shape, np.float32),
            "positions": np.broadcast_to(np.arange(self.seq_len, dtype=np.int32), inputs.shape).copy(),
            "segment_ids": np.ones(inputs.shape, np.int32),
        }

    def get_state(self) -> dict[str, Any]:
        return {"next_batch": self.next_batch}

    def set_state(self, state: dict[str, Any]) -> None:
        self.next_batch = int(state["next_batch"])

    def close(self) -> None:
        pass
