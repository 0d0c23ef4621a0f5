"""Mistral and Phi-3, each one module of interop/families/ and nothing else in the package: tiny
random transformers models (windowed and not) match transformers' logits on one device and fsdp2 x
tp2 (test_llama_qwen.py's parity test runs them); our export loads back in transformers with the
same logits (Phi-3's q, k, v and gate, up fused as its checkpoints hold them); a GGUF round trip
writes what llama.cpp's converter writes (Mistral as `llama` with Llama's Q/K permutation, Phi-3's
fused attn_qkv and ffn_up), transformers' GGUF loader reads the checkpoint's tensors back, and our
reader gives the same logits and tells Mistral from Llama; LoRA adapters load in PEFT (Phi-3's as
adapters of its fused modules) with our logits; the tiny configs train on fsdp2 x tp2 as on one
device."""

import json

import gguf
import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="these tests need torch: pip install -e '.[reference]'")
transformers = pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[reference]'")

import hf_reference  # noqa: E402
from bpe_files import byte_level_bpe  # noqa: E402
from conftest import config  # noqa: E402
from hf_reference import SEQ, SIZES, WINDOW  # noqa: E402
from test_gguf_families import converter_permute  # noqa: E402

from tunix_train import api  # noqa: E402
from tunix_train.interop import hf  # noqa: E402

MESH = [[2, 2], ["fsdp", "tp"]]
VOCAB = 320  # a byte-level BPE needs its 256 bytes; the tokenizer has 300 tokens, the rest is padding


def _tokens(vocab=SIZES["vocab_size"]):
    return np.random.default_rng(0).integers(0, vocab, (2, SEQ))


def _load(path):
    return api.load(path, mesh_shape=MESH, devices=jax.devices()[:4])


@pytest.mark.parametrize("variant", ["mistral", "phi3"])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, variant):
    reference = hf_reference.checkpoint_and_logits(variant, tmp_path / "checkpoint", _tokens())
    model = _load(tmp_path / "checkpoint")
    assert (model.config.local_layers_per_global, model.config.sliding_window) == (
        SIZES["num_hidden_layers"],
        WINDOW,
    )
    model.export(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["sliding_window"]) == (variant, WINDOW)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == {"mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM"}[variant]
    np.testing.assert_allclose(hf_reference.logits(back, _tokens()), reference, atol=1e-5, rtol=0)
    from safetensors import safe_open

    names = set(safe_open(str(tmp_path / "out" / "model.safetensors"), "np").keys())
    fused = variant == "phi3"  # as Phi-3's checkpoints hold them
    assert ("model.layers.0.self_attn.qkv_proj.weight" in names) == fused
    assert ("model.layers.0.mlp.gate_up_proj.weight" in names) == fused
    assert ("model.layers.0.self_attn.q_proj.weight" in names) == (not fused)


@pytest.fixture(scope="module", params=["mistral", "mistral_full", "phi3"])
def exported(request, tmp_path_factory):
    """(variant, directory, the transformers model, our model of it, the f32 GGUF we wrote)."""
    variant, tmp = request.param, tmp_path_factory.mktemp(request.param)
    reference = hf_reference.build(variant, tmp / "hf", vocab_size=VOCAB)
    byte_level_bpe(tmp / "hf", "llama", vocab_size=300)
    model = _load(tmp / "hf")
    model.export_gguf(tmp / "model.gguf", "f32")
    return variant, tmp, reference, model, tmp / "model.gguf"


def test_the_gguf_is_the_converters_and_both_readers_get_the_model_back(exported):
    variant, tmp, reference, model, path = exported
    reader = gguf.GGUFReader(path)
    field = {f: reader.get_field(f).contents() for f in reader.fields if not f.startswith("tokenizer.ggml.t")}
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    state = {k: v.numpy() for k, v in reference.state_dict().items()}
    layer = "model.layers.1."
    if variant.startswith("mistral"):  # llama.cpp's `llama`, Q and K permuted as its Llama's
        assert (field["general.architecture"], field["general.basename"]) == ("llama", "Mistral")
        assert field["llama.attention.sliding_window"] == (WINDOW if variant == "mistral" else 0)
        heads, kv = reference.config.num_attention_heads, reference.config.num_key_value_heads
        q, k = state[layer + "self_attn.q_proj.weight"], state[layer + "self_attn.k_proj.weight"]
        np.testing.assert_array_equal(tensors["blk.1.attn_q.weight"], converter_permute(q, heads, heads))
        np.testing.assert_array_equal(tensors["blk.1.attn_k.weight"], converter_permute(k, heads, kv))
    else:  # Phi3MiniModel's keys; q, k, v and gate, up fused and not permuted
        assert field["general.architecture"] == "phi3"
        assert (field["phi3.attention.sliding_window"], field["phi3.rope.dimension_count"]) == (WINDOW, 16)
        assert (
            field["phi3.rope.scaling.original_context_length"]
            == reference.config.original_max_position_embeddings
        )
        np.testing.assert_array_equal(
            tensors["blk.1.attn_qkv.weight"], state[layer + "self_attn.qkv_proj.weight"]
        )
        np.testing.assert_array_equal(
            tensors["blk.1.ffn_up.weight"], state[layer + "mlp.gate_up_proj.weight"]
        )
        assert "blk.1.attn_q.weight" not in tensors and "blk.1.ffn_gate.weight" not in tensors

    # transformers' GGUF loader gets the checkpoint's tensors back (Mistral's as a Llama: its file says
    # llama); Phi3Config's default pad id (32000) lies past this vocabulary
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp, gguf_file=path.name, dtype=torch.float32, pad_token_id=0
    )
    read = back.state_dict()
    assert set(read) == set(state)
    for name, tensor in read.items():
        np.testing.assert_array_equal(tensor.numpy(), state[name], err_msg=name)

    ours = _load(path)
    assert ours.config.family == variant.removesuffix("_full")  # Mistral told from Llama
    assert ours.config.sliding_window == model.config.sliding_window
    tokens = _tokens(VOCAB)
    np.testing.assert_allclose(ours.logits(tokens), model.logits(tokens), atol=1e-6, rtol=0)


def _cached_greedy(model, prompt, new_tokens):
    """transformers' forward with a KV cache, greedily, a token at a time: each step's RoPE factors
    are its own call's, the cached keys as they were rotated (the engine's semantics)."""
    import torch

    cache, ids, position, out = transformers.DynamicCache(config=model.config), torch.tensor(prompt), 0, []
    with torch.no_grad():
        for _ in range(new_tokens):
            positions = torch.arange(position, position + ids.shape[1])[None]
            logits = model(
                input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True
            ).logits
            out.append(int(logits[0, -1].argmax()))
            position, ids = position + ids.shape[1], torch.tensor([[out[-1]]])
    return out


def test_longrope_logits_short_and_long_and_greedy_tokens_equal_transformers(tmp_path):
    """Phi-3's LongRoPE (tiny, a pre-training context of 8): on fsdp2 x tp2, the logits of 6 tokens
    (short factors) and of 16 (long factors at every position) equal transformers' (1e-4). Greedy
    tokens equal transformers' generate for a request that stays within the context or starts past
    it; for one that crosses it while generating they equal transformers' forward with a KV cache
    (each step's factors its own, the cached keys kept), which generate is not: Phi-3's generate
    recomputes the whole cache with the long factors once (docs/models.md). The export reads back
    in transformers with the same logits."""
    from tunix_train.config import ConfigError, RopeScalingType

    tokens = _tokens()
    reference = {
        n: hf_reference.checkpoint_and_logits("phi3_longrope", tmp_path / "checkpoint", tokens[:, :n])
        for n in (6, SEQ)
    }
    assert np.abs(reference[SEQ][:, :6] - reference[6]).max() > 1e-2  # the two factor sets differ
    model = _load(tmp_path / "checkpoint")
    scaling = model.config.rope_scaling
    assert (scaling.type, scaling.original_context, scaling.factor) == (RopeScalingType.longrope, 8, 4.0)
    for n, expected in reference.items():
        np.testing.assert_allclose(model.logits(tokens[:, :n]), expected, atol=1e-4, rtol=0, err_msg=str(n))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint").eval()
    for length, new in ((3, 5), (10, 5)):  # within the context throughout; past it from the start
        prompt = tokens[:1, :length]
        assert model.generate(prompt.tolist(), max_new_tokens=new) == [
            hf_reference.greedy(theirs, prompt, new).tolist()
        ]
    for length in (6, 8):  # crossing it while generating
        prompt = tokens[:1, :length]
        assert model.generate(prompt.tolist(), max_new_tokens=6) == [_cached_greedy(theirs, prompt, 6)]
    model.export(tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    np.testing.assert_allclose(hf_reference.logits(back, tokens), reference[SEQ], atol=1e-5, rtol=0)
    with pytest.raises(ConfigError, match="llama.cpp keeps LongRoPE's factors as tensors of its own"):
        model.export_gguf(tmp_path / "model.gguf", "f32")


def test_longrope_with_cp_is_one_line_and_a_window_never_reached_is_none():
    """A cp shard does not see its sequence's length, which LongRoPE picks its factors by; and
    Phi-3-mini-128k's sliding_window (262144, past its 131072 positions) is no window."""
    from tunix_train.config import ConfigError
    from tunix_train.interop import families
    from tunix_train.train.setup import setup

    factors = "[" + ",".join(["1.0"] * 8) + "]"
    cfg = config(
        "model=phi3_tiny",
        "model.local_layers_per_global=0",
        "model.sliding_window=null",
        "model.rope_scaling.type=longrope",
        "model.rope_scaling.factor=4.0",
        "model.rope_scaling.original_context=8",
        f"model.rope_scaling.short_factor={factors}",
        f"model.rope_scaling.long_factor={factors}",
        "model.mesh_shape=[[2,2],[fsdp,cp]]",
    )
    with pytest.raises(ConfigError, match="longrope picks its factors by each sequence's length"):
        setup(cfg, jax.devices()[:4])
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    hf = {**SIZES, "sliding_window": 262144, "max_position_embeddings": 131072, "rope_scaling": rope}
    fields = families.named("phi3").from_hf({**hf, "original_max_position_embeddings": 4096})
    assert (fields["local_layers_per_global"], fields["sliding_window"]) == (0, None)
    assert fields["rope_scaling"].factor == 32.0


@pytest.mark.parametrize("window", ["4096", -5, 2.5, True])
def test_a_sliding_window_key_that_is_no_count_is_one_line(tmp_path, window):
    from tunix_train.config import ConfigError
    from tunix_train.interop import families

    def field(name, default=None):
        return {"llama.attention.sliding_window": window}.get(name, default)

    file = families.GgufFile("llama", field, frozenset(), lambda n: (64, 320), None, tmp_path / "m.gguf")
    with pytest.raises(ConfigError, match="llama.attention.sliding_window is .* not a count of tokens"):
        families.named("mistral").gguf.claims(file)


GGUF_SIZES = {
    "block_count": 2,
    "embedding_length": 64,
    "feed_forward_length": 96,
    "attention.head_count": 4,
    "attention.head_count_kv": 2,
    "context_length": 32,
}


@pytest.mark.parametrize(
    "rope", [{"rope_type": "yarn", "factor": 4.0}, {"rope_type": "linear", "factor": 2.0}]
)
def test_a_window_with_a_scaled_rope_is_one_line_both_ways(tmp_path, rope):
    """transformers' Mistral stretches every layer's RoPE; the decoder stretches only its global
    layers': a config.json with both, or a windowed model with a scaled RoPE to export, is refused
    rather than read with unscaled local layers."""
    from tunix_train.config import ConfigError, RopeScaling, RopeScalingType
    from tunix_train.interop import families

    hf = {
        **SIZES,
        "sliding_window": 5,
        "max_position_embeddings": 32,
        "rope_scaling": {**rope, "original_max_position_embeddings": 8},
    }
    with pytest.raises(ConfigError, match=f"sliding_window=5 with a scaled RoPE \\({rope['rope_type']}\\)"):
        families.named("mistral").from_hf(hf)
    cfg = config("model=mistral_tiny").model
    cfg.rope_scaling = RopeScaling(type=RopeScalingType.yarn, factor=4.0, original_context=8)
    with pytest.raises(ConfigError, match="mistral checkpoints stretch every layer's RoPE"):
        families.named("mistral").to_hf(cfg)
    values = {  # a Mistral GGUF (llama.cpp's `llama`) with both
        **{f"llama.{key}": value for key, value in GGUF_SIZES.items()},
        "llama.attention.sliding_window": 5,
        "llama.rope.scaling.type": "yarn" if rope["rope_type"] == "yarn" else "linear",
        "llama.rope.scaling.factor": rope["factor"],
        "llama.rope.scaling.original_context_length": 8,
    }
    file = families.GgufFile(
        "llama", values.get, frozenset({"token_embd.weight"}), lambda n: (64, 128), None, tmp_path / "m.gguf"
    )
    with pytest.raises(ConfigError, match="llama.attention.sliding_window=5 with a scaled RoPE"):
        families.named("mistral").gguf.fields(file)


@pytest.mark.slow  # a LoRA training each, checked with peft
@pytest.mark.parametrize("variant", ["mistral", "phi3"])
def test_lora_adapters_load_in_peft_with_our_logits(tmp_path, variant):
    """LoRA on every projection over a transformers base; Phi-3's q, k, v (and gate, up) adapters
    leave as one adapter of its fused module (peft.fused_tensors)."""
    pytest.importorskip("peft")
    from conftest import config
    from peft import PeftModel
    from test_hf import model_overrides

    from tunix_train.train.loop import train

    hf_reference.build(variant, tmp_path / "base")
    fields = hf.model_fields_from_hf(hf.read_hf_config(tmp_path / "base"))
    cfg = config(
        f"model={variant}_tiny",
        *model_overrides(fields),
        f"model.init_from={tmp_path / 'base'}",
        f"model.mesh_shape={json.dumps(MESH)}",
        "training.lora.rank=4",
        "training.lora.alpha=8",
        "training.lora.targets=[q,k,v,o,gate,up,down]",
        "training.max_steps=3",
        "training.warmup_steps=0",
        "training.learning_rate=1e-2",
        "training.eval_every=0",
    )
    train(cfg, tmp_path / "run", devices=jax.devices()[:4])
    model = _load(tmp_path / "run")
    model.export_adapters(tmp_path / "adapters")
    adapter = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    if variant == "phi3":
        assert sorted(adapter["target_modules"]) == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
        assert adapter["rank_pattern"] == {"qkv_proj": 12, "gate_up_proj": 8}
    tokens = _tokens()
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
        plain = hf_reference.logits(base, tokens)
        theirs = hf_reference.logits(PeftModel.from_pretrained(base, tmp_path / "adapters").eval(), tokens)
    assert np.abs(theirs - plain).max() > 1e-2  # the adapters change the model
    np.testing.assert_allclose(model.logits(tokens), theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["mistral_tiny", "phi3_tiny"])
def test_the_tiny_configs_train_on_fsdp2_tp2_as_on_one_device(tmp_path, name):
    from conftest import losses_on_one_device_and_fsdp2_tp2

    runs = losses_on_one_device_and_fsdp2_tp2(tmp_path, f"model={name}")
    assert len(runs["one"]) == 3 and np.all(np.isfinite(runs["one"]))
    np.testing.assert_allclose(runs["fsdp2_tp2"], runs["one"], rtol=1e-5)
