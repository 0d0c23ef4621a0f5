"""A request's body read and tokenized off the event loop (Preparer), every wait bounded: the body
within BODY_SECONDS, the tokenizing within the request's deadline."""

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from tunix_train.serve.access import Access
from tunix_train.serve.schema import BadRequest

BODY_SECONDS = 30.0


class Preparer:
    """A request's body read (at most max_body_bytes within BODY_SECONDS, at most max_preparing at
    once) and work on it (Api.prepare, tokenizing, scoring) run on a pool of two threads, each call
    within the request's deadline (a 504 after it). A thread cannot be stopped: one still busy past
    its request's deadline is stuck, which /health reports (503) so that a supervisor restarts the
    server."""

    def __init__(
        self, request_timeout_s: float, max_body_bytes: int = Access.max_body_bytes, max_preparing: int = 64
    ):
        self.timeout_s, self.max_body_bytes, self.max_preparing = (
            request_timeout_s,
            max_body_bytes,
            max_preparing,
        )
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="prepare")
        self.running: dict[int, tuple[float, float]] = {}  # calls running now: (began, their deadline)
        self.preparing = 0  # requests being read and tokenized now

    async def read(self, http, work, deadline: float):
        """The request `http` read and prepared: work(body)'s answer, or a BadRequest."""
        if self.preparing >= self.max_preparing:
            raise BadRequest(
                f"{self.preparing} requests are being read; retry later",
                status=429,
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )
        self.preparing += 1
        try:
            try:
                data = await asyncio.wait_for(self._body(http), BODY_SECONDS)
            except asyncio.TimeoutError:
                raise BadRequest(
                    f"the body took more than {BODY_SECONDS:g} s to arrive",
                    status=408,
                    code="request_timeout",
                ) from None
            return await self(data, work, deadline)
        finally:
            self.preparing -= 1

    async def _body(self, http) -> bytes:
        chunks, size = [], 0
        async for chunk in http.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise BadRequest(
                    f"the body is larger than this server's {self.max_body_bytes} bytes (--max_body_bytes)",
                    status=413,
                    code="body_too_large",
                )
            chunks.append(chunk)
        return b"".join(chunks)

    def _timed(self, data: bytes, work, deadline: float):
        thread = threading.get_ident()  # one call at a time on each
        self.running[thread] = (time.monotonic(), deadline)
        try:
            return work(data)
        finally:
            del self.running[thread]

    async def __call__(self, data: bytes, work, deadline: float):
        call = asyncio.get_running_loop().run_in_executor(self.pool, self._timed, data, work, deadline)
        try:
            return await asyncio.wait_for(call, max(deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            raise BadRequest(
                f"reading or scoring the request took more than {self.timeout_s:g} s (--request_timeout_s)",
                status=504,
                code="timeout",
            ) from None

    def stuck_s(self) -> float:
        """How long the oldest call past its request's deadline (its 504 given) has run; else 0."""
        now = time.monotonic()
        calls = tuple(self.running.values())  # a copy: the pool's threads write it
        return max((now - began for began, deadline in calls if now >= deadline), default=0.0)
