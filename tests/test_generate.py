"""The engine: cached decoding against the full forward pass, meshes, batches, sampling rules, errors
(greedy parity with transformers' generate: test_hf_parity.py)."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import config, train_losses
from flax import nnx

from tunix_train import api
from tunix_train.config import ConfigError, Remat
from tunix_train.generate import Engine, Request, Sampling, Tuning
from tunix_train.generate.sampling import Kinds, categorical, draw, top_p_threshold
from tunix_train.generate.sampling import Rules as SamplingRules
from tunix_train.observe.memory import OutOfMemory
from tunix_train.parallel import model_graphdef
from tunix_train.sharding import make_mesh
from tunix_train.train.init import plan_train_state
from tunix_train.train.loop import train
from tunix_train.train.optimizer import make_optimizer

# Two layers: a sliding-window one (window 6, shorter than the 40+ positions generated, so its ring
# buffer wraps) and a global one.
CFG = config("model.sliding_window=6").model
MESHES = {
    "1x1": [[1, 1], ["fsdp", "tp"]],
    "fsdp4_tp2": [[4, 2], ["fsdp", "tp"]],
    "dp2_fsdp2_tp2": [[2, 2, 2], ["dp", "fsdp", "tp"]],
}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42]]
NEW = 40


@functools.cache
def _host_params():
    """Random parameters whose post-norms make the layers outweigh the tied embedding (with zero
    norm scales a random model repeats its input token)."""
    mesh = make_mesh(MESHES["1x1"], jax.devices()[:1])
    params = plan_train_state(CFG, make_optimizer(config().training)[0], mesh, seed=0).create().params
    rng = np.random.default_rng(0)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: (
            np.asarray(x) + (4 + rng.normal(size=x.shape) if "post" in jax.tree_util.keystr(path) else 0)
        ),
        params,
    )


def _on(mesh_name):
    devices = int(np.prod(MESHES[mesh_name][0]))
    mesh = make_mesh(MESHES[mesh_name], jax.devices()[:devices])
    plan = plan_train_state(CFG, make_optimizer(config().training)[0], mesh, seed=0)
    leaves, treedef = jax.tree.flatten(_host_params())
    shardings = jax.tree.leaves(plan.shardings.params)
    return mesh, jax.tree.unflatten(
        treedef, [jax.device_put(x.astype(np.float32), s) for x, s in zip(leaves, shardings)]
    )


def _recomputed_greedy(prompt, new):
    """Argmax of the full forward pass over the whole sequence, recomputed at every step."""
    forward = jax.jit(
        nnx.merge(model_graphdef(CFG, Remat.none), jax.tree.map(jnp.asarray, _host_params())).__call__
    )
    seq = list(prompt)
    for _ in range(new):  # zeros after the sequence: a causal model's logits at len(seq) - 1 ignore them
        padded = jnp.asarray([seq + [0] * (len(prompt) + new - len(seq))])  # one shape, one compile
        seq.append(int(np.asarray(forward(padded))[0, len(seq) - 1].argmax()))
    return seq[len(prompt) :]


@functools.cache
def _reference():
    return [_recomputed_greedy(p, NEW) for p in PROMPTS]


def _requests(prompts, new, sampling=Sampling(), seed=0):
    return [Request(tuple(p), new, sampling, seed, i) for i, p in enumerate(prompts)]


def _tokens(engine, params, requests, **kwargs):
    return [c.tokens for c in engine.generate(params, requests, **kwargs)]


@pytest.mark.parametrize("mesh_name", MESHES)
def test_cached_greedy_decoding_equals_the_recomputed_forward_pass(mesh_name):
    mesh, params = _on(mesh_name)
    assert len(set(_reference()[0])) > 5  # the reference is not a repeated token
    assert _tokens(Engine(CFG, mesh), params, _requests(PROMPTS, NEW)) == _reference()


def test_each_row_of_a_batch_gets_the_tokens_of_its_prompt_alone():
    mesh, params = _on("fsdp4_tp2")
    engine = Engine(CFG, mesh)
    prompts = PROMPTS + [[3] * 20, [77]]
    batched = _tokens(engine, params, _requests(prompts, 24))
    assert batched == [_tokens(engine, params, _requests([p], 24))[0] for p in prompts]


def _alone(engine, params, request, max_len, slots, kinds):
    session = engine.session(params, max_len, slots, kinds)
    rid = session.add(request)
    while session.busy:
        session.step()
    return session.completions[rid]


def test_requests_through_few_slots_get_the_tokens_and_logprobs_they_get_alone():
    """64 requests of random prompt lengths, max_new_tokens and sampling rules through 8 slots: each
    gets the tokens it gets alone in those slots, and their log-probabilities within float32's
    rounding (a prefill of several prompts is a matmul of another shape than one prompt's)."""
    mesh, params = _on("1x1")
    rng = np.random.default_rng(0)
    rules = [Sampling(), Sampling(1.0, top_k=50), Sampling(0.7, top_p=0.9), Sampling(1.3)]
    requests = [
        Request(
            tuple(rng.integers(1, CFG.vocab_size, rng.integers(1, 30)).tolist()),
            int(rng.integers(1, 40)),
            rules[i % 4],
            seed=5,
            stream=i,
        )
        for i in range(64)
    ]
    engine = Engine(CFG, mesh, slots=8)
    together = engine.generate(params, requests)
    assert engine.stats["steps"] < sum(r.max_new_tokens for r in requests) / 8 + 2 * 40  # slots were refilled
    assert [len(c.tokens) for c in together] == [r.max_new_tokens for r in requests]
    assert {c.finish for c in together} == {"length"}
    kinds = Kinds.of(r.sampling for r in requests)
    for i in range(0, 64, 7):
        alone = _alone(engine, params, requests[i], engine.max_len_for(requests), 8, kinds)
        assert alone.tokens == together[i].tokens, i
        np.testing.assert_allclose(alone.logprobs, together[i].logprobs, atol=1e-5, rtol=0)


def test_generate_starts_the_requests_with_the_most_new_tokens_first():
    """Longest processing time first, ties in order (longest_first=False: in the order given); the
    completions come back in the given order."""
    mesh, params = _on("1x1")
    requests = [Request(tuple(PROMPTS[0]), n, stream=i) for i, n in enumerate([3, 30, 10, 30])]
    started = []
    done = Engine(CFG, mesh, slots=2).generate(
        params, requests, on_tokens=lambda i, _: started.append(i) if i not in started else None
    )
    assert started == [1, 3, 2, 0]
    assert [len(c.tokens) for c in done] == [3, 30, 10, 30]
    started.clear()
    Engine(CFG, mesh, slots=2).generate(
        params,
        requests,
        longest_first=False,
        on_tokens=lambda i, _: started.append(i) if i not in started else None,
    )
    assert started == [0, 1, 2, 3]


def test_a_shared_prefix_is_prefilled_once_and_gives_the_tokens_of_separate_prefills():
    mesh, params = _on("fsdp4_tp2")
    group = [Request(tuple(PROMPTS[0]), 12, Sampling(1.0), seed=2, stream=i) for i in range(8)]
    shared, separate = Engine(CFG, mesh), Engine(CFG, mesh, tuning=Tuning(prefix_cache=0))
    got, want = shared.generate(params, group), separate.generate(params, group)
    assert (shared.stats["prefills"], separate.stats["prefills"]) == (1, 8)
    # a session that lives on (a server's) reuses the prompt's kept prefill for a later request
    session = shared.session(params, shared.max_len_for(group), 8, Kinds.of([group[0].sampling]))
    for request in group[:2]:
        rid = session.add(request)
        while session.busy:
            session.step()
        assert session.completions[rid].tokens == want[request.stream].tokens
    assert shared.stats["prefills"] == 2 and shared.stats["prefix_hits"] == 7 + 1
    assert [c.tokens for c in got] == [c.tokens for c in want]
    np.testing.assert_allclose([c.logprobs for c in got], [c.logprobs for c in want], atol=1e-5, rtol=0)
    assert len({tuple(c.tokens) for c in got}) > 1  # the group's streams differ


def test_parameters_installed_mid_request_draw_its_next_tokens_and_each_token_records_its_version():
    """An in-flight weight update (Session.install between two chunks, asynchronous RL's): the
    tokens drawn before it are the old parameters' alone, every token records the version that
    drew it, a request that starts after it is the new parameters' alone (the kept prefill of its
    prompt, made by the old ones, is not reused), and installing the same parameters again changes
    the recorded versions only."""
    mesh, old = _on("1x1")
    rng = np.random.default_rng(1)
    new = jax.tree.map(lambda x: x * (1 + 0.3 * rng.normal(size=x.shape)).astype(np.float32), old)
    engine = Engine(CFG, mesh, slots=2, tuning=Tuning(chunk=4))
    request = Request(tuple(PROMPTS[0]), 16)
    alone_old, alone_new = (engine.generate(p, [request])[0] for p in (old, new))
    assert alone_old.tokens[5:] != alone_new.tokens[5:]

    def run(session, then):
        rid = session.add(request)
        session.step()  # the first token (the prefill's) and a chunk of 4
        then()
        while session.busy:
            session.step()
        return session.completions[rid]

    session = engine.session(old, engine.max_len_for([request]), 2, Kinds.of([request.sampling]))
    swapped = run(session, lambda: session.install(new, 1))
    assert swapped.versions == [0] * 5 + [1] * 11
    assert swapped.tokens[:5] == alone_old.tokens[:5] and swapped.tokens != alone_old.tokens
    np.testing.assert_allclose(swapped.logprobs[:5], alone_old.logprobs[:5], atol=1e-5, rtol=0)
    later = run(session, lambda: None)
    assert later.tokens == alone_new.tokens and later.versions == [1] * 16
    np.testing.assert_allclose(later.logprobs, alone_new.logprobs, atol=1e-5, rtol=0)

    session = engine.session(old, engine.max_len_for([request]), 2, Kinds.of([request.sampling]), version=3)
    same = run(session, lambda: session.install(old, 4))
    assert same.tokens == alone_old.tokens and same.versions == [3] * 5 + [4] * 11
    np.testing.assert_allclose(same.logprobs, alone_old.logprobs, atol=1e-5, rtol=0)

    # parameters that cannot replace the session's are refused, and it goes on with its own
    def bad_install(params, message):
        with pytest.raises(ValueError, match=message):
            session.install(params, 5)

    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), old)
    wrong = run(
        session, lambda: bad_install(half, r"^the new parameters' .* is bfloat16\[.*the session's float32")
    )
    assert wrong.tokens == alone_old.tokens and wrong.versions == [4] * 16
    fewer = dict(old)
    fewer.pop(next(iter(fewer)))
    bad_install(fewer, "tree differs from the session's")


def test_streamed_groups_leave_whole_as_they_finish_within_their_bounds():
    """12 prompts of 2 completions each, their lengths long-tailed (2 to 30 new tokens), through a
    stream of 4 slots (a group admitted while a slot would be idle) that buffers at most 3: every
    prompt's group comes out once and whole, each completion the tokens of its request generated
    apart, in the order the groups finish (a short one passes a long one admitted before it), the
    buffer never over its bound; parameters installed mid-stream show in the tokens' versions; the
    groups admitted and not finished are known in the order they came (what a checkpoint keeps).
    Warmed first (Session.warm), the stream compiles no prefill or insert, and its tokens are
    unchanged by the slots the warm-up wrote."""
    from tunix_train.generate.groups import GroupStream

    mesh, params = _on("1x1")
    lengths = [30, 2, 3, 24, 2, 5, 30, 2, 8, 3, 16, 2]
    engine = Engine(CFG, mesh, slots=4, tuning=Tuning(chunk=4))

    admitted = []

    def requests_for(key):
        admitted.append(key)
        return [
            Request(tuple(PROMPTS[key % 2]), lengths[key], Sampling(1.0), 7, 2 * key + i) for i in range(2)
        ]

    # a request's tokens depend on nothing but itself (test_requests_through_few_slots_...)
    together = engine.generate(params, [r for key in range(12) for r in requests_for(key)])
    alone = {key: together[2 * key : 2 * key + 2] for key in range(12)}
    admitted.clear()
    session = engine.session(params, 64, 4, Kinds.of([Sampling(1.0)]))
    session.warm([len(p) for p in PROMPTS])  # its admissions' programs: none compiles below
    compiled = (engine.prefill_step._cache_size(), engine.insert_step._cache_size())
    stream = GroupStream(session, iter(range(12)), requests_for, buffered=3)
    order, seen_ready, drawn_before, held = [], [], 0, 0
    stream.advance()  # groups 0 (30 new tokens) and 1 admitted, their first 5 tokens drawn
    stream.install(params, 1)  # the same values: the tokens stay those generated alone
    while not stream.done:
        for _ in range(8):
            stream.advance()
            seen_ready.append(len(stream.ready))
        for group in stream.take(2):
            order.append(group.key)
            assert [c.tokens for c in group.completions] == [c.tokens for c in alone[group.key]]
            assert [c.finish for c in group.completions] == ["length"] * 2
            versions = [c.versions for c in group.completions]
            if group.key == 0:
                assert versions == [[0] * 5 + [1] * 25] * 2
            assert group.admitted == 1 or group.key in (0, 1)
            drawn_before += any(0 in v for v in versions)
        # what a checkpoint would admit again whole: admitted, not finished, in admission order
        ready = [g.key for g in stream.ready]
        assert stream.unfinished() == [k for k in admitted if k not in order + ready]
        held += bool(stream.unfinished())
    assert sorted(order) == list(range(12)) and order != list(range(12))
    assert max(seen_ready) == 3 and order.index(1) < order.index(0)
    assert drawn_before == 2  # groups 0 and 1 only: tokens drawn before the install
    assert held >= 3 and stream.unfinished() == []
    assert (engine.prefill_step._cache_size(), engine.insert_step._cache_size()) == compiled


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_equal_the_full_forward_pass(temperature):
    """Each token's log-probability equals log_softmax(logits / T) of the trainer's forward pass
    over the whole sequence (T = 1 for greedy), within 1e-5 in float32."""
    mesh, params = _on("fsdp4_tp2")
    done = Engine(CFG, mesh).generate(params, _requests(PROMPTS, 20, Sampling(temperature), seed=1))
    forward = jax.jit(
        nnx.merge(model_graphdef(CFG, Remat.none), jax.tree.map(jnp.asarray, _host_params())).__call__
    )
    for prompt, c in zip(PROMPTS, done):
        logits = np.asarray(forward(jnp.asarray([prompt + c.tokens])))[0, len(prompt) - 1 : -1]
        logp = jax.nn.log_softmax(logits / (temperature or 1.0), axis=-1)
        want = np.take_along_axis(np.asarray(logp), np.asarray(c.tokens)[:, None], axis=-1)[:, 0]
        np.testing.assert_allclose(c.logprobs, want, atol=1e-5, rtol=0)


def test_sampling_with_a_seed_gives_the_same_tokens_on_every_mesh():
    sampling = Sampling(temperature=1.0, top_k=50, top_p=0.95)
    drawn = {
        name: _tokens(Engine(CFG, _on(name)[0]), _on(name)[1], _requests(PROMPTS, 24, sampling, seed=3))
        for name in MESHES
    }
    assert drawn["1x1"] == drawn["fsdp4_tp2"] == drawn["dp2_fsdp2_tp2"]
    assert drawn["1x1"] != _reference()  # it sampled
    mesh, params = _on("1x1")
    assert _tokens(Engine(CFG, mesh), params, _requests(PROMPTS, 24, sampling, seed=4)) != drawn["1x1"]


def test_top_k_1_is_greedy():
    mesh, params = _on("1x1")
    assert (
        _tokens(Engine(CFG, mesh), params, _requests(PROMPTS, NEW, Sampling(temperature=1.5, top_k=1), 1))
        == _reference()
    )


def test_top_p_keeps_the_smallest_set_whose_mass_reaches_p():
    probs = np.array([0.05, 0.5, 0.1, 0.2, 0.15])
    logp = jnp.log(jnp.asarray([probs], jnp.float32))
    for p, kept in ((0.5, {1}), (0.6, {1, 3}), (0.7, {1, 3}), (0.71, {1, 3, 4}), (1.0, {0, 1, 2, 3, 4})):
        threshold = float(top_p_threshold(jnp.sort(logp, axis=-1)[:, ::-1], jnp.asarray([p]))[0, 0])
        assert set(np.flatnonzero(np.asarray(logp[0]) >= threshold)) == kept, p
    n = 4000
    rules = SamplingRules(jnp.ones(n), jnp.full(n, 5, jnp.int32), jnp.full(n, 0.6))
    draws, logprobs = draw(
        jnp.broadcast_to(logp, (n, 5)),
        rules,
        jax.random.split(jax.random.key(0), n),
        Kinds(True, False, True),
    )
    assert set(np.asarray(draws)) == {1, 3}
    assert abs(np.mean(np.asarray(draws) == 1) - 0.5 / 0.7) < 0.03
    np.testing.assert_allclose(logprobs, np.log(probs)[np.asarray(draws)], rtol=1e-6)  # before the cut


@pytest.mark.parametrize("vocab", [5, 37, 300])
def test_the_two_step_draw_has_the_frequencies_of_softmax(vocab):
    """categorical draws a block of tokens, then a token in it: its frequencies over 100k draws
    equal softmax's within 5 standard errors, with masked tokens, whole masked blocks and a
    vocabulary that is not a multiple of the block."""
    rng = np.random.default_rng(vocab)
    logits = rng.normal(size=vocab) * 2
    logits[rng.random(vocab) < 0.3] = -np.inf
    logits[: vocab // 4] = -np.inf  # at 37 and 300, whole blocks (8 and 16 tokens) with no mass
    n = 100_000
    drawn = np.asarray(
        jax.jit(categorical)(
            jax.random.split(jax.random.key(1), n),
            jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, vocab)),
        )
    )
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    frequencies = np.bincount(drawn, minlength=vocab) / n
    assert len(frequencies) == vocab and frequencies[probs == 0].sum() == 0
    assert np.all(np.abs(frequencies - probs) <= 5 * np.sqrt(probs * (1 - probs) / n) + 1e-9)


def test_a_request_stops_at_its_stop_token_or_stop_string():
    mesh, params = _on("1x1")
    reference = _reference()
    stop = reference[0][6]
    out = Engine(CFG, mesh, stop_ids=[stop]).generate(params, _requests(PROMPTS, NEW))
    assert (out[0].tokens, out[0].finish) == (reference[0][: reference[0].index(stop)], "stop")
    assert out[1].tokens == (
        reference[1][: reference[1].index(stop)] if stop in reference[1] else reference[1]
    )

    def text(ids):
        return " ".join(f"<{i}>" for i in ids)

    first_new = next(i for i in range(2, NEW) if reference[0][i] not in reference[0][:i])
    cut = [Request(tuple(PROMPTS[0]), NEW, stop_strings=(f"<{reference[0][first_new]}>",))]
    (got,) = Engine(CFG, mesh, decode=text).generate(params, cut)
    assert (got.tokens, got.finish) == (reference[0][: first_new + 1], "stop")


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda e, p: e.generate(p, _requests(PROMPTS, 0)), "max_new_tokens=0 must be positive"),
        (
            lambda e, p: e.generate(p, _requests(PROMPTS, 4, Sampling(1.0, top_p=0.0))),
            r"top_p=0.0 must be in \(0, 1\]",
        ),
        (
            lambda e, p: e.generate(p, _requests(PROMPTS, 4, Sampling(1.0, top_p=1.5))),
            r"top_p=1.5 must be in \(0, 1\]",
        ),
        (
            lambda e, p: e.generate(p, _requests([[1] * 30], 8)),
            "a prompt of 30 tokens plus max_new_tokens=8 is longer than the model's context of 32 tokens",
        ),
        (lambda e, p: e.generate(p, _requests([[CFG.vocab_size]], 8)), "outside the model's vocabulary"),
        (
            lambda e, p: e.generate(p, [Request((1,), 4, stop_strings=("x",))]),
            "stop strings need a tokenizer",
        ),
        (
            lambda e, p: e.session(p, 16, 1).add(Request((1,) * 10, 8)),
            "a prompt of 10 tokens plus max_new_tokens=8 is longer than this session's 16 tokens",
        ),
    ],
)
def test_bad_requests_are_one_line_errors(call, message):
    mesh, params = _on("1x1")
    engine = Engine(CFG.__class__(**{**CFG.__dict__, "context_length": 32}), mesh)
    with pytest.raises(ConfigError, match=message):
        call(engine, params)


def test_running_out_of_memory_is_one_line_that_says_what_to_lower():
    """A prompt of 2^17 tokens makes the prefill's attention scores 512 GiB: XLA's CPU client fails
    the allocation (RESOURCE_EXHAUSTED) before computing anything."""
    mesh, params = _on("1x1")
    model = api.LoadedModel(CFG.__class__(**{**CFG.__dict__, "context_length": None}), mesh, params)
    with pytest.raises(OutOfMemory) as raised:
        model.generate([[5] * 2**17], 4)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("out of host RAM; an allocation of 512.")
    assert message.endswith(
        "to lower it, in this order: fewer prompts at once (1 now); shorter prompts (the longest "
        "has 131072 tokens); max_new_tokens=2; more devices on the fsdp axis (parameters divide "
        "by it)"
    )


@pytest.mark.slow  # a whole CLI run or a script: the README's suite stays short
def test_samples_during_training_are_logged_and_leave_the_losses_unchanged(tmp_path):
    text = [
        "data=shakespeare",
        "model.vocab_size=4096",
        "training.max_steps=4",
        "training.log_every=1",
        "training.eval_every=0",
        'model.mesh_shape=[[2,2],["fsdp","tp"]]',
    ]
    train(config(*text), tmp_path / "plain", devices=jax.devices()[:4])
    prompts = ["ROMEO:", "To be"]
    sampled = config(
        *text,
        "training.sample_every=2",
        "training.sample_max_new_tokens=6",
        f"training.sample_prompts=[{prompts[0]!r},{prompts[1]!r}]",
    )
    train(sampled, tmp_path / "sampled", devices=jax.devices()[:4])
    assert train_losses(tmp_path / "sampled") == train_losses(tmp_path / "plain")

    samples = [json.loads(line) for line in (tmp_path / "sampled" / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["prompt"]) for s in samples] == [(step, p) for step in (0, 2, 4) for p in prompts]
    final = api.load(tmp_path / "sampled", mesh_shape=[[1], ["fsdp"]], devices=jax.devices()[:1])
    assert [s["text"] for s in samples[-2:]] == final.generate_text(prompts, max_new_tokens=6)
    assert all(s["text"] for s in samples)
    assert "sample at step 4: 'ROMEO:' -> " in (tmp_path / "sampled" / "train.log").read_text()
    events = b"".join(p.read_bytes() for p in (tmp_path / "sampled").glob("events.out.tfevents.*"))
    assert b"sample_0" in events and b"sample_1" in events


def test_samples_need_text_data():
    with pytest.raises(
        ConfigError, match="training.sample_every needs training.sample_prompts and text data"
    ):
        config("training.sample_every=10")
