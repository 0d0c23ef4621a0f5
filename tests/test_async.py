"""Asynchronous rollouts (training.rollout.asynchronous, train/streaming.py): the settings' one-line
errors, per-token versions and the importance weights they give, and a run stopped by SIGTERM and
by kill -9 that, resumed, trains on every prompt once."""

import json
import signal

import pytest
from conftest import REPO, config, read_metrics, rl_overrides, run_python, run_training, start_python
from test_checkpoint import _wait_for_line

from tunix_train.rewards.arithmetic import write_task

LENGTH = "tests.rewards_for_tests:length"


def _async_run(tmp_path, *extra):
    prompts, _ = write_task(tmp_path / "task", count=33, seed=0)  # 32 to train on, 1 held out
    return [
        "model=gemma3_tiny",
        *rl_overrides(prompts),
        "data.seq_len=24",
        'model.mesh_shape=[[2],["fsdp"]]',
        "training.micro_batch_size=4",
        "training.rollout.num_generations=2",
        "training.rollout.max_new_tokens=8",
        f"training.rollout.reward=[{LENGTH}]",
        "training.rollout.asynchronous=true",
        'training.rollout.mesh_shape=[[2],["fsdp"]]',
        "checkpoint.every_steps=3",
        "checkpoint.keep=10",
        f"hydra.run.dir={tmp_path / 'run'}",
        *extra,
    ]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["training.rollout.mesh_shape=null"],
            "training.rollout.asynchronous=true needs training.rollout.mesh_shape",
        ),
        (["training.rollout.max_staleness=1"], "replaces max_staleness=1 and iterations=1"),
        (["objective=gkd"], "objective=gkd runs synchronously"),
        (
            ["training.rollout.asynchronous=false", "training.grpo.off_policy_correction=tis"],
            "training.grpo.off_policy_correction=tis corrects tokens other weights drew",
        ),
        (["training.rollout.buffer_steps=0"], "training.rollout.buffer_steps=0 must be at least 1"),
        (
            ["training.rollout.weight_update_every=4", "training.rollout.max_lag=2"],
            "training.rollout.max_lag=2 must be >= weight_update_every - 1 = 3",
        ),
        (
            ["training.rollout.asynchronous=false", "training.rollout.replicas=2"],
            "training.rollout.replicas=2 and ray_replicas=0 need asynchronous=true",
        ),
        (
            ["training.rollout.replicas=2"],
            "training.rollout.mesh_shape x 2 replicas: its 4 devices must leave devices for training",
        ),
        (
            ["training.rollout.prompt_lookup=3", "training.rollout.routing_replay=true"],
            "training.rollout.draft / prompt_lookup run without routing_replay: turn one off",
        ),
        (
            ["training.rollout.prompt_lookup=3", "training.rollout.draft=run"],
            "training.rollout.draft and training.rollout.prompt_lookup: give one drafter",
        ),
    ],
)
def test_impossible_settings_are_one_line(tmp_path, overrides, message):
    out = run_training(*_async_run(tmp_path, "training.max_steps=1", *overrides), devices=4)
    assert out.returncode != 0
    assert out.stderr.strip() == f"tunix_train: {out.stderr.strip().split('tunix_train: ', 1)[1]}"
    assert message in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def _async_config(tmp_path, *extra):
    """_async_run's settings as a Config, for a run in this process (train/loop.train)."""
    from tunix_train.compose import load_config

    return load_config([a for a in _async_run(tmp_path, *extra) if not a.startswith("hydra.")])[0]


def _each_prompt_trained_once(run_dir, steps: int) -> list[int]:
    """Asserts that steps 1..steps each trained 4 groups, no ticket twice, and the first epoch's 32
    prompts each once; returns the tickets trained, in step order."""
    trained = _trained(run_dir)
    tickets = [t for step in sorted(trained) for t in trained[step]["tickets"]]
    prompts = {t: p for step in trained.values() for t, p in zip(step["tickets"], step["prompts"])}
    assert sorted(trained) == list(range(1, steps + 1)) and len(tickets) == steps * 4 == len(set(tickets))
    assert set(range(32)) <= set(tickets) and sorted(prompts[t] for t in range(32)) == list(range(32))
    return tickets


def _trained(run_dir) -> dict[int, dict]:
    """Each step's record in rollouts.jsonl, the last written for a step (a resumed run writes the
    steps after its checkpoint again)."""
    return {r["step"]: r for r in map(json.loads, (run_dir / "rollouts.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_several_processes_are_refused_in_one_line_for_now(tmp_path):
    """2 processes x 2 CPU devices (the launcher): asynchronous rollouts run in one process for now
    (streamed across two, the engine's collectives went out of step between the processes and the
    run died in gloo): one line, before anything is written."""
    import os

    run = _async_run(tmp_path, "training.max_steps=10", "distributed.initialization_timeout_s=60")
    two = run_python(
        "-m",
        "tunix_train.launch",
        "--nprocs=2",
        "--cpu_devices_per_process=2",
        str(REPO / "run_training.py"),
        *run,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=300,
    )
    assert two.returncode != 0
    assert "training.rollout.asynchronous=true runs in one process for now (this run has 2)" in two.stdout
    assert "Traceback" not in two.stdout, two.stdout[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_stopped_and_killed_runs_resume_training_on_every_prompt_once(tmp_path):
    """SIGTERM after step 4 (a checkpoint of that step), kill -9 after step 8 (the checkpoint of step
    6 stands), then a run to step 14: 56 groups trained, each prompt's ticket (its place in the
    data's order) once. Tickets 0-31 are the first epoch's 32 prompts: every one trained once.
    The tickets the last checkpoint holds (finished, in flight, handed back) and those trained make
    every ticket handed out, none twice: nothing lost, nothing repeated."""
    args = _async_run(tmp_path, "training.max_steps=14")
    proc = start_python(REPO / "run_training.py", *args, devices=4)
    _wait_for_line(proc, "step 4/")
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, rest
    proc = start_python(REPO / "run_training.py", *args, devices=4)
    assert any("resumed from" in line for line in _wait_for_line(proc, "step 8/"))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    out = run_training(*args, devices=4, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "resumed from" in out.stdout + out.stderr

    tickets = _each_prompt_trained_once(tmp_path / "run", 14)
    data = json.loads((tmp_path / "run" / "checkpoints" / "14" / "data" / "metadata").read_text())
    held = data["iterator"]
    kept = [g["key"][0] for g in held["finished"]] + [k[0] for k in held["keys"]["returned"]]
    assert sorted(tickets + kept) == list(range(held["keys"]["tickets"]))


@pytest.mark.slow  # about 20 s: the engine's and the forward's compilations
def test_a_group_drawn_across_an_install_trains_with_each_tokens_own_behaviour_logprob(tmp_path):
    """Two completions streamed (GroupStream) with new parameters installed after their first 5
    tokens: their versions are [0] * 5 + [1] * 11; the step's rows (OnPolicy._rows) hold each
    token's recorded log-probability as its behaviour log-probability, at its target position and
    nowhere else; the loss's pi_old is exactly that, and the importance ratios and the loss equal
    numpy's min(exp(logp - recorded), cap) surrogate within 1e-6, logp the trainer's forward
    under the new parameters. The tokens before the install have ratios away from 1 (drawn by
    the old parameters), as they should."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from conftest import rl_config
    from flax import nnx
    from test_generate import CFG, PROMPTS, _on

    from tunix_train.config import OffPolicyCorrection, Remat
    from tunix_train.generate import Engine, Request, Sampling, Tuning
    from tunix_train.generate.groups import GroupStream
    from tunix_train.generate.sampling import Kinds
    from tunix_train.parallel import model_graphdef
    from tunix_train.train.objectives.grpo import OnPolicy
    from tunix_train.train.rollouts import Rollout
    from tunix_train.train.streaming import Streaming

    mesh, old = _on("1x1")
    rng = np.random.default_rng(1)
    new = jax.tree.map(lambda x: x * (1 + 0.3 * rng.normal(size=x.shape)).astype(np.float32), old)
    engine = Engine(CFG, mesh, slots=2, tuning=Tuning(chunk=4))
    prompt, T = PROMPTS[0], 24
    requests = [Request(tuple(prompt), 16, Sampling(1.0), 3, i) for i in range(2)]
    stream = GroupStream(
        engine.session(old, 64, 2, Kinds.of([Sampling(1.0)])), iter([(0, 0, 0)]), lambda k: requests, 1
    )
    stream.advance()  # the prefill's token and a chunk of 4
    stream.install(new, 1)
    (group,) = stream.take(1)
    rows = Streaming.rows_of(group)
    assert rows["versions"] == [[0] * 5 + [1] * 11] * 2

    cfg = rl_config(
        tmp_path,
        "training.rollout.num_generations=2",
        "training.rollout.reward=[tunix_train.rewards.arithmetic:exact_match]",
        "training.grpo.beta=0",
        f"data.seq_len={T}",
        "training.rollout.asynchronous=true",
        'training.rollout.mesh_shape=[[1],["fsdp"]]',
    )
    cfg.model = CFG
    objective = OnPolicy(cfg)
    objective.sampler.prompts, objective.sampler.stop_ids = [prompt], [1]
    rollout = Rollout(
        0, 0, 1, [0], rows["completions"], rows["logprobs"], [[1.0, 0.0]], 0.0, versions=rows["versions"]
    )
    full = objective._rows(rollout)
    behaviour, mask = full["behaviour_logp"], full["loss_mask"]
    start = len(prompt) - 1
    for row, recorded in enumerate(rows["logprobs"]):
        np.testing.assert_array_equal(behaviour[row, start : start + 16], np.float32(recorded))
        assert not behaviour[row, :start].any() and not behaviour[row, start + 16 :].any()

    forward = nnx.merge(model_graphdef(CFG, Remat.none), new)
    logits = np.asarray(forward(jnp.asarray(full["inputs"])), np.float64)
    log_softmax = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    logp = np.take_along_axis(log_softmax, full["targets"][..., None], -1)[..., 0] * mask
    advantages = np.repeat(np.array([[0.7], [-0.7]]), T, axis=1)
    micro = {
        "advantages": jnp.asarray(advantages, jnp.float32),
        "behaviour_logp": jnp.asarray(behaviour),
        "loss_mask": jnp.asarray(mask),
    }
    logp32 = jnp.asarray(logp, jnp.float32)
    weight = {"tokens": mask.sum(), "sequences": 2.0, "sequences_x_max_new_tokens": 2.0 * 16}
    g, cap = cfg.training.grpo, cfg.training.grpo.importance_cap
    ratio = np.where(mask > 0, np.exp(logp - behaviour), 1.0)  # pi / mu per token
    sequence = np.exp((np.log(ratio) * mask).sum(1, keepdims=True) / mask.sum(1, keepdims=True))
    clipped = np.minimum(  # behaviour_clip: the clip about mu, the ratio truncated at the cap
        np.minimum(ratio, cap) * advantages, np.clip(ratio, 1 - g.epsilon, 1 + g.epsilon) * advantages
    )
    expected = {  # the per-token surrogate; decoupled: pi_old = pi, so A times the weight
        "behaviour_clip": clipped,
        "tis": np.minimum(ratio, cap) * advantages,
        "sequence_mask": np.where((sequence >= 1 / cap) & (sequence <= cap), sequence, 0) * advantages,
    }
    for correction, surrogate in expected.items():
        cfg.training.grpo.off_policy_correction = OffPolicyCorrection(correction)
        objective = OnPolicy(cfg)
        pi_old = np.asarray(objective.policy_loss.old_logp(micro, logp32))
        assert np.array_equal(pi_old, behaviour if correction == "behaviour_clip" else logp32)
        loss, metrics = objective.loss(lambda: -logp32, None, micro, weight)
        np.testing.assert_allclose(float(loss), -(surrogate * mask).sum() / mask.sum(), atol=1e-6, rtol=0)
        if correction != "behaviour_clip":
            corrected = np.asarray(surrogate / advantages)
            np.testing.assert_allclose(
                float(metrics["importance_weight_mean"]), (corrected * mask).sum() / mask.sum(), atol=1e-6
            )
    assert 0 < sequence.min() and np.abs(np.log(ratio[:, start : start + 5])).max() > 0.05


@pytest.mark.slow  # two short runs, about 25 s
def test_a_weight_install_that_fails_or_hangs_ends_the_run_in_one_line(tmp_path, monkeypatch):
    """Weights the engine refuses (bf16 for its float32: Session.install's ValueError) and an install
    that never returns each stop the run at the step's install with one line and exit code 1
    (FAILED: a launcher restarts it from the last checkpoint, which stands), not a hang."""
    import threading

    import jax

    from tunix_train.generate.session import Session
    from tunix_train.train.loop import train
    from tunix_train.train.signals import RunStopped

    install = Session.install
    faults = {
        "refused": (
            lambda session, params, version, draft_params=None: install(
                session, jax.tree.map(lambda x: x.astype("bfloat16"), params), version, draft_params
            ),
            "installing version 1's weights failed (ValueError: the new parameters' ",
        ),
        "hung": (
            lambda session, params, version, draft_params=None: threading.Event().wait(120),
            "installing version 1's weights took over 3 s",
        ),
    }
    for name, (fault, message) in faults.items():
        cfg = _async_config(
            tmp_path / name,
            "training.max_steps=4",
            "checkpoint.every_steps=1",
            "training.rollout.weight_install_timeout_s=3",
        )
        monkeypatch.setattr(Session, "install", fault)
        with pytest.raises(RunStopped) as stopped:
            train(cfg, tmp_path / name / "run", devices=jax.devices()[:4])
        assert stopped.value.exit_code == 1 and "\n" not in str(stopped.value)
        assert str(stopped.value).startswith(f"training.rollout: {message}"), str(stopped.value)
        assert str(stopped.value).endswith("stopped (the last checkpoint stands)")
        assert sorted(
            p.name for p in (tmp_path / name / "run" / "checkpoints").iterdir() if p.name.isdigit()
        ) == ["1"]


@pytest.mark.slow  # one short run, about 20 s
def test_dynamic_sampling_trains_on_groups_with_signal_and_names_those_set_aside(tmp_path):
    """Under dynamic sampling a step takes the groups whose rewards differ (here: the prompts with
    an even answer, the only ones the reward varies on) and sets the others aside, named in
    rollouts.jsonl; no step needs filler groups."""
    import jax
    from conftest import read_metrics

    from tunix_train.train.loop import train

    cfg = _async_config(
        tmp_path,
        "training.max_steps=3",
        "training.rollout.reward=[tests.rewards_for_tests:length_for_even_answers]",
        "training.rollout.dynamic_sampling=true",
        "training.rollout.dynamic_sampling_rounds=8",
        "training.rollout.temperature=1.5",
    )
    train(cfg, tmp_path / "run", devices=jax.devices()[:4])
    answers = [
        json.loads(line)["answer"] for line in (tmp_path / "task" / "prompts.jsonl").read_text().splitlines()
    ]
    from tunix_train.data import Data

    docs = Data(cfg, ("prompt",)).train_docs
    answer_of = {i: int(doc["answer"]) for i, doc in enumerate(docs)}
    assert len(answers) == 33
    trained = _trained(tmp_path / "run")
    kept = [answer_of[p] for step in trained.values() for p in step["prompts"]]
    aside = [t for step in trained.values() for t in step["without_signal"]]
    assert len(kept) == 12 and all(a % 2 == 0 for a in kept), kept
    assert aside and not set(aside) & {t for step in trained.values() for t in step["tickets"]}
    assert all(m["groups_without_signal"] == 0 for m in read_metrics(tmp_path / "run") if "loss" in m)


@pytest.mark.slow  # two runs of 10 steps, about 60 s
@pytest.mark.parametrize("fault", ["dies", "hangs"])
def test_a_replica_that_dies_or_hangs_is_dropped_and_every_prompt_is_trained_once(
    tmp_path, monkeypatch, fault
):
    """Two engine replicas (one device each); after its third decode chunk replica 1 raises (a lost
    device) or never returns (replica_timeout_s=20): it is dropped with one warning, its groups in
    flight are drawn again by replica 0, and the run's 10 steps train on 40 tickets, none twice,
    the first epoch's 32 prompts each once."""
    import threading

    import jax
    from conftest import read_metrics

    from tunix_train.generate.session import Session
    from tunix_train.train.loop import train

    cfg = _async_config(
        tmp_path,
        "training.max_steps=10",
        'training.rollout.mesh_shape=[[1],["fsdp"]]',
        "training.rollout.replicas=2",
        # a chunk's deadline covers the compilations of the engine's first chunks
        f"training.rollout.replica_timeout_s={20 if fault == 'hangs' else 600}",
    )
    devices = jax.devices()[:4]  # training on 0 and 1; replica 0 on 2, replica 1 on 3
    step, chunks = Session.step, {0: 0, 1: 0}

    def faulty(session):
        replica = [d.id for d in session.engine.mesh.devices.flat] == [devices[3].id]
        chunks[replica] += 1
        if replica and chunks[1] > 3:
            if fault == "dies":
                raise RuntimeError("the device is gone (injected)")
            threading.Event().wait(120)
        return step(session)

    monkeypatch.setattr(Session, "step", faulty)
    train(cfg, tmp_path / "run", devices=devices)

    log = (tmp_path / "run" / "train.log").read_text()
    dropped = [line for line in log.splitlines() if "engine replica 1 is dropped" in line]
    why = "failed (RuntimeError: the device is gone (injected))" if fault == "dies" else "took over 20 s"
    assert len(dropped) == 1 and f"a decode chunk in engine replica 1 {why}" in dropped[0], dropped
    assert chunks[0] > chunks[1] > 3
    _each_prompt_trained_once(tmp_path / "run", 10)
    lost = [m["replicas_lost"] for m in read_metrics(tmp_path / "run") if "loss" in m]
    assert lost[0] == 0 and lost[-1] == 1, lost


@pytest.mark.slow  # a local Ray cluster, an actor's engine compiled: about 90 s
@pytest.mark.xdist_group("ray")
def test_a_ray_actor_replica_draws_groups_and_a_killed_one_is_survived(tmp_path, monkeypatch):
    """A replica in a Ray actor (training.rollout.ray_replicas=1, one CPU device of its own process)
    beside the local one, under LoRA: the base goes to the actor once and each install sends the
    adapters only; it finishes groups the run trains on until ray.kill ends it at its sixth decode
    chunk; the stream drops it with one warning (the actor's death, named), and the run's 10 steps
    train on 40 tickets, none twice, the first epoch's 32 prompts each once. Both replicas
    speculate with a draft model (the actor gets its parameters with the session's), distilled
    every step and sent with every install: the actor's drafts come back with its figures."""
    import tempfile

    import jax

    from tunix_train.config import ConfigError
    from tunix_train.generate.remote import RemoteSession
    from tunix_train.train.loop import train

    ray = pytest.importorskip("ray", reason="the Ray tests need the ray extra: pip install -e '.[ray]'")
    draft = config(
        "model.vocab_size=4096", "data.seq_len=16", "training.max_steps=1", "checkpoint.every_steps=1"
    )
    draft.model.mesh_shape = [[1], ["fsdp"]]
    train(draft, tmp_path / "draft", devices=jax.devices()[:1])
    cfg = _async_config(
        tmp_path,
        "training.max_steps=10",
        'training.rollout.mesh_shape=[[1],["fsdp"]]',
        "training.rollout.ray_replicas=1",
        "training.rollout.replica_timeout_s=300",  # the actor's first chunks compile its engine
        "training.lora.rank=4",
        "training.learning_rate=1e-2",
        f"training.rollout.draft={tmp_path / 'draft'}",
        "training.rollout.draft_distill_every=1",
    )
    step, calls, finished, drafted = RemoteSession.step, [0], set(), [0]
    install, sent, drafts_sent = RemoteSession.install, [], []

    def counted(session, params, version, draft_params=None):
        sent.append(sorted(jax.tree_util.keystr(path) for path, _ in jax.tree.leaves_with_path(params)))
        drafts_sent.append(draft_params is not None)
        install(session, params, version, draft_params)

    monkeypatch.setattr(RemoteSession, "install", counted)

    def killed_at_six(session):
        calls[0] += 1
        if calls[0] == 6:
            ray.kill(session.actor)
        step(session)
        finished.update(rid for rid, c in session.completions.items() if c.finish is not None)
        drafted[0] = max(drafted[0], session.engine.stats["drafted"])

    monkeypatch.setattr(RemoteSession, "step", killed_at_six)
    # unset, a local ray.init turns token authentication on for this process's environment and
    # writes ~/.ray/auth_token, which later clusters of this machine (test_launch.py's) then read
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    ray.init(
        num_cpus=2,
        num_gpus=0,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=tempfile.mkdtemp(prefix="ray", dir="/tmp"),  # short: Ray's socket paths
    )
    try:
        train(cfg, tmp_path / "run", devices=jax.devices()[:3])  # training on 2, the local replica on 1

        # a cluster without room for the actor (its 2 CPUs taken): one line within the deadline
        @ray.remote(num_cpus=2)
        class Idle:  # defined here: Ray sends it by value (its workers cannot import this file)
            def ready(self) -> bool:
                return True

        taken = Idle.remote()
        ray.get(taken.ready.remote())
        cfg = _async_config(
            tmp_path,
            'training.rollout.mesh_shape=[[1],["fsdp"]]',
            "training.rollout.ray_replicas=1",
            "training.rollout.replica_timeout_s=5",
        )
        with pytest.raises(ConfigError, match="an actor replica did not start within replica_timeout_s=5 s"):
            train(cfg, tmp_path / "no_room", devices=jax.devices()[:3])
    finally:
        ray.shutdown()

    dropped = [
        line for line in (tmp_path / "run" / "train.log").read_text().splitlines() if "dropped" in line
    ]
    assert len(dropped) == 1 and "a decode chunk in engine replica 1 failed (" in dropped[0], dropped
    assert "Actor" in dropped[0] and calls[0] == 6 and len(finished) >= 2, (dropped, calls, finished)
    assert drafts_sent and all(drafts_sent)  # the distilled draft goes with every install
    # a step after which no chunk ran (the buffer full) has no acceptance: nothing was drafted
    rates = [m["acceptance_rate"] for m in read_metrics(tmp_path / "run") if "acceptance_rate" in m]
    assert drafted[0] > 0 and rates and all(0 < r <= 1 for r in rates), rates
    _each_prompt_trained_once(tmp_path / "run", 10)
    # the installs before the actor died: LoRA's a and b matrices, nothing of the base
    assert sent and all(
        paths and all(p.endswith(("['a'].value", "['b'].value")) for p in paths) for paths in sent
    ), sent
