"""QLoRA: LoRA over a quantized frozen base (training.lora.base_quantization): the first loss is the
dequantized base's, the base stays bit-unchanged and small, meshes agree, resume is bit-identical."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_resumes_alike, checkpoint_records, config, read_metrics
from flax import nnx
from test_cli import run_cli
from test_lora import ALL, STEPS, _state_and_steps, hf_base_overrides

from tunix_train.config import Remat
from tunix_train.data.synthetic import SyntheticBatches
from tunix_train.model import quant
from tunix_train.parallel import model_graphdef
from tunix_train.train.forward import token_losses
from tunix_train.train.setup import setup

QLORA = ("training.lora.rank=4", ALL, "model.head_dim=64")  # nf4 blocks of 64 along head_dim and mlp (128)


def nbytes(tree):
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def _dense_model_loss(run, frozen) -> float:
    """The mean token loss of the first synthetic batch under the plain model whose weights are
    `frozen` dequantized: what a LoRA model with B = 0 computes."""
    model_cfg = config(*STEPS, *QLORA).model
    batch = next(
        SyntheticBatches(
            seq_len=32,
            vocab_size=model_cfg.vocab_size,
            accumulation_steps=1,
            global_micro_batch=run.micro_batch,
            seed=0,
        )
    )
    micro = {k: jnp.asarray(v[0]) for k, v in batch.items()}
    graphdef = model_graphdef(model_cfg, Remat.none)
    losses, _ = token_losses(graphdef, (quant.dense(frozen),), micro)
    return float(jnp.sum(losses * micro["loss_mask"]) / jnp.sum(micro["loss_mask"]))


@pytest.mark.parametrize(
    "kind, stored",
    [("nf4", {"uint8", "float32"}), pytest.param("int8", {"int8", "float32"}, marks=pytest.mark.slow)],
)
def test_quantized_base_starts_at_its_dequantized_loss_and_stays_unchanged(kind, stored):
    _, (_, dense0), _, _ = _state_and_steps(*QLORA, steps=0)
    run, (_, frozen0), state, losses = _state_and_steps(*QLORA, f"training.lora.base_quantization={kind}")
    # the projections are held quantized; the rest of the base (embeddings, norms) in float32
    q = dict(nnx.to_flat_state(state.frozen))[("layers", "attn", "q_DNH")].get_value()
    assert isinstance(q, quant.Quantized) and q.kind == kind and q.shape == (2, 64, 4, 64)
    assert {str(x.dtype) for x in jax.tree.leaves(state.frozen)} == stored
    assert nbytes(state.frozen) < (0.45 if kind == "nf4" else 0.6) * nbytes(dense0)
    # B = 0: the first loss is the dequantized base's (its own, not the float32 base's)
    assert losses[0] == pytest.approx(_dense_model_loss(run, state.frozen), rel=1e-6)
    assert losses[0] != pytest.approx(_dense_model_loss(run, dense0), rel=1e-6)
    assert losses[-1] < losses[0]
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, np.asarray(b)), frozen0, state.frozen))


def test_quantized_base_shards_along_the_weights_axes():
    run, *_ = _state_and_steps(
        *QLORA, "training.lora.base_quantization=nf4", steps=0, mesh=[[4, 2], ["fsdp", "tp"]]
    )
    frozen = dict(nnx.to_flat_state(run.plan.shardings.frozen))

    def spec(name, part):
        return tuple(getattr(frozen[("layers", *name)].get_value(), part).spec)

    # q [L, D, N, H]: D over fsdp, heads over tp; the codes halve head_dim, the scales one per block
    assert spec(("attn", "q_DNH"), "data") == spec(("attn", "q_DNH"), "scale") == (None, "fsdp", "tp", None)
    # the MLP's blocks run along its width, which tp splits into whole blocks
    assert spec(("mlp", "down_FD"), "scale") == (None, "tp", "fsdp")


@pytest.mark.slow
def test_nf4_base_on_fsdp4_tp2_equals_one_device():
    nf4 = (*QLORA, "training.lora.base_quantization=nf4")
    *_, losses = _state_and_steps(*nf4, mesh=[[4, 2], ["fsdp", "tp"]])
    *_, one = _state_and_steps(*nf4, "training.micro_batch_size=16", mesh=[[1], ["fsdp"]])  # the same 16 rows
    np.testing.assert_allclose(losses, one, rtol=1e-5)


def test_int8_scales_are_per_output_channel_and_never_split_along_inputs():
    run, *_ = _state_and_steps(*QLORA, "training.lora.base_quantization=int8", steps=0)
    frozen = dict(nnx.to_flat_state(run.plan.abstract.frozen))
    o = frozen[("layers", "attn", "o_NHD")].get_value()  # [L, N, H, D]: inputs (N, H)
    assert o.scale.shape == (2, 1, 1, 64) and tuple(o.scale.sharding.spec) == (None, None, None, "fsdp")


def test_nf4_trains_within_5_percent_of_a_bf16_base():
    steps = ("training.max_steps=50", "training.learning_rate=3e-3", "model.mesh_shape=[[1],[fsdp]]")
    final = {}
    for base in ("training.lora.base_dtype=bf16", "training.lora.base_quantization=nf4"):
        *_, losses = _state_and_steps(*QLORA, *steps, base, steps=50, mesh=[[1], ["fsdp"]])
        final[base] = losses[-1]
        assert losses[-1] < 0.8 * losses[0], (base, losses[0], losses[-1])
    bf16, nf4 = final.values()
    assert abs(nf4 - bf16) <= 0.05 * bf16, final


@pytest.mark.slow
def test_qlora_resumes_bit_identically_and_checkpoints_no_base(tmp_path):
    cfg = config(
        *STEPS,
        *QLORA,
        "training.lora.base_quantization=nf4",
        "training.lr_schedule=constant",
        "checkpoint.every_steps=2",
    )
    cfg.model.mesh_shape = [[2, 2], ["fsdp", "tp"]]
    straight = assert_resumes_alike(cfg, tmp_path, 6, 3, jax.devices()[:4])
    metadata, record = checkpoint_records(straight / "checkpoints" / "6")
    assert "q_lora" in metadata and "q_DNH" not in metadata
    assert record["frozen"]["source"] == "training.seed=0" and record["frozen"]["checksum"] > 0


def test_quantizing_a_loaded_base_holds_one_layers_temporaries():
    """model.init_from's base is quantized one layer at a time, with no int32 code per value: the
    quantizing program's temporaries are about one layer's float32 projections. All layers
    at once (nf4 by searchsorted) took 3.4x all twelve layers' float32 bytes, and gemma3_27b asked
    an H200 for 292 GiB."""
    cfg = config(*STEPS, *QLORA, "training.lora.base_quantization=nf4", "model.num_layers=12")
    cfg.model.mesh_shape = [[1], ["fsdp"]]
    plan = setup(cfg, jax.devices()[:1]).plan
    temporaries = plan._from_params.lower(plan.base, plan._key).compile().memory_analysis().temp_size_in_bytes
    stacks = [
        x
        for path, x in jax.tree_util.tree_leaves_with_path(plan.base)
        if "layers" in jax.tree_util.keystr(path) and x.ndim >= 3
    ]
    one_layer_float32 = sum(x.size // 12 * 4 for x in stacks)
    assert len(stacks) == 7 and temporaries < 2 * one_layer_float32, temporaries / one_layer_float32


def _hf_base_config(directory, *overrides):
    """The tiny QLoRA config over a transformers checkpoint built at `directory`."""
    from hf_reference import build

    build("gemma3", directory, head_dim=64, intermediate_size=128)
    return config(*STEPS, *QLORA[:2], *hf_base_overrides(directory), *overrides)


@pytest.mark.parametrize("kind", ["nf4", pytest.param("int8", marks=pytest.mark.slow)])
def test_a_loaded_base_is_quantized_layer_by_layer_into_the_whole_stacks_codes(tmp_path, kind, monkeypatch):
    """model.init_from under a quantized base: each projection is quantized as its layers are read
    (never whole and dense on the devices), into the codes and shardings quantizing it whole gives."""
    pytest.importorskip("transformers")
    from tunix_train.interop import hf
    from tunix_train.model.weights import Weights
    from tunix_train.train.setup import starting_state

    built, layer_by_layer = [], Weights.layer_by_layer

    def recorded(weights, frozen):  # the projections built layer by layer
        build = layer_by_layer(weights, frozen)

        def record(path, leaf, read_layer):
            stack = build(path, leaf, read_layer)
            if stack is not None:
                built.append(path)
            return stack

        return record

    monkeypatch.setattr(Weights, "layer_by_layer", recorded)
    cfg = _hf_base_config(
        tmp_path / "base", f"training.lora.base_quantization={kind}", "training.lora.base_dtype=bf16"
    )
    cfg.model.mesh_shape = [[2, 2], ["fsdp", "tp"]]
    run = setup(cfg, jax.devices()[:4])
    with jax.set_mesh(run.mesh):
        frozen = dict(nnx.to_flat_state(starting_state(cfg, run)[0].frozen))
        whole = dict(
            nnx.to_flat_state(
                run.weights.frozen_base(hf.load_params(tmp_path / "base", cfg.model, run.plan.base))
            )
        )
    planned = dict(nnx.to_flat_state(run.plan.abstract.frozen))
    quantized = [path for path, w in frozen.items() if quant.is_quantized(w.get_value())]
    assert sorted(".".join(p) for p in quantized) == sorted(built) and len(built) == 7
    for path in quantized:
        ours, theirs, plan = (x[path].get_value() for x in (frozen, whole, planned))
        assert ours.kind == theirs.kind == kind and ours.dtype == theirs.dtype == jnp.bfloat16
        for part in ("data", "scale"):
            np.testing.assert_array_equal(np.asarray(getattr(ours, part)), np.asarray(getattr(theirs, part)))
            assert getattr(ours, part).sharding == getattr(plan, part).sharding, (path, part)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["training.lora.rank=4", "training.lora.base_quantization=nf4"],
            "training.lora.base_quantization=nf4: layers.attn.q_DNH has head_dim 16, not a multiple of the "
            "block size 64",
        ),
        (
            [
                "model=gemma4_tiny",
                "model.head_dim=64",
                "training.lora.rank=4",
                "training.lora.base_quantization=nf4",
            ],
            "training.lora.base_quantization=nf4: a global layer's q_DNH has global_head_dim 32, not a "
            "multiple of the block size 64",
        ),
        (
            ["training.lora.base_quantization=int8"],
            "training.lora.base_quantization=int8 quantizes LoRA's frozen base: set training.lora.rank too",
        ),
    ],
)
def test_bad_quantized_base_settings_are_one_line(tmp_path, overrides, message):
    result = run_cli("model=gemma3_tiny", "data=synthetic", *overrides, f"hydra.run.dir={tmp_path}/run")
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1 and message in lines[0], result.stderr


@pytest.mark.slow
def test_grpo_samples_from_the_quantized_base_and_syncs_it_once(tmp_path):
    """The engine on its own mesh gets the quantized base once and the adapters each rollout, and
    samples with them apart (no dequantized copy): its log-probabilities are the trainer's."""
    from test_grpo import lora_rollouts

    run, metrics = lora_rollouts(tmp_path, "training.lora.base_quantization=nf4", "model.head_dim=64")
    assert run.weights.engine_lora is not None  # the engine's model carries the adapters beside the base
    assert metrics[-1]["kl"] > 0 and all(m["logprob_mismatch_max"] < 1e-4 for m in metrics)


@pytest.mark.slow
def test_peft_loads_a_qlora_runs_adapters_on_the_dequantized_base_with_our_logits(tmp_path):
    """The adapters trained over the nf4 base, put by peft on that base dequantized (exported as a
    transformers checkpoint), give our logits; the merged export is that base plus (alpha / r) B A."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from hf_reference import SIZES
    from peft import PeftModel
    from transformers import Gemma3ForCausalLM

    from tunix_train import api
    from tunix_train.interop import hf
    from tunix_train.model.weights import Weights
    from tunix_train.train.loop import train

    cfg = _hf_base_config(tmp_path / "base", "training.lora.alpha=8", "training.lora.base_quantization=nf4")
    cfg.model.mesh_shape = [[2, 2], ["fsdp", "tp"]]
    train(cfg, tmp_path / "run", devices=jax.devices()[:4])
    model = api.load(tmp_path / "run", mesh_shape=[[2, 2], ["fsdp", "tp"]], devices=jax.devices()[:4])
    model.export_adapters(tmp_path / "adapters")
    model.export(tmp_path / "merged")
    # the base as the run held it: the transformers weights, quantized to nf4, dequantized
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), model.params
    )
    weights = Weights(model.lora, keeps_reference=False)
    dequantized = quant.dense(weights.frozen_base(hf.load_params(tmp_path / "base", model.config, abstract)))
    hf.export(dequantized, model.config, tmp_path / "dequantized")

    tokens = np.random.default_rng(0).integers(0, SIZES["vocab_size"], (2, 12))
    ours = model.logits(tokens)
    with torch.no_grad():
        base = Gemma3ForCausalLM.from_pretrained(tmp_path / "dequantized").eval()
        plain = base(torch.tensor(tokens)).logits.numpy()
        theirs = (
            PeftModel.from_pretrained(base, tmp_path / "adapters").eval()(torch.tensor(tokens)).logits.numpy()
        )
        merged = (
            Gemma3ForCausalLM.from_pretrained(tmp_path / "merged").eval()(torch.tensor(tokens)).logits.numpy()
        )
        original = Gemma3ForCausalLM.from_pretrained(tmp_path / "base").eval()
        on_original = (
            PeftModel.from_pretrained(original, tmp_path / "adapters").eval()(torch.tensor(tokens)).logits
        )
    assert np.abs(theirs - plain).max() > 1e-2  # the adapters change the model
    assert np.abs(on_original.numpy() - ours).max() > 1e-2  # and the quantized base is not the original
    np.testing.assert_allclose(ours, theirs, atol=1e-3, rtol=0)
    np.testing.assert_allclose(merged, theirs, atol=1e-3, rtol=0)


# A Q4_K_M-like file: types that change from layer to layer within one projection (ffn_down Q4_K and
# Q8_0, attn_v Q5_0 and F16), Q4_0 gate, Q8_0 elsewhere, an F16 embedding and F32 norms.
def _mixed_by_layer(name, array):
    import gguf

    Q = gguf.GGMLQuantizationType
    if array.ndim == 1:
        return Q.F32
    if name == "token_embd.weight":
        return Q.F16
    layer = int(name.split(".")[1])
    if "ffn_down" in name:
        return Q.Q4_K if layer % 2 else Q.Q8_0
    if "attn_v" in name:
        return Q.Q5_0 if layer % 3 else Q.F16
    return Q.Q4_0 if "ffn_gate" in name else Q.Q8_0


def _gguf_runs(tmp_path, *overrides, kinds=("none", "gguf"), mesh=((2, 2), ("fsdp", "tp")), steps=3):
    """LoRA runs from one mixed-type GGUF file with each base_quantization: {kind: (final state, losses)}."""
    import gguf_files
    from test_gguf import GEMMA3, _exported

    from tunix_train.train.loop import train

    path = tmp_path / "m.gguf"
    if not path.exists():
        _, _, tensors, hf_config = _exported(tmp_path)
        gguf_files.write(path, "gemma3", hf_config, tensors, _mixed_by_layer)
    runs = {}
    for kind in kinds:
        cfg = config(
            *GEMMA3,
            f"model.init_from={path}",
            f"training.max_steps={steps}",
            "training.log_every=1",
            "training.warmup_steps=0",
            "training.lora.rank=4",
            ALL,
            "data=synthetic",
            "training.learning_rate=1e-2",
            f"training.lora.base_quantization={kind}",
            *overrides,
        )
        cfg.model.mesh_shape = [list(mesh[0]), list(mesh[1])]
        run_dir = tmp_path / f"{kind}-{'x'.join(map(str, mesh[0]))}"
        state = train(cfg, run_dir, devices=jax.devices()[: int(np.prod(mesh[0]))])
        runs[kind] = (state, read_metrics(run_dir))
    return path, runs


@pytest.mark.slow  # 31 s; .ci/python312 runs it too
def test_gguf_base_keeps_the_files_blocks_and_starts_at_its_dequantized_models_loss(tmp_path):
    import gguf

    path, runs = _gguf_runs(tmp_path, "training.eval_every=3", "training.eval_batches=2")
    (dense, dense_metrics), (blocks, metrics) = runs["none"], runs["gguf"]
    # the projections are the file's bytes: every layer's row, its type among the layer types
    reader = {t.name: t for t in gguf.GGUFReader(path).tensors}
    down = dict(nnx.to_flat_state(blocks.frozen))[("layers", "mlp", "down_FD")].get_value()
    assert down.kind == "gguf" and [quant.Q(t).name for t in down.qtypes] == ["Q8_0", "Q4_K"]
    for layer in (0, 1):
        raw = np.asarray(reader[f"blk.{layer}.ffn_down.weight"].data)
        np.testing.assert_array_equal(np.asarray(down.data)[layer, :, : raw.shape[1]], raw)
    # dequantized in the step, each layer equals gguf.quants.dequantize of its blocks (the dense base)
    for name in ("q_DNH", "v_DKH", "o_NHD"):
        flat = ("layers", "attn", name)
        np.testing.assert_array_equal(
            np.asarray(dict(nnx.to_flat_state(blocks.frozen))[flat].get_value().dequantized()),
            np.asarray(dict(nnx.to_flat_state(dense.frozen))[flat][...]),
            err_msg=name,
        )
    np.testing.assert_array_equal(
        np.asarray(down.dequantized()),
        np.asarray(dict(nnx.to_flat_state(dense.frozen))[("layers", "mlp", "down_FD")][...]),
    )
    assert nbytes(blocks.frozen) < 0.55 * nbytes(dense.frozen)

    def losses(m):
        return [x["loss"] for x in m if "loss" in x]

    assert losses(metrics)[0] == pytest.approx(losses(dense_metrics)[0], abs=1e-5)
    np.testing.assert_allclose(losses(metrics), losses(dense_metrics), atol=1e-5)
    evals = [x["eval_loss"] for x in metrics if "eval_loss" in x]
    assert len(evals) == 2 and evals[-1] < evals[0]  # at step 0 and after 3 steps


@pytest.mark.slow
def test_gguf_base_on_fsdp4_tp2_equals_one_device(tmp_path):
    _, eight = _gguf_runs(tmp_path, kinds=("gguf",), mesh=((4, 2), ("fsdp", "tp")))
    _, one = _gguf_runs(tmp_path, "training.micro_batch_size=16", kinds=("gguf",), mesh=((1,), ("fsdp",)))

    def losses(runs):
        return [x["loss"] for x in runs["gguf"][1] if "loss" in x]

    np.testing.assert_allclose(losses(eight), losses(one), rtol=1e-5)


@pytest.mark.slow
def test_gguf_base_resumes_bit_identically_and_checkpoints_no_base(tmp_path):
    import gguf_files
    from test_gguf import GEMMA3, _exported

    _, _, tensors, hf_config = _exported(tmp_path)
    path = gguf_files.write(tmp_path / "m.gguf", "gemma3", hf_config, tensors, _mixed_by_layer)
    cfg = config(
        *GEMMA3,
        f"model.init_from={path}",
        *STEPS,
        "training.lora.rank=4",
        ALL,
        "training.lora.base_quantization=gguf",
        "training.lr_schedule=constant",
        "checkpoint.every_steps=2",
    )
    cfg.model.mesh_shape = [[2, 2], ["fsdp", "tp"]]
    straight = assert_resumes_alike(cfg, tmp_path, 6, 3, jax.devices()[:4])
    metadata, record = checkpoint_records(straight / "checkpoints" / "6")
    assert "q_lora" in metadata and "q_DNH" not in metadata and "down_FD" not in metadata
    assert record["frozen"]["source"] == f"model.init_from={path}"


def test_gguf_base_bad_input_is_one_line(tmp_path):
    import gguf
    import gguf_files
    from test_gguf import GEMMA3, _exported

    no_file = run_cli(
        "model=gemma3_tiny",
        "data=synthetic",
        "training.lora.rank=4",
        "training.lora.base_quantization=gguf",
        f"hydra.run.dir={tmp_path}/a",
    )
    _, _, tensors, hf_config = _exported(tmp_path)

    def q4_1(name, array):
        return gguf.GGMLQuantizationType.Q4_1 if "ffn_up" in name else gguf_files.mixed_types(name, array)

    path = gguf_files.write(tmp_path / "q4_1.gguf", "gemma3", hf_config, tensors, q4_1)
    bad_type = run_cli(
        "model=gemma3_tiny",
        *GEMMA3,
        "data=synthetic",
        "training.lora.rank=4",
        f"model.init_from={path}",
        "training.lora.base_quantization=gguf",
        f"hydra.run.dir={tmp_path}/b",
    )
    for result, message in (
        (
            no_file,
            "training.lora.base_quantization=gguf trains on a GGUF file's blocks: set "
            "model.init_from to a .gguf file (it is None)",
        ),
        (bad_type, "tensor blk.0.ffn_up.weight has type Q4_1, which a gguf base does not read"),
    ):
        lines = result.stderr.strip().splitlines()
        assert result.returncode != 0 and len(lines) == 1 and message in lines[0], result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh, extra",
    [
        ([[2, 2], ["pp", "fsdp"]], ["training.pipeline_microbatches=2"]),
        ([[2, 2], ["cp", "fsdp"]], []),
        ([[2, 2], ["dp", "tp"]], []),
    ],
)
def test_nf4_base_on_pp_cp_and_dp_equals_one_device(mesh, extra):
    nf4 = (*QLORA, "training.lora.base_quantization=nf4", "model.num_layers=4")
    *_, losses = _state_and_steps(*nf4, *extra, mesh=mesh)
    *_, one = _state_and_steps(*nf4, "training.micro_batch_size=8", mesh=[[1], ["fsdp"]])
    np.testing.assert_allclose(losses, one, rtol=1e-5)


@pytest.mark.parametrize("remat", ["none", "full", "save_matmul_outputs"])
def test_no_dequantized_layer_is_kept_for_the_backward_pass(remat, monkeypatch):
    """jax's own account of what the backward pass keeps (saved_residuals): over an nf4 base, no
    array of a projection's shape (a dequantized layer, or a stack of them); without the remat
    policy that keeps them out, remat none keeps such arrays (the check can fail)."""
    from jax._src.ad_checkpoint import saved_residuals

    from tunix_train.config import Remat
    from tunix_train.model import kernels
    from tunix_train.model.decoder import Decoder, LayerLoop
    from tunix_train.model.weights import Weights

    def kept(kind):
        cfg = config(*QLORA, f"training.lora.base_quantization={kind}")
        weights = Weights.for_run(cfg, keeps_reference=False)
        graphdef, params = nnx.split(
            Decoder(cfg.model, nnx.Rngs(0), LayerLoop(Remat(remat)), lora=weights.lora), nnx.Param
        )
        adapters, frozen = weights.split(params)
        tokens = jnp.zeros((3, 16), jnp.int32)

        def loss(adapters, frozen):
            return nnx.merge(graphdef, frozen, adapters)(tokens).mean()

        projections = {tuple(w.shape) for w in jax.tree.leaves(quant.dense(frozen)) if w.ndim >= 3}
        return [
            (a.shape, why)
            for a, why in saved_residuals(loss, adapters, frozen)
            if tuple(a.shape) in projections and "argument" not in why
        ]

    assert kept("nf4") == []
    if remat == "none":
        monkeypatch.setattr(kernels, "remat_policy", lambda remat, quantized_base: None)
        assert kept("nf4") != []


# Every pair of settings (quantization and base dtype, quantization and precision, base dtype and
# precision) in 6 of the 12 combinations, the one that crashed (nf4, fp32, bf16) among them.
MATRIX = [
    ("nf4", "fp32", "bf16"),
    ("nf4", "bf16", "fp32"),
    ("int8", "fp32", "fp32"),
    ("int8", "bf16", "bf16"),
    ("none", "fp32", "bf16"),
    ("none", "bf16", "fp32"),
]


def test_the_matrix_holds_every_pair_of_settings():
    values = (("nf4", "int8", "none"), ("fp32", "bf16"), ("fp32", "bf16"))
    for i, j in ((0, 1), (0, 2), (1, 2)):
        assert {(c[i], c[j]) for c in MATRIX} == {(a, b) for a in values[i] for b in values[j]}


@pytest.mark.parametrize(
    "quantization, base_dtype, mixed",
    [
        pytest.param(*combo, marks=() if combo == ("nf4", "fp32", "bf16") else pytest.mark.slow)
        for combo in MATRIX
    ],
)
def test_every_base_dtype_precision_and_quantization_trains_and_plans(quantization, base_dtype, mixed):
    """nf4 with the default fp32 base under bf16 compute crashed in the step and the planner (the
    quantized leaf's static dtype differed from its sharding's); each combination now trains (the
    loss on a repeated batch falls) and plans."""
    from tunix_train.plan import plan

    overrides = (
        *QLORA,
        f"training.lora.base_quantization={quantization}",
        f"training.lora.base_dtype={base_dtype}",
        f"training.mixed_precision={mixed}",
    )
    *_, losses = _state_and_steps(*overrides, steps=3, mesh=[[2], ["fsdp"]])
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    figures, *_ = plan(
        [
            "model=gemma3_tiny",
            "data=synthetic",
            "data.seq_len=32",
            *overrides,
            'model.mesh_shape=[[8],["fsdp"]]',
        ]
    )
    assert figures
