"""training.rollout.environment=openenv: an OpenEnv environment from openenv-core's own package
(the echo environment its `openenv init` writes, served with its create_app) drives a multi-turn
GRPO run of a tiny model for 10 steps, started for the run; a server that is gone costs error
observations and the run goes on."""

import json
import subprocess
import sys

import jax
import pytest
from conftest import config, read_metrics, rl_config

pytest.importorskip("openenv.core.generic_client", reason="needs openenv-core: pip install -e '.[envs]'")

from tunix_train.config import OpenEnvConfig  # noqa: E402
from tunix_train.envs.openenv import start_server  # noqa: E402
from tunix_train.rewards.calculator import write_tokenizer  # noqa: E402
from tunix_train.train.loop import train  # noqa: E402

pytestmark = pytest.mark.slow  # GRPO runs with an environment server in a subprocess

SERVE = """from openenv.core.env_server.http_server import create_app
from echo_demo.models import EchoDemoAction, EchoDemoObservation
from echo_demo.server.echo_demo_environment import EchoDemoEnvironment

app = create_app(
    EchoDemoEnvironment, EchoDemoAction, EchoDemoObservation, env_name="echo_demo", max_concurrent_envs=64
)
"""


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    """A folder holding openenv's echo environment (`openenv init echo_demo`) and serve_echo:app."""
    folder = tmp_path_factory.mktemp("openenv")
    made = subprocess.run(
        [sys.executable, "-m", "openenv.cli", "init", "echo_demo", "-o", str(folder)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    (folder / "serve_echo.py").write_text(SERVE)
    return folder


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """gemma3_tiny fine-tuned to answer an arithmetic prompt in a short turn that ends (a random
    model never writes <end_of_turn>, so its turns would never reach the environment), exported."""
    from tunix_train.export import main as export
    from tunix_train.rewards.arithmetic import problems

    folder = tmp_path_factory.mktemp("warm")
    tokenizer = write_tokenizer(folder / "tok" / "tokenizer.model")
    rows = [
        {
            "messages": [
                {"role": "user", "content": p["prompt"]},
                {"role": "assistant", "content": p["answer"]},
            ]
        }
        for p in problems(256, seed=0)
    ]
    (folder / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config(
        "model.vocab_size=4102", f"data.tokenizer={tokenizer}", "data=chat",
        f"data.train_files=[{folder / 'sft.jsonl'}]", "data.seq_len=64", "training.max_steps=40",
        "training.micro_batch_size=8", "training.learning_rate=1e-2", "training.eval_every=0",
        "training.warmup_steps=10", "checkpoint.every_steps=0",
    )  # fmt: skip
    train(cfg, folder / "sft", devices=jax.devices()[:1])
    assert export([str(folder / "sft"), str(folder / "hf")]) == 0
    return tokenizer, folder / "hf"


def _cfg(tmp_path, warm, *overrides):
    """GRPO from the warm model on the arithmetic prompts in Gemma's turn format (the bundled
    tokenizer with its turn tokens), two turns of up to 6 tokens, the environment's reward added to
    the completion's length."""
    tokenizer, model = warm
    return rl_config(
        tmp_path,
        "model.vocab_size=4102",
        f"data.tokenizer={tokenizer}",
        f"model.init_from={model}",
        "training.rollout.environment=openenv",
        "training.rollout.max_turns=2",
        "training.rollout.num_generations=4",
        "training.micro_batch_size=8",
        "training.rollout.temperature=1.5",
        "data.seq_len=128",
        "training.rollout.max_new_tokens=6",
        "training.rollout.reward=[tests.rewards_for_tests:length]",
        "training.rollout.tool_timeout_s=5",
        "training.eval_every=0",
        "checkpoint.every_steps=0",
        'model.mesh_shape=[[1],["fsdp"]]',
        *overrides,
    )


def test_an_openenv_server_drives_a_multi_turn_grpo_run(tmp_path, echo, warm, monkeypatch):
    """Ten multi-turn GRPO steps against the echo server started for the run (openenv.app): turns
    and environment rewards in every step, and the server stopped when the run ends."""
    from tunix_train.envs import openenv

    started = []
    monkeypatch.setattr(openenv, "start_server", lambda s: started.append(start_server(s)) or started[-1])
    cfg = _cfg(
        tmp_path,
        warm, "training.max_steps=10", "training.rollout.openenv.app=serve_echo:app",
        f"training.rollout.openenv.app_dir={echo}",
        "training.rollout.openenv.observation_field=echoed_message",
    )  # fmt: skip
    train(cfg, tmp_path / "run", devices=jax.devices()[:1])
    steps = [m for m in read_metrics(tmp_path / "run") if "reward" in m]
    assert len(steps) == 10
    assert all(m["tool_errors"] == 0 and m["turns"] > 1 for m in steps), steps[0]
    # the echo environment rewards 0.1 a character of each turn the model sends it
    assert all(m["reward_environment"] > 0 for m in steps)
    assert len(started) == 1 and started[0][1].poll() is not None  # stopped, not left to atexit


def test_a_server_killed_mid_run_costs_error_observations_and_the_run_goes_on(tmp_path, echo, warm):
    """A server started as openenv.app starts one, killed after step 2 of 4 (a hook of the loop):
    the later rollouts meet a closed port at every reset and step, as error observations, and the
    run finishes."""
    from tunix_train.train.hooks import Hook

    url, server = start_server(OpenEnvConfig(app="serve_echo:app", app_dir=str(echo)))

    class KillAfterStep2(Hook):
        def after_step(self, end):
            if end.step == 2:
                server.kill()
                server.wait()

    cfg = _cfg(tmp_path, warm, "training.max_steps=4", f"training.rollout.openenv.url={url}")
    try:
        train(cfg, tmp_path / "run", devices=jax.devices()[:1], extra_hooks=[KillAfterStep2()])
    finally:
        server.kill()
    steps = [m for m in read_metrics(tmp_path / "run") if "reward" in m]
    assert len(steps) == 4
    # GRPO samples step N+1's rollouts while step N trains: the first rollout after the kill is step 4's
    assert steps[0]["tool_errors"] == 0 and steps[0]["reward_environment"] > 0
    assert steps[-1]["tool_errors"] > 0 and steps[-1]["reward_environment"] == 0


def test_an_asynchronous_run_continues_each_conversation_as_its_turn_ends(tmp_path, warm, monkeypatch):
    """training.rollout.asynchronous with an environment (test_tools' Checker: one more turn after
    the answer, rewarded 1 for a number): each conversation's next turn is queued as its last one
    finishes (generate/groups.py's `after`); the trained rows keep each token's version and which
    tokens the model wrote, the template's tokens between turns carry no log-probability, and the
    steps train whole groups, none twice."""
    from tunix_train.train import streaming

    rollouts, rollout_of = [], streaming.Streaming._rollout

    def kept(self, groups, *args):
        rollouts.append(rollout_of(self, groups, *args))
        return rollouts[-1]

    monkeypatch.setattr(streaming.Streaming, "_rollout", kept)
    cfg = _cfg(
        tmp_path,
        warm,
        "training.max_steps=6",
        "training.rollout.environment=tests.test_tools:Checker",
        "training.rollout.asynchronous=true",
        'training.rollout.mesh_shape=[[1],["fsdp"]]',
    )
    train(cfg, tmp_path / "run", devices=jax.devices()[:2])
    steps = [m for m in read_metrics(tmp_path / "run") if "reward" in m]
    assert len(steps) == 6 and all(m["tool_errors"] == 0 and m["turns"] > 1 for m in steps), steps
    assert all(m["reward_environment"] > 0 for m in steps) and "lag_mean" in steps[-1]
    rows = [row for r in rollouts for row in zip(r.completions, r.own, r.logprobs, r.versions)]
    assert all(len(tokens) == len(own) == len(logp) == len(versions) for tokens, own, logp, versions in rows)
    assert all(lp == 0.0 for _, own, logp, _ in rows for o, lp in zip(own, logp) if not o)
    assert sum(0 in own and 1 in own for _, own, _, _ in rows) > len(rows) // 2  # the turns between
    tickets = [t for r in rollouts for t in r.tickets]
    assert len(tickets) == len(set(tickets)) == 6 * 2
