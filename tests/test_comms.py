"""The communication profile: collective bytes from the compiled HLO against the theoretical volume
of each parallelism, and a profiled run's trace and summary."""

import collections
import json
import math

import jax
import jax.extend
import pytest
from conftest import config

from tunix_train.observe.comms import collective_volume
from tunix_train.train.init import count_params
from tunix_train.train.loop import train
from tunix_train.train.setup import setup
from tunix_train.train.step import abstract_batch

ACCUMULATION = 2


def _compiled_volume(mesh_shape, *overrides):
    cfg = config(f"training.gradient_accumulation_steps={ACCUMULATION}", *overrides)
    cfg.model.mesh_shape = mesh_shape
    run = setup(cfg, jax.devices()[: math.prod(mesh_shape[0])])
    batch = abstract_batch(run.mesh, ACCUMULATION, run.micro_batch, cfg.data.seq_len)
    with jax.set_mesh(run.mesh):
        compiled = run.step_fn.lower(run.plan.abstract, batch).compile()
    return collective_volume(compiled.as_text()), cfg, run


FSDP4 = [[4], ["fsdp"]]
LAYERS_DOMINATE = (
    "model.num_layers=4",
    "model.hidden_dim=512",
)  # the layers' parameters are most of the model


def test_fsdp_gathers_parameters_twice_and_reduces_gradients_once_per_micro_batch():
    # Four layers make the layers' parameters most of the model: the tied embedding is gathered
    # once per micro-batch (the forward's copy serves the backward), every layer twice.
    volume, _, run = _compiled_volume(FSDP4, *LAYERS_DOMINATE)
    param_bytes = 4 * count_params(run.plan.abstract.params)
    assert volume.bytes["all-gather"] == pytest.approx(2 * ACCUMULATION * param_bytes, rel=0.10)
    # XLA's CPU backend lowers the gradients' reduce-scatter as an all-reduce and a slice.
    reduced = volume.bytes["reduce-scatter"] + volume.bytes["all-reduce"]
    assert reduced == pytest.approx(ACCUMULATION * param_bytes, rel=0.10)
    assert volume.unknown_trip_counts == 0


def test_sync_gradients_every_k_reduces_once_per_k_micro_batches():
    volume, _, run = _compiled_volume(
        FSDP4, *LAYERS_DOMINATE, f"training.sync_gradients_every={ACCUMULATION}"
    )
    param_bytes = 4 * count_params(run.plan.abstract.params)
    reduced = volume.bytes["reduce-scatter"] + volume.bytes["all-reduce"]
    assert reduced == pytest.approx(param_bytes, rel=0.10)  # once per step, not once per micro-batch
    assert volume.bytes["all-gather"] == pytest.approx(2 * ACCUMULATION * param_bytes, rel=0.10)


@pytest.mark.parametrize("strategy, gathered", [("shard_grad_op", 1), ("no_shard", 0)])
def test_zero2_gathers_parameters_once_per_step_and_ddp_never(strategy, gathered):
    volume, _, run = _compiled_volume(FSDP4, *LAYERS_DOMINATE, f"training.sharding_strategy={strategy}")
    param_bytes = 4 * count_params(run.plan.abstract.params)
    # shard_grad_op: the updated parameters, computed on their shards, are gathered after the update.
    assert volume.bytes["all-gather"] == pytest.approx(
        gathered * param_bytes, rel=0.10, abs=0.01 * param_bytes
    )
    reduced = volume.bytes["reduce-scatter"] + volume.bytes["all-reduce"]
    assert reduced == pytest.approx(ACCUMULATION * param_bytes, rel=0.10)


@pytest.mark.parametrize("in_bf16", [True, False])
def test_bf16_gradients_reach_their_reduction_in_bf16_unless_opted_out(in_bf16):
    # XLA's CPU backend runs bf16 collectives in float32, so the HLO bytes cannot show this on fake
    # devices: the program handed to XLA can. Each micro-batch's gradients pass one sharding
    # constraint (where the reduce-scatter goes), in bf16 unless the run opted out.
    cfg = config("training.mixed_precision=bf16", f"training.reduce_gradients_in_compute_dtype={in_bf16}")
    cfg.model.mesh_shape = [[4], ["fsdp"]]
    run = setup(cfg, jax.devices()[:4])
    batch = abstract_batch(run.mesh, 1, run.micro_batch, cfg.data.seq_len)
    with jax.set_mesh(run.mesh):
        jaxpr = jax.make_jaxpr(run.step_fn)(run.plan.abstract, batch)
    param_shapes = {leaf.shape for leaf in jax.tree.leaves(run.plan.abstract.params)}
    constrained = collections.Counter()
    for eqn in _all_eqns(jaxpr.jaxpr):
        if eqn.primitive.name == "sharding_constraint":
            for var in eqn.invars:
                if var.aval.shape in param_shapes:
                    constrained[str(var.aval.dtype)] += 1
    n_params = len(jax.tree.leaves(run.plan.abstract.params))
    # float32 constraints: the accumulator, plus the gradients' reduction point when opted out.
    assert constrained["float32"] == (1 if in_bf16 else 2) * n_params
    assert constrained["bfloat16"] > n_params


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _all_eqns(sub)


def test_tp_all_reduces_activations_twice_per_layer_forward_and_three_times_backward():
    # Megatron-style: per layer, the attention and MLP outputs in the forward pass and their input
    # gradients in the backward pass; plus the embedding lookup and the logits' input gradient.
    # The MLP's input gradient comes from two matmuls (gate, up), and XLA's CPU pipeline reduces
    # each; its GPU pipeline reassociates add(all-reduce, all-reduce) into one all-reduce.
    volume, cfg, run = _compiled_volume([[4], ["tp"]], "model.num_kv_heads=4")
    m = cfg.model
    activation_bytes = 4 * run.micro_batch * cfg.data.seq_len * m.embed_dim
    theory = ACCUMULATION * ((2 + 3) * m.num_layers + 2) * activation_bytes
    assert volume.bytes["all-reduce"] == pytest.approx(theory, rel=0.10)
    assert volume.bytes["all-gather"] == volume.bytes["reduce-scatter"] == 0  # parameters never move


def test_a_profiled_run_writes_a_trace_and_a_summary(tmp_path):
    cfg = config(
        "training.max_steps=6",
        "training.profile_communication=true",
        "training.profile_steps=2",
        "training.eval_every=0",
    )
    cfg.model.mesh_shape = [[4], ["fsdp"]]
    train(cfg, tmp_path, devices=jax.devices()[:4])
    report = json.loads((tmp_path / "communication.json").read_text())
    assert report["steps"] == [3, 4] and report["devices_traced"] == 4
    assert list(tmp_path.glob("plugins/profile/*/*.xplane.pb")) and list(
        tmp_path.glob("plugins/profile/*/*.json.gz")
    )
    assert report["bytes_per_step"]["all-gather"] > 0 and report["collectives_per_step"]["all-gather"] > 0
    seconds = report["seconds_per_step"]
    assert seconds["computation"] > 0 and seconds["all-gather"] > 0 and seconds["all-to-all"] == 0
    assert seconds["computation"] + seconds["all-gather"] + seconds["all-reduce"] < 2 * report["step_time_s"]
    assert "all-gather" in (tmp_path / "train.log").read_text()


GPU_STYLE_HLO = """HloModule jit_step, entry_computation_layout={()->f32[]}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %x = f32[2,16]{1,0} get-tuple-element(%p), index=1
  %ags = (f32[2,16]{1,0}, f32[8,16]{1,0}) all-gather-start(%x), dimensions={0}, replica_groups=[1,4]<=[4]
  %agd = f32[8,16]{1,0} all-gather-done(%ags)
  %ars = f32[8,16]{1,0} all-reduce-start(%agd), to_apply=%add
  %ard = f32[8,16]{1,0} all-reduce-done(%ars)
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%i, %ard)
}

%cond (p: (s32[], f32[8,16])) -> pred[] {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (x: f32[8,16]) -> f32[] {
  %x = f32[8,16]{1,0} parameter(0)
  %w = (s32[], f32[8,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %cp = bf16[4,4]{1,0} collective-permute(%y), source_target_pairs={{0,1}}
  ROOT %r = f32[] constant(0)
}
"""  # noqa: E501 (HLO text as XLA prints it)


def test_async_collectives_in_loops_count_once_per_iteration():
    volume = collective_volume(GPU_STYLE_HLO)
    assert volume.count == {
        "all-gather": 5,
        "reduce-scatter": 0,
        "all-reduce": 5,
        "all-to-all": 0,
        "collective-permute": 1,
    }
    assert volume.bytes["all-gather"] == 5 * 8 * 16 * 4  # the gathered output, not the start's tuple
    assert volume.bytes["all-reduce"] == 5 * 8 * 16 * 4
    assert volume.bytes["collective-permute"] == 0  # %y is not defined in this text: no bytes guessed


@pytest.mark.slow  # a whole CLI run or a script: the README's suite stays short
def test_the_profile_names_pipeline_and_context_parallel_traffic():
    """The pipeline's only traffic between stages is its ppermute of one micro-batch's activations
    per time step, forward and backward; cp's is its ring's."""
    cfg = config(
        f"training.gradient_accumulation_steps={ACCUMULATION}",
        "training.micro_batch_size=4",
        "training.pipeline_microbatches=2",
    )
    cfg.model.mesh_shape = [[2, 4], ["pp", "fsdp"]]
    run = setup(cfg)
    batch = abstract_batch(run.mesh, ACCUMULATION, run.micro_batch, cfg.data.seq_len)
    with jax.set_mesh(run.mesh):
        hlo = run.step_fn.lower(run.plan.abstract, batch).compile().as_text()
    volume = collective_volume(hlo, dict(run.mesh.shape))
    schedule = run.parallel.schedule
    rows = run.micro_batch // schedule.microbatches // 4  # one micro-batch's rows on one fsdp shard
    activation = rows * cfg.data.seq_len * cfg.model.embed_dim * 4
    assert (
        volume.bytes_by_axes["collective-permute over pp"] == 2 * schedule.steps * activation * ACCUMULATION
    )
    assert not any(name.endswith("over cp") for name in volume.bytes_by_axes)

    # cp passes keys, values and windows round its ring and adds nothing to fsdp's traffic
    by_axes = {}
    for mesh_shape in ([[2, 4], ["cp", "fsdp"]], [[4], ["fsdp"]]):
        cfg = config(f"training.gradient_accumulation_steps={ACCUMULATION}", "training.micro_batch_size=4")
        cfg.model.mesh_shape = mesh_shape
        run = setup(cfg, jax.devices()[: math.prod(mesh_shape[0])])
        with jax.set_mesh(run.mesh):
            by_axes[len(mesh_shape[1])] = collective_volume(
                run.step_fn.lower(
                    run.plan.abstract, abstract_batch(run.mesh, ACCUMULATION, run.micro_batch, 32)
                )
                .compile()
                .as_text(),
                dict(run.mesh.shape),
            ).bytes_by_axes
    with_cp, without = by_axes[2], by_axes[1]
    assert with_cp["collective-permute over cp"] > 0
    assert {k: v for k, v in with_cp.items() if k.endswith("over fsdp")} == without
    assert not any(name.endswith("over pp") for name in with_cp)
