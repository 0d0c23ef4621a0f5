"""Files the project writes, never seen half-written.

A whole file (an export, a config) is written beside its target under a hidden temporary name,
flushed to disk (fsync), and renamed over the target, then the folder is synced: a crash leaves
the old file or the new one, and a failed write leaves nothing. The temporary file is created with
the mode any new file gets (0o666 less the umask, which is never changed). A log (metrics.jsonl)
is appended a whole line per write(2) with O_APPEND; a line torn by a crash is cut off when the
log is opened again, with a warning.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path
from typing import Callable

log = logging.getLogger("tunix_train")


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """write(temporary path) fills the file; then it replaces `path` whole."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.{secrets.token_hex(6)}.partial")
    # the umask applies, as to any new file
    os.close(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        write(partial)
        with open(partial, "rb+") as written:
            os.fsync(written.fileno())
        os.replace(partial, path)
        _sync_folder(path.parent)
    finally:
        if partial.exists():
            partial.unlink()


def write_text(path: Path, text: str) -> None:
    write_atomically(path, lambda partial: partial.write_text(text, encoding="utf-8"))


def _sync_folder(folder: Path) -> None:
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


class LineLog:
    """A file of lines, appended one whole line at a time."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._handle = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o666)
        self._cut_torn_line()

    def _cut_torn_line(self) -> None:
        size = os.fstat(self._handle).st_size
        if size == 0 or os.pread(self._handle, 1, size - 1) == b"\n":
            return
        tail = os.pread(self._handle, min(size, 1 << 20), max(size - (1 << 20), 0))
        keep = size - len(tail) + tail.rfind(b"\n") + 1 if b"\n" in tail else 0
        log.warning(
            f"warning: {self.path} ended in a line cut short ({size - keep} bytes, a crash while "
            f"writing it); it is removed"
        )
        os.ftruncate(self._handle, keep)

    def append(self, line: str) -> None:
        os.write(self._handle, (line.rstrip("\n") + "\n").encode("utf-8"))

    def close(self) -> None:
        os.close(self._handle)
