"""Preemption: SIGTERM or SIGINT asks the loop to stop after the current step."""

from __future__ import annotations

import signal
import threading


class StopRequest:
    """While active, the first SIGTERM/SIGINT sets `requested`; a second SIGINT interrupts at once."""

    def __init__(self):
        self.requested: str | None = None
        self._previous = {}

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # handlers only install there
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


class RunStopped(Exception):
    """The run ended early on purpose; `exit_code` is what the process should return."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
