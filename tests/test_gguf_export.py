"""GGUF export: our f32 and f16 exports read back as the model; transformers' GGUF loader reads the
f16 export of a Gemma 2 and a Gemma 3; quantized tensors are gguf.quants.quantize's bytes; the
tokenizer and the chat template read back; what cannot be written is refused, and nothing is left."""

import json
import os

import gguf
import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="these tests need torch: pip install -e '.[reference]'")
transformers = pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[reference]'")

import hf_reference  # noqa: E402
from conftest import run_python  # noqa: E402
from hf_reference import SEQ, SIZES  # noqa: E402

from tunix_train import api  # noqa: E402
from tunix_train.config import ConfigError  # noqa: E402
from tunix_train.data.chat import GEMMA_TEMPLATE  # noqa: E402
from tunix_train.interop import hf  # noqa: E402

MESH = [[2, 2], ["fsdp", "tp"]]
TEMPLATE = GEMMA_TEMPLATE.replace("model\n", "model\n\n")  # a template of its own, to see it travel
PROBES = ["Hello world", "To be, or not to be?", "<start_of_turn>user\nHi<end_of_turn>"]


def _tokenizer(directory):
    """A small SentencePiece-style BPE (the vocabulary of the test models is 128): specials, turn
    tokens, characters, a few merged pieces; and a tokenizer_config.json with a chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    pieces = (
        ["<pad>", "<eos>", "<bos>", "<unk>"]
        + list("\u2581abcdefghijklmnopqrstuvwxyzHTW,.?!\n")
        + ["\u2581t", "\u2581to", "he", "\u2581b", "\u2581be"]
    )
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = [("\u2581", "t"), ("\u2581t", "o"), ("h", "e"), ("\u2581", "b"), ("\u2581b", "e")]
    backend = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.decoder = decoders.Replace("\u2581", " ")
    backend.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t in ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
        ]
    )
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "chat_template": TEMPLATE}
        )
    )


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def source(request, tmp_path_factory):
    """(family, a random transformers model's checkpoint with our tokenizer, our model of it)."""
    tmp = tmp_path_factory.mktemp(request.param)
    hf_reference.build(request.param, tmp / "hf", for_gguf=True)
    _tokenizer(tmp / "hf")
    return request.param, tmp, api.load(tmp / "hf", mesh_shape=MESH, devices=jax.devices()[:4])


def test_our_exports_read_back_and_transformers_reads_the_f16_one(source):
    family, tmp, model = source
    tokens = np.random.default_rng(0).integers(0, SIZES["vocab_size"], (2, SEQ))
    model.export_gguf(tmp / "f32.gguf", "f32")
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp / "f32.gguf").stat().st_mode & 0o777 == 0o666 & ~umask  # a new file's mode, not mkstemp's
    exact = api.load(tmp / "f32.gguf", mesh_shape=MESH, devices=jax.devices()[:4])
    np.testing.assert_allclose(exact.logits(tokens), model.logits(tokens), atol=1e-5, rtol=0)

    model.export_gguf(tmp / "f16.gguf", "f16")
    half = api.load(tmp / "f16.gguf", mesh_shape=MESH, devices=jax.devices()[:4])
    rounded = jax.tree_util.tree_map_with_path(  # the norms stay float32, as 1-D tensors do in a GGUF
        lambda p, x: x if "norm" in jax.tree_util.keystr(p) else x.astype(np.float16).astype(np.float32),
        model.params,
    )
    as_f16 = api.LoadedModel(model.config, model.mesh, rounded)
    np.testing.assert_allclose(half.logits(tokens), as_f16.logits(tokens), atol=1e-5, rtol=0)
    assert np.abs(half.logits(tokens) - model.logits(tokens)).max() > 1e-6  # f16 did round

    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp, gguf_file="f16.gguf", dtype=torch.float32
    ).eval()
    assert type(reference).__name__ == {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[family]
    np.testing.assert_allclose(hf_reference.logits(reference, tokens), half.logits(tokens), atol=1e-3, rtol=0)

    ours, theirs = half.tokenizer, model.tokenizer
    assert [ours.encode(p) for p in PROBES] == [theirs.encode(p) for p in PROBES]
    assert (ours.bos_id, ours.eos_id, ours.pad_id, half.chat.template) == (
        theirs.bos_id,
        theirs.eos_id,
        theirs.pad_id,
        TEMPLATE,
    )
    assert half.stop_ids == model.stop_ids  # EOS and <end_of_turn>


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "bf16"])
def test_quantized_tensors_are_the_bytes_of_gguf_quants(source, dtype):
    family, tmp, model = source
    path = tmp / f"{dtype}.gguf"
    model.export_gguf(path, dtype)
    kind = gguf.GGMLQuantizationType[dtype.upper()]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[family.upper()], model.config.num_layers)
    ours = {
        names.get_name(n, try_suffixes=(".weight",)): t
        for n, t in hf.hf_tensors(model.params, model.config).items()
    }
    reader = gguf.GGUFReader(path)
    assert reader.get_field("general.file_type").contents() == int(
        gguf.LlamaFileType[f"MOSTLY_{dtype.upper()}"]
    )
    counted = 0
    for tensor in reader.tensors:
        weights = ours[tensor.name] + (1.0 if tensor.name.endswith("norm.weight") else 0.0)
        if weights.ndim == 1:
            assert tensor.tensor_type == gguf.GGMLQuantizationType.F32
            np.testing.assert_array_equal(np.asarray(tensor.data), weights)
            continue
        assert tensor.tensor_type == kind, tensor.name
        assert np.asarray(tensor.data).tobytes() == gguf.quants.quantize(weights, kind).tobytes(), tensor.name
        counted += 1
    assert counted == 1 + 7 * model.config.num_layers  # the embedding and each layer's projections


def test_what_cannot_be_written_is_refused_and_nothing_is_left(source, tmp_path):
    family, tmp, model = source
    with pytest.raises(ConfigError, match="--dtype q4_k: GGUF export writes f32, f16, bf16, q8_0, q4_0"):
        model.export_gguf(tmp_path / "m.gguf", "q4_k")
    # a query scale that GGUF readers do not assume (llama.cpp takes head_dim, 256 here)
    odd = api.LoadedModel(
        model.config.__class__(**{**vars(model.config), "query_pre_attn_scalar": 24}),
        model.mesh,
        model.params,
        model.tokenizer,
    )
    with pytest.raises(ConfigError, match="not written: a GGUF cannot hold model.query_pre_attn_scalar=24"):
        odd.export_gguf(tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []  # no file, no partial one
    (tmp_path / "m.gguf").write_bytes(b"precious")
    exported = run_python(
        "-m",
        "tunix_train.export",
        str(tmp / "hf"),
        str(tmp_path / "m.gguf"),
        "--format",
        "gguf",
        devices=1,
        timeout=300,
    )
    assert exported.returncode == 2 and (tmp_path / "m.gguf").read_bytes() == b"precious"
    assert exported.stderr.strip().splitlines() == [
        f"tunix_train.export: error: {tmp_path / 'm.gguf'} exists: pass --overwrite to replace it"
    ]
    adapters = run_python(
        "-m",
        "tunix_train.export",
        str(tmp / "hf"),
        str(tmp_path / "a.gguf"),
        "--format",
        "gguf",
        "--adapters",
        "--dtype",
        "q4_0",
        devices=1,
        timeout=300,
    )
    assert adapters.returncode == 2 and adapters.stderr.strip().splitlines() == [
        "tunix_train.export: error: --dtype q4_0: GGUF adapter export writes f32, f16, bf16, q8_0"
    ]
    with pytest.raises(ConfigError, match="this checkpoint has no LoRA adapters"):
        model.export_adapters(tmp_path / "a.gguf", format="gguf")
