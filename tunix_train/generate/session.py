"""Requests and a session of the engine's slots: the queue, admissions (prefill, insert), decode
chunks, and each request's completion (the host side of generate/engine.py).

A request's tokens depend on nothing but the request: its positions sit at the same cache slots
whatever slot or time it got (cache.py), each row of a prefill or decode step is computed on its
own, and its random stream is its own (token n is drawn with fold_in(key(seed), stream) folded
with n). A session takes requests while it runs (add), may drop one (cancel: a client that went
away) and widens its sampling kinds when a request needs more (one more compilation).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import time
from typing import Optional, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tunix_train.config import ConfigError
from tunix_train.generate import speculative
from tunix_train.generate.batching import batch_rows, bucket, prefill_batches, prefill_images
from tunix_train.generate.sampling import Draws, Kinds, Rules, Sampling
from tunix_train.sharding import data_axes


@dataclasses.dataclass(frozen=True)
class Request:
    """A prompt's token ids and how to continue it. Its random stream is fold_in(key(seed), stream),
    both taken modulo 2**32 (what jax.random.key makes of a seed without 64-bit mode)."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    seed: int = 0
    stream: int = 0
    stop_strings: tuple[str, ...] = ()  # needs the engine's `decode`
    # the prompt's images' pixel values [I, C, H, W] (model.vision), in the order of its placeholders
    images: Optional[np.ndarray] = dataclasses.field(default=None, compare=False)
    # under a speculative engine, False: drawn as without speculation (the plain engine's draws of
    # its seed), one token a round, whatever the drafts
    speculative: bool = True

    def prefix_key(self) -> tuple:
        """What makes two requests' prefills the same: the prompt, and its images' bytes."""
        if self.images is None:
            return self.prompt
        return self.prompt, hashlib.sha256(np.ascontiguousarray(self.images, np.float32).tobytes()).digest()


@dataclasses.dataclass
class Completion:
    """The new tokens (without the stop token; with the one that completed a stop string), the
    log-probability of each (sampling.draw), why it ended: "stop" or "length", and the stop token
    that ended it, if one did, with its log-probability. With the engine's record_routes, `routes`
    [positions, L, k]: the experts each layer chose for every position whose token was fed to the
    model, the prompt's and then each new token's but the last (whose successor was not drawn).
    `versions`: the version of the parameters that drew each new token, the stop token's last
    where one ended it (they change where Session.install swapped parameters mid-request)."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish: Optional[str] = None
    stop_token: Optional[int] = None
    stop_logprob: Optional[float] = None
    routes: Optional[np.ndarray] = None
    versions: list[int] = dataclasses.field(default_factory=list)


def before_stop(text: str, stops: Sequence[str], final: bool) -> tuple[str, bool]:
    """A streamed completion's text to show: up to its first stop string (and True when there is
    one); while not final, less a tail that may be the start of one."""
    cut = min((text.index(s) for s in stops if s in text), default=None)
    if cut is not None:
        return text[:cut], True
    if final:
        return text, False
    held = max(
        (k for s in stops for k in range(1, min(len(s), len(text)) + 1) if s.startswith(text[-k:])), default=0
    )
    return text[: len(text) - held], False


def _fetch(*xs: jax.Array) -> list[np.ndarray]:
    """The whole of global arrays on this host, fetched together: in a multi-process run the rows
    on other processes' devices are gathered (every process runs the same loop)."""
    if all(x.is_fully_addressable for x in xs):
        return [np.asarray(x) for x in jax.device_get(xs)]
    from jax.experimental import multihost_utils

    return [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in xs]


WORD = 1 << 32


@functools.lru_cache(maxsize=1024)
def _seed_key(seed: int) -> np.ndarray:
    """The raw data of key(seed mod 2**32), which is key(seed) wherever jax.random.key takes the
    seed (it keeps its low 32 bits): any integer is a seed."""
    return np.asarray(jax.random.key_data(jax.random.key(int(seed) % WORD)))


def _check_like(current, new) -> None:
    """New parameters for a running session must be the current ones' tree, shapes and dtypes."""
    have = jax.tree_util.tree_flatten_with_path(current)[0]
    got, structure = jax.tree_util.tree_flatten_with_path(new)
    if structure != jax.tree.structure(current):
        missing = {jax.tree_util.keystr(p) for p, _ in have} ^ {jax.tree_util.keystr(p) for p, _ in got}
        raise ValueError(f"the new parameters' tree differs from the session's at {sorted(missing)[:3]}")
    for (path, a), (_, b) in zip(have, got):
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            raise ValueError(
                f"the new parameters' {jax.tree_util.keystr(path)} is {b.dtype}{list(b.shape)}, "
                f"the session's {a.dtype}{list(a.shape)}"
            )


class Session:
    """One run of the engine's slots: requests wait in a queue, take a free slot, and leave when
    they stop. add() may be called while it runs; step() advances it by one chunk."""

    def __init__(
        self, engine, params, max_len: int, slots: int, kinds: Kinds, version: int = 0, draft_params=None
    ):
        """engine: the Engine (engine.py) whose compiled pieces run the session. version: the
        parameters' (a training step, for asynchronous RL), recorded with every token they draw.
        draft_params: the draft model's, where the engine speculates with one."""
        self.engine, self.params, self.max_len, self.slots, self.kinds = engine, params, max_len, slots, kinds
        # the caches' positions: a speculative round writes k past a request's last (Engine.lookahead)
        self.cache_len = max_len + engine.lookahead
        self.version = version
        self.queue: collections.deque[tuple[int, Request]] = collections.deque()
        self.completions: dict[int, Completion] = {}
        self.running: list[Optional[tuple[int, Request]]] = [None] * slots
        self._next_id = 0
        e = engine
        with jax.set_mesh(e.mesh):
            self.per_layer = e.unstack(params)
            self.caches = e.empty_caches(params, self.per_layer, self.cache_len, slots)
        self.row = {
            name: np.zeros(slots, dtype)
            for name, dtype in (
                ("token", np.int32),
                ("position", np.int32),
                ("count", np.int32),
                ("stream", np.uint32),
                ("temperature", np.float32),
                ("top_k", np.int32),
                ("top_p", np.float32),
                ("speculate", np.bool_),
            )
        }
        self.seeds = np.zeros((slots, *_seed_key(0).shape), np.uint32)
        self._on_device = None  # the rows' arrays on the devices, while the host has not changed them
        self.drafter = speculative.drafter(e, draft_params, self.cache_len, slots)
        self.acceptance: dict[int, float] = {}  # adaptive speculation's: each running request's
        e.stats["cache_bytes"] = sum(x.nbytes for c in self.caches if c is not None for x in c.values())
        # prompt -> (entries, logits, routes, row)
        self._prefixes: collections.OrderedDict = collections.OrderedDict()
        self._routes: dict[int, list[np.ndarray]] = {}  # record_routes: a running request's, in parts

    @property
    def busy_slots(self) -> bool:
        return any(r is not None for r in self.running)

    @property
    def unfinished(self) -> int:
        """Requests waiting or running."""
        return len(self.queue) + sum(r is not None for r in self.running)

    @property
    def busy(self) -> bool:
        return bool(self.queue) or self.busy_slots

    def add(self, request: Request) -> int:
        """Queues a request; returns its id (the key of its completion)."""
        if len(request.prompt) + request.max_new_tokens > self.max_len:
            raise ConfigError(
                f"a prompt of {len(request.prompt)} tokens plus max_new_tokens={request.max_new_tokens} "
                f"is longer than this session's {self.max_len} tokens"
            )
        rid, self._next_id = self._next_id, self._next_id + 1
        self.queue.append((rid, request))
        self.completions[rid] = Completion()
        return rid

    def install(self, params, version: int, draft_params=None) -> None:
        """New parameters between two chunks, without draining the slots (an in-flight weight
        update): the running requests draw their next tokens with them, over the keys and values
        their earlier tokens cached under the old ones (a partial rollout: each token's recorded
        log-probability and version are those of the parameters that drew it); the kept prefills
        are dropped, so a request that starts later is prefilled with the new parameters.
        draft_params: the draft model's new ones too (a distilled draft), drafting over its cache
        of the old ones (a draft only proposes: the tokens keep the model's distribution).
        Parameters of another structure, shape or dtype are a ValueError naming the first that
        differs, and the session goes on with its own."""
        _check_like(self.params, params)
        if draft_params is not None:
            if not isinstance(self.drafter, speculative.DraftModel):
                raise ValueError("draft parameters were given to a session without a draft model")
            _check_like(self.drafter.params, draft_params)
        with jax.set_mesh(self.engine.mesh):
            self.per_layer = self.engine.unstack(params)
            if draft_params is not None:
                layers = self.engine.draft.unstack(draft_params)
                self.drafter = dataclasses.replace(self.drafter, params=draft_params, per_layer=layers)
        self.params, self.version = params, version
        self._prefixes.clear()

    def warm(self, prompt_lengths: Sequence[int]) -> None:
        """Runs the prefill and insert programs once for every batch an admission can make (prefill
        rows: powers of two up to the slots; prompts: each length bucket of `prompt_lengths`), on
        slots no request has used yet, so that they compile now rather than at the first admission
        of each size: a stream (groups.py) admits as slots free, in batches of every size. The slots'
        sampling settings are unset then, so the tokens drawn are discarded. Before any request;
        text prompts only (an image prompt's prefill compiles when it comes)."""
        if self.busy_slots or self.queue:
            raise RuntimeError("Session.warm runs before any request")
        e, dp = self.engine, self.engine.batch_multiple
        sizes = sorted({batch_rows(count, dp) for count in range(1, self.slots + 1)})
        start, token_n = time.perf_counter(), None
        with jax.set_mesh(e.mesh):
            for length in sorted({bucket(n) for n in prompt_lengths}):
                for rows in sizes:
                    tokens, lengths = np.zeros((rows, length), np.int32), np.ones(rows, np.int32)
                    prefill = (self.to_devices(tokens), self.to_devices(lengths), None)
                    entries, logits, _ = e.prefill_step(
                        self.params, self.per_layer, *prefill, max_len=self.cache_len
                    )
                    entries = self._with_draft(entries, prefill)
                    for n in (n for n in sizes if n >= rows):  # as _start pads them
                        rows_n = np.minimum(np.arange(n, dtype=np.int32), rows - 1)
                        slots_n = np.minimum(np.arange(n, dtype=np.int32), self.slots - 1)
                        token_n, _ = self._insert(entries, logits, rows_n, slots_n)
        jax.block_until_ready(token_n)
        e.stats["warm_s"] += time.perf_counter() - start

    def widen(self, sampling: Sampling) -> None:
        """Makes the session able to draw as `sampling` asks (a sampled or cut draw where it drew
        only greedily): its decode program is then the wider one, compiled once."""
        self.kinds = Kinds(*(a or b for a, b in zip(self.kinds, Kinds.of([sampling]))))

    def cancel(self, rid: int) -> None:
        """Drops a request, waiting or running (its slot is free for the next one)."""
        self.queue = collections.deque((i, r) for i, r in self.queue if i != rid)
        self.running = [None if r is not None and r[0] == rid else r for r in self.running]
        self.completions.pop(rid, None)
        self._routes.pop(rid, None)

    def step(self) -> list[tuple[int, list[int]]]:
        """Fills the free slots from the queue, decodes one chunk, and returns each running
        request's new tokens (id, tokens); a request that stopped has its Completion's finish set."""
        new: list[tuple[int, list[int]]] = []
        with jax.set_mesh(self.engine.mesh):
            free = [slot for slot, r in enumerate(self.running) if r is None][: len(self.queue)]
            # a prefill's rows are split over the data axes: wait for that many free slots rather
            # than prefill padding rows (unless fewer requests wait, or no slot is running)
            if free and (
                len(free) >= min(self.engine.batch_multiple, len(self.queue)) or not self.busy_slots
            ):
                new += self._start([(slot, *self.queue.popleft()) for slot in free])
            if self.busy_slots:
                new += self._decode_chunk()
        return new

    def to_devices(self, x: np.ndarray) -> jax.Array:
        """A host array of the slots' rows on the mesh, split like a batch over the data axes."""
        mesh = self.engine.mesh
        return jax.device_put(x, NamedSharding(mesh, P(data_axes(mesh) or None, *[None] * (x.ndim - 1))))

    def _prefilled(self, starting: list[tuple[int, int, Request]]) -> list[tuple]:
        """Each starting request's prefill (entries, logits, routes, row): its prompt's kept one, or
        new ones, the prompts of one bucket length prefilled in one batch (routes: the experts of
        its tokens on the host, with record_routes)."""
        e = self.engine

        def key_of(i, r):
            return r.prefix_key() if e.prefix_cache else i

        found = {}
        for i, (_, _, r) in enumerate(starting):
            if key_of(i, r) in self._prefixes:
                self._prefixes.move_to_end(key_of(i, r))
                found[key_of(i, r)] = self._prefixes[key_of(i, r)]
        todo = {key_of(i, r): r for i, (_, _, r) in enumerate(starting) if key_of(i, r) not in found}
        dp = e.batch_multiple
        for length, group in prefill_batches([(k, r.prompt) for k, r in todo.items()], dp):
            N = batch_rows(len(group), dp)
            tokens, lengths = np.zeros((N, length), np.int32), np.zeros(N, np.int32)
            for row in range(N):
                prompt = group[min(row, len(group) - 1)][1]
                tokens[row, : len(prompt)], lengths[row] = prompt, len(prompt)
            images = prefill_images([todo[k].images for k, _ in group], N)
            prefill = tuple(None if x is None else self.to_devices(x) for x in (tokens, lengths, images))
            entries, logits, routes = e.prefill_step(
                self.params, self.per_layer, *prefill, max_len=self.cache_len
            )
            routes = None if routes is None else _fetch(routes)[0]
            entries = self._with_draft(entries, prefill)
            found.update({k: (entries, logits, routes, row) for row, (k, _) in enumerate(group)})
            e.stats["prefills"] += len(group)
        e.stats["prefix_hits"] += len(starting) - len(todo)
        if e.prefix_cache:
            self._prefixes.update((k, found[k]) for k in todo)
            while len(self._prefixes) > e.prefix_cache:
                self._prefixes.popitem(last=False)
        return [found[key_of(i, r)] for i, (_, _, r) in enumerate(starting)]

    def _start(self, starting: list[tuple[int, int, Request]]) -> list[tuple[int, list[int]]]:
        """Prefills the starting (slot, id, request)s, inserts each into its slot and draws its
        first token: one compiled insert per prefill batch they come from."""
        e, row = self.engine, self.row
        start = time.perf_counter()
        self._on_device = None
        by_source: dict[int, tuple] = {}
        for (slot, rid, request), (entries, logits, routes, prefill_row) in zip(
            starting, self._prefilled(starting)
        ):
            if routes is not None:
                self._routes[rid] = [routes[prefill_row, : len(request.prompt)]]
            s = request.sampling
            settings = {
                "token": 0,
                "position": len(request.prompt),
                "count": 1,
                "stream": int(request.stream) % WORD,
                "temperature": s.temperature,
                "top_k": s.top_k or e.cfg.vocab_size,
                "top_p": s.top_p or 1.0,
                "speculate": request.speculative,
            }
            for name, value in settings.items():
                row[name][slot] = value
            self.seeds[slot] = _seed_key(request.seed)
            self.running[slot] = (rid, request)
            if speculative.looks_up(self.drafter):  # prompt lookup's history: the prompt, for now
                if isinstance(self.drafter, jax.Array):  # on the devices since the last chunk
                    self.drafter = np.array(_fetch(self.drafter)[0])
                self.drafter[slot] = 0
                self.drafter[slot, : len(request.prompt)] = request.prompt
            by_source.setdefault(id(logits), (entries, logits, []))[2].append((prefill_row, slot))
        drawn = []
        for entries, logits, pairs in by_source.values():
            # padded with the last one repeated, which writes it again (and draws its token again,
            # the same), to a power of two and at least the prefill's rows (a kept prefix's batch
            # may serve fewer requests later): one program per prefill size and pair count above it
            rows = max(batch_rows(len(pairs), e.batch_multiple), logits.shape[0])
            pairs += [pairs[-1]] * (rows - len(pairs))
            rows_n, slots_n = (np.asarray(x, np.int32) for x in zip(*pairs))
            drawn.append((slots_n, *self._insert(entries, logits, rows_n, slots_n)))
        new, done = [], set()
        for slots_n, token_n, logprob_n in drawn:
            token_n, logprob_n = _fetch(token_n, logprob_n)
            for slot, token, logprob in zip(slots_n.tolist(), token_n.tolist(), logprob_n.tolist()):
                if slot not in done:
                    done.add(slot)
                    row["token"][slot] = token
                    if speculative.looks_up(self.drafter):
                        self.drafter[slot, row["position"][slot]] = token
                    new.append((self.running[slot][0], self.take(slot, [token], [logprob])))
        e.stats["prefill_s"] += time.perf_counter() - start
        return new

    def _with_draft(self, entries, prefill: tuple):
        """A prefill's entries; with a draft model, (entries, the draft's of the same prompts, with
        the images where the draft reads them), as _insert takes them."""
        if not isinstance(self.drafter, speculative.DraftModel):
            return entries
        d, (tokens, lengths, images) = self.drafter, prefill
        images = images if self.engine.draft.cfg.vision is not None else None
        return entries, self.engine.draft.prefill_step(
            d.params, d.per_layer, tokens, lengths, images, max_len=self.cache_len
        )[0]

    def _insert(self, entries, logits, rows_n: np.ndarray, slots_n: np.ndarray) -> tuple:
        """Writes prefill rows rows_n of `entries` (and the draft's, _with_draft) over slots
        slots_n and draws each one's first token by its slot's sampling settings: (tokens,
        log-probabilities), on the devices."""
        row = self.row
        if isinstance(self.drafter, speculative.DraftModel):
            entries, draft = entries
            caches = self.engine.draft.put_step(self.drafter.caches, draft, rows_n, slots_n)
            self.drafter = dataclasses.replace(self.drafter, caches=caches)
        self.caches, token_n, logprob_n = self.engine.insert_step(
            self.caches,
            entries,
            logits,
            rows_n,
            slots_n,
            Draws(
                Rules(row["temperature"][slots_n], row["top_k"][slots_n], row["top_p"][slots_n]),
                self.seeds[slots_n],
                row["stream"][slots_n],
            ),
            kinds=self.kinds,
        )
        return token_n, logprob_n

    def rows_on_devices(self) -> tuple[dict, jax.Array]:
        """The slots' rows (token, position, count, sampling settings) and seeds on the devices,
        uploaded again when the host changed them (a request started); a decode chunk updates the
        token, position and count there."""
        if self._on_device is None:
            self._on_device = (
                {name: self.to_devices(x) for name, x in self.row.items()},
                self.to_devices(self.seeds),
            )
        return self._on_device

    fetch = staticmethod(_fetch)  # for speculative.py, which session.py imports

    def _decode_chunk(self) -> list[tuple[int, list[int]]]:
        e, row = self.engine, self.row
        start = time.perf_counter()
        if e.speculation is not None:
            new = speculative.decode_chunk(self)
            e.stats["decode_s"] += time.perf_counter() - start
            return new
        rows, seeds = self.rows_on_devices()
        self.caches, token_B, position_B, count_B, drawn_BC, logprob_BC, routes_BC = e.decode_step(
            self.params,
            self.per_layer,
            self.caches,
            rows["token"],
            rows["position"],
            rows["count"],
            Draws(Rules(rows["temperature"], rows["top_k"], rows["top_p"]), seeds, rows["stream"]),
            kinds=self.kinds,
        )
        rows.update(token=token_B, position=position_B, count=count_B)  # the next chunk's, on the devices
        if routes_BC is None:
            drawn_BC, logprob_BC = _fetch(drawn_BC, logprob_BC)
        else:  # record_routes: the experts of the tokens fed, [B, chunk, L, k]
            drawn_BC, logprob_BC, routes_BC = _fetch(drawn_BC, logprob_BC, routes_BC)
        row["token"], row["position"], row["count"] = (
            drawn_BC[:, -1].copy(),
            row["position"] + e.chunk,
            row["count"] + e.chunk,
        )
        e.stats["decode_s"] += time.perf_counter() - start
        e.stats["steps"] += e.chunk
        return [
            (
                self.running[slot][0],
                self.take(
                    slot,
                    drawn_BC[slot].tolist(),
                    logprob_BC[slot].tolist(),
                    None if routes_BC is None else routes_BC[slot],
                ),
            )
            for slot in range(self.slots)
            if self.running[slot] is not None
        ]

    def take(self, slot: int, tokens: list[int], logprobs: list[float], routes=None) -> list[int]:
        """Appends a slot's new tokens to its completion up to where the request stops; frees the
        slot when it does. Returns the tokens taken. routes [C, L, k]: the experts of the token fed
        at each decode step, that drew tokens[c] (record_routes)."""
        rid, request = self.running[slot]
        done = self.completions[rid]
        taken, fed = [], 0
        for token, logprob in zip(tokens, logprobs):
            fed += 1
            done.versions.append(self.version)
            if token in self.engine.stop_ids:
                done.finish, done.stop_token, done.stop_logprob = "stop", token, logprob
                break
            done.tokens.append(token)
            done.logprobs.append(logprob)
            taken.append(token)
            if request.stop_strings and any(
                t in self.engine.decode(done.tokens) for t in request.stop_strings
            ):
                done.finish = "stop"
                break
            if len(done.tokens) == request.max_new_tokens:
                done.finish = "length"
                break
        if routes is not None:
            self._routes[rid].append(routes[:fed])
        if done.finish is not None:
            self.running[slot] = None
            if rid in self._routes:
                done.routes = np.concatenate(self._routes.pop(rid))
        self.engine.stats["tokens"] += len(taken)
        return taken
