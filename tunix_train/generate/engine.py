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

The compiled pieces live here; the host's side (requests, the queue, admissions, each request's
completion) in session.py. The prefills of recent prompts are kept (`prefix_cache` of them), so a
group's G completions of one prompt prefill it once. Parameters are an argument: the engine holds
no copy of the weights.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Callable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from tunix_train.config import ConfigError, LoraConfig, ModelConfig, Remat, RopeScalingType
from tunix_train.generate import cache as kv
from tunix_train.generate import speculative
from tunix_train.generate.adaptive import Adaptive
from tunix_train.generate.sampling import Draws, Kinds, draw, token_keys
from tunix_train.generate.session import Completion, Request, Session  # noqa: F401 (Completion: the API)
from tunix_train.generate.speculative import Speculation
from tunix_train.model.common import output_logits
from tunix_train.model.layout import kv_sources, layer_shapes, layer_windows
from tunix_train.model.vision import image_slots, images_on_global, token_counts
from tunix_train.parallel import model_graphdef
from tunix_train.platform import small_dot_options
from tunix_train.sharding import LOGICAL_RULES, constrain, data_parallel_size


def _draw(logits_BV, draws: Draws, count_B, kinds: Kinds):
    """Token number count_B of each row, drawn with fold_in(fold_in(key(seed), stream), count)."""
    return draw(logits_BV, draws.rules, token_keys(draws, count_B), kinds)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """What the engine trades memory and compile time for, never a token's distribution: `chunk`
    decode steps per compiled call, how many recent prompts' prefills `prefix_cache` keeps for
    reuse (0: every request is prefilled on its own), and `speculation`: drafted tokens the model
    verifies (speculative.py; greedy output is the same token for token, sampled output the same
    distribution, not the same draws of a seed)."""

    chunk: int = 8
    prefix_cache: int = 4
    speculation: Optional[Speculation] = None


class Engine:
    """Generates from a Gemma of `cfg` whose parameters are sharded over `mesh`, `slots` requests
    at a time (rounded up to the data-parallel size; None: all of a generate call's at once)."""

    def __init__(
        self,
        cfg: ModelConfig,
        mesh: Mesh,
        stop_ids: Sequence[int] = (),
        slots: Optional[int] = 16,
        tuning: Tuning = Tuning(),
        decode: Optional[Callable[[list[int]], str]] = None,
        lora: Optional[LoraConfig] = None,
        record_routes: bool = False,
    ):
        """stop_ids: the tokens that end a request (EOS, end of turn), excluded from its tokens.
        decode: token ids -> text, for requests with stop strings. lora: the
        model carries these adapters apart from its base (a quantized base, Weights.for_engine).
        record_routes: each completion keeps the experts every layer chose for each of its
        positions (Completion.routes; a mixture-of-experts model), for routing replay."""
        # the engine keeps positions whole: a prompt or one decoded token is not split over cp
        self.cfg, self.mesh, self.rules = cfg, mesh, LOGICAL_RULES.replace(seq=())
        self.stop_ids, self.decode = frozenset(int(i) for i in stop_ids), decode
        self.slots, self.chunk, self.prefix_cache = slots, tuning.chunk, tuning.prefix_cache
        self.record_routes = record_routes and bool(cfg.moe.experts)
        self.graphdef = model_graphdef(cfg, Remat.none, rules=self.rules, lora=lora)
        self.windows = tuple(int(w) for w in layer_windows(cfg))
        self.source = kv_sources(cfg)
        self.prefill_step = jax.jit(self._prefill_fn, static_argnames=("max_len",))
        self.insert_step = jax.jit(self._insert_fn, static_argnames=("kinds",), donate_argnums=(0,))
        self.put_step = jax.jit(self._put, donate_argnums=(0,))
        self.speculation, self.draft, self.lookahead, self.adaptive = tuning.speculation, None, 0, None
        # a batch of rows (slots, a prefill's prompts) is a multiple of it: split over the data axes
        self.batch_multiple = data_parallel_size(mesh)
        if self.speculation is None:
            self.decode_step = jax.jit(self._decode_fn, static_argnames=("kinds",), donate_argnums=(2,))
        else:
            self._speculative(self.speculation, record_routes)
        self.unstack = jax.jit(lambda params: nnx.merge(self.graphdef, params).layer_states())
        self._empty_caches: dict = {}
        # prefill_s, prefills, prefix_hits, decode_s, steps, tokens, and the last session's cache_bytes
        self.stats = collections.Counter()

    def _speculative(self, speculation: Speculation, record_routes: bool) -> None:
        """Decoding by speculation: a round writes k positions past a row's last kept one, so the
        caches keep k more slots (cache.slots_per_layer), the draft model's too (an engine of its
        own, used for its compiled pieces, on the model's mesh or its own split of the same devices:
        Speculation.draft_mesh), whose batches of rows are the model's."""
        speculation.check(self.cfg)
        if record_routes:
            raise ConfigError("routing replay records no experts under speculative decoding: turn one off")
        self.lookahead = speculation.tokens
        if speculation.draft is not None:
            mesh = speculation.draft_mesh(self.mesh)
            self.draft = Engine(speculation.draft, mesh, slots=self.slots, tuning=Tuning(prefix_cache=0))
            self.draft.lookahead = self.lookahead
            self.batch_multiple = math.lcm(self.batch_multiple, self.draft.batch_multiple)
        if speculation.adaptive:
            self.adaptive = Adaptive(speculation.choices)
        self.decode_step = jax.jit(
            functools.partial(speculative.chunk, self),
            static_argnames=("kinds", "plan"),
            donate_argnums=(1,),
            compiler_options=small_dot_options(self.mesh),
        )

    # -- the compiled pieces -------------------------------------------------------------------

    def _forward(
        self,
        params,
        per_layer,
        tokens_BT,
        positions_BT,
        attend_of_layer,
        last_B=None,
        images=None,
        slots_BT=None,
    ):
        """Next-token logits [B, V] at index last_B (None: after every position, [B, T, V], or [B, V]
        for one), each layer's cache (None for a layer that reuses an earlier one's keys and
        values), and with record_routes each token's experts in each layer [B, T, L, k] (else
        None). images, slots_BT: Decoder.embed's."""
        model = nnx.merge(self.graphdef, params)
        every = last_B is None and tokens_BT.shape[1] > 1
        # the activations' constraints name this engine's mesh: a draft's own inside the model's programs
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
            x_BD, caches, routes_BTLK = model.unrolled_layers(
                per_layer, tokens_BT, positions_BT, attend_of_layer, last_B, images, slots_BT, every
            )
            # every position's as rows of one batch: output_logits' faster layout for a decode step's
            x_XD = x_BD.reshape(-1, x_BD.shape[-1])
            logits_XV = output_logits(x_XD, model.output_table(), self.cfg.final_logit_softcap, self.rules)
        logits_BV = logits_XV.reshape(*x_BD.shape[:-1], -1)
        routes_BTLK = routes_BTLK if self.record_routes else None
        return logits_BV, kv.constrained(caches, self.cfg, self.mesh, self.rules), routes_BTLK

    def _prefill_fn(self, params, per_layer, tokens_NP, length_N, images=None, *, max_len: int):
        """Right-padded prompts -> each producing layer's cache entries [N*K, slots, H], the logits
        [N, V] after each prompt's last token, and the experts of their tokens (_forward). images:
        each prompt's [I, C, H, W] (model.vision; zeros past a prompt's own), or None."""
        P_ = tokens_NP.shape[1]
        slots = kv.slots_per_layer(self.cfg, max_len, self.lookahead)
        positions_NP = jnp.broadcast_to(jnp.arange(P_), tokens_NP.shape)
        if self.cfg.rope_scaling.type is RopeScalingType.longrope:  # it reads each row's last position:
            positions_NP = jnp.where(positions_NP < length_N[:, None], positions_NP, 0)  # not the padding's
        slots_NP = ids_NP = None
        if images is not None:
            slots_NP, ids_NP = image_slots(tokens_NP, self.cfg.vision, images)
        logits_NV, entries, routes_NPLK = self._forward(
            params,
            per_layer,
            tokens_NP,
            positions_NP,
            lambda i: kv.prefill_attend(
                self.windows[i],
                slots[i],
                length_N,
                keep=self.source[i] == i,
                images_BT=ids_NP,
                images_on_global=images_on_global(self.cfg.vision),
            ),
            length_N - 1,
            images,
            slots_NP,
        )
        return entries, logits_NV, routes_NPLK

    def _insert_fn(self, caches, entries, logits_NV, row_n, slot_n, draws_n: Draws, *, kinds: Kinds):
        """The caches with prefill row row_n[i] of `entries` written over slot slot_n[i]'s rows, for
        each i, and each request's first token (number 0 of its stream) drawn from its row's logits."""
        caches = self._put(caches, entries, row_n, slot_n)
        # the rows split over the data axes, as in decoding: a replicated draw would repeat on every device
        logits_nV = constrain(logits_NV[row_n], ("batch", "act_vocab"), self.rules)
        token_n, logprob_n = _draw(logits_nV, draws_n, jnp.zeros_like(draws_n.stream, jnp.int32), kinds)
        return caches, token_n, logprob_n

    def _put(self, caches, entries, row_n, slot_n):
        """The caches with prefill row row_n[i] of `entries` written over slot slot_n[i]'s rows."""

        def put(i, caches):
            def one(cache, entry, K):
                mine = jax.lax.dynamic_slice_in_dim(entry, row_n[i] * K, K, 0)
                return jax.lax.dynamic_update_slice_in_dim(cache, mine.astype(cache.dtype), slot_n[i] * K, 0)

            return [
                None if c is None else {name: one(c[name], e[name], shape.num_kv_heads) for name in c}
                for c, e, shape in zip(caches, entries, layer_shapes(self.cfg))
            ]

        caches = jax.lax.fori_loop(0, row_n.shape[0], put, caches)
        return kv.constrained(caches, self.cfg, self.mesh, self.rules)

    def extend(self, params, per_layer, caches, tokens_BT, position_B):
        """Feeds each row's T tokens at positions position_B, position_B + 1, ... over its cache:
        the logits after each ([B, V] for one token, [B, T, V] for more), the caches, and the
        experts chosen (_forward)."""
        T = tokens_BT.shape[1]
        updated = list(caches)  # the KV-sharing layers read their source's cache after its update

        def attend_of_layer(i):
            window = self.windows[i]
            if self.source[i] != i:
                return kv.decode_attend(updated[self.source[i]], window, position_B, False, positions=T)
            return kv.decode_attend(
                caches[i], window, position_B, on_write=lambda c: updated.__setitem__(i, c), positions=T
            )

        return self._forward(
            params, per_layer, tokens_BT, position_B[:, None] + jnp.arange(T), attend_of_layer
        )

    def _decode_fn(
        self, params, per_layer, caches, token_B, position_B, count_B, draws_B: Draws, *, kinds: Kinds
    ):
        """`chunk` steps: each feeds a row's token at its position and draws its token number
        count_B. Returns the caches, the next (token, position, count), the [B, chunk] tokens and
        their log-probabilities, and with record_routes the experts of the tokens fed, [B, chunk,
        L, k] (else None)."""

        def step(carry, _):
            caches, token_B, position_B, count_B = carry
            logits_BV, caches, routes_B1LK = self.extend(
                params, per_layer, caches, token_B[:, None], position_B
            )
            drawn_B, logprob_B = _draw(logits_BV, draws_B, count_B, kinds)
            routes_BLK = None if routes_B1LK is None else routes_B1LK[:, 0]
            return (caches, drawn_B, position_B + 1, count_B + 1), (drawn_B, logprob_B, routes_BLK)

        (caches, token_B, position_B, count_B), (drawn_CB, logprob_CB, routes_CBLK) = jax.lax.scan(
            step, (caches, token_B, position_B, count_B), None, length=self.chunk
        )
        routes_BCLK = None if routes_CBLK is None else jnp.swapaxes(routes_CBLK, 0, 1)
        return caches, token_B, position_B, count_B, drawn_CB.T, logprob_CB.T, routes_BCLK

    # -- requests ------------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """One-line errors for a request the engine cannot serve."""
        if request.max_new_tokens <= 0:
            raise ConfigError(f"max_new_tokens={request.max_new_tokens} must be positive")
        if not request.prompt:
            raise ConfigError("every prompt needs at least one token")
        limit = self.cfg.context_length
        if limit is not None and len(request.prompt) + request.max_new_tokens > limit:
            raise ConfigError(
                f"a prompt of {len(request.prompt)} tokens plus max_new_tokens={request.max_new_tokens} "
                f"is longer than the model's context of {limit} tokens: shorten the prompt or lower "
                f"max_new_tokens"
            )
        if any(not 0 <= i < self.cfg.vocab_size for i in request.prompt):
            raise ConfigError(
                f"a prompt holds a token id outside the model's vocabulary [0, {self.cfg.vocab_size})"
            )
        self._check_images(request)
        if request.stop_strings and self.decode is None:
            raise ConfigError(
                "stop strings need a tokenizer: this model has none, pass stop token ids instead"
            )
        request.sampling.check(self.cfg.vocab_size)
        for name in ("seed", "stream"):
            value = getattr(request, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ConfigError(f"{name}={value!r} must be an integer")

    def _check_images(self, request: Request) -> None:
        """A request's images: for a model with a tower, one per run of its prompt's placeholders."""
        vision = self.cfg.vision
        if request.images is None:
            return
        if vision is None:
            raise ConfigError("this model reads no images (its model.vision is null): send text only")
        shape = vision.image_shape
        if request.images.ndim != 1 + len(shape) or request.images.shape[1:] != shape:
            raise ConfigError(
                f"a request's images must be [images, {', '.join(map(str, shape))}] (data/images.py), "
                f"not {list(request.images.shape)}"
            )
        placeholders = request.prompt.count(vision.image_token_id)
        tokens = int(np.sum(token_counts(vision, request.images)))
        if placeholders != tokens:
            raise ConfigError(
                f"a prompt with {placeholders} image placeholder tokens comes with {len(request.images)} "
                f"images of {tokens} tokens: render it with the chat template"
            )

    def checked(self, requests: Sequence[Request]) -> list[Request]:
        """The requests with their prompts as tuples of ints, each checked."""
        requests = [
            dataclasses.replace(
                r,
                prompt=tuple(int(i) for i in r.prompt),
                images=None if r.images is None else np.asarray(r.images, np.float32),
            )
            for r in requests
        ]
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
            dp = self.batch_multiple  # the fewest prefill rows
            prefill = functools.partial(self._prefill_fn, max_len=max_len)
            entries = jax.eval_shape(
                prefill, params, per_layer, jnp.zeros((dp, 16), jnp.int32), jnp.ones((dp,), jnp.int32)
            )[0]

            def zeros():
                return kv.constrained(
                    [
                        None
                        if e is None
                        else {
                            name: jnp.zeros((slots * x.shape[0] // dp, *x.shape[1:]), x.dtype)
                            for name, x in e.items()
                        }
                        for e in entries
                    ],
                    self.cfg,
                    self.mesh,
                    self.rules,
                )

            self._empty_caches[layout] = jax.jit(zeros)
        return self._empty_caches[layout]()

    def slots_for(self, requests: int) -> int:
        """Slots for `requests` at once: the engine's number at most, a multiple of batch_multiple."""
        dp = self.batch_multiple
        return -(-min(requests, self.slots or requests) // dp) * dp

    def session(
        self,
        params,
        max_len: int,
        slots: int,
        kinds: Kinds = Kinds(True, True, True),
        version: int = 0,
        draft_params=None,
    ) -> "Session":
        """`slots` slots and their caches for requests of at most max_len tokens with their
        completions (and room for speculation's drafts past them); `version`: the parameters',
        recorded with each token (Session.install);
        draft_params: the draft model's, where the engine speculates with one."""
        return Session(self, params, max_len, slots, kinds, version, draft_params)

    def generate(
        self,
        params,
        requests: Sequence[Request],
        max_len: Optional[int] = None,
        on_tokens: Optional[Callable[[int, list[int]], None]] = None,
        longest_first: bool = True,
        draft_params=None,
    ) -> list[Completion]:
        """Every request's completion, in order; on_tokens(request index, new tokens) as they come.
        longest_first: the requests with the most max_new_tokens take slots first (longest
        processing time first: the last slots to free then free close together), ties in order;
        False: in the order given. A request's tokens do not depend on when it starts (session.py).
        draft_params: the draft model's, where the engine speculates with one."""
        requests = self.checked(requests)
        if not requests:
            return []
        session = self.session(
            params,
            max_len or self.max_len_for(requests),
            self.slots_for(len(requests)),
            Kinds.of(r.sampling for r in requests),
            draft_params=draft_params,
        )
        ids = [None] * len(requests)
        for i in sorted(
            range(len(requests)), key=lambda i: -requests[i].max_new_tokens if longest_first else 0
        ):
            ids[i] = session.add(requests[i])
        index = {rid: i for i, rid in enumerate(ids)}
        while session.busy:
            for rid, tokens in session.step():
                if on_tokens is not None and tokens:
                    on_tokens(index[rid], tokens)
        return [session.completions.pop(rid) for rid in ids]

    def stream(self, params, request: Request, draft_params=None) -> Iterator[list[int]]:
        """The request's new tokens, a chunk at a time, as they are produced."""
        (request,) = self.checked([request])
        session = self.session(
            params,
            self.max_len_for([request]),
            self.slots_for(1),
            Kinds.of([request.sampling]),
            draft_params=draft_params,
        )
        rid = session.add(request)
        while session.busy:
            for _, tokens in session.step():
                if tokens:
                    yield tokens
        session.completions.pop(rid)
