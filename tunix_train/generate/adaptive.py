"""Adaptive speculation: how many tokens to draft in the next chunk (Speculation(adaptive=True)).

A round that drafts k tokens emits one of the model's plus the drafts it keeps: where each draft
is kept with a chance a, (1 - a^(k+1)) / (1 - a) tokens on average. The verify pass has one shape
for the whole batch, so k is the batch's: the k of `choices` (0 included: no drafts, one token a
round) that emits the most tokens a second over the running rows, each row at its own recent
acceptance. Speculation that does not pay, for a weak draft, text that does not repeat, or a
policy that moved away from its draft, so turns itself off, and on again when the acceptance
rises.

A row's acceptance a is a moving average over its chunks: in a chunk that drafted, of the drafts
it kept over those kept and those refused (the maximum-likelihood a of its rounds); in a chunk
that drafted nothing, of the chance its first draft would have been kept (prompt lookup: computed
each round, speculative.first_kept; a draft model: estimated from the tokens emitted when it
reads them after the chunk, speculative.catch_up). A new row starts at the moving average of all
rows' chunks.

A round's cost at each k is measured: seconds a round, a moving average over the chunks that ran
it, leaving out each program's first call (its compilation). The largest and the smallest k are
measured first; a k in between is interpolated from its measured neighbours until it has run.

The tokens are the model's whatever the k (greedily the same, sampled the same distribution), but
which k runs depends on timings, so sampled tokens are not repeated from run to run for a seed.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

RECENT = 0.25  # weight of a chunk's figure in a moving average (a row's acceptance, a round's seconds)


def _averaged(previous: float | None, figure: float) -> float:
    return figure if previous is None else (1 - RECENT) * previous + RECENT * figure


class Adaptive:
    """The k of each chunk, from the rows' acceptance and each k's measured seconds a round."""

    def __init__(self, choices: Sequence[int]):
        self.choices = tuple(sorted(set(choices)))
        self.round_s: dict[int, float] = {}  # k -> seconds a round
        self.calls: dict[int, int] = dict.fromkeys(self.choices, 0)
        self.prior = 0.5  # a new row's acceptance: the moving average of all rows' chunks

    def choose(self, acceptance: Sequence[float]) -> int:
        """The k for rows whose drafts are kept with chances `acceptance` (1 row each; a row that
        does not speculate counts as 0)."""
        for k in (self.choices[-1], self.choices[0]):  # the ends are measured first
            if k not in self.round_s:
                return k
        a_S = np.minimum(np.asarray(acceptance, np.float64), 1 - 1e-6)
        measured = sorted(self.round_s)
        cost_K = np.interp(self.choices, measured, [self.round_s[k] for k in measured])
        tokens_K = np.array([np.sum((1 - a_S ** (k + 1)) / (1 - a_S)) for k in self.choices])
        return self.choices[int(np.argmax(tokens_K / cost_K))]  # a tie: the smaller k

    def record(self, k: int, rounds: int, seconds: float) -> None:
        """A chunk of `rounds` rounds at k took `seconds` (the first call of k compiled: left out)."""
        self.calls[k] += 1
        if self.calls[k] > 1:
            self.round_s[k] = _averaged(self.round_s.get(k), seconds / rounds)

    def observed(self, previous: float | None, k: int, kept: np.ndarray, chances: np.ndarray) -> float:
        """A row's acceptance after a chunk whose rounds at k kept `kept` drafts each, and measured
        `chances` of keeping a first draft; previous: the row's before (None: a new row)."""
        if k:
            refused = np.sum(kept < k)
            figure = float(np.sum(kept) / max(np.sum(kept) + refused, 1))
        else:
            figure = float(np.mean(chances))
        row = _averaged(self.prior if previous is None else previous, figure)
        self.prior = _averaged(self.prior, figure)
        return row
