"""Groups of completions streamed through one or more sessions (replicas: engines on devices of
their own), the rollout side of asynchronous RL (issue 73): prompts enter as slots free (a group's
requests are admitted, to the replica with the most free slots, while a slot would otherwise be
idle), a group (its prompt's n completions) leaves whole once all of them have stopped, in the
order groups finish rather than the order they entered, and at most `buffered` groups are admitted
and not taken (admission pauses while they are). New parameters enter between two chunks
(Session.install); each token records the version that drew it.

The stream advances only when asked (take, fill, advance): the caller interleaves it with training.
With a deadline (`timeout_s`), each replica's chunk and install run on a thread of its own, all
replicas at once: one that fails, or has not finished by the deadline, is dropped (`on_lost` says
so) and its groups in flight are admitted again, first, to the others; when none is left,
`ReplicasLost`. Replicas are visited in their order after each chunk, so what a stream hands out
depends on the chunks' results only, not on which replica finished first.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import queue
import threading
from typing import Any, Callable, Iterator, Sequence

from tunix_train.generate.session import Completion, Request, Session


class ReplicasLost(RuntimeError):
    """Every replica of a stream failed or stopped making progress (the message says how the last
    one did)."""


@dataclasses.dataclass
class Group:
    """One prompt's completions: `key` is the caller's (a prompt's index), `admitted` the version of
    the parameters when the group entered."""

    key: Any
    completions: list[Completion]
    admitted: int
    number: int  # the order it was admitted in
    settled: set[int] = dataclasses.field(default_factory=set)  # members done (over turns: `after`)


class _Worker:
    """A daemon thread doing one replica's work in order: one that hangs does not hold up the
    process's exit (a ThreadPoolExecutor's threads are joined at exit)."""

    def __init__(self, name: str):
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put((future, fn, args))
        return future

    def stop(self) -> None:
        self._inbox.put(None)

    def _run(self) -> None:
        while (item := self._inbox.get()) is not None:
            future, fn, args = item
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 - the caller reads it from the future
                future.set_exception(err)


@dataclasses.dataclass(eq=False)
class _Replica:
    index: int
    session: Session
    open: dict = dataclasses.field(default_factory=dict)  # key -> (Group, its request ids)
    worker: _Worker | None = None


class GroupStream:
    """Feeds `sessions` (one, or a replica's each) the requests of the prompts `keys` yields
    (requests_for(key): a group's) whenever fewer of a session's requests wait or run than it has
    slots, and holds finished groups until take() hands them out; groups admitted and not taken
    are at most `buffered`. timeout_s: the module docstring (None: in the caller's thread, no
    deadline). after(key, member, completion), for requests over turns: the request that
    continues member `member` of group `key` once its request finished, or None where it is done
    (its completion then the group's); without it every member is done at its first request's end."""

    def __init__(
        self,
        sessions: Session | Sequence[Session],
        keys: Iterator[Any],
        requests_for: Callable[[Any], list[Request]],
        buffered: int,
        timeout_s: float | None = None,
        install_timeout_s: float | None = None,
        on_lost: Callable[[int, str, int, int], None] = lambda replica, why, groups, left: None,
        after: Callable[[Any, int, Completion], Request | None] | None = None,
    ):
        if buffered < 1:
            raise ValueError(f"buffered={buffered} must be at least 1")
        sessions = [sessions] if isinstance(sessions, Session) else list(sessions)
        self.replicas = [_Replica(i, s) for i, s in enumerate(sessions)]
        self.started_with = len(self.replicas)
        self.keys, self.requests_for, self.buffered = keys, requests_for, buffered
        self.timeout_s, self.on_lost, self.after = timeout_s, on_lost, after
        self.install_timeout_s = timeout_s if install_timeout_s is None else install_timeout_s
        if timeout_s is not None:
            for r in self.replicas:
                r.worker = _Worker(f"replica-{r.index}")
        self.ready: list[Group] = []  # finished, in the order they finished
        self._returned: collections.deque = collections.deque()  # a lost replica's, admitted first
        self._exhausted, self._admissions = False, 0

    @property
    def session(self) -> Session:
        """The first live replica's session."""
        return self.replicas[0].session

    @property
    def _open(self) -> int:
        return sum(len(r.open) for r in self.replicas)

    @property
    def _drained(self) -> bool:
        """No group left to admit or run."""
        return self._exhausted and not self._returned and not self._open

    @property
    def done(self) -> bool:
        """No group left to admit, run or hand out."""
        return self._drained and not self.ready

    def unfinished(self) -> list:
        """The keys of the groups admitted and not finished (waiting or running), in the order
        they were admitted: what a checkpoint keeps, to admit them again whole on resume (the
        finished ones, `ready`, it keeps as they are)."""
        running = sorted((g for r in self.replicas for g, _ in r.open.values()), key=lambda g: g.number)
        return [*self._returned, *(g.key for g in running)]

    def _next_key(self):
        if self._returned:
            return self._returned.popleft()
        key = next(self.keys, None)
        self._exhausted = key is None
        return key

    def _admit(self) -> None:
        # admitted and not taken stays within `buffered`: the groups in flight finish into room
        while len(self.ready) + self._open < self.buffered:
            replica = max(self.replicas, key=lambda r: r.session.slots - r.session.unfinished)
            if replica.session.unfinished >= replica.session.slots:
                return
            key = self._next_key()
            if key is None:
                return
            ids = [replica.session.add(r) for r in self.requests_for(key)]
            replica.open[key] = (Group(key, [], replica.session.version, self._admissions), ids)
            self._admissions += 1

    def _on_each(self, replicas: list[_Replica], work: Callable, what: str, timeout_s: float | None) -> list:
        """work(replica) for each of `replicas`, at once on their threads within the deadline (or
        here, in turn, without one); those that fail or miss it are dropped. The replicas that did
        it, in order. what: the work, as the reason a replica is dropped names it."""
        if timeout_s is None:
            for r in replicas:
                work(r)
            return replicas
        futures = [(r, r.worker.submit(work, r)) for r in replicas]
        concurrent.futures.wait([f for _, f in futures], timeout=timeout_s)
        done = []
        for r, f in futures:
            where = f"{what} in engine replica {r.index}" if self.started_with > 1 else what
            if not f.done():
                self._lose(r, f"{where} took over {timeout_s:g} s")
            elif (err := f.exception()) is not None:  # its message's first line: the reason is one line
                first = next((line for line in str(err).splitlines() if line.strip()), "")
                self._lose(r, f"{where} failed ({type(err).__name__}: {first.strip()})")
            else:
                done.append(r)
        return done

    def _lose(self, replica: _Replica, why: str) -> None:
        """Drops a replica: its groups in flight are admitted again, first, in their order."""
        self.replicas.remove(replica)
        replica.worker.stop()  # a hung one's thread is left to end (a daemon)
        lost = sorted((g for g, _ in replica.open.values()), key=lambda g: g.number)
        self._returned.extendleft(reversed([g.key for g in lost]))
        self.on_lost(replica.index, why, len(lost), len(self.replicas))
        if not self.replicas:
            raise ReplicasLost(why)

    def close(self) -> None:
        """Ends the replicas' threads."""
        for r in self.replicas:
            if r.worker is not None:
                r.worker.stop()

    def install(self, params, version: int, draft_params=None) -> None:
        """New parameters in every replica between two chunks: `params` (each replica's the same)
        or params(replica index), called on the replica's thread within the deadline; the draft
        model's new ones too where given (Session.install)."""

        def install(r: _Replica) -> None:
            r.session.install(params(r.index) if callable(params) else params, version, draft_params)

        self._on_each(
            list(self.replicas), install, f"installing version {version}'s weights", self.install_timeout_s
        )

    def advance(self) -> None:
        """Admits what the bounds allow, decodes one chunk in every busy replica, and moves the
        groups it finished to `ready`."""
        self._admit()
        busy = [r for r in self.replicas if r.session.busy]
        for r in self._on_each(busy, lambda r: r.session.step(), "a decode chunk", self.timeout_s):
            completions = r.session.completions
            for key, (group, ids) in list(r.open.items()):
                if self.after is not None:
                    self._continue(r.session, group, ids)
                if all(completions[i].finish is not None for i in ids):
                    group.completions = [completions.pop(i) for i in ids]
                    self.ready.append(group)
                    del r.open[key]

    def _continue(self, session: Session, group: Group, ids: list[int]) -> None:
        """Each member whose request finished: its next request (`after`) queued in its place, in
        the same session, or it is settled."""
        for member, i in enumerate(ids):
            completion = session.completions[i]
            if member in group.settled or completion.finish is None:
                continue
            following = self.after(group.key, member, completion)
            if following is None:
                group.settled.add(member)
            else:
                del session.completions[i]
                ids[member] = session.add(following)

    def _advance_until(self, count: int) -> None:
        while len(self.ready) < count and not self._drained:
            self.advance()

    def fill(self, count: int, more: Callable[[], bool] = lambda: False) -> None:
        """Advances until `count` groups are ready (or the prompts run out) and admits what the
        bounds allow, then advances for as long as more() says and there is work."""
        self._advance_until(count)
        self._admit()  # the room left is filled: what the engine runs next
        while more() and any(r.session.busy for r in self.replicas):
            self.advance()

    def take(self, count: int) -> list[Group]:
        """The first `count` groups to finish (fewer only where the prompts run out), advancing
        the session until they have."""
        if count > self.buffered:
            raise ValueError(f"take({count}) asks for more than the {self.buffered} groups buffered")
        self._advance_until(count)
        taken, self.ready = self.ready[:count], self.ready[count:]
        self._admit()  # into the room they leave
        return taken
