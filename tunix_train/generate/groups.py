"""Groups of completions streamed through one session, the rollout side of asynchronous RL
(issue 73): prompts enter as slots free (a group's requests are admitted while a slot would
otherwise be idle), a group (its prompt's n completions) leaves whole once all
of them have stopped, in the order groups finish rather than the order they entered, and at most
`buffered` finished groups wait for the trainer (admission pauses while they do). New parameters
enter between two chunks (Session.install); each token records the version that drew it.

The stream advances only when asked (take, advance): the caller interleaves it with training.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

from tunix_train.generate.session import Completion, Request, Session


@dataclasses.dataclass
class Group:
    """One prompt's completions: `key` is the caller's (a prompt's index), `admitted` the version of
    the parameters when the group entered."""

    key: Any
    completions: list[Completion]
    admitted: int
    number: int  # the order it was admitted in


class GroupStream:
    """Feeds `session` the requests of the prompts `keys` yields (requests_for(key): a group's)
    whenever fewer of its requests wait or run than it has slots, and holds finished groups until
    take() hands them out; groups admitted and not taken are at most `buffered`."""

    def __init__(
        self,
        session: Session,
        keys: Iterator[Any],
        requests_for: Callable[[Any], list[Request]],
        buffered: int,
    ):
        if buffered < 1:
            raise ValueError(f"buffered={buffered} must be at least 1")
        self.session, self.keys, self.requests_for = session, keys, requests_for
        self.buffered = buffered
        self.ready: list[Group] = []  # finished, in the order they finished
        self._open: dict[Any, tuple[Group, list[int]]] = {}  # admitted: the group, its request ids
        self._exhausted, self._admissions = False, 0

    @property
    def done(self) -> bool:
        """No group left to admit, run or hand out."""
        return self._exhausted and not self._open and not self.ready

    def unfinished(self) -> list:
        """The keys of the groups admitted and not finished (waiting or running), in the order
        they were admitted: what a checkpoint keeps, to admit them again whole on resume (the
        finished ones, `ready`, it keeps as they are)."""
        return [g.key for g, _ in sorted(self._open.values(), key=lambda x: x[0].number)]

    def install(self, params, version: int) -> None:
        self.session.install(params, version)

    def _admit(self) -> None:
        # admitted and not taken stays within `buffered`: the groups in flight finish into room
        while (
            not self._exhausted
            and self.session.unfinished < self.session.slots
            and len(self.ready) + len(self._open) < self.buffered
        ):
            key = next(self.keys, None)
            if key is None:
                self._exhausted = True
                break
            ids = [self.session.add(r) for r in self.requests_for(key)]
            self._open[key] = (Group(key, [], self.session.version, self._admissions), ids)
            self._admissions += 1

    def advance(self) -> None:
        """Admits what the bounds allow, decodes one chunk, and moves the groups it finished to
        `ready`."""
        self._admit()
        if not self.session.busy:
            return
        self.session.step()
        completions = self.session.completions
        for key, (group, ids) in list(self._open.items()):
            if all(completions[i].finish is not None for i in ids):
                group.completions = [completions.pop(i) for i in ids]
                self.ready.append(group)
                del self._open[key]

    def _advance_until(self, count: int) -> None:
        while len(self.ready) < count and not (self._exhausted and not self._open):
            self.advance()

    def fill(self, count: int, more: Callable[[], bool] = lambda: False) -> None:
        """Advances until `count` groups are ready (or the prompts run out) and admits what the
        bounds allow, then advances for as long as more() says and there is work."""
        self._advance_until(count)
        self._admit()  # the room left is filled: what the engine runs next
        while more() and self.session.busy:
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
