"""Routing replay: the engine records the experts each layer chose for every position it fed, and a
forward given them uses those experts (weighted by its own router) instead of its top k. Checked on
Qwen 3 MoE's softmax router and Gemma 4's: the recorded experts are those a prefill of the whole
sequence chooses, the replayed forward's log-probabilities equal the engine's, other experts change
them; in GRPO (training.grpo.routing_replay) a bf16 engine's mismatch falls, float32's stays at
rounding, and a resumed run equals a straight one (the routes of a queued rollout in the checkpoint)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import config, read_metrics, straight_and_resumed
from flax import nnx

from tunix_train.compose import load_config
from tunix_train.config import ConfigError, Remat
from tunix_train.generate import Engine, Request, Sampling
from tunix_train.model.decoder import output_logits
from tunix_train.parallel import model_graphdef
from tunix_train.rewards.arithmetic import write_task
from tunix_train.sharding import make_mesh
from tunix_train.train.init import plan_train_state
from tunix_train.train.loop import train
from tunix_train.train.optimizer import make_optimizer

MODELS = {
    "qwen3_moe": ("model=qwen3_moe_tiny", "model.num_experts=16", "model.num_experts_per_token=4"),
    "gemma4_moe": ("model=gemma4_moe_tiny",),
}


def _model(name):
    cfg = config(*MODELS[name]).model
    mesh = make_mesh([[1], ["fsdp"]], jax.devices()[:1])
    params = plan_train_state(cfg, make_optimizer(config().training)[0], mesh, seed=0).create().params
    return cfg, mesh, params


def _logprobs(cfg, params, sequence, prompt_len, replay=None):
    """The full forward's log-probability of each completion token (replaying `replay` [T, L, k])."""
    model = nnx.merge(model_graphdef(cfg, Remat.none), params)
    x, _ = model.hidden_and_stats(
        jnp.asarray([sequence[:-1]]), replay_BTLK=None if replay is None else jnp.asarray(replay[None])
    )
    logp = jax.nn.log_softmax(output_logits(x, model.output_table(), cfg.final_logit_softcap), -1)
    taken = jnp.take_along_axis(logp, jnp.asarray([sequence[1:]])[..., None], -1)
    return np.asarray(taken[0, prompt_len - 1 :, 0])


@pytest.mark.parametrize("name", MODELS)
def test_the_engine_records_the_experts_and_replaying_them_gives_its_logprobs(name):
    cfg, mesh, params = _model(name)
    E, K = cfg.num_experts, cfg.num_experts_per_token
    engine = Engine(cfg, mesh, record_routes=True, slots=2)  # 5 requests in 2 slots: inserted mid-run
    requests = [Request((1, 2, 3, 4 + i), 20, Sampling(temperature=1.0), 0, i) for i in range(5)]
    with jax.set_mesh(mesh):
        done = engine.generate(params, requests)
    for request, completion in zip(requests, done):
        sequence, P = [*request.prompt, *completion.tokens], len(request.prompt)
        # every position fed: the prompt's and each new token's but the last
        assert completion.routes.shape == (len(sequence) - 1, cfg.num_layers, K)
        assert all(len(set(r)) == K and 0 <= min(r) and max(r) < E for r in completion.routes.reshape(-1, K))
        with jax.set_mesh(mesh):  # a prefill of the whole sequence routes each position alike
            (whole,) = Engine(cfg, mesh, record_routes=True).generate(
                params, [Request(tuple(sequence[:-1]), 1)]
            )
        np.testing.assert_array_equal(whole.routes, completion.routes)
        replayed = _logprobs(cfg, params, sequence, P, completion.routes)
        np.testing.assert_allclose(replayed, completion.logprobs, atol=1e-5, rtol=0)
        others = _logprobs(cfg, params, sequence, P, (completion.routes + 1) % E)
        assert np.abs(others - completion.logprobs).max() > 1e-3  # the replayed experts are used
    # an engine that does not record keeps no routes (and compiles no extra outputs)
    with jax.set_mesh(mesh):
        assert Engine(cfg, mesh).generate(params, requests[:1])[0].routes is None


def _grpo(tmp_path, *overrides):
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
            "training.grpo.num_generations=4",
            "training.grpo.max_new_tokens=12",
            "training.grpo.temperature=1.5",
            "training.grpo.reward=[tests.rewards_for_tests:length]",
            "training.learning_rate=1e-3",
            *overrides,
        ]
    )
    cfg.model.mesh_shape = [[2, 2], ["ep", "fsdp"]]
    return cfg


def _first_step(run_dir):
    return next(m for m in read_metrics(run_dir) if "loss" in m)


def test_grpo_with_routing_replay_trains_on_the_engines_experts(tmp_path):
    """Step 0 of each run draws the same completions (recording changes no draw): only the
    trainer's forward differs. bf16 engine: the replayed forward's mismatch is below the router's
    own; float32 (routes replayed): rounding alone."""
    first = {}
    for dtype, replay in (("bf16", False), ("bf16", True), ("fp32", True)):
        run_dir = tmp_path / f"{dtype}_{replay}"
        cfg = _grpo(
            tmp_path,
            "training.max_steps=1",
            f"training.grpo.rollout_dtype={dtype}",
            f"training.grpo.routing_replay={str(replay).lower()}",
        )
        train(cfg, run_dir, devices=jax.devices()[:4])
        first[dtype, replay] = _first_step(run_dir)
    for key in ("reward", "completion_tokens"):
        assert first["bf16", False][key] == first["bf16", True][key], key
    without, replayed = first["bf16", False], first["bf16", True]
    print(
        f"bf16 engine, step 0: logprob_mismatch_max {without['logprob_mismatch_max']:.4g} without replay, "
        f"{replayed['logprob_mismatch_max']:.4g} with; mean {without['logprob_mismatch_mean']:.4g}, "
        f"{replayed['logprob_mismatch_mean']:.4g}"
    )
    assert replayed["logprob_mismatch_max"] < without["logprob_mismatch_max"]
    assert first["fp32", True]["logprob_mismatch_max"] < 1e-5


@pytest.mark.slow
def test_a_resumed_grpo_run_with_routing_replay_equals_the_straight_one(tmp_path):
    """Off-policy: the rollout queued at the checkpoint keeps its routes through the checkpoint's JSON."""
    cfg = _grpo(
        tmp_path,
        "training.lr_schedule=constant",
        "checkpoint.every_steps=2",
        "training.grpo.routing_replay=true",
        "training.grpo.rollout_dtype=bf16",
        "training.grpo.max_staleness=1",
    )
    straight, resumed = straight_and_resumed(cfg, tmp_path, 4, 2, jax.devices()[:4])

    def metrics(run_dir):
        return [m for m in read_metrics(run_dir) if "loss" in m]

    for key in ("loss", "grad_norm", "reward", "logprob_mismatch_max"):
        assert [m[key] for m in metrics(resumed)] == [m[key] for m in metrics(straight)], key


@pytest.mark.parametrize(
    "model, mesh, message",
    [
        (("model=gemma3_tiny",), "[[1], [fsdp]]", "model gemma3_tiny has none"),
        (MODELS["qwen3_moe"], "[[2, 2], [pp, fsdp]]", "does not run with the pp mesh axis"),
        ((*MODELS["qwen3_moe"], "model.num_experts=300"), "[[1], [fsdp]]", "more than 256"),
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
                "training.grpo.reward=[tests.rewards_for_tests:length]",
                "training.grpo.routing_replay=true",
            ]
        )
    assert "\n" not in str(err.value)
