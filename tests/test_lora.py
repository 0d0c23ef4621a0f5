"""LoRA: the base's loss at the first step, only adapters train, adapter-only optimizer state and
checkpoints, sharding like the adapted weights, PEFT export equal to peft's logits, merged export."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_resumes_alike, checkpoint_records, config, synthetic_batches
from flax import nnx
from hf_reference import SIZES, build
from test_cli import run_cli

from tunix_train import api
from tunix_train.interop import hf
from tunix_train.sharding import to_global_batch
from tunix_train.train.loop import train
from tunix_train.train.setup import setup

ALL = "training.lora.targets=[q,k,v,o,gate,up,down]"
MESH = [[2, 2], ["fsdp", "tp"]]
STEPS = (
    "training.max_steps=4",
    "training.log_every=1",
    "training.eval_every=0",
    "training.warmup_steps=0",
    "training.learning_rate=1e-2",
    "training.micro_batch_size=4",
)


def _state_and_steps(*overrides, steps=3, mesh=MESH):
    """A fresh state of the tiny model on `mesh`, and it after `steps` steps on one synthetic batch."""
    cfg = config(*STEPS, *overrides)
    cfg.model.mesh_shape = mesh
    run = setup(cfg, jax.devices()[: int(np.prod(mesh[0]))])
    data = synthetic_batches(cfg, run.micro_batch)
    with jax.set_mesh(run.mesh):
        state = run.plan.create()
        start = jax.tree.map(np.asarray, (state.params, state.frozen))
        losses, batch = [], to_global_batch(next(data), run.mesh)
        for _ in range(steps):
            state, metrics = run.step_fn(state, batch)
            losses.append(float(metrics["loss"]))
    return run, start, state, losses


def test_first_loss_is_the_base_models_and_only_the_adapters_train():
    _, base_start, base_state, base_losses = _state_and_steps()
    run, (adapters0, frozen0), state, losses = _state_and_steps("training.lora.rank=4", ALL)
    # the base of a LoRA model is the model without adapters; B = 0 makes its first loss the base's
    assert jax.tree.all(jax.tree.map(np.array_equal, base_start[0], frozen0))
    assert losses[0] == pytest.approx(base_losses[0], rel=1e-6)
    assert losses[-1] < losses[0]
    # the frozen base is exactly unchanged; every adapter moved (B away from zero)
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, np.asarray(b)), frozen0, state.frozen))
    for path, b in nnx.to_flat_state(state.params):
        assert not np.array_equal(
            np.asarray(b[...]), np.asarray(dict(nnx.to_flat_state(adapters0))[path][...])
        ), path

    # optimizer state: AdamW's two moments of the adapters, and nothing of the base
    def nbytes(tree):
        return sum(x.nbytes for x in jax.tree.leaves(tree))

    assert nbytes(state.opt_state) <= 2 * nbytes(state.params) * 1.01
    assert nbytes(state.params) < 0.2 * nbytes(state.frozen)


def test_adapters_shard_like_the_weights_they_adapt():
    run, *_ = _state_and_steps("training.lora.rank=4", ALL, steps=0)
    shardings = dict(nnx.to_flat_state(run.plan.shardings.params))

    def spec(*path):
        return tuple(shardings[path].spec)

    def P(*entries):
        return tuple(entries)

    # like the weight they adapt: A by its input dimensions, B by its output ones (tp); fsdp splits the
    # first dimension whose rule names it, the rank where it comes first
    assert spec("layers", "attn", "q_lora", "a") == P(None, "fsdp", None)  # [L, D, r]: like q's input
    assert spec("layers", "attn", "q_lora", "b") == P(None, "fsdp", "tp", None)  # [L, r, N, H]: q's heads
    assert spec("layers", "attn", "o_lora", "a") == P(None, "tp", None, "fsdp")  # [L, N, H, r]
    assert spec("layers", "attn", "o_lora", "b") == P(None, "fsdp", None)  # [L, r, D]
    assert spec("layers", "mlp", "down_lora", "a") == P(None, "tp", "fsdp")  # [L, F, r]


def test_bf16_base_is_held_in_bf16():
    run, (_, frozen0), state, losses = _state_and_steps(
        "training.lora.rank=4", "training.lora.base_dtype=bf16"
    )
    assert {x.dtype for x in jax.tree.leaves(state.frozen)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


def hf_base_overrides(directory) -> list[str]:
    """model.init_from=directory, and the model keys its config.json sets."""
    fields = hf.model_fields_from_hf(hf.read_hf_config(directory))
    return [
        f"model.init_from={directory}",
        *(
            f"model.{k}={v}"
            for k, v in fields.items()
            if k
            in (
                "vocab_size",
                "embed_dim",
                "hidden_dim",
                "num_layers",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "sliding_window",
                "local_layers_per_global",
                "rope_base_global",
                "rope_base_local",
                "rope_scale_global",
                "query_pre_attn_scalar",
            )
        ),
    ]


def test_peft_loads_the_exported_adapters_with_our_logits_and_the_merged_export_equals_base_plus_ba(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import Gemma3ForCausalLM

    build("gemma3", tmp_path / "base")
    run_dir = tmp_path / "run"
    cfg = config(
        *STEPS, "training.lora.rank=4", "training.lora.alpha=8", ALL, *hf_base_overrides(tmp_path / "base")
    )
    cfg.model.mesh_shape = MESH
    train(cfg, run_dir, devices=jax.devices()[:4])

    model = api.load(run_dir, mesh_shape=MESH, devices=jax.devices()[:4])
    model.export_adapters(tmp_path / "adapters")
    model.export(tmp_path / "merged")
    config_json = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert config_json["r"] == 4 and config_json["lora_alpha"] == 8
    tokens = np.random.default_rng(0).integers(0, SIZES["vocab_size"], (2, 12))
    ours = model.logits(tokens)
    with torch.no_grad():
        base = Gemma3ForCausalLM.from_pretrained(tmp_path / "base").eval()
        plain = base(torch.tensor(tokens)).logits.numpy()
        adapted = PeftModel.from_pretrained(base, tmp_path / "adapters").eval()
        theirs = adapted(torch.tensor(tokens)).logits.numpy()
        merged = (
            Gemma3ForCausalLM.from_pretrained(tmp_path / "merged").eval()(torch.tensor(tokens)).logits.numpy()
        )
    assert np.abs(theirs - plain).max() > 1e-2  # the adapters change the model
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    np.testing.assert_allclose(merged, theirs, atol=1e-4, rtol=0)

    # merged weight = base + (alpha / rank) · A B, by numpy
    a = np.asarray(model.adapters["layers"]["attn"]["q_lora"]["a"][...])  # [L, D, r]
    b = np.asarray(model.adapters["layers"]["attn"]["q_lora"]["b"][...])  # [L, r, N, H]
    base_q = hf.load_params(
        tmp_path / "base",
        model.config,
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), model.params),
    )
    expected = np.asarray(base_q["layers"]["attn"]["q_DNH"][...]) + 2.0 * np.einsum("ldr,lrnh->ldnh", a, b)
    np.testing.assert_allclose(np.asarray(model.params["layers"]["attn"]["q_DNH"][...]), expected, atol=1e-6)

    # as llama.cpp's adapter GGUF: on a base file's weight (transformers' [out, in], as our GGUF export
    # and llama.cpp's converter write it), W + (alpha / rank) lora_b lora_a is the merged weight
    import gguf
    from safetensors.numpy import load_file

    model.export_adapters(tmp_path / "adapter.gguf", format="gguf", dtype="f32")
    reader = gguf.GGUFReader(tmp_path / "adapter.gguf")
    assert [
        reader.get_field(k).contents() for k in ("general.type", "adapter.type", "adapter.lora.alpha")
    ] == ["adapter", "lora", 8.0]
    lora = {t.name: np.asarray(t.data) for t in reader.tensors}
    base_w, merged_w = (load_file(tmp_path / d / "model.safetensors") for d in ("base", "merged"))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, SIZES["num_hidden_layers"])
    adapted = [n for n in merged_w if names.get_name(n, try_suffixes=(".weight",)) + ".lora_a" in lora]
    assert len(adapted) == 7 * SIZES["num_hidden_layers"] and len(lora) == 2 * len(adapted)
    for hf_name in adapted:
        g = names.get_name(hf_name, try_suffixes=(".weight",))
        assert lora[g + ".lora_a"].shape == (4, base_w[hf_name].shape[1]), g
        np.testing.assert_allclose(
            base_w[hf_name] + 2.0 * lora[g + ".lora_b"] @ lora[g + ".lora_a"],
            merged_w[hf_name],
            atol=1e-5,
            err_msg=g,
        )


@pytest.mark.slow
def test_checkpoints_hold_only_adapters_and_resume_bit_identically(tmp_path):
    lora = ("training.lora.rank=4", ALL, "training.lr_schedule=constant")
    cfg = config(*STEPS, *lora, "checkpoint.every_steps=2")
    cfg.model.mesh_shape = MESH
    straight = assert_resumes_alike(cfg, tmp_path, 6, 3, jax.devices()[:4])
    metadata, record = checkpoint_records(straight / "checkpoints" / "6")
    assert "q_lora" in metadata and "q_DNH" not in metadata  # the base is not in the checkpoint
    assert record["frozen"]["source"] == "training.seed=0" and record["frozen"]["checksum"] > 0


@pytest.mark.parametrize(
    "override, message",
    [
        ("training.lora.rank=0", "training.lora.rank=0 must be positive"),
        ("training.lora.targets=[q,qkv]", "unknown projection 'qkv'; choose from q, k, v, o, gate, up, down"),
        ("training.lora.dropout=0.1", "unknown config key 'training.lora.dropout'"),
    ],
)
def test_bad_lora_settings_are_one_line(tmp_path, override, message):
    result = run_cli(
        "model=gemma3_tiny",
        "data=synthetic",
        "training.lora.rank=4",
        override,
        f"hydra.run.dir={tmp_path}/run",
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1 and message in lines[0], result.stderr
