"""A rollout's sequences packed into rows (data.padding_free for GRPO, PPO and on-policy
distillation): each padded row's used positions moved into a shared row of seq_len, and back.

The host keeps computing per sequence in padded rows (advantages, GAE, a scoring pass's figures
read back with `unpack`); only the step's batch is packed. Rows are filled first-fit, longest
sequence first (first-fit decreasing), and the used rows come first, so a rollout whose packed
rows fill fewer micro-batches leaves whole micro-batches empty, which the step skips
(Objective.skips_empty_micro_batches). In a row, sequence k (by position) is segment k + 1 and
its positions restart at 0; padding is segment 0 at position 0.
"""

from __future__ import annotations

import dataclasses

import numpy as np

PADDING = {"routes": -1}  # a field's value off every sequence (0 where not named)


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where each of N sequences lies in the packed layout of `rows` rows."""

    row: np.ndarray  # [N]
    start: np.ndarray  # [N] its first position in that row
    length: np.ndarray  # [N] its positions
    segment: np.ndarray  # [N] its segment id there: 1 + the sequences placed in the row before it
    rows: int

    @classmethod
    def first_fit(cls, segment_ids_NT: np.ndarray, rows: int) -> Packing:
        """The layout of padded rows [N, T] (a sequence's positions: its row's segment_ids > 0) in
        `rows` rows of T; an error when they do not fit."""
        N, T = segment_ids_NT.shape
        length = (segment_ids_NT > 0).sum(axis=1)
        row, start, segment = (np.zeros(N, np.int64) for _ in range(3))
        room, placed = [], []  # per opened row: its free positions, its sequences
        for i in np.argsort(-length, kind="stable"):
            r = next((r for r, free in enumerate(room) if free >= length[i]), len(room))
            if r == len(room):
                room.append(T)
                placed.append(0)
            row[i], start[i] = r, T - room[r]
            room[r] -= length[i]
            placed[r] += 1
            segment[i] = placed[r]
        if len(room) > rows:
            raise ValueError(f"{N} sequences need {len(room)} packed rows, more than {rows}")
        return cls(row, start, length, segment, rows)

    @property
    def used_rows(self) -> int:
        return int(self.row.max()) + 1 if len(self.row) else 0

    def pack(self, padded: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Padded rows [N, T, ...] (each sequence from position 0) -> packed rows [rows, T, ...],
        positions and segment_ids made anew."""
        out = {
            name: np.full((self.rows, *x.shape[1:]), PADDING.get(name, 0), x.dtype)
            for name, x in padded.items()
        }
        for i, (r, s, n) in enumerate(zip(self.row, self.start, self.length)):
            for name, x in padded.items():
                out[name][r, s : s + n] = x[i, :n]
            out["positions"][r, s : s + n] = np.arange(n)
            out["segment_ids"][r, s : s + n] = self.segment[i]
        return out

    def unpack(self, packed_RT: np.ndarray) -> np.ndarray:
        """Packed rows' figure [rows, T, ...] -> each sequence's, in padded rows [N, T, ...] (0 after it)."""
        out = np.zeros((len(self.row), *packed_RT.shape[1:]), packed_RT.dtype)
        for i, (r, s, n) in enumerate(zip(self.row, self.start, self.length)):
            out[i, :n] = packed_RT[r, s : s + n]
        return out
