"""uvicorn's h11 connection with a deadline for each request's line and headers, which uvicorn
itself lacks: a connection whose next request has not shown all its headers `header_seconds`
after it opened (or after its last response) is closed, so clients that send headers a byte at a
time cannot hold connections open. The body has its own deadline (preparer.BODY_SECONDS)."""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_SECONDS = 10.0


class _HeaderDeadline(H11Protocol):
    header_seconds = HEADER_SECONDS

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def _arm(self) -> None:
        self._deadline = deadline = object()  # this wait's: a later one replaces it
        self.loop.call_later(self.header_seconds, self._headers_late, deadline)

    def _headers_late(self, deadline: object) -> None:
        """Closes the connection if this wait is still on and its request's headers are not in."""
        waiting = deadline is self._deadline and self.conn.their_state is h11.IDLE
        if waiting and not self.transport.is_closing():
            self.transport.close()


def header_deadline(seconds: float = HEADER_SECONDS) -> type[H11Protocol]:
    """The protocol class to give uvicorn.Config(http=...)."""
    return type("H11HeaderDeadline", (_HeaderDeadline,), {"header_seconds": seconds})
