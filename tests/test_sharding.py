"""Mesh construction, the rules table, and that parameters and optimizer state are really sharded."""

import json
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import config
from jax.sharding import PartitionSpec as P

from tunix_train.config import ConfigError
from tunix_train.platform import validate_training_for_mesh
from tunix_train.sharding import (
    LOGICAL_RULES,
    Rules,
    batch_sharding,
    constrain,
    logical_to_spec,
    make_mesh,
    per_shard_rules,
)
from tunix_train.train.init import create_train_state
from tunix_train.train.optimizer import make_optimizer

GOLDEN = Path(__file__).parent / "golden" / "gemma3_tiny_fsdp2_tp4.json"


def _specs(tree) -> dict[str, str]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        jax.tree_util.keystr(path, simple=True, separator=".").removesuffix(".value"): str(
            array.sharding.spec
        )
        for path, array in flat
    }


def _state(mesh, *overrides):
    cfg = config(*overrides)
    optimizer, _ = make_optimizer(cfg.training)
    with jax.set_mesh(mesh):
        return create_train_state(cfg.model, optimizer, mesh, seed=0)[0]


def test_parameter_specs_match_the_golden_table():
    # tp=4 divides the 4 query heads but not the 2 key/value heads, which are replicated.
    state = _state(make_mesh([[2, 4], ["fsdp", "tp"]]))
    params = _specs(state.params)
    assert params == json.loads(GOLDEN.read_text())
    adam = state.opt_state[1][0]  # chain(clip, adamw) -> adamw's ScaleByAdamState
    assert _specs(adam.mu) == params and _specs(adam.nu) == params


def test_fsdp8_keeps_an_eighth_of_params_and_optimizer_state_per_device():
    state = _state(make_mesh([[8], ["fsdp"]]))
    arrays = jax.tree.leaves((state.params, state.opt_state))
    total = sum(a.nbytes for a in arrays)
    replicated = sum(a.nbytes for a in arrays if a.sharding.is_fully_replicated)
    for device in jax.devices():
        held = sum(s.data.nbytes for a in arrays for s in a.addressable_shards if s.device == device)
        assert held <= total / 8 + replicated, (device, held, total)
    assert replicated < 0.02 * total  # only QK-norm scales and counters


def test_tp_is_innermost_whatever_the_axis_order():
    devices = jax.devices()
    for mesh_shape in ([[4, 2], ["fsdp", "tp"]], [[2, 4], ["tp", "fsdp"]]):
        mesh = make_mesh(mesh_shape)
        tp_axis = mesh.axis_names.index("tp")
        groups = np.moveaxis(mesh.devices, tp_axis, -1).reshape(-1, mesh.shape["tp"])
        ids = [[devices.index(d) for d in group] for group in groups]
        assert all(g == list(range(g[0], g[0] + len(g))) for g in ids), ids  # neighbours share tp


def test_minus_one_fills_the_remaining_devices():
    assert dict(make_mesh([[-1, 2], ["dp", "tp"]]).shape) == {"dp": 4, "tp": 2}


@pytest.mark.parametrize(
    "mesh_shape, message",
    [
        ([[4, 4], ["fsdp", "tp"]], "has 16 devices but 8 are available"),
        ([[8], ["xp"]], "unknown mesh axis 'xp'"),
        ([[2, 4], ["fsdp", "fsdp"]], "duplicate mesh axis"),
        ([[-1, -1], ["fsdp", "tp"]], "at most one -1"),
        ([[8]], "must be [[sizes...], [axis names...]]"),
    ],
)
def test_bad_mesh_shapes_name_the_problem(mesh_shape, message):
    with pytest.raises(ConfigError, match="model.mesh_shape") as err:
        make_mesh(mesh_shape)
    assert message in str(err.value)


def test_indivisible_parameter_dimension_names_the_parameter():
    mesh = make_mesh([[8], ["fsdp"]])
    with pytest.raises(ConfigError, match="layers.mlp.up_DF: dimension 'embed' of size 12"):
        logical_to_spec(("layers", "embed", "mlp"), (2, 12, 64), mesh, "layers.mlp.up_DF")
    assert logical_to_spec(("kv_heads",), (1,), make_mesh([[8], ["tp"]]), "k") == P(None)


def test_the_embedding_splits_rows_over_tp_and_fsdp_or_else_columns_over_fsdp():
    mesh = make_mesh([[2, 4], ["fsdp", "tp"]])
    assert logical_to_spec(("vocab", "embed"), (64, 16), mesh, "e") == P(("tp", "fsdp"), None)
    assert logical_to_spec(("vocab", "embed"), (36, 16), mesh, "e") == P("tp", "fsdp")  # 8 does not divide 36
    assert logical_to_spec(("vocab", "embed"), (36, 16), make_mesh([[8], ["fsdp"]]), "e") == P(None, "fsdp")


def test_rules_are_values_a_variant_table_leaves_alone():
    """The delayed-sync step's table (batch unsplit inside its vmap) is a new value: the shared table
    cannot be changed, and each constraint follows the table it is given, in one process."""
    per_shard = per_shard_rules(LOGICAL_RULES)
    assert per_shard["batch"] == () and LOGICAL_RULES["batch"] == ("dp", "fsdp", "ep")
    assert {k: v for k, v in per_shard.items() if k != "batch"} == {
        k: v for k, v in LOGICAL_RULES.items() if k != "batch"
    }
    with pytest.raises(TypeError):
        LOGICAL_RULES["batch"] = ()
    assert isinstance(per_shard, Rules) and hash(per_shard) != hash(LOGICAL_RULES)
    x = np.zeros((8, 4, 16), np.float32)
    with jax.set_mesh(make_mesh([[4, 2], ["fsdp", "tp"]])):
        specs = [
            jax.jit(lambda x: constrain(x, ("batch", "seq", "act_mlp"), rules))(x).sharding.spec
            for rules in (LOGICAL_RULES, per_shard, LOGICAL_RULES)
        ]
    assert specs == [P("fsdp", None, "tp"), P(None, None, "tp"), P("fsdp", None, "tp")]


def test_batch_is_split_over_dp_and_fsdp_only():
    mesh = make_mesh([[2, 2, 2], ["dp", "fsdp", "tp"]])
    assert batch_sharding(mesh).spec == P(None, ("dp", "fsdp"), None)


def test_devices_of_different_kinds_are_refused(monkeypatch):
    from tunix_train.launch import distributed

    class FakeDevice:
        def __init__(self, kind):
            self.device_kind = kind

    monkeypatch.setattr(jax, "devices", lambda: [FakeDevice("NVIDIA H100"), FakeDevice("NVIDIA A100")])
    with pytest.raises(ConfigError, match="devices are not homogeneous"):
        distributed.check_devices()


def test_cudnn_attention_on_a_cpu_mesh_is_refused_by_the_mesh_check():
    """A config valid on its own (cudnn, bf16, no soft-cap) that these devices cannot honour: the
    mesh check itself names the key."""
    training = config("training.attention=cudnn", "training.mixed_precision=bf16").training
    with pytest.raises(
        ConfigError, match="training.attention=cudnn needs NVIDIA GPUs, and this mesh is on cpu"
    ):
        validate_training_for_mesh(training, make_mesh([[1], ["fsdp"]], jax.devices()[:1]))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["training.attention=cudnn"], "training.attention=cudnn needs training.mixed_precision=bf16"),
        (
            ["training.attention=cudnn", "training.mixed_precision=bf16", "model.attn_logit_softcap=50"],
            "training.attention=cudnn cannot soft-cap",
        ),
        (
            ["training.gradient_accumulation_steps=4", "training.sync_gradients_every=3"],
            "training.sync_gradients_every=3 must divide training.gradient_accumulation_steps=4",
        ),
    ],
)
def test_training_options_the_config_cannot_honour_are_refused_when_it_loads(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config(*overrides)


@pytest.mark.parametrize("key", ["offload_optimizer_state", "offload_master_weights"])
def test_offload_without_pinned_host_memory_is_one_line_naming_the_key_and_the_backend(key):
    class Memory:
        kind = "device"

    class Device:
        platform = "accel"

        def addressable_memories(self):
            return [Memory()]

    mesh = types.SimpleNamespace(devices=np.array([Device()], dtype=object))
    with pytest.raises(ConfigError) as err:
        validate_training_for_mesh(
            config(f"training.{key}=true", "training.mixed_precision=bf16").training, mesh
        )
    assert str(err.value) == (
        f"training.{key}=true needs pinned host memory, which accel devices "
        "do not offer (they have ['device']): set it to false"
    )
