"""The inference engine: continuous batching over a fixed number of slots, on the mesh the
parameters live on. The one way this project generates text (the API, the CLI, samples during
training, GRPO's rollouts).

Waiting requests take the free slots: their prompts are prefilled together (right-padded to a
power of two, so few compilations), each one's keys and values inserted into its slot's cache
rows, and its first token drawn from the prefill's logits. Decoding runs `chunk` steps of every
slot per call to one compiled scan; between chunks the host takes each slot's new tokens, frees
the slots whose request stopped (a stop token, its max_new_tokens, a stop string) and inserts
waiting requests there, so the batch never waits for its longest row (JetStream's and MaxText's
prefill / insert / generate split).

A request's tokens depend on nothing but the request: its positions sit at the same cache slots
whatever slot or time it got (cache.py), each row of a prefill or decode step is computed on its
own, and its random stream is its own (token n is drawn with fold_in(key(seed), stream) folded
with n). The prefills of recent prompts
are kept (`prefix_cache` of them), so a group's G completions of one prompt prefill it once.
Parameters are an argument: the engine holds no copy of the weights.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
from typing import Callable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tunix_train.config import ConfigError, ModelConfig, Remat
from tunix_train.generate import cache as kv
from tunix_train.generate.sampling import Kinds, Rules, Sampling, draw
from tunix_train.model import kernels
from tunix_train.model.layout import kv_sources, layer_windows
from tunix_train.parallel import model_graphdef
from tunix_train.sharding import LOGICAL_RULES, Rules as ShardingRules, constrain, data_axes, data_parallel_size


@dataclasses.dataclass(frozen=True)
class Request:
    """A prompt's token ids and how to continue it. Its random stream is fold_in(key(seed), stream)."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    seed: int = 0
    stream: int = 0
    stop_strings: tuple[str, ...] = ()  # needs the engine's `decode`


@dataclasses.dataclass
class Completion:
    """The new tokens (without the stop token; with the one that completed a stop string), the
    log-probability of each (sampling.draw), why it ended: "stop" or "length", and the stop token
    that ended it, if one did, with its log-probability."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish: Optional[str] = None
    stop_token: Optional[int] = None
    stop_logprob: Optional[float] = None


def bucket(length: int) -> int:
    """Prompts are right-padded to a power of two (at least 16): few prefill compilations."""
    return max(16, 1 << math.ceil(math.log2(max(length, 1))))


def _batch_rows(count: int, dp: int) -> int:
    """Rows of a prefill or insert batch of `count` requests: a power of two (few compilations),
    rounded up to a multiple of the data-parallel size."""
    return -(-(1 << math.ceil(math.log2(count))) // dp) * dp


def _prefill_batches(prompts: list[tuple], dp: int) -> list[tuple[int, list[tuple]]]:
    """(key, prompt)s in prefill batches (bucket length, members): runs of consecutive bucket
    lengths, chosen to compute the fewest padded tokens (rows x length), fewer calls on a tie."""
    by_length = collections.defaultdict(list)
    for key, prompt in prompts:
        by_length[bucket(len(prompt))].append((key, prompt))
    lengths = sorted(by_length)

    def split(cuts: int) -> list[tuple[int, list[tuple]]]:  # bit i set: a batch ends after lengths[i]
        batches, run = [], []
        for i, length in enumerate(lengths):
            run += by_length[length]
            if cuts >> i & 1 or i == len(lengths) - 1:
                batches, run = batches + [(length, run)], []
        return batches

    return min((split(cuts) for cuts in range(1 << (len(lengths) - 1))),
               key=lambda batches: (sum(_batch_rows(len(run), dp) * length for length, run in batches), len(batches)))


def _fetch(*xs: jax.Array) -> list[np.ndarray]:
    """The whole of global arrays on this host, fetched together: in a multi-process run the rows
    on other processes' devices are gathered (every process runs the same loop)."""
    if all(x.is_fully_addressable for x in xs):
        return [np.asarray(x) for x in jax.device_get(xs)]
    from jax.experimental import multihost_utils

    return [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in xs]


@functools.lru_cache(maxsize=1024)
def _seed_key(seed: int) -> np.ndarray:
    """The raw data of key(seed)."""
    return np.asarray(jax.random.key_data(jax.random.key(seed)))


def _draw(logits_BV, rules: Rules, seeds_B, stream_B, count_B, kinds: Kinds):
    """Token number count_B of each row, drawn with fold_in(fold_in(key(seed), stream), count)
    (seeds_B: the raw data of each row's key(seed))."""
    fold = jax.vmap(jax.random.fold_in)
    return draw(logits_BV, rules, fold(fold(jax.random.wrap_key_data(seeds_B), stream_B), count_B), kinds)


class Engine:
    """Generates from a Gemma of `cfg` whose parameters are sharded over `mesh`, `slots` requests
    at a time (rounded up to the data-parallel size; None: all of a generate call's at once)."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh, stop_ids: Sequence[int] = (), rules: ShardingRules = LOGICAL_RULES,
                 slots: Optional[int] = 16, chunk: int = 8, prefix_cache: int = 4,
                 decode: Optional[Callable[[list[int]], str]] = None):
        """stop_ids: the tokens that end a request (EOS, end of turn), excluded from its tokens.
        prefix_cache: how many recent prompts' prefills are kept for reuse (0: every request is
        prefilled on its own). decode: token ids -> text, for requests with stop strings."""
        # the engine keeps positions whole: a prompt or one decoded token is not split over cp
        self.cfg, self.mesh, self.rules, self.chunk = cfg, mesh, rules.replace(seq=()), chunk
        self.stop_ids, self.decode = frozenset(int(i) for i in stop_ids), decode
        self.slots, self.prefix_cache = slots, prefix_cache
        self.graphdef = model_graphdef(cfg, Remat.none, rules=self.rules)
        self.windows = tuple(int(w) for w in layer_windows(cfg))
        self.source = kv_sources(cfg)
        self._prefill = jax.jit(self._prefill_fn, static_argnames=("max_len",))
        self._insert = jax.jit(self._insert_fn, static_argnames=("kinds",), donate_argnums=(0,))
        self._decode = jax.jit(self._decode_fn, static_argnames=("kinds",), donate_argnums=(2,))
        self._unstack = jax.jit(lambda params: nnx.merge(self.graphdef, params).layer_states())
        self._empty_caches: dict = {}
        # prefill_s, prefills, prefix_hits, decode_s, steps, tokens, and the last session's cache_bytes
        self.stats = collections.Counter()

    # -- the compiled pieces -------------------------------------------------------------------

    def _forward(self, params, per_layer, tokens_BT, positions_BT, attend_of_layer, last_B=None):
        """Next-token logits [B, V] at index last_B (default the last), and each layer's cache
        (None for a layer that reuses an earlier one's keys and values)."""
        model = nnx.merge(self.graphdef, params)
        x_BD, caches = model.unrolled_layers(per_layer, tokens_BT, positions_BT, attend_of_layer, last_B)
        return self._logits(x_BD, model.output_table()), kv.constrained(caches, self.cfg, self.mesh, self.rules)

    def _logits(self, x_BD, table_VD):
        """float32 logits [B, V], as gemma.output_logits computes them for training, but with the
        vocabulary as the dot's rows. Why: XLA:CPU's dot runs [V, D] x [D, B] about twice as fast as
        [B, D] x [D, V] at a decoding batch (performance-history.md); the barrier keeps XLA from
        folding the transpose back into the dot."""
        logits_VB = jnp.einsum("vd,bd->vb", table_VD.astype(x_BD.dtype), x_BD).astype(jnp.float32)
        logits_BV = jax.lax.optimization_barrier(logits_VB).T
        logits_BV = kernels.soft_cap(logits_BV, self.cfg.final_logit_softcap)
        return constrain(logits_BV, ("batch", "act_vocab"), self.rules)

    def _prefill_fn(self, params, per_layer, tokens_NP, length_N, *, max_len: int):
        """Right-padded prompts -> each producing layer's cache entries [N*K, slots, H] and the
        logits [N, V] after each prompt's last token."""
        P_ = tokens_NP.shape[1]
        slots = kv.slots_per_layer(self.cfg, max_len)
        positions_NP = jnp.broadcast_to(jnp.arange(P_), tokens_NP.shape)
        logits_NV, entries = self._forward(
            params, per_layer, tokens_NP, positions_NP,
            lambda i: kv.prefill_attend(self.windows[i], slots[i], length_N, keep=self.source[i] == i), length_N - 1)
        return entries, logits_NV

    def _insert_fn(self, caches, entries, logits_NV, row_n, slot_n, rules: Rules, seeds_n, stream_n, *, kinds: Kinds):
        """The caches with prefill row row_n[i] of `entries` written over slot slot_n[i]'s rows, for
        each i, and each request's first token (number 0 of its stream) drawn from its row's logits."""
        def put(i, caches):
            def one(cache, entry):
                K = entry.shape[0] // logits_NV.shape[0]
                mine = jax.lax.dynamic_slice_in_dim(entry, row_n[i] * K, K, 0)
                return jax.lax.dynamic_update_slice_in_dim(cache, mine.astype(cache.dtype), slot_n[i] * K, 0)

            return [None if c is None else {name: one(c[name], e[name]) for name in c} for c, e in zip(caches, entries)]

        caches = jax.lax.fori_loop(0, row_n.shape[0], put, caches)
        # the rows split over the data axes, as in decoding: a replicated draw would repeat on every device
        logits_nV = constrain(logits_NV[row_n], ("batch", "act_vocab"), self.rules)
        token_n, logprob_n = _draw(logits_nV, rules, seeds_n, stream_n, jnp.zeros_like(stream_n, jnp.int32), kinds)
        return kv.constrained(caches, self.cfg, self.mesh, self.rules), token_n, logprob_n

    def _decode_fn(self, params, per_layer, caches, token_B, position_B, count_B, seeds_B, stream_B, rules: Rules, *,
                   kinds: Kinds):
        """`chunk` steps: each feeds a row's token at its position and draws its token number
        count_B. Returns the caches, the next (token, position, count) and the [B, chunk] tokens
        and their log-probabilities."""

        def step(carry, _):
            caches, token_B, position_B, count_B = carry
            updated = list(caches)  # the KV-sharing layers read their source's cache after its update

            def attend_of_layer(i):
                if self.source[i] != i:
                    return kv.decode_attend(updated[self.source[i]], self.windows[i], position_B, write=False)
                return kv.decode_attend(caches[i], self.windows[i], position_B,
                                        on_write=lambda c: updated.__setitem__(i, c))

            logits_BV, caches = self._forward(params, per_layer, token_B[:, None], position_B[:, None], attend_of_layer)
            drawn_B, logprob_B = _draw(logits_BV, rules, seeds_B, stream_B, count_B, kinds)
            return (caches, drawn_B, position_B + 1, count_B + 1), (drawn_B, logprob_B)

        (caches, token_B, position_B, count_B), (drawn_CB, logprob_CB) = jax.lax.scan(
            step, (caches, token_B, position_B, count_B), None, length=self.chunk)
        return caches, token_B, position_B, count_B, drawn_CB.T, logprob_CB.T

    # -- requests ------------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """One-line errors for a request the engine cannot serve."""
        if request.max_new_tokens <= 0:
            raise ConfigError(f"max_new_tokens={request.max_new_tokens} must be positive")
        if not request.prompt:
            raise ConfigError("every prompt needs at least one token")
        limit = self.cfg.context_length
        if limit is not None and len(request.prompt) + request.max_new_tokens > limit:
            raise ConfigError(f"a prompt of {len(request.prompt)} tokens plus max_new_tokens={request.max_new_tokens} "
                              f"is longer than the model's context of {limit} tokens: shorten the prompt or lower "
                              f"max_new_tokens")
        if any(not 0 <= i < self.cfg.vocab_size for i in request.prompt):
            raise ConfigError(f"a prompt holds a token id outside the model's vocabulary [0, {self.cfg.vocab_size})")
        if request.stop_strings and self.decode is None:
            raise ConfigError("stop strings need a tokenizer: this model has none, pass stop token ids instead")

    def _checked(self, requests: Sequence[Request]) -> list[Request]:
        """The requests with their prompts as tuples of ints, each checked."""
        requests = [dataclasses.replace(r, prompt=tuple(int(i) for i in r.prompt)) for r in requests]
        for r in requests:
            self.check(r)
        return requests

    def max_len_for(self, requests: Sequence[Request]) -> int:
        """Cache slots of a global layer that serve every request: a multiple of 64, within the context."""
        needed = max(len(r.prompt) + r.max_new_tokens for r in requests)
        rounded = -(-needed // 64) * 64
        return min(rounded, self.cfg.context_length or rounded)

    def empty_caches(self, params, per_layer, max_len: int, slots: int) -> list:
        """Every slot's cache, zeros: a prefill entry's layout (and dtype) with `slots` times its
        rows, made by one compiled call (traced once per layout)."""
        layout = (max_len, slots, tuple((x.shape, x.dtype) for x in jax.tree.leaves(params)))
        if layout not in self._empty_caches:
            dp = data_parallel_size(self.mesh)  # the fewest prefill rows
            prefill = functools.partial(self._prefill_fn, max_len=max_len)
            entries = jax.eval_shape(prefill, params, per_layer, jnp.zeros((dp, 16), jnp.int32),
                                     jnp.ones((dp,), jnp.int32))[0]
            zeros = lambda: kv.constrained(
                [None if e is None else {name: jnp.zeros((slots * x.shape[0] // dp, *x.shape[1:]), x.dtype)
                                         for name, x in e.items()} for e in entries], self.cfg, self.mesh, self.rules)
            self._empty_caches[layout] = jax.jit(zeros)
        return self._empty_caches[layout]()

    def slots_for(self, requests: int) -> int:
        """Slots for `requests` at once: the engine's number at most, a multiple of the data-parallel size."""
        dp = data_parallel_size(self.mesh)
        return -(-min(requests, self.slots or requests) // dp) * dp

    def session(self, params, max_len: int, slots: int, kinds: Kinds = Kinds(True, True, True)) -> "Session":
        """`slots` slots and their caches for requests of at most max_len tokens with their completions."""
        return Session(self, params, max_len, slots, kinds)

    def generate(self, params, requests: Sequence[Request], max_len: Optional[int] = None,
                 on_tokens: Optional[Callable[[int, list[int]], None]] = None) -> list[Completion]:
        """Every request's completion, in order; on_tokens(request index, new tokens) as they come."""
        requests = self._checked(requests)
        if not requests:
            return []
        session = self.session(params, max_len or self.max_len_for(requests), self.slots_for(len(requests)),
                               Kinds.of(r.sampling for r in requests))
        ids = [session.add(r) for r in requests]
        index = {rid: i for i, rid in enumerate(ids)}
        while session.busy:
            for rid, tokens in session.step():
                if on_tokens is not None and tokens:
                    on_tokens(index[rid], tokens)
        return [session.completions.pop(rid) for rid in ids]

    def stream(self, params, request: Request) -> Iterator[list[int]]:
        """The request's new tokens, a chunk at a time, as they are produced."""
        request, = self._checked([request])
        session = self.session(params, self.max_len_for([request]), self.slots_for(1), Kinds.of([request.sampling]))
        rid = session.add(request)
        while session.busy:
            for _, tokens in session.step():
                if tokens:
                    yield tokens
        session.completions.pop(rid)


class Session:
    """One run of the engine's slots: requests wait in a queue, take a free slot, and leave when
    they stop. add() may be called while it runs; step() advances it by one chunk."""

    def __init__(self, engine: Engine, params, max_len: int, slots: int, kinds: Kinds):
        self.engine, self.params, self.max_len, self.slots, self.kinds = engine, params, max_len, slots, kinds
        self.queue: collections.deque[tuple[int, Request]] = collections.deque()
        self.completions: dict[int, Completion] = {}
        self.running: list[Optional[tuple[int, Request]]] = [None] * slots
        self._next_id = 0
        e = engine
        with jax.set_mesh(e.mesh):
            self.per_layer = e._unstack(params)
            self.caches = e.empty_caches(params, self.per_layer, max_len, slots)
        self.row = {name: np.zeros(slots, dtype) for name, dtype in
                    (("token", np.int32), ("position", np.int32), ("count", np.int32), ("stream", np.uint32),
                     ("temperature", np.float32), ("top_k", np.int32), ("top_p", np.float32))}
        self.seeds = np.zeros((slots, *_seed_key(0).shape), np.uint32)
        self._on_device = None  # the rows' arrays on the devices, while the host has not changed them
        e.stats["cache_bytes"] = sum(x.nbytes for c in self.caches if c is not None for x in c.values())
        self._prefixes: collections.OrderedDict = collections.OrderedDict()  # prompt -> (entries, logits, row)

    @property
    def busy_slots(self) -> bool:
        return any(r is not None for r in self.running)

    @property
    def busy(self) -> bool:
        return bool(self.queue) or self.busy_slots

    def add(self, request: Request) -> int:
        """Queues a request; returns its id (the key of its completion)."""
        if len(request.prompt) + request.max_new_tokens > self.max_len:
            raise ConfigError(f"a prompt of {len(request.prompt)} tokens plus max_new_tokens={request.max_new_tokens} "
                              f"is longer than this session's {self.max_len} tokens")
        rid, self._next_id = self._next_id, self._next_id + 1
        self.queue.append((rid, request))
        self.completions[rid] = Completion()
        return rid

    def step(self) -> list[tuple[int, list[int]]]:
        """Fills the free slots from the queue, decodes one chunk, and returns each running
        request's new tokens (id, tokens); a request that stopped has its Completion's finish set."""
        new: list[tuple[int, list[int]]] = []
        with jax.set_mesh(self.engine.mesh):
            free = [slot for slot, r in enumerate(self.running) if r is None][:len(self.queue)]
            # a prefill's rows are split over the data axes: wait for that many free slots rather
            # than prefill padding rows (unless fewer requests wait, or no slot is running)
            if free and (len(free) >= min(data_parallel_size(self.engine.mesh), len(self.queue)) or not self.busy_slots):
                new += self._start([(slot, *self.queue.popleft()) for slot in free])
            if self.busy_slots:
                new += self._decode_chunk()
        return new

    def _rows(self, x: np.ndarray) -> jax.Array:
        mesh = self.engine.mesh
        return jax.device_put(x, NamedSharding(mesh, P(data_axes(mesh) or None, *[None] * (x.ndim - 1))))

    def _prefilled(self, starting: list[tuple[int, int, Request]]) -> list[tuple]:
        """Each starting request's prefill (entries, logits, row): its prompt's kept one, or new
        ones, the prompts of one bucket length prefilled in one batch."""
        e = self.engine
        key_of = lambda i, r: r.prompt if e.prefix_cache else i
        found = {}
        for i, (_, _, r) in enumerate(starting):
            if key_of(i, r) in self._prefixes:
                self._prefixes.move_to_end(key_of(i, r))
                found[key_of(i, r)] = self._prefixes[key_of(i, r)]
        todo = {key_of(i, r): r.prompt for i, (_, _, r) in enumerate(starting) if key_of(i, r) not in found}
        dp = data_parallel_size(e.mesh)
        for length, group in _prefill_batches([(k, p) for k, p in todo.items()], dp):
            N = _batch_rows(len(group), dp)
            tokens, lengths = np.zeros((N, length), np.int32), np.zeros(N, np.int32)
            for row in range(N):
                prompt = group[min(row, len(group) - 1)][1]
                tokens[row, :len(prompt)], lengths[row] = prompt, len(prompt)
            entries, logits = e._prefill(self.params, self.per_layer, self._rows(tokens), self._rows(lengths),
                                         max_len=self.max_len)
            found.update({k: (entries, logits, row) for row, (k, _) in enumerate(group)})
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
        for (slot, rid, request), (entries, logits, prefill_row) in zip(starting, self._prefilled(starting)):
            s = request.sampling
            settings = {"token": 0, "position": len(request.prompt), "count": 1, "stream": request.stream,
                        "temperature": s.temperature, "top_k": s.top_k or e.cfg.vocab_size, "top_p": s.top_p or 1.0}
            for name, value in settings.items():
                row[name][slot] = value
            self.seeds[slot] = _seed_key(request.seed)
            self.running[slot] = (rid, request)
            by_source.setdefault(id(logits), (entries, logits, []))[2].append((prefill_row, slot))
        drawn = []
        for entries, logits, pairs in by_source.values():
            # padded with the last one repeated, which writes it again
            pairs += [pairs[-1]] * (_batch_rows(len(pairs), data_parallel_size(e.mesh)) - len(pairs))
            rows_n, slots_n = (np.asarray(x, np.int32) for x in zip(*pairs))
            self.caches, token_n, logprob_n = e._insert(
                self.caches, entries, logits, rows_n, slots_n,
                Rules(row["temperature"][slots_n], row["top_k"][slots_n], row["top_p"][slots_n]), self.seeds[slots_n],
                row["stream"][slots_n], kinds=self.kinds)
            drawn.append((slots_n, token_n, logprob_n))
        new, done = [], set()
        for slots_n, token_n, logprob_n in drawn:
            token_n, logprob_n = _fetch(token_n, logprob_n)
            for slot, token, logprob in zip(slots_n.tolist(), token_n.tolist(), logprob_n.tolist()):
                if slot not in done:
                    done.add(slot)
                    row["token"][slot] = token
                    new.append((self.running[slot][0], self._take(slot, [token], [logprob])))
        e.stats["prefill_s"] += time.perf_counter() - start
        return new

    def _decode_chunk(self) -> list[tuple[int, list[int]]]:
        e, row = self.engine, self.row
        start = time.perf_counter()
        if self._on_device is None:  # the rows changed on the host (a request started): upload them
            self._on_device = ({name: self._rows(x) for name, x in row.items()}, self._rows(self.seeds))
        rows, seeds = self._on_device
        self.caches, token_B, position_B, count_B, drawn_BC, logprob_BC = e._decode(
            self.params, self.per_layer, self.caches, rows["token"], rows["position"], rows["count"], seeds,
            rows["stream"], Rules(rows["temperature"], rows["top_k"], rows["top_p"]), kinds=self.kinds)
        rows.update(token=token_B, position=position_B, count=count_B)  # the next chunk's, on the devices
        drawn_BC, logprob_BC = _fetch(drawn_BC, logprob_BC)
        row["token"], row["position"], row["count"] = drawn_BC[:, -1].copy(), row["position"] + e.chunk, \
            row["count"] + e.chunk
        e.stats["decode_s"] += time.perf_counter() - start
        e.stats["steps"] += e.chunk
        return [(self.running[slot][0], self._take(slot, drawn_BC[slot].tolist(), logprob_BC[slot].tolist()))
                for slot in range(self.slots) if self.running[slot] is not None]

    def _take(self, slot: int, tokens: list[int], logprobs: list[float]) -> list[int]:
        """Appends a slot's new tokens to its completion up to where the request stops; frees the
        slot when it does. Returns the tokens taken."""
        rid, request = self.running[slot]
        done = self.completions[rid]
        taken = []
        for token, logprob in zip(tokens, logprobs):
            if token in self.engine.stop_ids:
                done.finish, done.stop_token, done.stop_logprob = "stop", token, logprob
                break
            done.tokens.append(token)
            done.logprobs.append(logprob)
            taken.append(token)
            if request.stop_strings and any(t in self.engine.decode(done.tokens) for t in request.stop_strings):
                done.finish = "stop"
                break
            if len(done.tokens) == request.max_new_tokens:
                done.finish = "length"
                break
        if done.finish is not None:
            self.running[slot] = None
        self.engine.stats["tokens"] += len(taken)
        return taken


