"""A teacher's top-k log-probabilities, stored beside the batches they were computed on
(scripts/teacher_logits.py writes them; objective=distill with training.distill.teacher_logits
reads them instead of running the teacher: MaxText's offline distillation).

A directory holds `teacher_logits.json` (what was computed: the teacher, k, the batch shape, the
number of steps) and, per process p, `train-{p:05d}.parquet` and `eval-{p:05d}.parquet`: one row
group per step (an evaluation batch), one row per (accumulation step, global row) with the row's
tokens (`inputs`, `targets`, `loss_mask`, `positions`, `segment_ids`, T each) and the teacher's
`top_ids` and `top_log_probs` (T x k each, flattened). A reader takes the rows its process holds
from every file, so a run may read them on another number of hosts than wrote them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from tunix_train.config import ConfigError

META = "teacher_logits.json"
TOKEN_FIELDS = ("inputs", "targets", "loss_mask", "positions", "segment_ids")
TOP_FIELDS = {"top_ids": np.int32, "top_log_probs": np.float32}
KEY = "training.distill.teacher_logits"


def _parquet():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{KEY}: reading and writing them needs pyarrow: pip install pyarrow") from None
    return pa, pq


class Writer:
    """One process's files: `add(split, batch)` appends a host batch (the data's fields [A, B, T],
    top_ids and top_log_probs [A, B, T, k]) whose rows are `rows` of the global batch."""

    def __init__(self, directory: Path, process: int, rows: range):
        self.directory, self.rows = Path(directory), rows
        self.directory.mkdir(parents=True, exist_ok=True)
        self.names = {split: self.directory / f"{split}-{process:05d}.parquet" for split in ("train", "eval")}
        self._writers: dict[str, Any] = {}
        self.counts = {"train": 0, "eval": 0}

    def add(self, split: str, batch: dict[str, np.ndarray]) -> None:
        pa, pq = _parquet()
        A, B, T = batch["inputs"].shape
        columns = {
            "micro": np.repeat(np.arange(A, dtype=np.int32), B),
            "row": np.tile(np.arange(self.rows.start, self.rows.start + B, dtype=np.int32), A),
        }
        for name in TOKEN_FIELDS:
            columns[name] = list(batch[name].reshape(A * B, T))
        for name, dtype in TOP_FIELDS.items():
            columns[name] = list(batch[name].astype(dtype).reshape(A * B, -1))
        table = pa.table(columns)
        if split not in self._writers:
            self._writers[split] = pq.ParquetWriter(self.names[split], table.schema)
        self._writers[split].write_table(table, row_group_size=A * B)  # one row group per batch
        self.counts[split] += 1

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()


def write_meta(directory: Path, meta: dict[str, Any]) -> None:
    (Path(directory) / META).write_text(json.dumps(meta, indent=1) + "\n")


# what teacher_logits.json must hold: each a whole number of at least 1 (k, the batch's shape)
COUNTS = (
    "top_k",
    "vocab_size",
    "seq_len",
    "global_micro_batch",
    "accumulation_steps",
    "steps",
    "eval_batches",
)


def read_meta(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / META
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"{KEY}: cannot read {path} ({type(err).__name__}); write the directory with "
            f"scripts/teacher_logits.py"
        ) from None
    bad = next(
        (c for c in COUNTS if not isinstance(meta, dict) or type(meta.get(c)) is not int or meta[c] < 0),
        None,
    )
    if bad is not None:
        raise ConfigError(
            f"{KEY}: {path} has no whole number {bad}; rewrite it with scripts/teacher_logits.py"
        )
    return meta


LOG_PROB_SLACK = 1e-4  # a log-probability above 0 by rounding


def _check_log_probs(file, path: Path) -> None:
    """Every stored log-probability finite and at most 0 (LOG_PROB_SLACK), read a row group at a
    time: a file of NaN, infinities or positive values is refused when it is opened."""
    for group in range(file.num_row_groups):
        try:
            column = file.read_row_group(group, columns=["top_log_probs"]).column(0)
            values = column.combine_chunks().flatten().to_numpy(zero_copy_only=False)
        except Exception as err:  # noqa: BLE001 - pyarrow's errors for a damaged file or another layout
            raise ConfigError(f"{KEY}: {path} has no readable top_log_probs ({type(err).__name__})") from None
        bad = ~np.isfinite(values) | (values > LOG_PROB_SLACK)
        if bad.any():
            raise ConfigError(
                f"{KEY}: {path} holds log-probabilities that are not finite numbers at most 0 (row "
                f"group {group}: {values[bad][0]}); rewrite the directory with scripts/teacher_logits.py"
            )


class StoredBatches:
    """The host batches of one split, in the order they were written, with the teacher's top k:
    [A, this process's rows, T] (and T x k); checkpointable (get_state: the next batch's number)."""

    def __init__(self, directory: str | Path, split: str, rows: range, meta: dict[str, Any]):
        _, pq = _parquet()
        self.rows, self.meta = rows, meta
        self.files = []
        for path in sorted(Path(directory).glob(f"{split}-*.parquet")):
            try:
                self.files.append(pq.ParquetFile(path))
            except Exception as err:  # pyarrow's errors for a file that is not Parquet
                raise ConfigError(f"{KEY}: {path} is not a Parquet file ({type(err).__name__})") from None
            _check_log_probs(self.files[-1], path)
        self.count = meta["steps" if split == "train" else "eval_batches"]
        self.next = 0

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self.next >= self.count:
            raise StopIteration
        batch = self.read(self.next)
        self.next += 1
        return batch

    def read(self, n: int) -> dict[str, np.ndarray]:
        A, T, B = self.meta["accumulation_steps"], self.meta["seq_len"], len(self.rows)
        try:
            batch = self._rows_of(n, A, B, T)
        except ConfigError:
            raise
        except (
            KeyError,
            ValueError,
            TypeError,
            IndexError,
            OSError,
        ) as err:  # a damaged file, another layout
            raise ConfigError(
                f"{KEY}: batch {n} cannot be read ({type(err).__name__}); rewrite the directory with "
                f"scripts/teacher_logits.py"
            ) from None
        ids = [batch[f] for f in ("inputs", "targets", "top_ids")]
        if any(x.size and (x.min() < 0 or x.max() >= self.meta["vocab_size"]) for x in ids):
            raise ConfigError(
                f"{KEY}: batch {n} holds token ids outside the vocabulary; rewrite the directory"
            )
        return batch

    def _rows_of(self, n: int, A: int, B: int, T: int) -> dict[str, np.ndarray]:
        pa, _ = _parquet()
        table = pa.concat_tables([f.read_row_group(n) for f in self.files if n < f.num_row_groups])
        micro, row = (table.column(c).to_numpy() for c in ("micro", "row"))
        keep = (row >= self.rows.start) & (row < self.rows.stop)
        picked = np.flatnonzero(keep)[np.lexsort((row[keep], micro[keep]))]
        if len(picked) != A * B:
            raise ConfigError(
                f"{KEY}: batch {n} holds {len(picked)} of this process's {A * B} rows; the "
                f"directory is incomplete (rewrite it with scripts/teacher_logits.py)"
            )
        taken = table.take(picked)
        batch = {}
        for name in (*TOKEN_FIELDS, *TOP_FIELDS):
            values = np.stack(taken.column(name).to_numpy(zero_copy_only=False))
            batch[name] = (
                values.reshape(A, B, T, self.meta["top_k"]) if name in TOP_FIELDS else values.reshape(A, B, T)
            )
        return batch

    def get_state(self) -> dict[str, Any]:
        return {"stored_batch": self.next}

    def set_state(self, state: dict[str, Any]) -> None:
        self.next = state["stored_batch"]

    def close(self) -> None:
        self.files = []
