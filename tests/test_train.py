"""The compiled train step: equal losses on every mesh, accumulation == full batch, bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import config, read_metrics, train_losses

from tunix_train.compose import load_config
from tunix_train.config import ConfigError
from tunix_train.data.synthetic import SyntheticBatches
from tunix_train.sharding import make_mesh, to_global_batch
from tunix_train.train.hooks import Hook
from tunix_train.train.init import plan_train_state
from tunix_train.train.loop import train
from tunix_train.train.program import program_for
from tunix_train.train.setup import setup
from tunix_train.train.step import compile_train_step

GLOBAL_BATCH = 8
# Pure fsdp over 8 devices is checked by test_checkpoint (its fsdp8 resume continues the fsdp4 losses).
MESHES = {  # name: (mesh_shape, devices used)
    "1x1": ([[1, 1], ["fsdp", "tp"]], 1),
    "fsdp4_tp2": ([[4, 2], ["fsdp", "tp"]], 8),
    "tp8": ([[1, 8], ["fsdp", "tp"]], 8),
    "dp2_fsdp2_tp2": ([[2, 2, 2], ["dp", "fsdp", "tp"]], 8),
}
# tp=8 needs 8 query heads and an MLP width divisible by 8; the same model runs on every mesh.
MODEL = (
    "model.num_heads=8",
    "model.num_kv_heads=2",
    "model.head_dim=8",
    "training.log_every=1",
    "training.max_steps=3",
    "training.warmup_steps=1",
    "training.eval_every=0",
)
_LOSSES: dict = {}  # (mesh name, overrides) -> train losses, shared by the tests of this module


def _losses(tmp_path, name, *overrides):
    if (name, overrides) not in _LOSSES:
        _LOSSES[name, overrides] = _train_losses(tmp_path / "_".join((name, *overrides)), name, *overrides)
    return _LOSSES[name, overrides]


def _train(run_dir, name, *overrides):
    """The final TrainState of MODEL trained on mesh `name` with GLOBAL_BATCH rows per step."""
    mesh_shape, n_devices = MESHES[name]
    dp = 1
    for size, axis in zip(*mesh_shape):
        dp *= size if axis in ("dp", "fsdp") else 1
    cfg = config(*MODEL, f"training.micro_batch_size={GLOBAL_BATCH // dp}", *overrides)
    cfg.model.mesh_shape = mesh_shape
    return train(cfg, run_dir, devices=jax.devices()[:n_devices])


def _train_losses(run_dir, name, *overrides):
    _train(run_dir, name, *overrides)
    return np.array(train_losses(run_dir))


def test_every_mesh_gives_the_same_losses(tmp_path):
    reference = _losses(tmp_path, "1x1")
    assert len(reference) == 3
    for name in MESHES:
        if name != "1x1":
            np.testing.assert_allclose(_losses(tmp_path, name), reference, rtol=1e-5, err_msg=name)


def _one_sgd_step(cfg, mesh_shape, n_devices, micro_batch, accumulation):
    """Parameters after one plain-SGD step (lr 1): params - grads, so the update is the gradient."""
    mesh = make_mesh(mesh_shape, jax.devices()[:n_devices])
    optimizer, schedule = optax.sgd(1.0), optax.constant_schedule(1.0)
    data = SyntheticBatches(
        seq_len=cfg.data.seq_len,
        vocab_size=cfg.model.vocab_size,
        accumulation_steps=accumulation,
        global_micro_batch=micro_batch,
        seed=0,
    )
    with jax.set_mesh(mesh):
        plan = plan_train_state(cfg.model, optimizer, mesh, 0, cfg.training.sharding_strategy)
        state = plan.create()
        before = jax.tree.map(np.asarray, state.params)
        step = compile_train_step(program_for(plan, cfg.model, cfg.training, (optimizer, schedule)))
        state, metrics = step(state, to_global_batch(next(data), mesh))
    update = jax.tree.map(lambda new, old: np.asarray(new) - old, state.params, before)
    return update, float(metrics["loss"])


@pytest.mark.parametrize(
    "mesh_shape, n_devices, sync_every",
    [([[1], ["fsdp"]], 1, 1), ([[2, 4], ["fsdp", "tp"]], 8, 1), ([[2, 4], ["fsdp", "tp"]], 8, 2)],
)
def test_accumulated_gradients_equal_full_batch(mesh_shape, n_devices, sync_every):
    # sync_every > 1: each fsdp shard keeps its own gradient sums and they are reduced every
    # sync_every micro-batches; the result is the same gradient.
    full, full_loss = _one_sgd_step(config(), mesh_shape, n_devices, micro_batch=8, accumulation=1)
    cfg = config("training.gradient_accumulation_steps=4", f"training.sync_gradients_every={sync_every}")
    accumulated, acc_loss = _one_sgd_step(cfg, mesh_shape, n_devices, micro_batch=8 // 4, accumulation=4)
    assert acc_loss == pytest.approx(full_loss, rel=1e-6)
    for a, b in zip(jax.tree.leaves(accumulated), jax.tree.leaves(full)):
        assert np.abs(b).max() > 0
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def test_accumulation_in_the_cli_config_matches_full_batch(tmp_path):
    """micro_batch_size 2 x 4 accumulation steps vs 8 x 1, end to end with AdamW."""
    losses = {}
    for micro, accumulation in ((8, 1), (2, 4)):
        cfg = config(
            "training.max_steps=3",
            "training.log_every=1",
            "training.eval_every=0",
            f"training.micro_batch_size={micro}",
            f"training.gradient_accumulation_steps={accumulation}",
        )
        cfg.model.mesh_shape = [[1], ["fsdp"]]
        train(cfg, tmp_path / f"{micro}x{accumulation}", devices=jax.devices()[:1])
        losses[micro] = train_losses(tmp_path / f"{micro}x{accumulation}")
    np.testing.assert_allclose(losses[2], losses[8], rtol=1e-5)


@pytest.mark.slow  # 20 s
def test_bf16_computes_in_bfloat16_and_keeps_float32_master_weights(tmp_path):
    state = _train(tmp_path / "bf16", "fsdp4_tp2", "training.mixed_precision=bf16")
    assert {x.dtype for x in jax.tree.leaves((state.params, state.opt_state[1][0].mu))} == {
        jnp.dtype("float32")
    }
    bf16 = train_losses(tmp_path / "bf16")
    fp32 = _losses(tmp_path, "fsdp4_tp2")
    # Same model and data: bf16 differs from fp32 by rounding, not by a different computation.
    np.testing.assert_allclose(bf16, fp32, rtol=2e-2)
    assert list(bf16) != list(fp32)


@pytest.mark.slow  # 22 s
def test_remat_policies_give_the_same_losses(tmp_path):
    reference = _losses(tmp_path, "fsdp4_tp2")  # the default, remat=save_matmul_outputs
    for policy in ("none", "full", "offload_matmul_outputs"):
        losses = _losses(tmp_path, "fsdp4_tp2", f"training.remat={policy}")
        np.testing.assert_allclose(losses, reference, rtol=1e-5, err_msg=policy)


@pytest.mark.slow
def test_the_default_job_learns(tmp_path):
    """`python run_training.py` as shipped (gemma3_small on the bundled corpus), cut to 40 steps."""
    cfg, _ = load_config(["training.max_steps=40", "training.log_every=10", "training.eval_every=20"])
    assert cfg.model.name == "gemma3_small" and cfg.data.source.value == "shakespeare"
    train(cfg, tmp_path / "default", devices=jax.devices()[:1])
    metrics = read_metrics(tmp_path / "default")
    losses = [m["loss"] for m in metrics if "loss" in m]
    evals = {m["step"]: m["eval_loss"] for m in metrics if "eval_loss" in m}
    assert losses[-1] < losses[0] - 1.0, losses  # 7.28 at step 10, 5.96 at step 40
    assert list(evals) == [0, 20, 40] and evals[40] < evals[20] < evals[0] - 2.0, evals
    assert all(
        np.exp(m["eval_loss"]) == pytest.approx(m["eval_perplexity"]) for m in metrics if "eval_loss" in m
    )


def test_chunked_loss_gives_the_loss_and_gradients_of_the_whole_one():
    cfg = config("model.final_logit_softcap=30.0", "training.loss_chunk_size=0")
    whole, whole_loss = _one_sgd_step(cfg, [[2, 4], ["fsdp", "tp"]], 8, micro_batch=8, accumulation=1)
    cfg.training.loss_chunk_size = 8  # 4 chunks of a 32-token row
    chunked, chunked_loss = _one_sgd_step(cfg, [[2, 4], ["fsdp", "tp"]], 8, micro_batch=8, accumulation=1)
    assert chunked_loss == pytest.approx(whole_loss, rel=1e-6)
    for a, b in zip(jax.tree.leaves(chunked), jax.tree.leaves(whole)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


@pytest.mark.parametrize("strategy", ["shard_grad_op", "no_shard"])
def test_sharding_strategies_give_the_same_losses_and_shard_what_they_say(tmp_path, strategy):
    reference = _losses(tmp_path, "fsdp4_tp2")
    losses = _losses(tmp_path, "fsdp4_tp2", f"training.sharding_strategy={strategy}")
    np.testing.assert_allclose(losses, reference, rtol=1e-5)

    cfg = config(*MODEL, f"training.sharding_strategy={strategy}")
    cfg.model.mesh_shape = MESHES["fsdp4_tp2"][0]
    with jax.set_mesh((run := setup(cfg)).mesh):
        state = run.plan.create()
    mlp_up = state.params["layers"]["mlp"]["up_DF"].get_value()  # [layers, embed, mlp]
    adam_mu = state.opt_state[1][0].mu["layers"]["mlp"]["up_DF"].get_value()
    assert mlp_up.sharding.spec == jax.sharding.PartitionSpec(None, None, "tp")  # not over fsdp
    assert adam_mu.sharding.spec == (
        jax.sharding.PartitionSpec(None, "fsdp", "tp")
        if strategy == "shard_grad_op"
        else jax.sharding.PartitionSpec(None, None, "tp")
    )
    assert mlp_up.addressable_shards[0].data.shape == (2, 64, 128 // 2)


def _run(run_dir, max_steps, *overrides):
    """MODEL on fsdp4_tp2 for max_steps steps (resuming run_dir's checkpoint if it has one)."""
    cfg = config(*MODEL, "training.micro_batch_size=2", *overrides)
    cfg.model.mesh_shape, cfg.training.max_steps = MESHES["fsdp4_tp2"][0], max_steps
    return train(cfg, run_dir, devices=jax.devices()[:8])


BF16 = "training.mixed_precision=bf16"
OFFLOADS = {  # what goes to the host: (overrides, offloaded parts of the state)
    "optimizer state": (("training.offload_optimizer_state=true",), {"opt_state"}),
    "master weights": ((BF16, "training.offload_master_weights=true"), {"params"}),
    "both": (
        (BF16, "training.offload_optimizer_state=true", "training.offload_master_weights=true"),
        {"params", "opt_state"},
    ),
}


def _memory_kinds(state):
    return {
        part: {x.sharding.memory_kind for x in jax.tree.leaves(getattr(state, part))}
        for part in ("params", "opt_state")
    }


@pytest.mark.parametrize("offload", ["optimizer state", "both"])  # "both" holds the master weights'
def test_an_offloaded_state_lives_in_pinned_host_memory_and_changes_no_loss(tmp_path, offload):
    overrides, on_host = OFFLOADS[offload]
    reference = _losses(tmp_path, "fsdp4_tp2", *[o for o in overrides if o == BF16])
    state = _run(tmp_path / "offload", 3, *overrides)
    assert _memory_kinds(state) == {
        part: {"pinned_host" if part in on_host else "device"} for part in ("params", "opt_state")
    }
    np.testing.assert_allclose(train_losses(tmp_path / "offload"), reference, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_a_checkpoint_resumes_with_or_without_offload(tmp_path, offload="both"):
    """3 steps with the state offloaded then 2 without, and the reverse, give the losses of 5 steps in
    one run: checkpoints are the same either way. (A constant learning rate: the schedule does not
    depend on max_steps, which the resumed runs change.)"""
    overrides, on_host = OFFLOADS[offload]
    same = ("training.lr_schedule=constant", *[o for o in overrides if o == BF16])
    offloaded = [o for o in overrides if o != BF16]
    _run(tmp_path / "straight", 5, *same)
    straight = train_losses(tmp_path / "straight")
    for first, then in (("true", "false"), ("false", "true")):
        run_dir = tmp_path / f"{first}_then_{then}"
        _run(run_dir, 3, *same, *[o.replace("true", first) for o in offloaded])
        state = _run(run_dir, 5, *same, *[o.replace("true", then) for o in offloaded])
        assert _memory_kinds(state) == {
            part: {"pinned_host" if then == "true" and part in on_host else "device"}
            for part in ("params", "opt_state")
        }
        np.testing.assert_allclose(train_losses(run_dir), straight, rtol=0, atol=1e-6)


def test_offloaded_master_weights_need_bf16():
    with pytest.raises(
        ConfigError, match="training.offload_master_weights=true keeps the float32 master copy"
    ):
        config("training.offload_master_weights=true")


class _Recorder(Hook):
    """Records the loop's calls; adds the state's step counter to the logged scalars of even steps."""

    def __init__(self):
        self.calls = []

    def at_start(self, start):
        self.calls.append(("start", start.step))

    def before_step(self, step):
        self.calls.append(("before", step))

    def after_step(self, end):
        self.calls.append(("after", end.step))
        if end.step % 2 == 0:
            end.scalars["state_step"] = int(end.state.step)

    def at_end(self, state):
        self.calls.append(("end", int(state.step)))


def test_a_hook_plugged_into_the_loop_sees_every_step_and_its_scalars_are_logged(tmp_path):
    cfg = config("training.max_steps=3", "training.log_every=3", "training.eval_every=0")
    cfg.model.mesh_shape = [[1], ["fsdp"]]
    first = _Recorder()
    train(cfg, tmp_path, devices=jax.devices()[:1], extra_hooks=[first])
    assert first.calls == [
        ("start", 0),
        ("before", 0),
        ("after", 1),
        ("before", 1),
        ("after", 2),
        ("before", 2),
        ("after", 3),
        ("end", 3),
    ]
    cfg.training.max_steps = 4  # resumed: the hook starts where the checkpoint left off
    resumed = _Recorder()
    train(cfg, tmp_path, devices=jax.devices()[:1], extra_hooks=[resumed])
    assert resumed.calls == [("start", 3), ("before", 3), ("after", 4), ("end", 4)]
    records = {m["step"]: m for m in read_metrics(tmp_path)}
    assert sorted(records) == [2, 3, 4]
    assert records[2] == {"step": 2, "state_step": 2}  # written on a step that logs nothing else
    assert records[4]["state_step"] == 4 and "loss" in records[4] and "state_step" not in records[3]
