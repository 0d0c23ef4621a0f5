"""The three tokenizer sources against transformers, token for token: a SentencePiece model, a
tokenizer.json, and a GGUF file's vocabulary (the bundled 4,096-piece BPE, written into each)."""

import json
import shutil

import gguf
import pytest

transformers = pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[reference]'")

from tunix_train.config import ConfigError  # noqa: E402
from tunix_train.data.tokenizer import BUNDLED_TOKENIZER, load_tokenizer, with_bos  # noqa: E402

PROBES = [
    "To be, or not to be: that is the question.",
    "  two leading spaces and\ttabs\t\there",
    "lines\n\nand\r\nbreaks\n",
    "accents: café, naïve, Ærø, Ångström",
    "CJK: 你好，世界。日本語のテキスト",
    "emoji: 🤗🚀👩‍👩‍👧 and ½ ∑ ≠",
    "ROMEO:\nBut, soft! what light through yonder window breaks?",
]


def _gguf_with_the_bundled_vocabulary(path):
    """A GGUF holding the bundled tokenizer's pieces as llama.cpp writes a SentencePiece vocabulary."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(BUNDLED_TOKENIZER))
    pieces = range(sp.vocab_size())
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in pieces])
    writer.add_token_scores([sp.get_score(i) for i in pieces])
    kinds = [3 if sp.is_control(i) else 2 if sp.is_unknown(i) else 6 if sp.is_byte(i) else 1 for i in pieces]
    writer.add_token_types(kinds)
    writer.add_bos_token_id(sp.bos_id()), writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id()), writer.add_pad_token_id(sp.pad_id())
    (
        writer.write_header_to_file(),
        writer.write_kv_data_to_file(),
        writer.write_tensors_to_file(),
        writer.close(),
    )
    return path


def _assert_like(ours, reference, probes=PROBES):
    for text in probes:
        ids = ours.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == text
    assert (ours.bos_id, ours.eos_id) == (reference.bos_token_id, reference.eos_token_id)


def test_a_gguf_vocabulary_tokenizes_like_transformers_gguf_conversion(tmp_path):
    path = _gguf_with_the_bundled_vocabulary(tmp_path / "vocab.gguf")
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="vocab.gguf")
    ours = load_tokenizer(path, 4096)
    _assert_like(ours, reference)
    assert ours.pad_id == reference.pad_token_id == 0


def test_a_tokenizer_json_tokenizes_like_transformers(tmp_path):
    _gguf_with_the_bundled_vocabulary(tmp_path / "vocab.gguf")
    transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="vocab.gguf").save_pretrained(
        tmp_path / "hf"
    )
    assert (tmp_path / "hf" / "tokenizer.json").is_file() and not (
        tmp_path / "hf" / "tokenizer.model"
    ).exists()
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    # transformers adds the Gemma special tokens it misses (<bos>, <eos>, <mask>): 4,099 tokens
    _assert_like(load_tokenizer(tmp_path / "hf", 4099), reference)  # the directory: its tokenizer.json
    _assert_like(load_tokenizer(tmp_path / "hf" / "tokenizer.json", 4099), reference)


def test_a_sentencepiece_model_tokenizes_like_transformers(tmp_path):
    shutil.copy(BUNDLED_TOKENIZER, tmp_path / "tokenizer.model")
    reference = transformers.LlamaTokenizer.from_pretrained(tmp_path, legacy=False)
    # One known difference, transformers' and not ours (we run SentencePiece itself): for a model that
    # adds a dummy prefix, as the bundled one does (Gemma's does not), transformers' conversion
    # tokenizes a leading run of spaces differently from SentencePiece.
    leading_spaces = [p for p in PROBES if p.startswith("  ")]
    _assert_like(
        load_tokenizer(tmp_path / "tokenizer.model", 4096),
        reference,
        [p for p in PROBES if p not in leading_spaces],
    )
    assert all(
        reference.encode(p, add_special_tokens=False)
        != load_tokenizer(tmp_path / "tokenizer.model", 4096).encode(p)
        for p in leading_spaces
    )


def test_a_tokenizer_larger_than_the_model_is_one_line(tmp_path):
    path = _gguf_with_the_bundled_vocabulary(tmp_path / "vocab.gguf")
    with pytest.raises(Exception) as err:
        load_tokenizer(path, 1000, "model.init_from")
    assert str(err.value) == (
        f"model.init_from: {path} has 4096 tokens but model.vocab_size=1000; set "
        f"model.vocab_size >= 4096 or use the model's own tokenizer"
    )


def test_a_saved_tokenizer_loads_in_transformers_with_bos_in_front(tmp_path):
    ours = load_tokenizer(_gguf_with_the_bundled_vocabulary(tmp_path / "vocab.gguf"), 4096)
    (tmp_path / "saved").mkdir()
    ours.save(tmp_path / "saved")
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path / "saved")
    for text in PROBES:
        assert reference(text).input_ids == [ours.bos_id, *ours.encode(text)]
    _assert_like(load_tokenizer(tmp_path / "saved", 4096), reference)


def test_offsets_and_chat_encoding_take_linear_time():
    """A user message of 100 K and of 400 K characters (the server's bodies are up to 2 MiB): four
    times the text costs about four times the time (it cost sixteen when each piece's offsets were
    found by decoding the text before it). The fastest of three runs of each, bounded at 8x."""
    import time

    from tunix_train.data.chat import GEMMA_TEMPLATE, ChatTemplate
    from tunix_train.data.tokenizer import BUNDLED_TOKENIZER, load_tokenizer

    tokenizer = load_tokenizer(BUNDLED_TOKENIZER, 4096)
    chat = ChatTemplate(GEMMA_TEMPLATE, "Gemma's turn format", tokenizer)

    def seconds(chars: int) -> float:
        text = ("Speak, é, 世界 " * (chars // 14 + 1))[:chars]
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            ids, _ = chat.encode([{"role": "user", "content": text}, {"role": "assistant", "content": "Ay."}])
            runs.append(time.perf_counter() - start)
        assert len(ids) > chars // 4
        return min(runs)

    assert seconds(400_000) < 8 * seconds(100_000)


@pytest.mark.parametrize("kind", ["qwen", "llama"])
def test_a_byte_level_bpe_tokenizes_like_transformers_and_saves_as_it_came(tmp_path, kind):
    """Qwen's and Llama 3's tokenizer.json: byte-level BPE; BOS only where the tokenizer has one."""
    from bpe_files import byte_level_bpe

    directory = byte_level_bpe(tmp_path / kind, kind)
    ours, reference = load_tokenizer(directory, 600), transformers.AutoTokenizer.from_pretrained(directory)
    for text in PROBES:
        ids = ours.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False) and ours.decode(ids) == text, text
        # what training and generation feed the model: transformers' own encoding, BOS and all
        assert with_bos(ours, ids) == reference(text).input_ids, text
    assert ours.eos_id == reference.eos_token_id
    if kind == "qwen":  # no BOS: nothing prepended
        assert reference.bos_token_id is None and not ours.add_bos
    else:
        assert ours.add_bos and ours.bos_id == reference.bos_token_id is not None
    (tmp_path / "saved").mkdir()
    ours.save(tmp_path / "saved")
    again = transformers.AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert type(again) is type(reference)
    for text in PROBES:
        assert again(text).input_ids == with_bos(ours, ours.encode(text)), text


def test_a_tokenizer_json_that_does_not_parse_is_one_line(tmp_path):
    from bpe_files import byte_level_bpe

    directory = byte_level_bpe(tmp_path / "qwen", "qwen")
    broken = json.loads((directory / "tokenizer.json").read_text())
    broken["model"]["merges"] = [["a"]] + broken["model"]["merges"]  # a merge of one piece
    (directory / "tokenizer.json").write_text(json.dumps(broken))
    with pytest.raises(
        ConfigError, match=f"data.tokenizer: {directory / 'tokenizer.json'} is not a tokenizer.json"
    ) as err:
        load_tokenizer(directory, 600)
    assert "\n" not in str(err.value)


def test_a_saved_sentencepiece_model_loads_in_transformers_as_it_tokenizes(tmp_path):
    """Saved beside any family's config.json (a Qwen one would make transformers pick a BPE class),
    the bundled model comes back through the class its tokenizer_config.json names, BOS in front."""
    ours = load_tokenizer(BUNDLED_TOKENIZER, 4096)
    (tmp_path / "saved").mkdir()
    ours.save(tmp_path / "saved")
    (tmp_path / "saved" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert type(reference).__name__ == "LlamaTokenizer"
    # as in test_a_sentencepiece_model_tokenizes_like_transformers: a leading run of spaces differs
    for text in [p for p in PROBES if not p.startswith("  ")]:
        assert reference(text).input_ids == with_bos(ours, ours.encode(text)), text
