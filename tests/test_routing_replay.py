"""Routing replay: the engine records the experts each layer chose for every position it fed, and a
forward given them uses those experts (weighted by its own router) instead of its top k. Checked on
Qwen 3 MoE's softmax router and Gemma 4's: the recorded experts are those a prefill of the whole
sequence chooses, the replayed forward's log-probabilities equal the engine's, other experts change
them; in GRPO (training.rollout.routing_replay) a bf16 engine's mismatch falls, and a resumed run
equals a straight one (the routes of a queued rollout in the checkpoint)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_resumes_alike, config, read_metrics
from flax import nnx

from tunix_train.compose import load_config
from tunix_train.config import ConfigError, Remat
from tunix_train.generate import Engine, Request, Sampling
from tunix_train.model.common import output_logits
from tunix_train.parallel import model_graphdef
from tunix_train.rewards.arithmetic import write_task
from tunix_train.sharding import make_mesh
from tunix_train.train.init import plan_train_state
from tunix_train.train.loop import train
from tunix_train.train.optimizer import make_optimizer

MODELS = {
    "qwen3_moe": ("model=qwen3_moe_tiny", "model.moe.experts=16", "model.moe.experts_per_token=4"),
    "gemma4_moe": ("model=gemma4_moe_tiny",),
}


def _model(name):
    cfg = config(*MODELS[name]).model
    mesh = make_mesh([[1], ["fsdp"]], jax.devices()[:1])
    params = plan_train_state(cfg, make_optimizer(config().training)[0], mesh, seed=0).create().params
    return cfg, mesh, params


def _logprobs(cfg, params, sequences, prompt_len, replay=None):
    """The full forward's log-probability of each completion token of `sequences` [N, S] (one
    length), replaying `replay` [N, S - 1, L, k] where given."""
    model = nnx.merge(model_graphdef(cfg, Remat.none), params)
    x, _ = model.hidden_and_stats(sequences[:, :-1], replay_BTLK=replay)
    logp = jax.nn.log_softmax(output_logits(x, model.output_table(), cfg.final_logit_softcap), -1)
    return jnp.take_along_axis(logp, sequences[:, 1:, None], -1)[:, prompt_len - 1 :, 0]


@pytest.mark.parametrize(
    "name",
    ["qwen3_moe", pytest.param("gemma4_moe", marks=pytest.mark.slow)],  # Gemma 4's: 40 s
)
def test_the_engine_records_the_experts_and_replaying_them_gives_its_logprobs(name):
    cfg, mesh, params = _model(name)
    E, K = cfg.moe.experts, cfg.moe.experts_per_token
    engine = Engine(cfg, mesh, record_routes=True, slots=2)  # 3 requests in 2 slots: one inserted mid-run
    requests = [Request((1, 2, 3, 4 + i), 20, Sampling(temperature=1.0), 0, i) for i in range(3)]
    with jax.set_mesh(mesh):
        done = engine.generate(params, requests)
        sequences = np.asarray(
            [[*r.prompt, *c.tokens] for r, c in zip(requests, done)]
        )  # no stop ids: 24 each
        routes = np.stack([c.routes for c in done])
        # every position fed: the prompt's and each new token's but the last
        assert routes.shape == (3, sequences.shape[1] - 1, cfg.num_layers, K)
        assert all(len(set(r)) == K and 0 <= min(r) and max(r) < E for r in routes.reshape(-1, K))
        # a prefill of each whole sequence routes every position as the decoding did
        whole = engine.generate(params, [Request(tuple(s[:-1]), 1, requests[0].sampling) for s in sequences])
        np.testing.assert_array_equal(np.stack([c.routes for c in whole]), routes)
        forward = jax.jit(functools.partial(_logprobs, cfg), static_argnums=2)
        replayed = forward(params, jnp.asarray(sequences), 4, jnp.asarray(routes))
        np.testing.assert_allclose(replayed, [c.logprobs for c in done], atol=1e-5, rtol=0)
        others = forward(params, jnp.asarray(sequences), 4, jnp.asarray((routes + 1) % E))
        assert np.abs(others - replayed).max() > 1e-3  # the replayed experts are the ones used
        if name == "qwen3_moe":  # an engine that does not record keeps no routes
            assert Engine(cfg, mesh).generate(params, requests[:1])[0].routes is None


def test_replayed_experts_reach_every_pipeline_stage_and_repeat():
    """Under pp each stage runs a chunk of the layers, twice with pipeline_repeats=2 (stage 0 layers
    0 and 2, stage 1 layers 1 and 3): given the same routes, the replayed forward equals one
    device's within 1e-5, and other routes change it there too."""
    from tunix_train import parallel

    cfg = config(*MODELS["qwen3_moe"], "model.num_layers=4", "training.micro_batch_size=4")
    cfg.training.pipeline_microbatches, cfg.training.pipeline_repeats = 2, 2
    m = cfg.model
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, m.vocab_size, (4, 17)))
    # each token's k distinct experts in each layer [4, 16, L, k]
    routes = np.argsort(rng.random((4, 16, m.num_layers, m.moe.experts)), -1)[..., : m.moe.experts_per_token]

    def logprobs(mesh_shape, routes):
        mesh = make_mesh(mesh_shape, jax.devices()[: np.prod(mesh_shape[0])])
        with jax.set_mesh(mesh):
            params = plan_train_state(m, make_optimizer(cfg.training)[0], mesh, seed=0).create().params
            model = model_graphdef(m, Remat.none, parallel=parallel.for_run(mesh, m, cfg.training, 16))

            @jax.jit
            def forward(params, replay):
                decoder = nnx.merge(model, params)
                x, _ = decoder.hidden_and_stats(tokens[:, :-1], replay_BTLK=replay)
                logp = jax.nn.log_softmax(output_logits(x, decoder.output_table(), None), -1)
                return jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]

            return np.asarray(forward(params, jnp.asarray(routes, jnp.int32)))

    one = logprobs([[1], ["fsdp"]], routes)
    np.testing.assert_allclose(logprobs([[2], ["pp"]], routes), one, atol=1e-5, rtol=0)
    other = logprobs([[2], ["pp"]], (routes + 1) % m.moe.experts)
    assert np.abs(other - one).max() > 1e-3


def _grpo(tmp_path, *overrides, mesh=((2, 2), ("ep", "fsdp"))):
    prompts, _ = write_task(tmp_path / "task", count=64, seed=0)
    cfg, _ = load_config(
        [
            *MODELS["qwen3_moe"],
            "model.vocab_size=4096",
            "objective=grpo",
            "data=jsonl",
            f"data.train_files=[{prompts}]",
            "data.seq_len=24",
            "training.log_every=1",
            "training.micro_batch_size=8",
            "training.rollout.num_generations=4",
            "training.rollout.max_new_tokens=12",
            "training.rollout.temperature=1.5",
            "training.rollout.reward=[tests.rewards_for_tests:length]",
            "training.learning_rate=1e-3",
            *overrides,
        ]
    )
    cfg.model.mesh_shape = [list(axes) for axes in mesh]
    return cfg


def _first_step(run_dir):
    return next(m for m in read_metrics(run_dir) if "loss" in m)


@pytest.mark.slow  # two GRPO runs, 31 s; the engine test stays in the README suite
def test_grpo_with_routing_replay_trains_on_the_engines_experts(tmp_path):
    """Step 0 of both runs draws the same completions with a bf16 engine (recording changes no
    draw): only the trainer's forward differs, and with the engine's experts its mismatch falls.
    On pp2 x fsdp2, so the routes reach each pipeline stage's layers (ep2 x fsdp2: the resume
    test's; one device: the engine test's)."""
    first = {}
    for replay in (False, True):
        cfg = _grpo(
            tmp_path,
            "training.max_steps=1",
            "training.rollout.dtype=bf16",
            f"training.rollout.routing_replay={str(replay).lower()}",
            "training.micro_batch_size=16",
            "training.pipeline_microbatches=2",
            mesh=((2, 2), ("pp", "fsdp")),
        )
        train(cfg, tmp_path / str(replay), devices=jax.devices()[:4])
        first[replay] = _first_step(tmp_path / str(replay))
    for key in ("reward", "completion_tokens"):
        assert first[False][key] == first[True][key], key
    without, replayed = first[False], first[True]
    print(
        f"bf16 engine, step 0: logprob_mismatch_max {without['logprob_mismatch_max']:.4g} without replay, "
        f"{replayed['logprob_mismatch_max']:.4g} with; mean {without['logprob_mismatch_mean']:.4g}, "
        f"{replayed['logprob_mismatch_mean']:.4g}"
    )
    # misplaced routes would raise it: a forward on experts other than the engine's is further off
    assert replayed["logprob_mismatch_max"] < without["logprob_mismatch_max"] / 4


@pytest.mark.slow
def test_a_resumed_grpo_run_with_routing_replay_equals_the_straight_one(tmp_path):
    """Off-policy: the rollout queued at the checkpoint keeps its routes through the checkpoint's JSON."""
    cfg = _grpo(
        tmp_path,
        "training.lr_schedule=constant",
        "checkpoint.every_steps=2",
        "training.rollout.routing_replay=true",
        "training.rollout.dtype=bf16",
        "training.rollout.max_staleness=1",
    )
    keys = ("loss", "grad_norm", "reward", "logprob_mismatch_max")
    assert_resumes_alike(cfg, tmp_path, 4, 2, jax.devices()[:4], keys)


@pytest.mark.parametrize(
    "model, mesh, message",
    [
        (("model=gemma3_tiny",), "[[1], [fsdp]]", "model gemma3_tiny has none"),
        ((*MODELS["qwen3_moe"], "model.moe.experts=300"), "[[1], [fsdp]]", "more than 256"),
    ],
)
def test_routing_replay_where_it_cannot_run_is_one_line(tmp_path, model, mesh, message):
    prompts, _ = write_task(tmp_path / "task", count=8, seed=0)
    with pytest.raises(ConfigError, match=message) as err:
        load_config(
            [
                *model,
                f"model.mesh_shape={mesh}",
                "objective=grpo",
                "data=jsonl",
                f"data.train_files=[{prompts}]",
                "training.micro_batch_size=4",
                "training.rollout.reward=[tests.rewards_for_tests:length]",
                "training.rollout.routing_replay=true",
            ]
        )
    assert "\n" not in str(err.value)
