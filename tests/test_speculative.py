"""Speculative decoding (generate/speculative.py) against the plain engine: greedy output token for
token on 100 prompts (a close draft, a random one, prompt lookup; a sliding window that wraps,
shared prefixes, stop tokens, few slots), the sampled distribution of the first three tokens
against the model's own by a chi-square test, the rejection rule against its formula, errors."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import config
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from scipy import stats
from test_generate import CFG, _on

from tunix_train.config import ConfigError, Remat
from tunix_train.generate import Engine, Request, Sampling, Tuning
from tunix_train.generate.adaptive import RECENT, Adaptive
from tunix_train.generate.sampling import Draws, Kinds, Rules
from tunix_train.generate.speculative import Speculation, accept, first_kept, lookup_drafts
from tunix_train.parallel import model_graphdef
from tunix_train.sharding import data_axes, make_mesh
from tunix_train.train.init import plan_train_state
from tunix_train.train.optimizer import make_optimizer


def _perturbed(params, scale, seed):
    """A draft: the model's parameters plus noise (scale 0.3: a draft that agrees often, 3: rarely)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: x + scale * rng.normal(size=x.shape).astype(x.dtype) * np.std(x), params)


def _engine(mesh, drafter, adaptive=False, **kw):
    spec = (
        Speculation(tokens=3, draft=CFG, rounds=2, adaptive=adaptive)
        if "lookup" not in drafter
        else Speculation(tokens=3, lookup=3, adaptive=adaptive)
    )
    return Engine(CFG, mesh, tuning=Tuning(speculation=spec), **kw)


@pytest.mark.parametrize(
    "drafter, scale",
    [
        pytest.param("close draft", 0.05, marks=pytest.mark.slow),  # two models' programs compile
        pytest.param("random draft", 3.0, marks=pytest.mark.slow),
        ("lookup", None),
        pytest.param("random draft, adaptive", 3.0, marks=pytest.mark.slow),
        pytest.param("lookup, adaptive", None, marks=pytest.mark.slow),
    ],
)
def test_greedy_output_is_the_plain_engines_on_100_prompts(drafter, scale):
    """100 prompts (a fifth of them repeated: kept prefills; lengths 1 to 15; each its own
    max_new_tokens up to 23, past the sliding window of 6, whose ring buffer wraps) through 8
    slots, each slot keeping its own number of drafts a round: the same tokens, finish and stop
    token as the plain engine, log-probabilities within float32's rounding (a verify round is a
    matmul over k + 1 positions, a decode step over one). Adaptively (adaptive.py) the k changes
    from chunk to chunk, mid-request, and the same tokens come; a random draft turns itself off."""
    mesh, params = _on("1x1")
    rng = np.random.default_rng(1)
    prompts = [tuple(rng.integers(1, CFG.vocab_size, rng.integers(1, 16)).tolist()) for _ in range(80)]
    new = rng.integers(1, 24, 80).tolist()
    prompts, new = prompts + prompts[:20], new + new[:20]  # repeats: next to their first in the queue
    requests = [Request(p, n, stream=i) for i, (p, n) in enumerate(zip(prompts, new))]
    plain = Engine(CFG, mesh, stop_ids=[7], slots=8).generate(params, requests)
    engine = _engine(mesh, drafter, "adaptive" in drafter, stop_ids=[7], slots=8)
    draft = None if scale is None else _perturbed(params, scale, 0)
    ours = engine.generate(params, requests, draft_params=draft)
    assert [c.tokens for c in ours] == [c.tokens for c in plain]
    assert [(c.finish, c.stop_token) for c in ours] == [(c.finish, c.stop_token) for c in plain]
    assert sum(c.finish == "stop" for c in plain) > 5
    for a, b in zip(ours, plain):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5, rtol=0)
    rate = engine.stats["accepted"] / engine.stats["drafted"]
    if "adaptive" not in drafter:  # adaptively, which slot frees when depends on timings (the k)
        assert engine.stats["prefix_hits"] >= 15  # most repeats reused their first prefill
    assert {"close draft": rate > 0.5, "random draft": rate < 0.1, "lookup": 0.05 < rate < 0.9}[
        drafter.split(",")[0]
    ], rate
    if "adaptive" in drafter:
        assert sum(n > 0 for n in engine.adaptive.calls.values()) >= 2  # k changed
        if "random" in drafter:  # a draft almost never kept: most rounds draft nothing
            assert engine.stats["plain_rounds"] > engine.stats["rounds"], engine.stats


# -- the sampled distribution ---------------------------------------------------------------------

SMALL = config("model.sliding_window=6", "model.vocab_size=8").model
PROMPT = (1, 2, 3, 1, 2, 3, 4, 1, 2)


@functools.cache
def _small():
    mesh = make_mesh([[1, 1], ["fsdp", "tp"]], jax.devices()[:1])
    params = plan_train_state(SMALL, make_optimizer(config().training)[0], mesh, seed=3).create().params
    rng = np.random.default_rng(3)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: (
            np.asarray(x) + (1 + rng.normal(size=x.shape) if "post" in jax.tree_util.keystr(path) else 0)
        ),
        params,
    )
    return mesh, jax.tree.map(jnp.asarray, params)


def _exact(params, sampling: Sampling) -> np.ndarray:
    """[V, V, V]: the model's probability of each first three tokens after PROMPT, from full forward
    passes, each token drawn from softmax(logits / T) cut to top_k and top_p."""
    V = SMALL.vocab_size
    forward = jax.jit(nnx.merge(model_graphdef(SMALL, Remat.none), params).__call__)
    rows = np.array([PROMPT + (a, b) for a in range(V) for b in range(V)])
    logits = np.asarray(forward(jnp.asarray(rows)), np.float64)[:, len(PROMPT) - 1 :]  # [V*V, 3, V]

    def probs(x):
        p = np.exp((x - x.max(-1, keepdims=True)) / sampling.temperature)
        p /= p.sum(-1, keepdims=True)
        order = np.argsort(-p, axis=-1)
        ranked = np.take_along_axis(p, order, -1)
        keep = np.ones_like(p, bool)
        if sampling.top_k:
            keep &= np.arange(V) < sampling.top_k
        if sampling.top_p:
            keep &= np.cumsum(ranked, -1) - ranked < sampling.top_p
        kept = np.zeros_like(p)
        np.put_along_axis(kept, order, ranked * keep, -1)
        return kept / kept.sum(-1, keepdims=True)

    P = probs(logits).reshape(V, V, 3, V)  # [t1, t2, position, next token]
    return P[0, 0, 0][:, None, None] * P[:, 0, 1, :][:, :, None] * P[:, :, 2, :]


def _counts(engine, params, sampling, n, **kw):
    V = SMALL.vocab_size
    requests = [Request(PROMPT, 3, sampling, seed=7, stream=i) for i in range(n)]
    done = engine.generate(params, requests, **kw)
    codes = [c.tokens[0] * V * V + c.tokens[1] * V + c.tokens[2] for c in done]
    return np.bincount(codes, minlength=V**3)


def _p_value(counts, expected_probs):
    """Chi-square goodness of fit, the cells of fewer than 5 expected draws pooled into one."""
    expected = expected_probs.ravel() * counts.sum()
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    return stats.chisquare(observed, expected).pvalue


@pytest.mark.parametrize(
    "drafter, sampling",
    [
        pytest.param("draft", Sampling(1.0), marks=pytest.mark.slow),  # 60,000 draws and two models
        pytest.param("draft", Sampling(0.8, top_k=5, top_p=0.9), marks=pytest.mark.slow),
        pytest.param("lookup", Sampling(1.0), marks=pytest.mark.slow),
        pytest.param("draft, adaptive", Sampling(1.0), marks=pytest.mark.slow),
    ],
)
def test_sampled_tokens_have_the_models_distribution(drafter, sampling):
    """20,000 samples of the first three tokens (512 outcomes): the speculative engine's, and the
    plain engine's, both fit the model's exact distribution (chi-square, p > 0.001), while drafts
    taken without the rejection rule (the draft model's own samples) do not (p < 1e-6): the test
    can tell. Adaptively, the k of each chunk (0, 1 or 2) depends on the acceptance so far."""
    mesh, params = _small()
    draft = _perturbed(params, 1.0, 1)
    drafting = {"draft": SMALL} if drafter.startswith("draft") else {"lookup": 2}
    spec = Speculation(tokens=2, rounds=1, adaptive="adaptive" in drafter, **drafting)
    n, slots = 20_000, 2_000
    exact = _exact(params, sampling)
    plain = _counts(Engine(SMALL, mesh, slots=slots, tuning=Tuning(chunk=2)), params, sampling, n)
    engine = Engine(SMALL, mesh, slots=slots, tuning=Tuning(speculation=spec))
    ours = _counts(engine, params, sampling, n, draft_params=draft if "draft" in drafting else None)
    assert 0.2 < engine.stats["accepted"] / engine.stats["drafted"] < 0.95  # drafts both kept and not
    if spec.adaptive:
        assert sum(n > 0 for n in engine.adaptive.calls.values()) >= 2, engine.adaptive.calls
    p_plain, p_ours = _p_value(plain, exact), _p_value(ours, exact)
    assert p_plain > 1e-3 and p_ours > 1e-3, (p_plain, p_ours)
    print(f"chi-square p: plain {p_plain:.3f}, speculative {p_ours:.3f}")
    drafts_alone = _counts(Engine(SMALL, mesh, slots=slots, tuning=Tuning(chunk=2)), draft, sampling, n)
    assert _p_value(drafts_alone, exact) < 1e-6


def test_the_rejection_rule_keeps_a_draft_with_probability_min_1_p_over_q():
    """One position, many keys: a draft token kept with probability min(1, p/q), and the token
    emitted (kept draft or replacement from the residual) distributed as p (Leviathan et al., 2023,
    theorem 1), checked against the formula over 200,000 draws."""
    V, n = 5, 200_000
    p = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    q = np.array([0.1, 0.5, 0.1, 0.2, 0.1])
    rng = np.random.default_rng(0)
    drafts = rng.choice(V, size=n, p=q).astype(np.int32)
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(p, jnp.float32)), (n, 2, V))
    rules = Rules(jnp.ones(n), jnp.full(n, V, jnp.int32), jnp.ones(n))
    draws = Draws(rules, jnp.zeros((n, 2), jnp.uint32), jnp.arange(n, dtype=jnp.uint32))
    keys = jax.vmap(lambda k: jax.random.split(k, 6).reshape(2, 3))(jax.random.split(jax.random.key(0), n))
    kinds = Kinds(True, False, False)
    emitted, _, kept, _ = jax.jit(accept, static_argnames="kinds")(
        logits,
        jnp.asarray(drafts)[:, None],
        jnp.broadcast_to(jnp.asarray(q, jnp.float32), (n, 1, V)),
        draws,
        keys,
        kinds=kinds,
    )
    kept, first = np.asarray(kept), np.asarray(emitted)[:, 0]
    for token in range(V):
        rate = kept[drafts == token].mean()
        assert abs(rate - min(1, p[token] / q[token])) < 0.01, token
    frequencies = np.bincount(first, minlength=V) / n
    assert np.all(np.abs(frequencies - p) <= 5 * np.sqrt(p * (1 - p) / n))
    # the chance of keeping a first draft that adaptive.py reads: sum_v min(p_v, q_v), the keep rate
    two = Rules(*(x[:2] for x in rules))
    chance = first_kept(logits[:2, 0], jnp.asarray(drafts[:2]), jnp.asarray([q, q], jnp.float32), two, kinds)
    np.testing.assert_allclose(chance, np.minimum(p, q).sum(), rtol=1e-5)
    assert abs(kept.mean() - np.minimum(p, q).sum()) < 0.005


def test_adaptive_speculation_drafts_the_k_that_emits_most_tokens_a_second():
    """Adaptive k (adaptive.py): the largest and smallest k are measured first, each program's
    first call (its compilation) is not timed, and then the k is argmax E[tokens]/cost, with
    E[tokens] = (1 - a^(k+1)) / (1 - a) a round (Leviathan et al., 2023, eq. 1) checked here
    against a simulation of rounds, and the cost of an unmeasured k interpolated."""
    adaptive = Adaptive(Speculation(tokens=4, lookup=2, adaptive=True).choices)
    assert adaptive.choices == (0, 1, 2, 4)
    assert adaptive.choose([0.5]) == 4
    adaptive.record(4, 2, 100.0)  # compiling: not a measurement
    assert adaptive.choose([0.5]) == 4
    adaptive.record(4, 2, 4.0)  # 2 s a round
    assert adaptive.choose([0.5]) == 0
    adaptive.record(0, 8, 100.0)
    adaptive.record(0, 8, 8.0)  # 1 s a round; 1.25, 1.5 s interpolated for k = 1, 2
    assert adaptive.round_s == {4: 2.0, 0: 1.0}
    rng = np.random.default_rng(0)
    for a in (0.1, 0.5, 0.7, 0.95):  # E[tokens] by simulation: 1 + the drafts kept before the first miss
        kept = np.cumprod(rng.random((100_000, 4)) < a, axis=1).sum(1)
        simulated = {k: 1 + np.minimum(kept, k).mean() for k in adaptive.choices}
        best = max(adaptive.choices, key=lambda k: simulated[k] / {0: 1, 1: 1.25, 2: 1.5, 4: 2}[k])
        assert adaptive.choose([a, a]) == best, a
    assert [adaptive.choose([a]) for a in (0.1, 0.5, 0.7, 0.95)] == [0, 1, 2, 4]
    assert adaptive.choose([0.95] + [0.0] * 4) == 0  # rows that do not speculate count as 0: 8.5 / 2 < 5 / 1
    # a row's acceptance: kept / (kept + refused) in a chunk that drafted (7 kept, 2 rounds refused
    # one), else the mean chance of a first draft; a new row starts from the prior, 0.5 at first
    w = RECENT  # a chunk's weight in the moving averages
    first = adaptive.observed(None, 4, np.array([2, 4, 1]), np.array([0.1, 0.1, 0.1]))
    assert first == pytest.approx((1 - w) * 0.5 + w * 7 / 9) and adaptive.prior == pytest.approx(first)
    assert adaptive.observed(first, 0, np.zeros(8), np.full(8, 0.2)) == pytest.approx(
        (1 - w) * first + w * 0.2
    )


def test_prompt_lookup_proposes_what_followed_the_longest_recent_match():
    history = jnp.asarray(
        [
            [5, 6, 7, 8, 9, 5, 6, 7, 0, 0, 0, 0],  # "6 7" then 8 9 ... : at p=7 (token 7) -> 8 9 5
            [1, 2, 3, 4, 2, 3, 9, 3, 0, 0, 0, 0],  # "3" last seen at 5 -> 9 3 ...; no "9 3" earlier
            [1, 2, 3, 4, 5, 0, 0, 0, 0, 0, 0, 0],  # no match: the current token repeated
        ]
    )
    drafts = lookup_drafts(history, jnp.asarray([7, 7, 4]), 3, 3)
    assert np.asarray(drafts).tolist() == [[8, 9, 5], [9, 3, 0], [5, 5, 5]]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Speculation(tokens=0, lookup=3), "speculative tokens=0 must be an integer from 1 to 64"),
        (
            lambda: Speculation(tokens=100_000, lookup=3),
            "speculative tokens=100000 must be an integer from 1 to 64",
        ),
        (lambda: Speculation(tokens=4), "speculative decoding takes one drafter"),
        (lambda: Speculation(tokens=4, lookup=2, draft=CFG), "speculative decoding takes one drafter"),
        (
            lambda: Engine(CFG, _on("1x1")[0], tuning=Tuning(speculation=Speculation(draft=SMALL))),
            "the draft model's vocabulary has 8 tokens, the model's 256: a draft must share",
        ),
        (
            lambda: _engine(_on("1x1")[0], "draft").generate(_on("1x1")[1], [Request((1, 2), 4)]),
            "this engine speculates with a draft model: pass the draft's parameters",
        ),
    ],
)
def test_bad_settings_are_one_line_errors(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_adaptive_speculation_in_a_rollout_needs_a_drafter(tmp_path):
    from conftest import rl_config

    reward = "training.rollout.reward=[tunix_train.rewards.arithmetic:exact_match]"
    with pytest.raises(ConfigError, match="training.rollout.adaptive_speculation needs a drafter"):
        rl_config(tmp_path, reward, "training.rollout.adaptive_speculation=true")
    assert rl_config(
        tmp_path, reward, "training.rollout.adaptive_speculation=true", "training.rollout.prompt_lookup=2"
    )


def test_a_draft_mesh_without_a_draft_model_is_a_one_line_error(capsys, tmp_path):
    from conftest import rl_config

    from tunix_train.generate.__main__ import main as generate
    from tunix_train.serve.cli import main as serve

    reward = "training.rollout.reward=[tunix_train.rewards.arithmetic:exact_match]"
    with pytest.raises(ConfigError, match="training.rollout.draft_mesh_shape is the draft model's: set"):
        rl_config(
            tmp_path,
            reward,
            "training.rollout.prompt_lookup=2",
            "training.rollout.draft_mesh_shape=[[8],[dp]]",
        )
    with pytest.raises(ConfigError, match="speculative draft_mesh_shape is a draft model's"):
        Speculation(lookup=2, draft_mesh_shape=[[8], ["dp"]])
    with pytest.raises(ConfigError, match=r"draft_mesh_shape: mesh \{'dp': 3\} has 3 devices but 8 are"):
        Speculation(draft=CFG, draft_mesh_shape=[[3], ["dp"]]).draft_mesh(_on("fsdp4_tp2")[0])
    assert serve([str(tmp_path / "no_model"), "--draft_mesh_shape", '[[8],["dp"]]']) == 2
    assert (
        generate([str(tmp_path / "no_model"), "--prompt", "hi", "--draft", "x", "--draft_mesh_shape", "[["])
        == 2
    )
    assert capsys.readouterr().err.strip().splitlines() == [
        "tunix_train.serve: error: --draft_mesh_shape is a draft model's: give --draft",
        "tunix_train.generate: error: --draft_mesh_shape is not JSON (Expecting value: line 1 column 3 "
        "(char 2))",
    ]


def test_the_command_lines_refuse_adaptive_speculation_without_a_drafter(capsys, tmp_path):
    from tunix_train.generate.__main__ import _arguments
    from tunix_train.serve.cli import main as serve

    with pytest.raises(SystemExit) as exited:
        _arguments([str(tmp_path), "--prompt", "hi", "--adaptive_speculation"])
    assert exited.value.code == 2
    assert "--adaptive_speculation needs a drafter" in capsys.readouterr().err
    assert serve([str(tmp_path / "no_model"), "--adaptive_speculation"]) == 2  # before loading the model
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "tunix_train.serve: error: --adaptive_speculation needs a drafter: give --draft or --prompt_lookup"
    ]


@pytest.mark.slow  # two GRPO runs
def test_grpo_with_a_draft_trains_as_without_and_logs_its_acceptance(tmp_path):
    """GRPO on the arithmetic task, 3 steps of 8 prompts x 4 completions, at temperature 1e-4 (each
    draw is the argmax, with or without drafts): with the first run's final checkpoint as the
    draft model (on a mesh of its own, draft_mesh_shape), the same completions, rewards and losses
    within 1e-5 (the log-probabilities come from a verify pass over k + 1 positions instead of
    one), and each step logs its acceptance."""
    from conftest import read_metrics, rl_config

    from tunix_train.train.loop import train

    def run(name, *overrides):
        cfg = rl_config(
            tmp_path,
            "training.micro_batch_size=8",
            "training.rollout.num_generations=4",
            "training.rollout.reward=[tunix_train.rewards.arithmetic:exact_match]",
            "training.max_steps=3",
            "training.rollout.temperature=1e-4",
            *overrides,
        )
        cfg.model.mesh_shape = [[2], ["fsdp"]]
        train(cfg, tmp_path / name, devices=jax.devices()[:2])
        return [m for m in read_metrics(tmp_path / name) if "loss" in m]

    plain = run("plain")
    drafted = run(  # the draft whole on each device, the rows split: its own mesh (the async test: the same)
        "drafted",
        f"training.rollout.draft={tmp_path / 'plain'}",
        "training.rollout.num_speculative_tokens=3",
        "training.rollout.draft_mesh_shape=[[2],[dp]]",
    )
    for key in ("loss", "reward", "completion_tokens", "grad_norm"):
        np.testing.assert_allclose(
            [m[key] for m in drafted], [m[key] for m in plain], rtol=1e-5, atol=1e-6, err_msg=key
        )
    # at T = 1e-4 a near-tie's log-probability moves by 1e4 times the logits' rounding (about 1e-7)
    assert all(m["logprob_mismatch_max"] < 5e-3 for m in drafted)
    assert all(0 < m["acceptance_rate"] <= 1 and 1 <= m["mean_accepted_length"] <= 4 for m in drafted), (
        drafted
    )
    assert "acceptance_rate" not in plain[0]


@pytest.mark.slow  # a draft's run and an asynchronous GRPO run
def test_an_asynchronous_run_speculates_with_a_draft_distilled_each_step(tmp_path):
    """Asynchronous GRPO (the rollout engine on devices of its own, its programs warmed before the
    stream, the draft model's prefill too) with a draft model: every step trains, logs the drafts'
    acceptance since the step before (the draft is the policy's initial weights, its run's one step
    having had a learning rate of 0: near 1, then lower as the policy moves), and its tokens' lags
    as without a draft. The draft is distilled after every step (draft_distill_every=1, installed
    with the next weights): each step logs its divergence, and the checkpoint holds it."""
    from conftest import read_metrics
    from test_async import _async_config

    from tunix_train.train.loop import train

    draft = config(
        "model.vocab_size=4096", "data.seq_len=16", "training.max_steps=1", "checkpoint.every_steps=1"
    )
    draft.model.mesh_shape = [[1], ["fsdp"]]
    train(draft, tmp_path / "draft", devices=jax.devices()[:1])
    cfg = _async_config(
        tmp_path,
        "training.max_steps=3",
        f"training.rollout.draft={tmp_path / 'draft'}",
        "training.rollout.temperature=1.0",
        "training.rollout.draft_distill_every=1",
        "training.rollout.draft_learning_rate=1e-3",
    )
    train(cfg, tmp_path / "run", devices=jax.devices()[:4])
    steps = [m for m in read_metrics(tmp_path / "run") if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all("lag_mean" in m and np.isfinite(m["loss"]) for m in steps)
    # a step after which no chunk ran (the buffer full) has no acceptance: nothing was drafted
    rates = [m["acceptance_rate"] for m in steps if "acceptance_rate" in m]
    assert "acceptance_rate" in steps[0] and all(0 < r <= 1 for r in rates), steps
    assert min(rates) < 1  # the policy moves away from the draft
    # the draft starts as the policy, which then moves away from it
    assert [m["draft_divergence"] == 0 for m in steps] == [True, False, False], steps
    assert all(0 <= m["draft_divergence"] < 1 for m in steps), steps
    assert (tmp_path / "run" / "checkpoints" / "3" / "draft").is_dir()


def test_a_request_that_opts_out_draws_the_plain_engines_tokens_for_its_seed():
    """Request(speculative=False) on a speculative engine: sampled at temperature 1 beside requests
    that speculate, it gets the plain engine's tokens for its seed (one a round, no draft kept),
    while the others get tokens of the same distribution but other draws."""
    mesh, params = _on("1x1")
    requests = [
        Request((5, 6, 7, 8), 16, Sampling(1.0), seed=3, stream=i, speculative=i % 2 == 0) for i in range(8)
    ]
    plain = Engine(CFG, mesh, slots=8).generate(params, requests)
    ours = _engine(mesh, "lookup", slots=8).generate(params, requests)
    alone = [i for i, r in enumerate(requests) if not r.speculative]
    assert [ours[i].tokens for i in alone] == [plain[i].tokens for i in alone]
    assert [ours[i].tokens for i in range(0, 8, 2)] != [plain[i].tokens for i in range(0, 8, 2)]


@pytest.mark.slow  # the speculative program and the plain one compile: the asynchronous path's
def test_a_draft_installed_mid_stream_drafts_for_the_requests_after_it():
    """Session.install with draft parameters (a distilled draft reaching asynchronous rollouts): a
    random draft, almost never kept, replaced after two chunks by the model itself. The requests
    in flight go on over the old draft's cache entries (a draft only proposes: their tokens stay
    the plain engine's); those that start after it are prefilled by the new draft, and nearly
    every draft is kept. A draft of another shape is a ValueError, and the session keeps its own."""
    mesh, params = _on("1x1")
    first, later = ([Request((5 + i, 6, 7, 8), 20, stream=i) for i in range(k, k + 4)] for k in (0, 4))
    plain = Engine(CFG, mesh, slots=4).generate(params, first + later)
    engine = _engine(mesh, "draft", slots=4)
    random_draft = _perturbed(params, 3.0, 0)
    session = engine.session(params, 64, 4, Kinds(True, False, False), draft_params=random_draft)
    ids = [session.add(r) for r in first]
    session.step()
    session.step()
    with pytest.raises(ValueError):
        session.install(params, 1, draft_params=jax.tree.map(lambda x: x[..., :1], params))
    assert session.drafter.params is random_draft
    assert engine.stats["accepted"] < 0.2 * engine.stats["drafted"], engine.stats
    session.install(params, 1, draft_params=params)
    while session.busy:
        session.step()
    before = dict(engine.stats)
    ids += [session.add(r) for r in later]
    while session.busy:
        session.step()
    assert [session.completions[i].tokens for i in ids] == [c.tokens for c in plain]
    after = {k: engine.stats[k] - before[k] for k in ("accepted", "drafted")}
    assert after["accepted"] > 0.9 * after["drafted"] > 0, after


@pytest.mark.slow  # two speculative programs and the plain one compile
def test_a_draft_that_skipped_chunks_catches_up_before_it_drafts_again():
    """Adaptively, a chunk that drafts nothing leaves the draft model out of its rounds and feeds
    it the chunk's tokens after (speculative.catch_up, lookahead + 1 positions a pass). With the
    model as its own draft and chunks alternating k = 0 and k = 3, its caches are right when it
    drafts again: nearly every draft is kept, greedy rows and rows sampled at temperature 1 (a
    draft with a stale or misplaced cache entry is refused), past a sliding window of 6."""
    mesh, params = _on("1x1")
    rng = np.random.default_rng(2)
    requests = [
        Request(
            tuple(rng.integers(1, CFG.vocab_size, 5).tolist()), 23, Sampling(float(i % 2)), seed=1, stream=i
        )
        for i in range(6)
    ]
    engine = _engine(mesh, "draft", adaptive=True, slots=6)
    chunks = itertools.count()
    engine.adaptive.choose = lambda acceptance: (0, 3)[next(chunks) % 2]
    ours = engine.generate(params, requests, draft_params=params)
    plain = Engine(CFG, mesh, slots=6).generate(params, requests)
    assert [c.tokens for c in ours[::2]] == [c.tokens for c in plain[::2]]  # greedy
    assert engine.stats["plain_rounds"] > 0 and engine.stats["rounds"] > 0
    assert engine.stats["accepted"] / engine.stats["drafted"] > 0.99, engine.stats


@pytest.mark.slow  # three models load, two speculative engines compile
def test_a_draft_loads_from_a_transformers_directory_or_a_gguf_file(tmp_path):
    """Drafts as a user has them (LoadedModel.generate(draft=PATH)): the model's own weights
    exported in transformers' layout and written to a float32 GGUF file. Each is the model, so
    greedy output is the plain tokens and nearly every draft is kept (the GGUF's norms are
    (1 + w) - 1 in float32)."""
    import gguf_files
    from test_gguf import _exported

    from tunix_train import api

    _, _, tensors, hf_config = _exported(tmp_path)
    path = gguf_files.write(tmp_path / "m.gguf", "gemma3", hf_config, tensors)
    model = api.load(tmp_path / "hf", mesh_shape=[[1], ["fsdp"]], devices=jax.devices()[:1])
    prompts = [[1, 5, 9, 2], [3, 3, 8]]
    plain = model.generate(prompts, 12)
    for draft in (tmp_path / "hf", path):
        assert model.generate(prompts, 12, draft=draft, speculative_tokens=3) == plain, draft
        engine = model.engine_for(draft, 3)[0]
        assert engine.stats["accepted"] / engine.stats["drafted"] > 0.9, (draft, engine.stats)


@pytest.mark.slow  # a model on 4 devices and two engines compile
def test_load_draft_puts_a_draft_on_its_own_split_of_the_models_devices(tmp_path):
    """LoadedModel.load_draft(PATH, [[4], ["dp"]]) beside a model on fsdp=2 x tp=2: the whole draft
    on each device (every parameter replicated), loaded once, and the plain greedy tokens with it;
    a draft loaded on other devices is a one-line error."""
    from test_gguf import _exported

    from tunix_train import api

    _exported(tmp_path)
    model = api.load(tmp_path / "hf", mesh_shape=[[2, 2], ["fsdp", "tp"]], devices=jax.devices()[:4])
    draft = model.load_draft(tmp_path / "hf", [[4], ["dp"]])
    assert model.load_draft(tmp_path / "hf", [[4], ["dp"]]) is draft
    assert list(draft.mesh.devices.flat) == list(model.mesh.devices.flat) and draft.mesh.shape == {"dp": 4}
    assert all(all(axis is None for axis in x.sharding.spec) for x in jax.tree.leaves(draft.params))
    prompts = [[1, 5, 9, 2], [3, 3, 8]]
    assert model.generate(prompts, 12, draft=draft, speculative_tokens=3) == model.generate(prompts, 12)
    assert model.engine_for(draft, 3)[0].draft.mesh == draft.mesh
    elsewhere = api.load(tmp_path / "hf", mesh_shape=[[4], ["dp"]], devices=jax.devices()[4:])
    with pytest.raises(
        ConfigError, match="a draft model must be loaded on the model's devices, in their order"
    ):
        model.generate(prompts, 4, draft=elsewhere)


@pytest.mark.slow  # another family's three engines compile
def test_gemma4s_shared_kv_layers_speculate_to_the_plain_tokens():
    """Gemma 4's layers that reuse an earlier layer's keys and values (num_kv_shared_layers), keys
    equal to values and wider global heads, a window of 8: a verify round reads the shared cache
    after its source wrote k + 1 positions, and greedy output is the plain engine's with either
    drafter."""
    cfg = config("model=gemma4_tiny").model
    assert cfg.gemma4.num_kv_shared_layers > 0
    mesh = make_mesh([[1], ["fsdp"]], jax.devices()[:1])
    params = plan_train_state(cfg, make_optimizer(config().training)[0], mesh, seed=0).create().params
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: (
            np.asarray(x) + (4 + rng.normal(size=x.shape) if "post" in jax.tree_util.keystr(path) else 0)
        ).astype(np.asarray(x).dtype),
        params,
    )
    requests = [
        Request(tuple(rng.integers(1, cfg.vocab_size, n).tolist()), 30, stream=i)
        for i, n in enumerate([3, 9, 17, 5])
    ]
    plain = [c.tokens for c in Engine(cfg, mesh, slots=4).generate(params, requests)]
    assert len(set(plain[0])) > 5
    for spec, draft in (
        (Speculation(3, lookup=2), None),
        (Speculation(3, draft=cfg), _perturbed(params, 0.05, 1)),
    ):
        engine = Engine(cfg, mesh, slots=4, tuning=Tuning(speculation=spec))
        assert [c.tokens for c in engine.generate(params, requests, draft_params=draft)] == plain


@pytest.mark.slow  # three engines on 8 devices compile (about 20 s)
def test_a_draft_on_its_own_split_of_the_devices_speculates_to_the_plain_tokens():
    """A model split over fsdp=4 x tp=2, its draft (the model plus noise) whole on each of the 8
    devices with the rows split 8 ways (draft_mesh_shape [[8], ["dp"]]): the plain engine's greedy
    tokens, the slots a multiple of 8, the draft's caches on its own mesh, and its forward pass free
    of collectives (each device drafts for its own rows), where on the model's mesh it has some."""
    mesh, params = _on("fsdp4_tp2")
    spec = Speculation(tokens=3, draft=CFG, draft_mesh_shape=[[8], ["dp"]])
    draft_mesh = spec.draft_mesh(mesh)
    assert list(draft_mesh.devices.flat) == list(mesh.devices.flat) and draft_mesh.shape == {"dp": 8}
    shardings = plan_train_state(CFG, make_optimizer(config().training)[0], draft_mesh, seed=0).shardings
    leaves, treedef = jax.tree.flatten(_perturbed(params, 0.05, 0))
    draft = jax.tree.unflatten(
        treedef, [jax.device_put(x, s) for x, s in zip(leaves, jax.tree.leaves(shardings.params))]
    )
    rng = np.random.default_rng(4)
    requests = [
        Request(tuple(rng.integers(1, CFG.vocab_size, rng.integers(1, 16)).tolist()), int(n), stream=i)
        for i, n in enumerate(rng.integers(1, 24, 12))
    ]
    plain = Engine(CFG, mesh, stop_ids=[7], slots=4).generate(params, requests)
    engine = Engine(CFG, mesh, stop_ids=[7], slots=4, tuning=Tuning(speculation=spec))
    ours = engine.generate(params, requests, draft_params=draft)
    assert [c.tokens for c in ours] == [c.tokens for c in plain]
    assert engine.batch_multiple == 8 and engine.slots_for(3) == 8 and engine.draft.mesh == draft_mesh
    assert engine.stats["accepted"] / engine.stats["drafted"] > 0.3, engine.stats
    session = engine.session(params, 64, 8, draft_params=draft)
    assert {x.sharding.mesh for c in session.drafter.caches if c for x in c.values()} == {draft_mesh}

    def collectives(on_mesh, draft_params):
        drafting = Engine(CFG, on_mesh, slots=8)
        with jax.set_mesh(on_mesh):
            per_layer = drafting.unstack(draft_params)
            caches = drafting.empty_caches(draft_params, per_layer, 64, 8)
            rows = NamedSharding(on_mesh, P(data_axes(on_mesh)))
            token_B1, position_B = (jax.device_put(np.ones(s, np.int32), rows) for s in ((8, 1), (8,)))
            text = jax.jit(drafting.extend).lower(draft_params, per_layer, caches, token_B1, position_B)
            text = text.compile().as_text()
        return [op for op in ("all-reduce", "all-gather", "all-to-all", "collective-permute") if op in text]

    assert collectives(draft_mesh, draft) == []
    assert collectives(mesh, params) != []  # tp=2: the check sees them where they are
