"""Gemma 4 and mixture of experts: logits and greedy tokens equal to transformers' Gemma4ForCausalLM
per feature and per mesh (ep included), the export equal to the imported files, dropless dispatch
equal to a dense reference, loss and gradients equal across ep, the experts really split, and
one-line errors. transformers runs in this process or in TUNIX_TRAIN_REFERENCE_PYTHON's."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    assert_resumes_alike,
    config,
    read_metrics,
    step_metrics,
    train_losses,
)
from flax import nnx
from hf_reference import GEMMA4, SEQ, SIZES, build, checkpoint_and_logits
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tunix_train import api, platform
from tunix_train.config import ConfigError, MoeDispatch, Remat, with_fields
from tunix_train.model.decoder import Decoder
from tunix_train.model.layout import layer_groups
from tunix_train.model.moe import Dispatching, MoE, apply_experts, dropless_places, load_balancing_loss
from tunix_train.parallel import model_graphdef
from tunix_train.parallel.experts import _expert_parallel
from tunix_train.sharding import LOGICAL_RULES, data_axes, make_mesh, state_shardings, validate_model_for_mesh
from tunix_train.train.forward import token_losses
from tunix_train.train.loop import train
from tunix_train.train.setup import setup

MESHES = {"1": [[1], ["fsdp"]], "fsdp2_tp2": [[2, 2], ["fsdp", "tp"]]}
EP_MESHES = {"ep2_fsdp2": [[2, 2], ["ep", "fsdp"]], "ep2_fsdp2_tp2": [[2, 2, 2], ["ep", "fsdp", "tp"]]}
TOKENS = np.random.default_rng(0).integers(0, SIZES["vocab_size"], (4, SEQ))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """family -> (checkpoint directory, transformers' logits of TOKENS), built once per family."""
    built = {}

    def get(family):
        if family not in built:
            directory = tmp_path_factory.mktemp(family) / "checkpoint"
            built[family] = directory, checkpoint_and_logits(family, directory, TOKENS)
        return built[family]

    return get


def _logits(directory, mesh_shape):
    model = api.load(directory, mesh_shape=mesh_shape, devices=jax.devices()[: int(np.prod(mesh_shape[0]))])
    return model, model.logits(TOKENS)


# Every family on one device in the main suite; on fsdp x tp (slow) the family with every dense
# feature and the one with experts (which also runs on the ep meshes below).
PARITY = [
    pytest.param(family, mesh, marks=() if mesh == "1" else pytest.mark.slow)
    for family in GEMMA4
    for mesh in MESHES
    if mesh == "1" or family in ("gemma4_all", "gemma4_moe")
]


@pytest.mark.parametrize("family, mesh", PARITY)
def test_logits_match_transformers(reference, family, mesh):
    directory, expected = reference(family)
    _, logits = _logits(directory, MESHES[mesh])
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "family, mesh",
    [
        ("gemma4_moe", "ep2_fsdp2"),
        ("gemma4_moe", "ep2_fsdp2_tp2"),
        pytest.param("gemma4_all", "ep2_fsdp2", marks=pytest.mark.slow),
        pytest.param("gemma4_all", "ep2_fsdp2_tp2", marks=pytest.mark.slow),
    ],
)
def test_expert_parallel_logits_match_transformers(reference, family, mesh):
    directory, expected = reference(family)
    _, logits = _logits(directory, EP_MESHES[mesh])
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)


def test_layers_are_grouped_by_shape(reference):
    """Groups (first layer, period, repeats) that compile the fewest layer bodies. gemma4_all:
    local, local, global with their own weights, then the same reusing keys and values: runs of
    one shape (4 bodies) beat two periods of three (6). A uniform model is one stack of every layer."""
    model, _ = _logits(reference("gemma4_all")[0], MESHES["1"])
    groups = layer_groups(model.config)
    assert [(g.first, len(g.period), g.repeats) for g in groups] == [
        (0, 1, 2),
        (2, 1, 1),
        (3, 1, 2),
        (5, 1, 1),
    ]
    assert [g.period[0].shares_kv for g in groups] == [False, False, True, True] and groups[1].period[
        0
    ].k_eq_v
    uniform = config("model.num_layers=6")
    assert [(g.first, len(g.period), g.repeats) for g in layer_groups(uniform.model)] == [(0, 1, 6)]
    e2b = config("model=gemma4_e2b")  # 4 local : 1 global, the last 20 of 35 layers sharing
    assert [(g.first, len(g.period), g.repeats) for g in layer_groups(e2b.model)] == [(0, 5, 3), (15, 5, 4)]


@pytest.mark.slow
def test_export_equals_the_imported_files(reference, tmp_path):
    from safetensors.numpy import load_file

    directory, _ = reference("gemma4_all")
    model, _ = _logits(directory, MESHES["fsdp2_tp2"])
    model.export(tmp_path / "export")
    original, exported = (
        load_file(directory / "model.safetensors"),
        load_file(tmp_path / "export" / "model.safetensors"),
    )
    original.pop("lm_head.weight", None)  # tied to the embedding
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        np.testing.assert_array_equal(exported[name], tensor.astype(np.float32), err_msg=name)
    config_json = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config_json["model_type"] == "gemma4_text" and config_json["num_kv_shared_layers"] == 3
    np.testing.assert_allclose(
        api.load(tmp_path / "export", mesh_shape=MESHES["1"], devices=jax.devices()[:1]).logits(TOKENS),
        reference("gemma4_all")[1],
        atol=1e-4,
        rtol=0,
    )


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma4_all", "gemma4_global"])
def test_greedy_generation_matches_transformers(tmp_path, family):
    prompt = np.random.default_rng(2).integers(3, SIZES["vocab_size"], (1, 6))
    expected = checkpoint_and_logits(family, tmp_path / "checkpoint", prompt, greedy_tokens=12)
    model = api.load(tmp_path / "checkpoint", mesh_shape=MESHES["fsdp2_tp2"], devices=jax.devices()[:4])
    assert len(set(expected.tolist())) > 3
    assert model.generate(prompt.tolist(), max_new_tokens=12) == [expected.tolist()]


def test_a_multimodal_checkpoint_loads_with_its_tower_and_its_text_logits_equal(tmp_path):
    """The tower comes with it (test_vision_gemma4.py tests it with images); text is the decoder's alone."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    text = {
        **SIZES,
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 5,
        "hidden_size_per_layer_input": 0,
        "global_head_dim": 16,
    }
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1)
    vision |= dict(num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    full = transformers.Gemma4ForConditionalGeneration(
        transformers.Gemma4Config(text_config=text, vision_config=vision, image_token_id=127)
    ).eval()
    full.save_pretrained(tmp_path / "multimodal")
    text_only = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**text)).eval()
    text_only.model.load_state_dict(full.model.language_model.state_dict())
    with torch.no_grad():
        expected = text_only(torch.tensor(TOKENS)).logits.numpy()
    model = api.load(tmp_path / "multimodal", mesh_shape=MESHES["1"], devices=jax.devices()[:1])
    assert model.config.vision.encoder.value == "gemma4" and model.config.vision.image_token_id == 127
    np.testing.assert_allclose(model.logits(TOKENS), expected, atol=1e-4, rtol=0)


# --- mixture of experts ------------------------------------------------------------------------


def _moe(dispatch=MoeDispatch.dropless, capacity_factor=1.25, experts=8, top_k=2):
    cfg = config(
        "model=gemma4_moe_tiny",
        f"model.moe.experts={experts}",
        f"model.moe.experts_per_token={top_k}",
        f"model.moe.dispatch={dispatch.value}",
        f"model.moe.capacity_factor={capacity_factor}",
    ).model
    moe = MoE(cfg, nnx.Rngs(0), LOGICAL_RULES)
    moe.expert_scale[...] = jnp.linspace(0.5, 1.5, experts)  # make the per-expert scale matter
    return moe


def _dense_reference(moe, route_XD, x_XD):
    """Every token through each of its top-k experts, weighted: the plain loop of the definition."""
    weights, experts, _ = (np.asarray(a) for a in moe.route(route_XD))
    gate_up, down = np.asarray(moe.gate_up_EDCM[...]), np.asarray(moe.down_EMD[...])

    def gelu(v):
        return np.asarray(jax.nn.gelu(v, approximate=True))

    out = np.zeros_like(np.asarray(x_XD))
    for t in range(x_XD.shape[0]):
        for k in range(experts.shape[1]):
            e = experts[t, k]
            h = np.einsum("d,dcm->cm", np.asarray(x_XD[t]), gate_up[e])
            out[t] += weights[t, k] * (gelu(h[0]) * h[1]) @ down[e]
    return out


def test_dropless_dispatch_equals_the_dense_reference():
    moe = _moe()
    route, x = (jax.random.normal(jax.random.key(i), (2, 24, 64)) for i in (1, 2))
    y, stats, experts = moe(route, x)
    expected = _dense_reference(moe, route.reshape(-1, 64), x.reshape(-1, 64))
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 64), expected, atol=1e-5, rtol=0)
    assert float(stats["expert_tokens"].sum()) == 2 * 24 * 2
    np.testing.assert_allclose(float(stats["router_probs"].sum()), 48.0, rtol=1e-5)


def test_capacity_dispatch_equals_dropless_with_room_and_drops_without():
    route, x = (jax.random.normal(jax.random.key(i), (48, 64)) for i in (1, 2))
    dropless = _moe()
    weights, experts, _ = dropless.route(route)
    args = (x, weights, experts, dropless.gate_up_EDCM[...], dropless.down_EMD[...])
    exact = apply_experts(*args, Dispatching(MoeDispatch.dropless, 1.0))
    roomy = apply_experts(*args, Dispatching(MoeDispatch.capacity, 8.0))  # 8 x the even share: all fit
    np.testing.assert_allclose(roomy, exact, atol=1e-5, rtol=0)
    tight = np.asarray(apply_experts(*args, Dispatching(MoeDispatch.capacity, 0.5)))
    counts = np.bincount(np.asarray(experts).ravel(), minlength=8)
    capacity = int(np.ceil(0.5 * 96 / 8))
    assert counts.max() > capacity  # some expert overflows ...
    changed = np.abs(tight - np.asarray(exact)).max(axis=1) > 1e-6
    assert 0 < changed.sum() < 48  # ... so some tokens lose a copy, the others are exact


def test_the_load_balancing_loss_is_the_formula_on_a_hand_made_routing():
    # 4 tokens, 4 experts, top 2: experts 0 and 1 take every token
    tokens = np.array([[4.0, 4.0, 0.0, 0.0]])
    probs = np.array([[0.4, 0.3, 0.2, 0.1]]) * 4  # summed over the 4 tokens, each row summing to 1
    # E * sum_e f_e P_e, f = [1, 1, 0, 0], P = [.4, .3, .2, .1]
    assert float(load_balancing_loss(jnp.asarray(tokens), jnp.asarray(probs))) == pytest.approx(4 * 0.7)
    even = load_balancing_loss(jnp.full((3, 4), 2.0), jnp.full((3, 4), 1.0))  # 4 tokens, even routing
    assert float(even) == pytest.approx(2.0)  # = top_k


def _loss_and_grads(cfg, params, mesh_shape, tokens):
    mesh = make_mesh(mesh_shape, jax.devices()[: int(np.prod(mesh_shape[0]))])
    validate_model_for_mesh(cfg, mesh)
    graphdef = model_graphdef(cfg, Remat.none)
    with jax.set_mesh(mesh):
        shardings = state_shardings(nnx.eval_shape(lambda: nnx.state(Decoder(cfg, nnx.Rngs(0)))), mesh)
        params = jax.device_put(params, shardings)
        rows = NamedSharding(mesh, P(data_axes(mesh)))
        micro = {
            "inputs": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "positions": np.broadcast_to(
                np.arange(tokens.shape[1] - 1), (tokens.shape[0], tokens.shape[1] - 1)
            ),
            "segment_ids": np.ones((tokens.shape[0], tokens.shape[1] - 1), np.int32),
        }
        micro = {k: jax.device_put(jnp.asarray(v, jnp.int32), rows) for k, v in micro.items()}

        def loss(params):
            losses, stats = token_losses(graphdef, (params,), micro)
            return jnp.mean(losses) + 0.01 * load_balancing_loss(
                stats["expert_tokens"], stats["router_probs"]
            )

        step = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
        value, grads = step(params)
        return float(value), jax.tree.map(np.asarray, grads), params, step.as_text()


@pytest.mark.slow  # three compilations
def test_loss_and_gradients_are_equal_for_every_ep_and_the_experts_are_split():
    tokens = np.random.default_rng(3).integers(0, 256, (8, 33))
    cfg = config(
        "model=gemma4_moe_tiny",
        "data.seq_len=32",
        "model.num_layers=3",  # one (local, local, global)
        "model.layer_types=[sliding_attention,sliding_attention,full_attention]",
    ).model
    host_params = nnx.state(Decoder(cfg, nnx.Rngs(0)))
    value, grads, _, text = _loss_and_grads(cfg, host_params, [[1], ["ep"]], tokens)
    assert "all-to-all" not in text
    for ep in (2, 4):  # (8 as 4: each of 8 experts on its own device adds no new path)
        ep_value, ep_grads, params, text = _loss_and_grads(cfg, host_params, [[ep], ["ep"]], tokens)
        assert ep_value == pytest.approx(value, abs=1e-5)
        for (path, g), ep_g in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ep_grads)):
            np.testing.assert_allclose(
                ep_g, g, atol=1e-5, rtol=0, err_msg=f"ep={ep} {jax.tree_util.keystr(path)}"
            )
        # the router's top k runs on each shard's tokens: XLA's partitioner gathered them all for it
        assert not re.search(r"custom-call\(%all-gather[.\d]*\), custom_call_target=\"TopK\"", text)
        if ep == 4:
            experts = params["groups"][0][0]["moe"]["gate_up_EDCM"][...]
            assert {s.data.nbytes for s in experts.addressable_shards} == {experts.nbytes // 4}
            assert "all-to-all" in text


ROUTINGS = {  # each token's two experts [32, 2]
    "balanced": np.arange(64).reshape(32, 2) % 8,
    "one expert busier": np.repeat(np.arange(8), [12, 8, 8, 8, 7, 7, 7, 7]).reshape(2, 32).T,
    "four experts take every token": np.arange(64).reshape(32, 2) % 4,
    "two experts take every token": np.arange(64).reshape(32, 2) % 2,
}


@pytest.mark.parametrize(
    "routing, one_device, ep4",
    [
        ("balanced", 0, 0),
        ("one expert busier", 1, 1),
        ("four experts take every token", 2, 2),
        ("two experts take every token", 2, 3),
    ],
)
def test_dropless_is_exact_in_each_of_its_places_on_one_device_and_on_ep4(routing, one_device, ep4):
    """dropless_experts runs the first of dropless_places that holds every copy: the fixed slots for
    balanced routing, the slots and the pool for one busier expert, the blocks for 2A rows when two
    ep shards receive twice their share, and the blocks for all S x A when one receives every copy.
    Values and gradients equal the definition (each copy through its expert's weights, gathered
    per copy) within 1e-5 in each."""
    X, K, E = 32, 2, 8
    sizes = np.bincount(ROUTINGS[routing].reshape(-1), minlength=E)

    def first_fitting(places, sizes):
        return next(i for i, slots in enumerate(places) if slots.fit(jnp.asarray(sizes)))

    assert first_fitting(dropless_places(X * K, X * K, E), sizes) == one_device
    shard_A = X // 4 * K  # copies a shard sends under ep=4; each shard holds 2 experts
    received = [sizes[2 * s : 2 * s + 2] for s in range(4)]
    assert max(first_fitting(dropless_places(shard_A, 4 * shard_A, 2), r) for r in received) == ep4
    _assert_dropless_is_the_definition(ROUTINGS[routing])


@pytest.mark.parametrize("routing", ["balanced", "two experts take every token"])
def test_the_ragged_dot_path_is_exact_on_one_device_and_on_ep4(routing, monkeypatch):
    """TPUs' path (jax.lax.ragged_dot on the copies sorted, at ep=4 on the first 2A received rows
    when they hold every copy, else on all), run here through XLA's dense ragged_dot."""
    monkeypatch.setattr(platform, "ragged_dot_is_native", lambda: True)
    _assert_dropless_is_the_definition(ROUTINGS[routing], ragged=True)


def _assert_dropless_is_the_definition(experts_XK, ragged=False):
    """Values and gradients of the dropless experts, on one device and on ep=4, equal the definition
    (each copy through its expert's weights, gathered per copy) within 1e-5."""
    moe = _moe()
    route, x = (jax.random.normal(jax.random.key(i), (experts_XK.shape[0], 64)) for i in (1, 2))
    weights, _, _ = moe.route(route)
    experts = jnp.asarray(experts_XK)

    def definition(x, w, g, d):
        h = jnp.einsum("xd,xkdcm->xkcm", x, g[experts])
        return jnp.einsum(
            "xkm,xkmd,xk->xd", jax.nn.gelu(h[..., 0, :], approximate=True) * h[..., 1, :], d[experts], w
        )

    def one(x, w, g, d):
        return apply_experts(x, w, experts, g, d, Dispatching(MoeDispatch.dropless, 1.0, ragged=ragged))

    def ep4(x, w, g, d):
        return _expert_parallel(x, w, experts, g, d, Dispatching(MoeDispatch.dropless, 1.0, ragged=ragged))

    def value_and_grads(f):
        return jax.jit(
            lambda *a: (f(*a), jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2, 3))(*a))
        )

    args = (x, weights, moe.gate_up_EDCM[...], moe.down_EMD[...])
    want = value_and_grads(definition)(*args)
    got = {"ep=1": value_and_grads(one)(*args)}
    with jax.set_mesh(make_mesh([[4], ["ep"]], jax.devices()[:4])):
        got["ep=4"] = value_and_grads(ep4)(*args)
    for name, (y, grads) in got.items():
        np.testing.assert_allclose(np.asarray(y), np.asarray(want[0]), atol=1e-5, rtol=0, err_msg=name)
        for g_got, g_want in zip(grads, want[1]):
            np.testing.assert_allclose(np.asarray(g_got), np.asarray(g_want), atol=1e-5, rtol=0, err_msg=name)


# --- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ("model.moe.experts_per_token=9",),
            "model.moe.experts_per_token=9 must be between 1 and model.moe.experts=8",
        ),
        (
            (
                "model.layer_types=[sliding_attention,sliding_attention,global,sliding_attention,sliding_attention,"
                "full_attention]",
            ),
            "model.layer_types: unknown layer type 'global'",
        ),
        (
            (
                "model.layer_types=[full_attention,full_attention,full_attention,full_attention,full_attention,"
                "sliding_attention]",
                "model.gemma4.num_kv_shared_layers=1",
            ),
            "layer 5 (sliding_attention) would reuse the keys",
        ),
    ],
)
def test_bad_gemma4_configs_are_one_line_errors(overrides, message):
    with pytest.raises(
        ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ) as err:
        config("model=gemma4_moe_tiny", *overrides)
    assert "\n" not in str(err.value)


def test_experts_not_divisible_by_ep_is_a_one_line_error():
    cfg = config("model=gemma4_moe_tiny", "model.moe.experts=6")
    with pytest.raises(ConfigError, match=r"model.moe.experts=6 is not divisible by the ep mesh axis \(4\)"):
        validate_model_for_mesh(cfg.model, make_mesh([[4], ["ep"]], jax.devices()[:4]))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model.gemma4.per_layer_input_dim=8"],
            "model.mesh_shape: pp does not yet run per-layer inputs, nor layers other than",
        ),
        (
            ["model.gemma4.num_kv_shared_layers=2"],
            "model.mesh_shape: pp does not yet run per-layer inputs, nor layers other than",
        ),
        (
            [
                "model.num_layers=4",
                "model.layer_types=[sliding_attention,sliding_attention,full_attention,full_attention]",
            ],
            "model.mesh_shape: pp does not yet run per-layer inputs, nor layers other than",
        ),
        (
            ['model.mesh_shape=[[3],["pp"]]', "training.pipeline_microbatches=3"],
            "model.mesh_shape: pp=3 is more than the 2 repeats of model.layer_types' 3-layer period",
        ),
    ],
)
def test_gemma4_on_axes_it_does_not_run_on_is_a_one_line_error(overrides, message):
    cfg = config(
        "model=gemma4_moe_tiny",
        "training.pipeline_microbatches=2",
        'model.mesh_shape=[[2,2],["pp","fsdp"]]',
        *overrides,
    )
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        setup(cfg, jax.devices()[: int(np.prod(cfg.model.mesh_shape[0]))])
    assert "\n" not in str(err.value)


# --- training ----------------------------------------------------------------------------------


def _three_step_losses(run_dir, mesh_shape, *overrides):
    cfg = config(
        "data.seq_len=32",
        "training.log_every=1",
        "training.max_steps=3",
        "training.eval_every=0",
        "training.warmup_steps=1",
        *overrides,
    )
    cfg.model.mesh_shape = mesh_shape
    train(cfg, run_dir, devices=jax.devices()[: int(np.prod(mesh_shape[0]))])
    return np.array(train_losses(run_dir))


@pytest.mark.slow
def test_context_parallel_gemma4_gives_the_losses_of_one_device(tmp_path):
    """The MoE model with KV sharing (a scan carry in cp's shard_map) and per-layer inputs too, the
    experts' dispatch inside cp's shard_map with the tokens also split over fsdp and the experts over
    ep, the ring strategy."""
    model = (
        "model=gemma4_moe_tiny",
        "model.num_layers=3",
        "model.gemma4.per_layer_input_dim=8",  # the last reuses the first's
        "model.layer_types=[sliding_attention,full_attention,sliding_attention]",
        "model.gemma4.num_kv_shared_layers=1",
    )
    one = _three_step_losses(tmp_path / "one", [[1], ["fsdp"]], *model, "training.micro_batch_size=8")
    split = _three_step_losses(
        tmp_path / "split",
        [[2, 2, 2], ["fsdp", "ep", "cp"]],
        *model,
        "training.micro_batch_size=2",
        "model.context_parallel_strategy=ring",
    )
    assert len(one) == 3
    np.testing.assert_allclose(split, one, rtol=1e-5)


@pytest.mark.slow
def test_pipelined_experts_give_the_losses_and_expert_statistics_of_one_device(tmp_path):
    """pp with ep and cp beside it, on gemma4_moe_tiny's mixed layer shapes (its period of three,
    repeated twice: one repeat a stage): the losses, the load-balancing loss and the experts' loads
    equal one device's, so the statistics come through the stages whole and none of a pipeline's
    idle steps."""
    model = ("model=gemma4_moe_tiny",)
    logged = {}
    for name, mesh_shape, rows in (
        ("one", [[1], ["fsdp"]], 8),
        ("split", [[2, 2, 2], ["pp", "ep", "cp"]], 4),
    ):
        _three_step_losses(
            tmp_path / name,
            mesh_shape,
            *model,
            f"training.micro_batch_size={rows}",
            "training.pipeline_microbatches=2",
        )
        logged[name] = np.array(
            [
                [m[k] for k in ("loss", "moe_aux_loss", "moe_load_max", "moe_load_min")]
                for m in read_metrics(tmp_path / name)
                if "loss" in m
            ]
        )
    assert logged["one"].shape == (3, 4)
    np.testing.assert_allclose(logged["split"], logged["one"], rtol=1e-5)


@pytest.mark.slow
def test_moe_training_on_ep_resumes_bit_identically_and_logs_the_experts(tmp_path):
    # the same at any max_steps
    cfg = config(
        "model=gemma4_moe_tiny",
        "data.seq_len=32",
        "training.log_every=1",
        "training.eval_every=0",
        "training.micro_batch_size=2",
        "checkpoint.every_steps=3",
        "training.warmup_steps=0",
        "training.learning_rate=0.01",
        "training.lr_schedule=constant",
    )
    cfg.model.mesh_shape = [[2, 2], ["ep", "fsdp"]]
    straight = assert_resumes_alike(cfg, tmp_path, 6, 3, jax.devices()[:4])
    logged = step_metrics(straight)
    assert all(m["moe_load_max"] >= 1.0 >= m["moe_load_min"] >= 0.0 and m["moe_aux_loss"] > 0 for m in logged)
    assert logged[-1]["loss"] < logged[0]["loss"]


@pytest.mark.slow
def test_lora_on_gemma4_exports_adapters_that_peft_applies_with_our_logits(tmp_path):
    """LoRA on every projection of gemma4_all (groups, keys as values, KV-sharing layers without
    key/value weights, experts), trained from its checkpoint; PEFT's Gemma 4 with our adapters
    gives our logits, and so does our merged export."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import Gemma4ForCausalLM

    from tunix_train.interop import hf
    from tunix_train.train.loop import train

    build("gemma4_all", tmp_path / "base")
    cfg = config(
        "data.seq_len=32",
        "training.log_every=1",
        "training.eval_every=0",
        "training.max_steps=3",
        "training.warmup_steps=0",
        "training.learning_rate=0.01",
        "training.lora.rank=4",
        "training.lora.targets=[q,k,v,o,gate,up,down]",
        f"model.init_from={tmp_path / 'base'}",
    )
    fields = hf.model_fields_from_hf(hf.read_hf_config(tmp_path / "base"))
    cfg.model = with_fields(cfg.model, {**fields, "mesh_shape": MESHES["fsdp2_tp2"]})
    train(cfg, tmp_path / "run", devices=jax.devices()[:4])

    model = api.load(tmp_path / "run", mesh_shape=MESHES["fsdp2_tp2"], devices=jax.devices()[:4])
    model.export_adapters(tmp_path / "adapters")
    model.export(tmp_path / "merged")
    ours = model.logits(TOKENS)
    with torch.no_grad():
        base = Gemma4ForCausalLM.from_pretrained(tmp_path / "base").eval()
        plain = base(torch.tensor(TOKENS), output_hidden_states=True).logits.numpy()
        theirs = (
            PeftModel.from_pretrained(base, tmp_path / "adapters")
            .eval()(torch.tensor(TOKENS), output_hidden_states=True)
            .logits.numpy()
        )
        merged = (
            Gemma4ForCausalLM.from_pretrained(tmp_path / "merged")
            .eval()(torch.tensor(TOKENS), output_hidden_states=True)
            .logits.numpy()
        )
    assert np.abs(theirs - plain).max() > 1e-2  # the adapters change the model
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    np.testing.assert_allclose(merged, theirs, atol=1e-4, rtol=0)
