"""GGUF for Llama 3 and Qwen 2.5 / 3 (dense and MoE): a tiny random transformers model with a
byte-level BPE tokenizer, exported by us, is the file llama.cpp's converter would write (Llama's Q
and K rows permuted as its `permute`, llama3's rope_freqs as its loop computes them, the BPE
vocabulary with merges and `pre`); transformers' GGUF loader reads back the checkpoint's own
tensors and tokenizes as the original; our import reads it back with the same logits, past the
pre-training context where RoPE is scaled; LoRA adapters in llama.cpp's adapter GGUF merge onto the
base file's (permuted) weights."""

import math

import gguf
import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="these tests need torch: pip install -e '.[reference]'")
transformers = pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[reference]'")

import hf_reference  # noqa: E402
from bpe_files import byte_level_bpe  # noqa: E402
from hf_reference import SEQ  # noqa: E402

from tunix_train import api  # noqa: E402
from tunix_train.config import ConfigError  # noqa: E402

MESH = [[2, 2], ["fsdp", "tp"]]
VOCAB = 320  # a byte-level BPE needs its 256 bytes; the tokenizer has 300 tokens, the rest is padding


def _probes(count: int = 200) -> list[str]:
    """Seeded probe strings: corpus lines, Unicode (accents, Cyrillic, CJK, emoji and joiners),
    whitespace runs, digit runs, contractions and code, cut and mixed."""
    import json
    import lzma

    from tunix_train.data.sources import BUNDLED_CORPUS

    with lzma.open(BUNDLED_CORPUS, "rt") as f:
        lines = [json.loads(line)["text"][:80] for _, line in zip(range(60), f)]
    pieces = lines + [
        "naïve café",
        "текст на русском",
        "我想在apple工作",
        "🦙🦙 🚀 😶\u200d🌫️",
        "ÅΩ≈ç√∫",
        "   ",
        "\t\t",
        "\n\n\n",
        " \n \t ",
        "3",
        "33 333 3333 33333",
        "3.14159",
        "1,000,000",
        "I've",
        "'RE you sure?",
        "We'Ve a'lL",
        "def f(x):\n    return x ** 2",
        "if (a && b) { c++; }",
        '<tag attr="v">',
        "x = [1, 2, 3]  # list",
        "SELECT * FROM t;",
        "e^{i\\pi} + 1 = 0",
    ]
    rng = np.random.default_rng(7)
    return [" ".join(rng.choice(pieces, size=rng.integers(1, 4))) for _ in range(count)]


PROBES = _probes()
ARCH = {"llama_rope": "llama", "qwen2": "qwen2", "qwen3_yarn": "qwen3", "qwen3_moe": "qwen3moe"}
# what transformers' GGUF loader assumes where these files are silent (its Qwen3Config's head_dim,
# Qwen3MoeConfig's moe_intermediate_size): the sizes it reads the tensors at
READABLE = {"qwen3_yarn": dict(head_dim=128), "qwen3_moe": dict(head_dim=128, moe_intermediate_size=768)}


def converter_permute(weights, n_head, n_head_kv):
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, transcribed."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def converter_rope_freqs(base, dim, factor, low_freq_factor, high_freq_factor, old_context_len):
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.generate_extra_tensors (llama3), transcribed."""
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(rope_factors, np.float32)


@pytest.fixture(scope="module", params=list(ARCH))
def exported(request, tmp_path_factory):
    """(variant, directory, the transformers model, our model of it, the f32 GGUF we wrote)."""
    variant, tmp = request.param, tmp_path_factory.mktemp(request.param)
    reference = hf_reference.build(variant, tmp / "hf", vocab_size=VOCAB, **READABLE.get(variant, {}))
    byte_level_bpe(tmp / "hf", "llama" if variant.startswith("llama") else "qwen", vocab_size=300)
    model = api.load(tmp / "hf", mesh_shape=MESH, devices=jax.devices()[:4])
    model.export_gguf(tmp / "model.gguf", "f32")
    return variant, tmp, reference, model, tmp / "model.gguf"


def test_the_file_is_the_converters_and_transformers_reads_back_the_checkpoint(exported):
    variant, tmp, reference, model, path = exported
    reader = gguf.GGUFReader(path)
    field = {f: reader.get_field(f).contents() for f in reader.fields if not f.startswith("tokenizer.ggml.t")}
    arch = ARCH[variant]
    assert field["general.architecture"] == arch and field["tokenizer.ggml.model"] == "gpt2"
    assert field["tokenizer.ggml.pre"] == ("llama-bpe" if arch == "llama" else "qwen2")
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    state = {k: v.numpy() for k, v in reference.state_dict().items()}
    config = reference.config
    q, k = state["model.layers.1.self_attn.q_proj.weight"], state["model.layers.1.self_attn.k_proj.weight"]
    if arch == "llama":  # Q and K rows permuted; llama3's divisors as the converter computes them
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        np.testing.assert_array_equal(tensors["blk.1.attn_q.weight"], converter_permute(q, heads, heads))
        np.testing.assert_array_equal(tensors["blk.1.attn_k.weight"], converter_permute(k, heads, kv))
        rope = config.rope_parameters
        np.testing.assert_allclose(
            tensors["rope_freqs.weight"],
            converter_rope_freqs(
                rope["rope_theta"],
                config.head_dim,
                rope["factor"],
                rope["low_freq_factor"],
                rope["high_freq_factor"],
                rope["original_max_position_embeddings"],
            ),
            rtol=1e-6,
        )
    else:
        np.testing.assert_array_equal(tensors["blk.1.attn_q.weight"], q)
    if variant == "qwen2":
        np.testing.assert_array_equal(
            tensors["blk.1.attn_q.bias"], state["model.layers.1.self_attn.q_proj.bias"]
        )
    if variant == "qwen3_yarn":
        assert (field["qwen3.rope.scaling.type"], field["qwen3.rope.scaling.factor"]) == ("yarn", 4.0)
        assert field["qwen3.rope.scaling.original_context_length"] == 8
    if variant == "qwen3_moe":
        assert (field["qwen3moe.expert_count"], field["qwen3moe.expert_used_count"]) == (8, 2)
        gate_up = state["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2M, D]
        np.testing.assert_array_equal(tensors["blk.1.ffn_gate_exps.weight"], gate_up[:, :768])
        np.testing.assert_array_equal(tensors["blk.1.ffn_up_exps.weight"], gate_up[:, 768:])

    # transformers' GGUF loader gets the checkpoint's own tensors back (it undoes Llama's permutation)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp, gguf_file=path.name, dtype=torch.float32)
    assert type(back).__name__ == type(reference).__name__
    for name, tensor in back.state_dict().items():
        if name in state:
            np.testing.assert_array_equal(tensor.numpy(), state[name], err_msg=name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp, gguf_file=path.name)
    original = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp / "hf" / "tokenizer.json"))
    for probe in PROBES:
        want = original.encode(probe, add_special_tokens=False)
        assert model.tokenizer.encode(probe) == want, probe
        assert tokenizer.encode(probe, add_special_tokens=False) == want, probe


def test_our_import_gives_the_logits_and_the_tokenizer_back(exported):
    variant, tmp, _, model, path = exported
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, SEQ))  # past the scaled RoPE's context
    back = api.load(path, mesh_shape=MESH, devices=jax.devices()[:4])
    assert back.config.rope_scaling == model.config.rope_scaling
    np.testing.assert_allclose(back.logits(tokens), model.logits(tokens), atol=1e-6, rtol=0)
    model.export_gguf(tmp / "f16.gguf", "f16")
    half = api.load(tmp / "f16.gguf", mesh_shape=MESH, devices=jax.devices()[:4])
    rounded = jax.tree_util.tree_map_with_path(  # norms and biases stay float32: 1-D tensors in a GGUF
        lambda p, x: (
            x
            if "norm" in jax.tree_util.keystr(p) or "bias" in jax.tree_util.keystr(p)
            else x.astype(np.float16).astype(np.float32)
        ),
        model.params,
    )
    np.testing.assert_allclose(
        half.logits(tokens),
        api.LoadedModel(model.config, model.mesh, rounded).logits(tokens),
        atol=1e-5,
        rtol=0,
    )
    if variant in ("qwen2", "qwen3_moe"):  # transformers' GGUF loader reads all of these two files
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            tmp, gguf_file="f16.gguf", dtype=torch.float32
        )
        np.testing.assert_allclose(
            hf_reference.logits(reference.eval(), tokens), half.logits(tokens), atol=1e-3, rtol=0
        )
    ours, theirs = back.tokenizer, model.tokenizer
    assert [ours.encode(p) for p in PROBES] == [theirs.encode(p) for p in PROBES]
    assert (ours.bos_id, ours.eos_id, ours.add_bos) == (theirs.bos_id, theirs.eos_id, theirs.add_bos)
    assert ours.add_bos == variant.startswith("llama")  # Qwen's have no BOS: nothing is prepended
    assert back.stop_ids == (model.tokenizer.eos_id,)  # config.json's other EOS ids: not in a GGUF


def test_merges_that_do_not_parse_and_an_unknown_pre_are_one_line(tmp_path):
    from tunix_train.data.tokenizer import load_tokenizer

    for key, value, words in (
        ("tokenizer.ggml.merges", ["a b", "ab"], r"tokenizer.ggml.merges\[1\] 'ab' is not two tokens"),
        ("tokenizer.ggml.merges", ["a zz"], r"tokenizer.ggml.merges\[0\] 'a zz' is not two tokens"),
        ("tokenizer.ggml.pre", "deepseek-llm", "tokenizer.ggml.pre='deepseek-llm' is a pre-tokenizer"),
    ):
        path = tmp_path / "t.gguf"
        writer = gguf.GGUFWriter(str(path), "qwen2")
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(value if key == "tokenizer.ggml.pre" else "qwen2")
        writer.add_token_list(["a", "b", "ab", "<|im_end|>"])
        writer.add_token_types([1, 1, 1, 3])
        writer.add_token_merges(value if key == "tokenizer.ggml.merges" else ["a b"])
        writer.add_eos_token_id(3)
        writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(ConfigError, match=words) as err:
            load_tokenizer(path, 8)
        assert "\n" not in str(err.value)


def test_a_pre_tokenizer_llama_cpp_does_not_name_is_refused(tmp_path):
    from tokenizers import pre_tokenizers

    from tunix_train.data.tokenizer import HFTokenizer, tokenizer_json

    backend = tokenizer_json(byte_level_bpe(tmp_path, "qwen", vocab_size=300) / "tokenizer.json")._tokenizer
    assert HFTokenizer(backend, tmp_path, -1, 1, -1).gguf_bpe()[0] == "qwen2"
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(use_regex=False)]
    )
    with pytest.raises(ConfigError, match="none that llama.cpp names .*export a Hugging Face checkpoint"):
        HFTokenizer(backend, tmp_path, -1, 1, -1).gguf_bpe()


@pytest.mark.slow  # two LoRA runs
def test_qlora_over_a_gguf_llama_base_and_its_adapters_as_llama_cpp_applies_them(tmp_path):
    """QLoRA over a q8_0 Llama file's own blocks: the permuted Q and K rows are read back in
    transformers' order, so the base dequantized in the step is the dense one and so are the
    losses; the adapters, as llama.cpp's adapter GGUF, merge onto the file's (permuted) weights."""
    from conftest import config, read_metrics
    from flax import nnx
    from gguf import quants
    from test_hf import model_overrides

    from tunix_train.interop import hf
    from tunix_train.train.loop import train

    hf_reference.build("llama", tmp_path / "hf", vocab_size=VOCAB)
    byte_level_bpe(tmp_path / "hf", "llama", vocab_size=300)
    base = api.load(tmp_path / "hf", devices=jax.devices()[:1])
    base.export_gguf(tmp_path / "base.gguf", "q8_0")
    fields = hf.model_fields_from_hf(hf.read_hf_config(tmp_path / "hf"))
    runs = {}
    for kind in ("none", "gguf"):
        cfg = config(
            "model=llama_tiny",
            *model_overrides(fields),
            f"model.init_from={tmp_path / 'base.gguf'}",
            "training.lora.rank=4",
            "training.lora.alpha=8",
            "training.lora.targets=[q,k,v,o,gate,up,down]",
            f"training.lora.base_quantization={kind}",
            "training.max_steps=3",
            "training.log_every=1",
            "training.learning_rate=1e-2",
            "training.eval_every=0",
        )
        cfg.model.mesh_shape = MESH
        state = train(cfg, tmp_path / kind, devices=jax.devices()[:4])
        losses = [m["loss"] for m in read_metrics(tmp_path / kind) if "loss" in m]
        runs[kind] = (dict(nnx.to_flat_state(state.frozen)), losses)
    (dense, dense_losses), (blocks, losses) = runs["none"], runs["gguf"]
    for name in ("q_DNH", "k_DKH"):
        held = blocks[("layers", "attn", name)].get_value()
        assert held.kind == "gguf"
        np.testing.assert_array_equal(
            np.asarray(held.dequantized()), np.asarray(dense[("layers", "attn", name)][...])
        )
    np.testing.assert_allclose(losses, dense_losses, atol=1e-5)

    model = api.load(tmp_path / "gguf", devices=jax.devices()[:1])
    model.export_adapters(tmp_path / "adapter.gguf", format="gguf", dtype="f32")
    model.tokenizer = base.tokenizer  # a run on synthetic data keeps none
    model.export_gguf(tmp_path / "merged.gguf", "f32")

    def read(name):
        return {t.name: t for t in gguf.GGUFReader(tmp_path / name).tensors}

    lora = {n: np.asarray(t.data) for n, t in read("adapter.gguf").items()}
    base_w, merged_w = read("base.gguf"), read("merged.gguf")
    adapted = [n.removesuffix(".lora_a") for n in lora if n.endswith(".lora_a")]
    assert len(adapted) == 7 * fields["num_layers"] and "blk.0.attn_k.weight" in adapted
    for name in adapted:
        w = quants.dequantize(base_w[name].data, base_w[name].tensor_type)
        np.testing.assert_allclose(
            w + 2.0 * lora[name + ".lora_b"] @ lora[name + ".lora_a"],
            np.asarray(merged_w[name].data),
            atol=1e-5,
            err_msg=name,
        )


def test_a_damaged_rope_freqs_or_yarn_key_is_one_line(tmp_path):
    from tunix_train.interop import gguf_llama

    for factors in (np.ones(3), np.array([1.0, -2.0, 8.0, 8.0]), np.array([1.0, np.nan, 8.0, 8.0])):
        with pytest.raises(ConfigError, match="rope_freqs.weight holds .* the file is damaged"):
            gguf_llama.llama3_scaling(factors, 5e5, 8, tmp_path / "m.gguf")

    def key(name, default=None):
        return {"embedding_length": 64, "attention.head_count": 4, "rope.scaling.type": "yarn"}.get(
            name, default
        )

    from tunix_train.interop import families

    def field(name, default=None):
        return key(name.removeprefix("qwen3."), default)

    file = families.GgufFile("qwen3", field, frozenset(), lambda n: (64, 320), None, tmp_path / "m.gguf")
    with pytest.raises(ConfigError, match="yarn RoPE scaling without qwen3.rope.scaling.factor"):
        families.named("qwen3").gguf.fields(file)
