"""Pipeline (pp) and context (cp) parallelism: the same losses and gradients as one device, the
layers and the sequence really split, balanced causal work, a schedule whose idle time is the
bubble formula, resumes across pp and cp, and one-line errors."""

import jax
import numpy as np
import optax
import pytest
from conftest import config, train_losses

from tunix_train import parallel
from tunix_train.config import ConfigError
from tunix_train.data import Data
from tunix_train.model import kernels
from tunix_train.parallel import context, pipeline
from tunix_train.sharding import make_mesh, process_rows, to_global_batch
from tunix_train.train.init import plan_train_state
from tunix_train.train.loop import train
from tunix_train.train.program import program_for
from tunix_train.train.setup import setup
from tunix_train.train.step import abstract_batch, compile_train_step

# gemma3_tiny with 4 layers (local, global, local, global; window 8), packed Shakespeare
# paragraphs (segment ids, restarting positions), 2 accumulation steps and the logits in chunks.
MODEL = (
    "data=shakespeare",
    "model.vocab_size=4096",
    "model.num_layers=4",
    "data.seq_len=64",
    "training.gradient_accumulation_steps=2",
    "training.loss_chunk_size=16",
    "training.log_every=1",
    "training.max_steps=3",
    "training.warmup_steps=1",
    "training.eval_every=0",
)
RING = "model.context_parallel_strategy=ring"
RUNS = {  # name: (mesh_shape, rows per data-parallel shard, overrides); 16 rows a step in all
    "pp2": ([[2], ["pp"]], 8, ["training.pipeline_microbatches=2"]),
    "pp4": ([[4], ["pp"]], 8, ["training.pipeline_microbatches=4"]),
    # remat inside the stages
    "pp2_repeats2": (
        [[2], ["pp"]],
        8,
        ["training.pipeline_microbatches=4", "training.pipeline_repeats=2", "training.remat=full"],
    ),
    "cp2": ([[2], ["cp"]], 8, []),
    "cp2_ring": ([[2], ["cp"]], 8, [RING]),
    "cp4": ([[4], ["cp"]], 8, []),
    "cp4_ring": ([[4], ["cp"]], 8, [RING]),
    "pp2_fsdp2_tp2": ([[2, 2, 2], ["pp", "fsdp", "tp"]], 4, ["training.pipeline_microbatches=2"]),
    "dp2_cp2_tp2": ([[2, 2, 2], ["dp", "cp", "tp"]], 4, []),
    "pp2_cp2_fsdp2": ([[2, 2, 2], ["pp", "cp", "fsdp"]], 4, ["training.pipeline_microbatches=2"]),
    "pp2_cp2_fsdp2_ring": ([[2, 2, 2], ["pp", "cp", "fsdp"]], 4, ["training.pipeline_microbatches=2", RING]),
}
FAST = ("pp2", "pp2_repeats2", "cp2", "cp2_ring", "cp4", "pp4")  # pp2_cp2_fsdp2 (20 s): slow
_REFERENCE: list = []


def _run_config(mesh_shape, rows, *overrides):
    cfg = config(*MODEL, f"training.micro_batch_size={rows}", *overrides)
    cfg.model.mesh_shape = mesh_shape
    return cfg


def _devices(mesh_shape):
    return jax.devices()[: int(np.prod(mesh_shape[0]))]


def _losses(run_dir, mesh_shape, rows, overrides):
    train(_run_config(mesh_shape, rows, *overrides), run_dir, devices=_devices(mesh_shape))
    return np.array(train_losses(run_dir))


def _reference(tmp_path):
    if not _REFERENCE:
        _REFERENCE.append(_losses(tmp_path / "reference", [[1], ["fsdp"]], 8, []))
    return _REFERENCE[0]


def _check_losses(tmp_path, name):
    reference = _reference(tmp_path)
    assert len(reference) == 3
    np.testing.assert_allclose(_losses(tmp_path / name, *RUNS[name]), reference, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("name", FAST)
def test_pp_and_cp_give_the_losses_of_one_device(tmp_path, name):
    _check_losses(tmp_path, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in RUNS if n not in FAST])
def test_every_pp_and_cp_combination_gives_the_losses_of_one_device(tmp_path, name):
    _check_losses(tmp_path, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp2_cp2_fsdp2_ring"])  # the ring's own backward, and every reduction
def test_bf16_runs_under_pp_and_cp_with_the_losses_of_one_device(tmp_path, name):
    """bf16 with pp and cp beside an auto axis compiles (every reduction of theirs is float32: see
    parallel/float32_reductions.py) and matches one device's bf16 losses to bf16 precision."""
    mesh_shape, rows, overrides = RUNS[name]
    bf16 = "training.mixed_precision=bf16"
    reference = _losses(tmp_path / "one", [[1], ["fsdp"]], 8, [bf16])
    np.testing.assert_allclose(
        _losses(tmp_path / name, mesh_shape, rows, [*overrides, bf16]), reference, rtol=1e-2
    )


def _gradients(mesh_shape, rows, *overrides):
    """The gradient of the first step's loss (plain SGD at rate 1: the update is minus it)."""
    cfg = _run_config(mesh_shape, rows, *overrides)
    mesh = make_mesh(mesh_shape, _devices(mesh_shape))
    data = Data(cfg).train_batches(rows, process_rows(mesh, rows))
    optimizer, schedule = optax.sgd(1.0), optax.constant_schedule(1.0)
    with jax.set_mesh(mesh):
        plan = plan_train_state(cfg.model, optimizer, mesh, 0)
        state = plan.create()
        before = jax.tree.map(np.asarray, state.params)
        layout = parallel.for_run(mesh, cfg.model, cfg.training, cfg.data.seq_len)
        step = compile_train_step(
            program_for(plan, cfg.model, cfg.training, (optimizer, schedule), parallel=layout)
        )
        state, _ = step(state, to_global_batch(next(data), mesh))
    data.close()
    return jax.tree.map(lambda old, new: old - np.asarray(new), before, state.params)


SOFTCAP = "model.attn_logit_softcap=2.0"  # Gemma 2's soft-cap, through the ring's own backward pass


@pytest.mark.parametrize(
    "mesh_shape, overrides, model",
    [
        ([[4], ["pp"]], ["training.pipeline_microbatches=4"], []),
        pytest.param([[4], ["cp"]], [], [], marks=pytest.mark.slow),
        ([[4], ["cp"]], [RING], [SOFTCAP]),
    ],
)
def test_the_whole_gradient_equals_one_devices(mesh_shape, overrides, model):
    reference = _gradients([[1], ["fsdp"]], 8, *model)
    split = _gradients(mesh_shape, 8, *overrides, *model)
    for (path, expected), got in zip(jax.tree_util.tree_leaves_with_path(reference), jax.tree.leaves(split)):
        scale = np.abs(expected).max()
        assert scale > 0, path
        np.testing.assert_allclose(
            got, expected, rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path)
        )


def test_pp_gives_each_device_a_quarter_of_the_layers():
    cfg = _run_config([[4], ["pp"]], 8, "training.pipeline_microbatches=4")
    run = setup(cfg, _devices(cfg.model.mesh_shape))
    state = run.plan.create()
    layers = state.params["layers"]
    for leaf in jax.tree.leaves(layers):
        shards = leaf.addressable_shards
        assert len(shards) == 4
        assert {s.data.nbytes for s in shards} == {leaf.nbytes // 4}
        assert sorted(s.index[0].start for s in shards) == [0, 1, 2, 3]  # one layer each, all four
    # the embedding is replicated over pp: every stage holds all of it
    embedding = state.params["embedding_VD"]
    assert {s.data.nbytes for s in embedding.addressable_shards} == {embedding.nbytes}


def test_cp_splits_the_sequence_entering_attention(monkeypatch):
    """Inside the shard_map over cp every shard's queries hold seq_len / cp positions; the global
    layers attend to all seq_len keys (gathered), the local ones to their own and the window."""
    seen = []
    real = kernels.attention

    def spy(q, k, v, mask, *args, **kwargs):
        seen.append((q.shape[1], k.shape[1], mask.shape[1:]))
        return real(q, k, v, mask, *args, **kwargs)

    monkeypatch.setattr(kernels, "attention", spy)
    cfg = _run_config([[4], ["cp"]], 8)
    run = setup(cfg, _devices(cfg.model.mesh_shape))
    with jax.set_mesh(run.mesh):
        run.step_fn.lower(run.plan.abstract, abstract_batch(run.mesh, 2, run.micro_batch, 64))
    window = cfg.model.sliding_window
    assert (16, 64, (16, 64)) in seen  # global layers: 64 / 4 queries, every key
    assert (16, 16 + 2 * window, (16, 16 + 2 * window)) in seen  # local layers: own keys and two tails
    assert all(q == 16 for q, _, _ in seen)


def test_the_balanced_order_evens_out_causal_work():
    for cp in (2, 4, 8):
        balanced = context.ring_chunk_pairs(1024, cp, balanced=True)
        plain = context.ring_chunk_pairs(1024, cp, balanced=False)
        assert max(balanced) / min(balanced) < 1.1, balanced
        assert max(plain) / min(plain) > 2, plain
        # the ring skips only what the mask hides: both orders compute every causal pair once
        assert sum(balanced) == sum(plain) < (2 * cp) ** 2
    # 4 chunks of 4: shard 0 holds chunks 0 and 3, shard 1 chunks 1 and 2
    order = context.balanced_order(16, 2)
    np.testing.assert_array_equal(order, [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])


@pytest.mark.parametrize(
    "stages, repeats, microbatches", [(2, 1, 2), (4, 1, 4), (4, 1, 16), (2, 2, 4), (4, 3, 8)]
)
def test_the_schedules_idle_time_is_the_bubble_formula(stages, repeats, microbatches):
    schedule = pipeline.Schedule(stages, repeats, microbatches)
    assert schedule.idle_fraction() == pytest.approx((stages - 1) / (repeats * microbatches + stages - 1))
    # every stage does every (repeat, micro-batch) once, in order
    for s in range(stages):
        tasks = [
            tuple(int(x) for x in schedule.task(t, s)[1:])
            for t in range(schedule.steps)
            if schedule.task(t, s)[0]
        ]
        assert tasks == [(r, m) for r in range(repeats) for m in range(microbatches)]


@pytest.mark.parametrize(
    "mesh_shape, overrides, message",
    [
        ([[8], ["pp"]], ["training.pipeline_microbatches=8"], "pp=8 is more than model.num_layers=4"),
        (
            [[4], ["pp"]],
            ["model.num_layers=6", "training.pipeline_microbatches=4"],
            "model.num_layers=6 is not divisible by pp x training.pipeline_repeats = 4",
        ),
        (
            [[2], ["pp"]],
            ["model.num_layers=6", "training.pipeline_microbatches=4", "training.pipeline_repeats=2"],
            "model.num_layers=6 is not divisible by pp x training.pipeline_repeats = 4",
        ),
        (
            [[2], ["pp"]],
            ["training.pipeline_microbatches=3"],
            "training.pipeline_microbatches=3 must be a multiple of pp=2",
        ),
        (
            [[4], ["pp"]],
            ["training.pipeline_microbatches=2"],
            "training.pipeline_microbatches=2 must be a multiple of pp=4",
        ),
        (
            [[2], ["pp"]],
            ["training.pipeline_microbatches=16"],
            "training.pipeline_microbatches=16 must divide training.micro_batch_size=8",
        ),
        (
            [[4], ["pp"]],
            ["training.pipeline_microbatches=4", "training.pipeline_repeats=2"],
            "training.pipeline_repeats=2: model.num_layers=4 is too shallow",
        ),
        (
            [[4], ["cp"]],
            ["data.seq_len=36", "training.loss_chunk_size=0"],
            "data.seq_len=36 must be divisible by 2 x cp = 8",
        ),
        (
            [[4], ["cp"]],
            ["training.loss_chunk_size=32"],
            "training.loss_chunk_size=32 must divide data.seq_len / cp = 16",
        ),
    ],
)
def test_bad_pp_and_cp_settings_are_one_line_errors(mesh_shape, overrides, message):
    cfg = _run_config(mesh_shape, 8, *overrides)
    with pytest.raises(ConfigError) as err:
        setup(cfg, _devices(mesh_shape))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_an_unknown_context_parallel_strategy_is_a_one_line_error():
    with pytest.raises(ConfigError) as err:
        config("model.context_parallel_strategy=ulysses")
    assert "model.context_parallel_strategy" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_a_pp2_checkpoint_resumes_on_pp1_and_pp4_with_the_same_losses(tmp_path):
    steps = ("training.max_steps=4", "checkpoint.every_steps=2")
    straight = _losses(tmp_path / "straight", [[2], ["pp"]], 8, ["training.pipeline_microbatches=2", *steps])
    first = _losses(
        tmp_path / "first",
        [[2], ["pp"]],
        8,
        ["training.pipeline_microbatches=2", "training.max_steps=2", "checkpoint.every_steps=2"],
    )
    np.testing.assert_array_equal(first, straight[:2])
    for name, mesh_shape, overrides in (
        ("pp1", [[1], ["fsdp"]], []),
        ("pp4", [[4], ["pp"]], ["training.pipeline_microbatches=4"]),
        ("cp4", [[4], ["cp"]], []),
    ):
        resumed = _losses(
            tmp_path / name,
            mesh_shape,
            8,
            [*overrides, *steps, f"checkpoint.resume_from={tmp_path / 'first'}"],
        )
        np.testing.assert_allclose(resumed, straight[2:], rtol=1e-5, err_msg=name)
