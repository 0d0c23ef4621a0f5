"""GGUF import without transformers: round trips of our own weights through a GGUF file, the
dequantized weights against gguf.quants.dequantize, init_from, and bad files (parity with
transformers' GGUF loader: test_gguf_parity.py)."""

import json
import logging

import gguf
import gguf_files
import jax
import numpy as np
import pytest
from conftest import config
from safetensors.numpy import load_file
from test_model import SHIPPED

from tunix_train import api
from tunix_train.config import ConfigError
from tunix_train.interop import hf
from tunix_train.sharding import make_mesh
from tunix_train.train.init import plan_train_state
from tunix_train.train.loop import train
from tunix_train.train.optimizer import make_optimizer

MESH = [[2, 2], ["fsdp", "tp"]]
# A Gemma 3 whose metadata a GGUF file can leave out (5 local layers per global, transformers'
# default; the query scale 256, head_dim 256 as llama.cpp takes it), and whose MLP rows hold whole
# Q4_K blocks (256).
GEMMA3 = [
    "model.num_layers=6",
    "model.head_dim=256",
    "model.local_layers_per_global=5",
    "model.sliding_window=5",
    "model.hidden_dim=256",
    "model.query_pre_attn_scalar=256",
    "model.rope_base_global=1000000.0",
    "model.rope_base_local=10000.0",
    "model.context_length=64",
]


def _exported(tmp_path, *overrides):
    """A random model of `overrides` exported in transformers' layout: (config, its params, tensors,
    config.json)."""
    cfg = config(*GEMMA3, *overrides)
    mesh = make_mesh([[1], ["fsdp"]], jax.devices()[:1])
    params = plan_train_state(cfg.model, make_optimizer(cfg.training)[0], mesh, seed=3).create().params
    rng = np.random.default_rng(0)  # norms start at zero: make them matter
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: (
            x + rng.normal(size=x.shape).astype(np.float32) * 0.2 if "norm" in jax.tree_util.keystr(p) else x
        ),
        params,
    )
    hf.export(params, cfg.model, tmp_path / "hf")
    return (
        cfg,
        params,
        load_file(str(tmp_path / "hf" / "model.safetensors")),
        json.loads((tmp_path / "hf" / "config.json").read_text()),
    )


def test_a_float32_gguf_loads_our_weights_exactly(tmp_path):
    cfg, params, tensors, hf_config = _exported(tmp_path)
    path = gguf_files.write(tmp_path / "m.gguf", "gemma3", hf_config, tensors)
    model = api.load(path, mesh_shape=MESH, devices=jax.devices()[:4])
    for key in (
        "num_layers",
        "local_layers_per_global",
        "sliding_window",
        "query_pre_attn_scalar",
        "head_dim",
        "rope_base_local",
        "rope_base_global",
        "use_qk_norm",
        "vocab_size",
        "context_length",
    ):
        assert getattr(model.config, key) == getattr(cfg.model, key), key
    _assert_same_as_stored(model.params, params)


def test_a_vision_tower_in_the_file_is_left_out_with_one_line_of_log(tmp_path):
    _, params, tensors, hf_config = _exported(tmp_path)
    vision = {
        "v.patch_embd.weight": np.ones((8, 3, 2, 2)),
        "v.blk.0.attn_q.weight": np.ones((8, 8)),
        "mm.input_projection.weight": np.ones((8, 64)),
    }
    path = gguf_files.write(tmp_path / "m.gguf", "gemma3", hf_config, tensors, extra=vision)
    assert {t.name for t in gguf.GGUFReader(path).tensors} >= set(vision)
    # read on the "tunix_train" logger itself: a training run earlier in the process stops it
    # propagating to the root logger, where pytest's caplog listens
    logger, lines = logging.getLogger("tunix_train"), []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        model = api.load(path, mesh_shape=MESH, devices=jax.devices()[:4])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    _assert_same_as_stored(model.params, params)
    assert [line for line in lines if "vision" in line] == [
        "m.gguf: 3 vision-tower tensors ignored (text weights only)"
    ]


def _assert_same_as_stored(loaded, params):
    """Equal, the norms up to what a file that stores 1 + w in float32 holds: (1 + w) - 1."""
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(loaded)[0], jax.tree.leaves(params)):
        b = np.asarray(b)
        if "norm" in jax.tree_util.keystr(path):
            b = (b + np.float32(1)) - np.float32(1)
        np.testing.assert_array_equal(np.asarray(a), b)


def test_quantized_weights_are_gguf_dequantize_exactly(tmp_path):
    _, _, tensors, hf_config = _exported(tmp_path)
    path = gguf_files.write(tmp_path / "m.gguf", "gemma3", hf_config, tensors, gguf_files.mixed_types)
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert {
        types["token_embd.weight"],
        types["blk.0.attn_q.weight"],
        types["blk.0.ffn_down.weight"],
        types["blk.0.ffn_gate.weight"],
        types["blk.0.ffn_up.weight"],
    } == {"F16", "Q8_0", "Q4_K", "Q5_0", "Q4_0"}
    model = api.load(path, mesh_shape=MESH, devices=jax.devices()[:4])
    tensor = {t.name: t for t in reader.tensors}

    def dequantized(name):
        return gguf.quants.dequantize(tensor[name].data, tensor[name].tensor_type)

    p = model.params
    np.testing.assert_array_equal(np.asarray(p["embedding_VD"][...]), dequantized("token_embd.weight"))
    np.testing.assert_array_equal(
        np.asarray(p["layers"]["mlp"]["down_FD"][...])[2], dequantized("blk.2.ffn_down.weight").T
    )
    np.testing.assert_array_equal(
        np.asarray(p["layers"]["mlp"]["up_DF"][...])[4], dequantized("blk.4.ffn_up.weight").T
    )
    q = dequantized("blk.1.attn_q.weight").reshape(4, 256, 64).transpose(2, 0, 1)  # [N*H, D] -> [D, N, H]
    np.testing.assert_array_equal(np.asarray(p["layers"]["attn"]["q_DNH"][...])[1], q)
    np.testing.assert_array_equal(
        np.asarray(p["layers"]["post_ffw_norm"]["scale"][...])[3],
        dequantized("blk.3.post_ffw_norm.weight") - 1.0,
    )


def test_init_from_a_gguf_trains_from_its_weights_and_checks_the_model_config(tmp_path):
    cfg, params, tensors, hf_config = _exported(tmp_path)
    path = gguf_files.write(tmp_path / "m.gguf", "gemma3", hf_config, tensors)
    run = config(*GEMMA3, f"model.init_from={path}", "training.max_steps=1", "training.learning_rate=0")
    state = train(run, tmp_path / "run", devices=jax.devices()[:1])
    _assert_same_as_stored(state.params, params)
    with pytest.raises(
        ConfigError, match=r"has num_layers=6 but model.num_layers=2; use the matching model config"
    ):
        train(
            config(f"model.init_from={path}", "training.max_steps=1"),
            tmp_path / "bad",
            devices=jax.devices()[:1],
        )


def test_bad_gguf_files_are_one_line_errors(tmp_path):
    _, _, tensors, hf_config = _exported(tmp_path)
    good = gguf_files.write(tmp_path / "m.gguf", "gemma3", hf_config, tensors)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[:5000])
    for arch in ("falcon", "llama"):  # a family this package does not read; one whose sizes are missing
        writer = gguf.GGUFWriter(str(tmp_path / f"{arch}.gguf"), arch)
        writer.add_block_count(1)
        writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
        (
            writer.write_header_to_file(),
            writer.write_kv_data_to_file(),
            writer.write_tensors_to_file(),
            writer.close(),
        )
    falcon, llama = tmp_path / "falcon.gguf", tmp_path / "llama.gguf"
    odd = gguf_files.write(
        tmp_path / "odd.gguf",
        "gemma3",
        hf_config,
        tensors,
        lambda name, a: gguf_files.Q.Q8_1 if name == "blk.0.attn_k.weight" else gguf_files.Q.F32,
    )
    for path, message in (
        (truncated, f"{truncated}: not a readable GGUF file ("),
        (
            falcon,
            f"{falcon}: a GGUF of architecture 'falcon'; tunix_train reads gemma, gemma2, gemma3, llama, "
            "phi3, qwen2, qwen3, qwen3moe",
        ),
        (llama, f"{llama}: the GGUF metadata lacks llama.block_count, embedding_length, feed_forward_length"),
        (odd, f"{odd}: tensor blk.0.attn_k.weight has type Q8_1, which gguf.quants cannot dequantize"),
        (tmp_path / "missing.gguf", "missing.gguf: no such GGUF file"),
    ):
        with pytest.raises(ConfigError) as err:
            api.load(path, devices=jax.devices()[:1])
        assert message in str(err.value) and "\n" not in str(err.value)


def test_sizes_in_the_metadata_are_held_against_the_tensors_before_anything_is_built(tmp_path):
    """A crafted file that declares a million layers or another width is refused in one line
    before a model of that size is planned."""
    _, _, tensors, hf_config = _exported(tmp_path)
    for key, value, held in (
        ("block_count", 1_000_000, 6),
        ("embedding_length", 1 << 20, 64),
        ("feed_forward_length", 1 << 30, 256),
    ):
        path = gguf_files.write(tmp_path / f"{key}.gguf", "gemma3", hf_config, tensors, metadata={key: value})
        with pytest.raises(ConfigError) as err:
            api.load(path, devices=jax.devices()[:1])
        assert f"{path}: its metadata says {key}={value} but its tensors hold {held}" in str(err.value)


# every published Gemma 2 and 3 among the named configs (the test-sized ones aside)
PUBLISHED_GEMMA = [
    n for n in SHIPPED if n.startswith(("gemma2_", "gemma3_")) and not n.endswith(("_small", "_tiny"))
]


@pytest.mark.parametrize("name", PUBLISHED_GEMMA)
def test_the_query_scale_a_gguf_leaves_out_is_llama_cpps_and_each_published_models(name):
    """llama.cpp's rule (head_dim, n_embd / n_head for the 27B models, which it knows by their layer
    count) gives every published Gemma 2 and 3 its config.json's query_pre_attn_scalar (our named
    configs hold those); transformers' GGUF loader's 256 misses the two 27B models."""
    from tunix_train.interop import families

    assert len(PUBLISHED_GEMMA) == 8  # 2B, 9B, 27B; 270M, 1B, 4B, 12B, 27B
    m = config(f"model={name}").model
    scale = families.named(m.family).gguf.query_scale(m.num_layers, m.embed_dim, m.num_heads, m.head_dim)
    assert scale == m.query_pre_attn_scalar
    assert (scale != 256) == name.endswith("27b")
