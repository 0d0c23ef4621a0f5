"""Synthetic data for tests and benchmarks: random but learnable token sequences.

Each row is an arithmetic progression modulo the vocabulary, with a random start and stride, so a
model that has learned to continue it drives the loss well below log(vocab_size).
"""

from __future__ import annotations

import numpy as np

MAX_STRIDE = 16


class SyntheticData:
    """Deterministic in (seed, step); each process gets its contiguous block of the global rows."""

    def __init__(self, *, seq_len: int, vocab_size: int, accumulation_steps: int, global_micro_batch: int,
                 seed: int, process_index: int = 0, process_count: int = 1):
        if global_micro_batch % process_count:
            raise ValueError(f"global micro-batch {global_micro_batch} not divisible by {process_count} processes")
        self.seq_len, self.vocab_size, self.seed = seq_len, vocab_size, seed
        self.shape = (accumulation_steps, global_micro_batch)
        rows = global_micro_batch // process_count
        self.rows = slice(process_index * rows, (process_index + 1) * rows)

    def batch(self, step: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, step])
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
