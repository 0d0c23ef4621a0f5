"""metrics.jsonl (one JSON object per logged step) and tensorboardX scalars, side by side."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from tunix_train.files import LineLog


def _without_torch():
    """tensorboardX's SummaryWriter. Where torch is installed (transformers' users), tensorboardX
    imports it, 1.7 s of every run's start here, only to accept torch tensors as values; we log
    floats, so unless torch is already loaded its import is refused for that moment."""
    refuse = "torch" not in sys.modules
    if refuse:
        sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX expects
    try:
        from tensorboardX import SummaryWriter
    finally:
        if refuse:
            del sys.modules["torch"]
    return SummaryWriter


SummaryWriter = _without_torch()

LOGGER_NAME = "tunix_train"


class _ConsoleHandler(logging.StreamHandler):
    """On a terminal, records logged with extra={"progress": True} rewrite one live line in place;
    anything else (and everything when the output is not a terminal) is a plain line."""

    def __init__(self, stream):
        super().__init__(stream)
        self._live = stream.isatty()
        self._pending = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self._live:
            return super().emit(record)
        text = self.format(record)
        if getattr(record, "progress", False):
            self.stream.write("\r\x1b[K" + text)
            self._pending = True
        else:
            self.stream.write(("\n" if self._pending else "") + text + "\n")
            self._pending = False
        self.flush()


def setup_logging(run_dir: Path) -> logging.Logger:
    """The tunix_train logger writes to stdout (a live progress line on a terminal) and to
    run_dir/train.log (plain lines)."""
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    formatter = logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for handler in (_ConsoleHandler(sys.stdout), logging.FileHandler(run_dir / "train.log")):
        handler.setFormatter(formatter)
        logger.addHandler(handler)
    return logger


class MetricsWriter:
    """Appends to run_dir/metrics.jsonl and writes the same scalars as TensorBoard events."""

    def __init__(self, run_dir: Path):
        self._run_dir = run_dir
        self._jsonl = LineLog(run_dir / "metrics.jsonl")
        self._tensorboard = SummaryWriter(logdir=str(run_dir))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self._jsonl.append(json.dumps({"step": step, **scalars}))
        for name, value in scalars.items():
            self._tensorboard.add_scalar(name, value, step)
        self._tensorboard.flush()

    def write_samples(self, step: int, samples: list[tuple[str, str]]) -> None:
        """Generated continuations (prompt, text): to samples.jsonl and as TensorBoard text."""
        samples_log = LineLog(self._run_dir / "samples.jsonl")
        for prompt, text in samples:
            samples_log.append(json.dumps({"step": step, "prompt": prompt, "text": text}))
        samples_log.close()
        for i, (prompt, text) in enumerate(samples):
            self._tensorboard.add_text(f"sample_{i}", f"{prompt}{text}", step)
        self._tensorboard.flush()

    def write_rollout(self, step: int, record: dict) -> None:
        """What an asynchronous step trained on (its prompts' tickets, streaming.py) to rollouts.jsonl."""
        rollouts = LineLog(self._run_dir / "rollouts.jsonl")
        rollouts.append(json.dumps({"step": step, **record}))
        rollouts.close()

    def close(self) -> None:
        self._jsonl.close()
        self._tensorboard.close()
