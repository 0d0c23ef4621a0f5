"""Llama 3 and Qwen 2.5 / 3 (dense and MoE) through the Gemma decoder as data: tiny random
transformers models load through our Hugging Face import with transformers' logits (float32, 1e-4)
on one device, fsdp2 x tp2 and (MoE) ep2 x fsdp2, with llama3 and yarn RoPE at positions past the
pre-training context; greedy tokens equal transformers' generate; our export loads back in
transformers with the same logits. transformers runs in this process or in
TUNIX_TRAIN_REFERENCE_PYTHON's (hf_reference.py)."""

import json

import jax
import numpy as np
import pytest
from hf_reference import LLAMA_QWEN, SEQ, SIZES, checkpoint_and_logits

from tunix_train import api
from tunix_train.config import ConfigError, RopeScalingType
from tunix_train.interop import hf

MESHES = {
    "one": ([[1, 1], ["fsdp", "tp"]], 1),
    "fsdp2_tp2": ([[2, 2], ["fsdp", "tp"]], 4),
    "ep2_fsdp2": ([[2, 2], ["ep", "fsdp"]], 4),
}
GREEDY = 16


def _tokens():
    return np.random.default_rng(0).integers(0, SIZES["vocab_size"], (2, SEQ))


@pytest.mark.parametrize("variant", LLAMA_QWEN)
def test_logits_match_transformers(tmp_path, variant):
    reference = checkpoint_and_logits(variant, tmp_path / "checkpoint", _tokens())
    meshes = ["one", "fsdp2_tp2"] + (["ep2_fsdp2"] if variant == "qwen3_moe" else [])
    for mesh in meshes:
        shape, devices = MESHES[mesh]
        model = api.load(tmp_path / "checkpoint", mesh_shape=shape, devices=jax.devices()[:devices])
        np.testing.assert_allclose(model.logits(_tokens()), reference, atol=1e-4, rtol=0, err_msg=mesh)
    cfg = model.config
    assert cfg.family == LLAMA_QWEN[variant][0].lower().replace("qwen3moe", "qwen3_moe")
    assert not cfg.scale_embeddings and cfg.norm_weight_offset == 0.0
    assert cfg.tie_embeddings == (variant in ("llama_tied", "qwen2"))
    assert cfg.qkv_bias == (variant == "qwen2") and cfg.use_qk_norm == variant.startswith("qwen3")
    scaling = {
        "llama_rope": RopeScalingType.llama3,
        "qwen3_yarn": RopeScalingType.yarn,
        "phi3_longrope": RopeScalingType.longrope,
    }
    assert cfg.rope_scaling.type is scaling.get(variant, RopeScalingType.none)
    if variant in scaling:  # SEQ runs past the pre-training context the schedule stretches
        assert cfg.rope_scaling.original_context < SEQ


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3_yarn", "qwen3_moe"])
def test_greedy_generation_matches_transformers(tmp_path, variant):
    prompt = np.random.default_rng(2).integers(3, SIZES["vocab_size"], (1, 6))
    reference = checkpoint_and_logits(variant, tmp_path / "checkpoint", prompt, greedy_tokens=GREEDY)
    model = api.load(tmp_path / "checkpoint", mesh_shape=MESHES["fsdp2_tp2"][0], devices=jax.devices()[:4])
    assert len(reference) == GREEDY and len(set(reference.tolist())) > 3  # not one repeated token
    assert model.generate(prompt.tolist(), max_new_tokens=GREEDY) == [reference.tolist()]


@pytest.mark.parametrize("variant", ["llama_rope", "qwen2", "qwen3_moe"])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, variant):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    reference = checkpoint_and_logits(variant, tmp_path / "checkpoint", _tokens())
    model = api.load(tmp_path / "checkpoint", mesh_shape=MESHES["fsdp2_tp2"][0], devices=jax.devices()[:4])
    model.export(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == [
        transformers.AutoConfig.from_pretrained(tmp_path / "checkpoint").architectures[0]
    ]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        logits = back(torch.tensor(_tokens())).logits.numpy()
    np.testing.assert_allclose(logits, reference, atol=1e-5, rtol=0)
    if variant == "qwen3_moe":  # each expert's projections as tensors of their own, as published
        from safetensors import safe_open

        names = set(safe_open(str(tmp_path / "out" / "model.safetensors"), "np").keys())
        assert "model.layers.0.mlp.experts.7.gate_proj.weight" in names
        assert not any(n.endswith("experts.gate_up_proj") for n in names)


def _config(**changes):
    base = {
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    return {**base, **changes}


def test_what_the_decoder_cannot_hold_is_one_line_naming_the_key():
    for changes, words in (
        (
            {"model_type": "falcon"},
            "model_type 'falcon' is not one this package reads .*llama, mistral, phi3, qwen2, qwen3",
        ),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope_scaling type 'dynamic'"),
        (
            {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}},
            "longrope needs config.json's original_max_position_embeddings",
        ),
        ({"attention_bias": True}, "attention_bias=True is not supported for llama"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        (
            {
                "model_type": "qwen3_moe",
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 8,
                "mlp_only_layers": [0],
            },
            "mlp_only_layers",
        ),
    ):
        with pytest.raises(ConfigError, match=words):
            hf.model_fields_from_hf(_config(**changes))


def test_published_config_keys_read_as_transformers_5_writes_them():
    """Llama 3.1's config.json carries rope_theta and rope_scaling (transformers 4's keys)."""
    fields = hf.model_fields_from_hf(
        _config(
            rope_theta=500000.0,
            rope_scaling={
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            tie_word_embeddings=False,
        )
    )
    assert fields["rope_base_global"] == 500000.0 and not fields["tie_embeddings"]
    scaling = fields["rope_scaling"]
    assert (scaling.type, scaling.factor, scaling.original_context) == (RopeScalingType.llama3, 8.0, 8192)


@pytest.mark.parametrize("name", ["qwen3_tiny"])  # 50 steps (Llama trains in the context-extension test)
def test_tiny_qwen3_learns_the_bundled_corpus(tmp_path, name):
    from conftest import read_metrics

    from tunix_train.compose import load_config
    from tunix_train.train.loop import train

    cfg, _ = load_config(
        [f"model={name}", "model.vocab_size=4096", "training.max_steps=50", "training.eval_every=25"]
    )
    train(cfg, tmp_path / "run", devices=jax.devices()[:1])
    held_out = [m["eval_loss"] for m in read_metrics(tmp_path / "run") if "eval_loss" in m]
    # at steps 0, 25 and 50: from about ln(4096) = 8.3 down, by more than 2 nats
    assert len(held_out) == 3 and held_out[2] < held_out[1] < held_out[0] - 1, held_out
    assert held_out[2] < held_out[0] - 2, held_out


@pytest.mark.parametrize(
    "name, mesh",
    [("qwen2_tiny", "fsdp2_tp2"), pytest.param("qwen3_moe_tiny", "ep2_fsdp2", marks=pytest.mark.slow)],
)
def test_training_on_a_mesh_equals_one_device(tmp_path, name, mesh):
    from conftest import config, train_losses

    from tunix_train.train.loop import train

    runs = {}
    for run, (shape, devices) in (("one", MESHES["one"]), (mesh, MESHES[mesh])):
        rows = 8 // (shape[0][shape[1].index("fsdp")] * (shape[0][0] if shape[1][0] == "ep" else 1))
        cfg = config(
            f"model={name}",
            f"model.mesh_shape={json.dumps(shape)}",
            f"training.micro_batch_size={rows}",  # the same 8 rows a step: rows per data shard
            "training.max_steps=3",
            "training.log_every=1",
        )
        train(cfg, tmp_path / run, devices=jax.devices()[:devices])
        runs[run] = np.array(train_losses(tmp_path / run))
    assert len(runs["one"]) == 3 and np.all(np.isfinite(runs["one"]))
    np.testing.assert_allclose(runs[mesh], runs["one"], rtol=1e-5)


@pytest.mark.slow  # two trainings, each checked with peft
@pytest.mark.parametrize("variant, quantization", [("qwen2", "nf4"), ("qwen3_moe", "int8")])
def test_lora_and_qlora_over_a_transformers_base_equal_peft(tmp_path, variant, quantization):
    """LoRA on every projection over a quantized Qwen 2 (q/k/v biases) or Qwen 3 MoE base (no
    LoRA code is a family's own; quantizing their bases is the new part): peft puts the exported
    adapters on the base as the run held it (dequantized, exported) and gives our logits; the
    merged export gives them too."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    import transformers
    from conftest import config
    from hf_reference import build
    from peft import PeftModel
    from test_hf import model_overrides

    from tunix_train.model import quant
    from tunix_train.model.weights import Weights
    from tunix_train.train.loop import train

    # nf4 blocks of 64 along head_dim and the MLP
    build(variant, tmp_path / "base", head_dim=64, intermediate_size=128, moe_intermediate_size=64)
    fields = hf.model_fields_from_hf(hf.read_hf_config(tmp_path / "base"))
    mesh, devices = MESHES["fsdp2_tp2"]
    tiny = {"qwen2": "qwen2_tiny", "qwen3_moe": "qwen3_moe_tiny"}[variant]
    cfg = config(
        f"model={tiny}",
        *model_overrides(fields),
        f"model.init_from={tmp_path / 'base'}",
        f"model.mesh_shape={json.dumps(mesh)}",
        "training.lora.rank=4",
        "training.lora.alpha=8",
        "training.lora.targets=[q,k,v,o,gate,up,down]",
        f"training.lora.base_quantization={quantization}",
        "training.max_steps=3",
        "training.warmup_steps=0",
        "training.learning_rate=1e-2",
        "training.eval_every=0",
    )
    train(cfg, tmp_path / "run", devices=jax.devices()[:devices])
    model = api.load(tmp_path / "run", mesh_shape=mesh, devices=jax.devices()[:devices])
    model.export_adapters(tmp_path / "adapters")
    model.export(tmp_path / "merged")
    base_dir = tmp_path / "base"
    if quantization != "none":  # the base as the run held it: dequantized
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), model.params
        )
        frozen = Weights(model.lora, keeps_reference=False).frozen_base(
            hf.load_params(base_dir, model.config, abstract)
        )
        hf.export(quant.dense(frozen), model.config, tmp_path / "held")
        base_dir = tmp_path / "held"
    tokens = _tokens()
    ours = model.logits(tokens)
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
        plain = base(torch.tensor(tokens)).logits.numpy()
        theirs = (
            PeftModel.from_pretrained(base, tmp_path / "adapters").eval()(torch.tensor(tokens)).logits.numpy()
        )
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        merged = merged(torch.tensor(tokens)).logits.numpy()
    assert np.abs(theirs - plain).max() > 1e-2  # the adapters change the model
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    np.testing.assert_allclose(merged, theirs, atol=1e-4, rtol=0)


def test_a_qwen_directory_with_its_tokenizer_exports_its_special_ids(tmp_path):
    """A Qwen 3 checkpoint beside its byte-level BPE tokenizer (no BOS): loaded, it prepends nothing
    and stops at <|im_end|>; exported, config.json names the tokenizer's ids and transformers reads
    the tokenizer back the same."""
    transformers = pytest.importorskip("transformers")
    from bpe_files import byte_level_bpe
    from hf_reference import build

    build("qwen3", tmp_path / "qwen3", vocab_size=640)
    byte_level_bpe(tmp_path / "qwen3", "qwen")
    model = api.load(tmp_path / "qwen3", mesh_shape=MESHES["one"][0], devices=jax.devices()[:1])
    end = model.tokenizer.encode("<|im_end|>")
    assert len(end) == 1 and end[0] in model.stop_ids and not model.tokenizer.add_bos
    model.export(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (None, end[0])
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "To be, or not to be"
    assert theirs(text).input_ids == model.tokenizer.encode(text)


def test_a_context_extension_fine_tune_sets_rope_scaling_on_a_model_trained_without_it(tmp_path, capsys):
    from conftest import config, train_losses
    from hf_reference import build
    from test_hf import model_overrides

    from tunix_train.train.loop import train

    build("llama", tmp_path / "base")
    fields = hf.model_fields_from_hf(hf.read_hf_config(tmp_path / "base"))
    assert fields["rope_scaling"].type is RopeScalingType.none
    fields.pop("rope_scaling")
    cfg = config(
        "model=llama_tiny",  # llama3 scaling x4 from a 64-token context
        *model_overrides(fields),
        f"model.init_from={tmp_path / 'base'}",
        "model.mesh_shape=[[1],[fsdp]]",
        "training.max_steps=2",
        "training.log_every=1",
    )
    train(cfg, tmp_path / "run", devices=jax.devices()[:1])
    assert (
        "has rope_scaling none; this run uses llama3 (factor 4.0): a context extension"
        in capsys.readouterr().out
    )
    assert len(train_losses(tmp_path / "run")) == 2
    model = api.load(tmp_path / "run", devices=jax.devices()[:1])
    assert (model.config.rope_scaling.type, model.config.rope_scaling.original_context) == (
        RopeScalingType.llama3,
        64,
    )


def test_every_shipped_model_config_can_be_written_as_its_family():
    """What a run trained from a named config exports must pass its family's check (export runs it)."""
    from importlib.resources import files

    from tunix_train.compose import load_config
    from tunix_train.interop import families

    names = sorted(
        p.name.removesuffix(".yaml") for p in files("tunix_train.configs").joinpath("model").iterdir()
    )
    assert "qwen3_tiny" in names and "llama3_1_8b" in names
    for name in names:
        cfg, _ = load_config([f"model={name}"])
        families.named(cfg.model.family).check(cfg.model)


def test_a_config_json_missing_a_key_or_with_a_wrong_value_is_one_line():
    with pytest.raises(ConfigError, match="config.json of model_type 'qwen3' lacks 'num_hidden_layers'"):
        hf.model_fields_from_hf({"model_type": "qwen3", "vocab_size": 10})
    with pytest.raises(ConfigError, match="config.json holds a value of the wrong kind"):
        hf.model_fields_from_hf(_config(hidden_size="x", head_dim=None))


@pytest.mark.parametrize(
    "variant, kind, template", [("qwen3", "qwen", "qwen2_5"), ("llama", "llama", "llama3")]
)
def test_a_chat_reply_is_transformers_greedy_reply_to_the_templated_conversation(
    tmp_path, variant, kind, template
):
    """A tiny model beside its byte-level BPE tokenizer and its family's chat template (TRL's copy
    of Qwen's ChatML, Llama 3's): the prompt we render is transformers' apply_chat_template's, and
    the reply (`LoadedModel.reply`, what `generate --chat` and the server stream) is transformers'
    greedy continuation, decoded, up to the end of turn."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    pytest.importorskip("trl")

    from bpe_files import byte_level_bpe
    from hf_reference import build

    reference = build(variant, tmp_path / "m", vocab_size=640)
    byte_level_bpe(tmp_path / "m", kind, template=template)
    model = api.load(tmp_path / "m", mesh_shape=MESHES["fsdp2_tp2"][0], devices=jax.devices()[:4])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who is there?"}]

    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "m")
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    prompt = prompt["input_ids"]
    assert model.chat.encode(messages, add_generation_prompt=True)[0] == prompt
    end = tokenizer.convert_tokens_to_ids({"qwen": "<|im_end|>", "llama": "<|eot_id|>"}[kind])
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=GREEDY, eos_token_id=end, pad_token_id=end
        )
    new = out[0, len(prompt) :].tolist()
    new = new[: new.index(end)] if end in new else new
    assert len(new) >= 4  # a reply of some length, not an immediate end of turn
    assert "".join(model.reply(messages, max_new_tokens=GREEDY)) == tokenizer.decode(new)


@pytest.mark.slow  # four runs straight and resumed
@pytest.mark.parametrize(
    "name, kind, template", [("qwen3_tiny", "qwen", "qwen2_5"), ("llama_tiny", "llama", "llama3")]
)
def test_sft_on_conversations_and_qlora_dpo_resume_bit_identically_on_fsdp2_tp2(
    tmp_path, name, kind, template
):
    """With the family's byte-level BPE tokenizer and chat template: SFT on conversations
    (data=chat: the template's loss mask) and DPO over an nf4 base with LoRA, each stopped and
    resumed, log the losses of a straight run bit for bit."""
    pytest.importorskip("trl")

    from bpe_files import byte_level_bpe
    from conftest import straight_and_resumed, train_losses

    from tunix_train.compose import load_config

    tokenizer = byte_level_bpe(tmp_path / "tok", kind, template=template)
    rng = np.random.default_rng(0)
    words = ["king", "queen", "night", "day", "love", "sword"]
    with open(tmp_path / "chat.jsonl", "w") as f, open(tmp_path / "pairs.jsonl", "w") as g:
        for _ in range(48):
            question, answer = " ".join(rng.choice(words, 3)), " ".join(rng.choice(words, 2))
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"messages": messages}) + "\n")
            rejected = " " + " ".join(rng.choice(words, 4))
            g.write(
                json.dumps({"prompt": question + ":", "chosen": " " + answer, "rejected": rejected}) + "\n"
            )
    common = [
        f"model={name}",
        "model.vocab_size=640",
        f"data.tokenizer={tokenizer}",
        "data.seq_len=128",  # Qwen 2.5's template adds its default system prompt
        "training.log_every=1",
        "training.eval_every=0",
        "training.learning_rate=1e-2",
        "checkpoint.every_steps=2",
    ]
    runs = {
        "sft": [*common, "data=chat", f"data.train_files=[{tmp_path / 'chat.jsonl'}]"],
        "dpo": [
            *common,
            "objective=dpo",
            "data=jsonl",
            f"data.train_files=[{tmp_path / 'pairs.jsonl'}]",
            "model.head_dim=64",  # nf4 blocks of 64
            "training.lora.rank=4",
            "training.lora.targets=[q,k,v,o,gate,up,down]",
            "training.lora.base_quantization=nf4",
        ],
    }
    for objective, overrides in runs.items():
        cfg, _ = load_config(overrides)
        cfg.model.mesh_shape = [[2, 2], ["fsdp", "tp"]]
        straight, resumed = straight_and_resumed(cfg, tmp_path / objective, 4, 2, jax.devices()[:4])
        assert train_losses(resumed) == train_losses(straight) and len(train_losses(straight)) == 4, objective
        assert len(set(train_losses(straight))) > 1, objective  # it trains
