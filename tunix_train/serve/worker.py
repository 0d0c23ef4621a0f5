"""The engine's session on a thread of its own, which no request can stop.

submit() queues requests and returns, for each, the asyncio queue its (tokens, finish) items
arrive on; finish is None until the last item, then "stop", "length" or "error: why". A request
the session refuses fails alone; a step that raises fails the requests then in the session, which
starts anew. Only a failure outside both ends the thread: every request then learns why, `error`
says it, and on_death() tells the server to exit non-zero so that a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Callable

from tunix_train.serve.schema import BadRequest

log = logging.getLogger("tunix_train.serve")


def _why(err: BaseException) -> str:
    return f"error: {type(err).__name__}: {' '.join(str(err).split())[:300]}"


class Generator:
    def __init__(
        self,
        model,
        slots: int,
        max_len: int,
        max_queue: int,
        on_death: Callable[[], None] = lambda: None,
        draft=None,
        speculative_tokens: int = 4,
        adaptive_speculation: bool = False,
    ):
        """draft, speculative_tokens, adaptive_speculation: speculative decoding of every request, as
        LoadedModel.speculation_for takes them (a draft model's path, or a Speculation)."""
        from tunix_train.generate import Engine, Tuning

        self.model, self.max_len, self.max_queue, self.on_death = model, max_len, max_queue, on_death
        speculation, self.draft_params = model.speculation_for(
            draft, speculative_tokens, adaptive_speculation
        )
        self.engine = Engine(
            model.config,
            model.mesh,
            model.stop_ids,
            slots=slots,
            tuning=Tuning(speculation=speculation),
            decode=model.tokenizer.decode if model.tokenizer else None,
        )
        self.slots = self.engine.slots_for(slots)
        self.session = self._new_session()
        self.error: str | None = None  # why the thread ended, once it has
        self._inbox: queue.Queue = queue.Queue()
        self._outputs: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # _outputs: submit() on the event loop, the rest on the thread
        self._ids = iter(range(1 << 62))
        self._stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.thread.start()

    def _new_session(self):
        from tunix_train.generate.sampling import Kinds

        return self.engine.session(
            self.model.params,
            self.max_len,
            self.slots,
            Kinds(False, False, False),
            draft_params=self.draft_params,
        )

    @property
    def alive(self) -> bool:
        return self.error is None and self.thread.is_alive()

    def check(self, request) -> None:
        """The engine's one-line refusal of a request it cannot serve, as a 400."""
        from tunix_train.config import ConfigError

        try:
            self.engine.check(request)
        except ConfigError as err:
            param = next(
                (p for p in ("max_new_tokens", "top_k", "top_p", "temperature") if p in str(err)), "messages"
            )
            raise BadRequest(str(err), {"max_new_tokens": "max_tokens"}.get(param, param)) from None
        if len(request.prompt) + request.max_new_tokens > self.max_len:
            raise BadRequest(
                f"the prompt's {len(request.prompt)} tokens plus max_tokens={request.max_new_tokens} "
                f"pass this server's {self.max_len} tokens (--max_len)",
                "max_tokens",
                code="context_length_exceeded",
            )

    def submit(self, requests: list) -> list[tuple[int, asyncio.Queue]]:
        """The requests queued together, or none of them: a 503 once the engine has stopped, a 429
        when more than max_queue would wait for a slot."""
        if not self.alive:
            raise BadRequest(
                f"the engine has stopped ({self.error}); the server is exiting",
                status=503,
                code="engine_stopped",
            )
        loop, submitted = asyncio.get_running_loop(), []
        with self._lock:
            waiting = len(self._outputs) + len(requests) - self.slots
            if waiting > self.max_queue:
                raise BadRequest(
                    f"{len(self._outputs)} requests are in flight and at most {self.max_queue} may "
                    f"wait for this server's {self.slots} slots (--max_queue); retry later",
                    status=429,
                    code="rate_limit_exceeded",
                    headers={"Retry-After": "1"},
                )
            for _ in requests:
                key, output = next(self._ids), asyncio.Queue()
                self._outputs[key] = (loop, output)
                submitted.append((key, output))
        for (key, _), request in zip(submitted, requests):
            self._inbox.put(("add", key, request))
        return submitted

    def cancel(self, key: int) -> None:
        with self._lock:
            self._outputs.pop(key, None)
        self._inbox.put(("cancel", key, None))

    def stop(self) -> None:
        self._stopped.set()
        self.thread.join(timeout=30)

    def occupancy(self) -> dict[str, int]:
        with self._lock:
            in_flight = len(self._outputs)
        return {"running": min(in_flight, self.slots), "queued": max(in_flight - self.slots, 0)}

    def stats(self) -> dict[str, float]:
        """The engine's counters, less prefix_hits (which would tell one client another's prompts),
        and with speculative decoding its acceptance rate and mean accepted length."""
        from tunix_train.generate import speculative

        stats = dict(self.engine.stats)
        if self.engine.speculation is not None:
            stats.update(speculative.figures(self.engine.stats))
        return {k: round(v, 3) for k, v in stats.items() if k != "prefix_hits"}

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as err:  # noqa: BLE001 - every request learns why, then the server exits
            self.error = _why(err)
            log.error(f"the engine stopped: {self.error}")
            with self._lock:
                keys = list(self._outputs)
            for key in keys:
                self._send(key, [], self.error)
            self.on_death()

    def _serve(self) -> None:
        rids: dict[int, int] = {}  # our key -> the session's request id
        while not self._stopped.is_set():
            try:
                items = [self._inbox.get(timeout=0.05 if not self.session.busy else 0)]
            except queue.Empty:
                items = []
            while not self._inbox.empty():
                items.append(self._inbox.get_nowait())
            for action, key, request in items:
                if action == "cancel":
                    if key in rids:
                        self.session.cancel(rids.pop(key))
                    continue
                try:
                    self.session.widen(request.sampling)
                    rids[key] = self.session.add(request)
                except Exception as err:  # noqa: BLE001 - this request fails, the others go on
                    self._send(key, [], _why(err))
            if not self.session.busy:
                continue
            keys = {rid: key for key, rid in rids.items()}  # the session's request id -> our key
            try:
                produced = self.session.step()
            except Exception as err:  # noqa: BLE001 - which request made it fail is unknown: all in it fail
                log.error(
                    f"a step of the engine failed: {_why(err)}; its {len(rids)} requests failed with it"
                )
                for key in rids:
                    self._send(key, [], _why(err))
                rids.clear()
                self.session = self._new_session()
                continue
            merged: dict[int, list[int]] = {}  # a request that starts gets its first token and a chunk
            for rid, tokens in produced:
                merged.setdefault(rid, []).extend(tokens)
            for rid, tokens in merged.items():
                key, done = keys.get(rid), self.session.completions.get(rid)
                if key is None or done is None:
                    continue
                self._send(key, tokens, done.finish)
                if done.finish is not None:
                    self.session.completions.pop(rid)
                    rids.pop(key, None)

    def _send(self, key: int, tokens: list[int], finish: str | None) -> None:
        with self._lock:
            target = self._outputs.get(key) if finish is None else self._outputs.pop(key, None)
        if target is not None:
            loop, output = target
            try:
                loop.call_soon_threadsafe(output.put_nowait, (tokens, finish))
            except RuntimeError:  # the event loop has closed: the server is gone
                pass
