"""Tokenizers: one interface over three sources.

- a SentencePiece model (`tokenizer.model`; the bundled Shakespeare tokenizer is one);
- a Hugging Face `tokenizer.json`, read with the `tokenizers` package;
- the vocabulary embedded in a GGUF file (`tokenizer.ggml.*`), rebuilt as a `tokenizers` BPE the way
  transformers' GGUF conversion builds Gemma's (integrations/gguf/gguf_tokenizer_mapping.py), or a
  byte-level BPE (Llama 3's, Qwen's: data/byte_bpe.py).

`encode` never adds BOS or EOS. BOS is the tokenizer's property: `with_bos` puts it in front of a
sequence where the tokenizer's family starts sequences with one (`add_bos`; Qwen's tokenizers have
none); EOS (`eos_id`) is required.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from tunix_train.config import ConfigError
from tunix_train.data import byte_bpe
from tunix_train.files import write_atomically, write_text

BUNDLED_TOKENIZER = Path(__file__).parent / "corpus" / "shakespeare_4k.model"


class Tokenizer(Protocol):
    path: Path
    vocab_size: int
    bos_id: int  # -1: none
    eos_id: int
    pad_id: int  # -1: none
    add_bos: bool  # whether a sequence starts with BOS (with_bos)

    def encode(self, text: str) -> list[int]: ...

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of a text whose special tokens are written out (a rendered chat template), and each
        one's character span in it."""

    def token(self, id_: int) -> str: ...

    def decode(self, ids: list[int]) -> str: ...

    def save(self, directory: Path) -> None: ...


def with_bos(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    """The ids of a sequence from its start: BOS first where the tokenizer adds one."""
    return [tokenizer.bos_id, *ids] if tokenizer.add_bos and tokenizer.bos_id >= 0 else list(ids)


class SentencePieceTokenizer:
    def __init__(self, path: Path):
        import sentencepiece as spm

        self.path = path
        self._sp = spm.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self._sp.vocab_size()
        self.bos_id, self.eos_id, self.pad_id = self._sp.bos_id(), self._sp.eos_id(), self._sp.pad_id()
        self.add_bos = self.bos_id >= 0

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """SentencePiece reads control tokens (BOS, EOS, pad) as text: the text is split at them."""
        controls = {self.token(i): i for i in (self.bos_id, self.eos_id, self.pad_id) if i >= 0}
        ids, offsets, start = [], [], 0
        for piece in re.split(f"({'|'.join(map(re.escape, controls))})", text) if controls else [text]:
            if piece in controls:
                ids.append(controls[piece])
                offsets.append((start, start + len(piece)))
            elif piece:
                # the character holding each byte offset (the end: one past the last), in one pass
                data = np.frombuffer(piece.encode("utf-8"), np.uint8)
                chars = np.append(np.cumsum((data & 0xC0) != 0x80) - 1, len(piece)).tolist()
                for p in self._sp.encode(piece, return_type="proto").pieces:
                    ids.append(p.id)
                    offsets.append((start + chars[p.begin], start + chars[p.end]))
            start += len(piece)
        return ids, offsets

    def token(self, id_: int) -> str:
        return self._sp.id_to_piece(id_)

    def gguf_vocabulary(self) -> tuple[list[str], list[float], list[int]]:
        """Pieces, scores and types (SentencePiece's, which are GGUF's) as llama.cpp writes them."""
        from sentencepiece import sentencepiece_model_pb2

        model = sentencepiece_model_pb2.ModelProto()
        model.ParseFromString(self.path.read_bytes())
        return (
            [p.piece for p in model.pieces],
            [p.score for p in model.pieces],
            [p.type for p in model.pieces],
        )

    @property
    def adds_space_prefix(self) -> bool:
        from sentencepiece import sentencepiece_model_pb2

        model = sentencepiece_model_pb2.ModelProto()
        model.ParseFromString(self.path.read_bytes())
        return model.normalizer_spec.add_dummy_prefix

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`; an id past the pieces (a model's vocabulary padded beyond its
        tokenizer's, which sampling may still draw) is no text, as the tokenizers library does."""
        return self._sp.decode([i for i in ids if 0 <= i < self.vocab_size])

    def save(self, directory: Path) -> None:
        """As tokenizer.model, where transformers and load_tokenizer find it, with a
        tokenizer_config.json naming its special tokens and the transformers class that reads it as
        SentencePiece does: GemmaTokenizer for a model without a dummy prefix (Gemma's), else
        LlamaTokenizer without its legacy handling (whatever the model's family: transformers would
        otherwise pick the family's own class, a BPE one for Qwen)."""
        write_atomically(
            directory / "tokenizer.model", lambda partial: partial.write_bytes(self.path.read_bytes())
        )

        def name(i):
            return self.token(i) if i >= 0 else None

        prefix = self.adds_space_prefix
        config = {
            "tokenizer_class": "LlamaTokenizer" if prefix else "GemmaTokenizer",
            "bos_token": name(self.bos_id),
            "eos_token": name(self.eos_id),
            "pad_token": name(self.pad_id),
            "unk_token": name(self._sp.unk_id()),
            "add_bos_token": self.add_bos,
            "add_eos_token": False,
            **({"legacy": False} if prefix else {}),
        }
        write_text(directory / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")


class HFTokenizer:
    """A `tokenizers.Tokenizer` (from tokenizer.json or a GGUF vocabulary) and its special ids."""

    def __init__(
        self,
        tokenizer,
        path: Path,
        bos_id: int,
        eos_id: int,
        pad_id: int,
        add_bos: bool = True,
        tokenizer_class: str | None = None,
    ):
        """tokenizer_class: transformers' class its tokenizer_config.json names (saved as it came);
        None: GemmaTokenizer for a SentencePiece-style vocabulary, the generic one for byte-level BPE."""
        self._tokenizer, self.path, self.tokenizer_class = tokenizer, path, tokenizer_class
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.add_bos = add_bos and bos_id >= 0

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def token(self, id_: int) -> str:
        return self._tokenizer.id_to_token(id_)

    def gguf_vocabulary(self) -> tuple[list[str], list[float], list[int]]:
        """Tokens, scores (-id: merges in vocabulary order, as gguf_tokenizer rebuilds them) and
        types: 3 control (special added tokens), 4 user-defined (other added ones), 6 byte
        (<0xNN>), 2 unknown, 1 normal."""
        added = self._tokenizer.get_added_tokens_decoder()
        unknown = getattr(self._tokenizer.model, "unk_token", None)
        tokens = [self._tokenizer.id_to_token(i) for i in range(self.vocab_size)]
        types = [
            (3 if added[i].special else 4)
            if i in added
            else 6
            if re.fullmatch(r"<0x[0-9A-F]{2}>", t)
            else 2
            if t == unknown
            else 1
            for i, t in enumerate(tokens)
        ]
        return tokens, [-float(i) for i in range(len(tokens))], types

    def gguf_bpe(self) -> tuple[str, list[str], list[int], list[str]] | None:
        """(pre, tokens, types, merges) of a byte-level BPE as a GGUF holds it; None for another kind."""
        return byte_bpe.gguf_fields(self._tokenizer, self.vocab_size, self.path)

    adds_space_prefix = False  # Gemma's tokenizer.json adds none

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def save(self, directory: Path) -> None:
        """As tokenizer.json, which puts BOS in front as transformers' Gemma tokenizers do, with a
        tokenizer_config.json naming its special tokens."""
        from tokenizers import Tokenizer as Backend
        from tokenizers import processors

        def name(i):
            return self._tokenizer.id_to_token(i) if i >= 0 else None

        saved = Backend.from_str(self._tokenizer.to_str())
        bos = name(self.bos_id)
        if self.add_bos:
            saved.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, self.bos_id)]
            )
        write_atomically(directory / "tokenizer.json", lambda partial: saved.save(str(partial)))
        config = {
            "bos_token": name(self.bos_id),
            "eos_token": name(self.eos_id),
            "pad_token": name(self.pad_id),
            "add_bos_token": self.add_bos,
            "tokenizer_class": self.tokenizer_class or self._default_class(),
        }
        write_text(directory / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")

    def _default_class(self) -> str:
        byte_level = '"ByteLevel"' in json.dumps(json.loads(self._tokenizer.to_str()).get("pre_tokenizer"))
        return "PreTrainedTokenizerFast" if byte_level else "GemmaTokenizer"


def tokenizer_json(path: Path) -> HFTokenizer:
    """tokenizer.json, its special tokens named by tokenizer_config.json beside it (a null one: none),
    else Gemma's (<bos>, <eos>, <pad>); BOS is added unless the config's add_bos_token is false."""
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_file(str(path))
    names = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
    config = path.parent / "tokenizer_config.json"
    settings = json.loads(config.read_text()) if config.is_file() else {}
    for key in names:
        if key in settings:
            value = settings[key]
            names[key] = value["content"] if isinstance(value, dict) else value
    ids = {key: backend.token_to_id(name) if name else None for key, name in names.items()}
    if ids["eos_token"] is None:
        raise ConfigError(f"{path}: no EOS token ({names['eos_token']!r}) in its vocabulary")
    return HFTokenizer(
        backend,
        path,
        ids["bos_token"] if ids["bos_token"] is not None else -1,
        ids["eos_token"],
        ids["pad_token"] if ids["pad_token"] is not None else -1,
        add_bos=settings.get("add_bos_token", True) is not False,
        tokenizer_class=settings.get("tokenizer_class"),
    )


def gguf_tokenizer(reader, path: Path) -> HFTokenizer:
    """The Gemma SentencePiece-style BPE a GGUF file describes (tokenizer.ggml.model = llama):
    byte fallback, spaces as U+2581, merges rebuilt from the vocabulary in file order (Gemma files
    list none, and their scores do not follow the merge order), control tokens kept whole."""
    from tokenizers import AddedToken, decoders, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import BPE

    def field(key):
        return None if reader.get_field(key) is None else reader.get_field(key).contents()

    def special(key, default):
        return field(f"tokenizer.ggml.{key}") if field(f"tokenizer.ggml.{key}") is not None else default

    kind = field("tokenizer.ggml.model")
    if kind not in ("llama", "gpt2") or field("tokenizer.ggml.tokens") is None:
        raise ConfigError(
            f"{path}: no SentencePiece-style or byte-level BPE vocabulary (tokenizer.ggml.model="
            f"{kind!r}); pass data.tokenizer"
        )
    if kind == "gpt2":  # Llama 3's and Qwen's byte-level BPE
        backend, pre = byte_bpe.from_gguf(field, path)
        return HFTokenizer(
            backend,
            path,
            special("bos_token_id", -1),
            special("eos_token_id", -1),
            special("padding_token_id", -1),
            add_bos=special("add_bos_token", pre == "llama-bpe") is not False,
            tokenizer_class="PreTrainedTokenizerFast",
        )
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in field("tokenizer.ggml.tokens")]
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = _merges_in_vocabulary_order(vocab)
    unk = tokens[field("tokenizer.ggml.unknown_token_id") or 0]
    backend = Backend(BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token=unk, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    if field("tokenizer.ggml.add_space_prefix"):  # SentencePiece's dummy prefix (Gemma's files: none)
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), backend.normalizer])
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    types = field("tokenizer.ggml.token_type") or []
    # CONTROL
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, types) if kind == 3]
    )
    # USER_DEFINED
    backend.add_tokens(
        [AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, types) if kind == 4]
    )

    return HFTokenizer(
        backend,
        path,
        special("bos_token_id", 2),
        special("eos_token_id", 1),
        special("padding_token_id", 0),
        add_bos=special("add_bos_token", True) is not False,
    )


def _merges_in_vocabulary_order(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, ordered by the token's position in the vocabulary
    (earlier first), then longer left and right pieces first: transformers' generate_merges with
    scores -position."""
    merges = []
    for token, index in vocab.items():
        pairs = [
            (token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab
        ]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((-index, left, right) for left, right in pairs)
    merges.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in merges]


def carries_tokenizer(path: str | Path) -> bool:
    """Whether a checkpoint (a .gguf, or a Hugging Face directory) holds its tokenizer."""
    from tunix_train.interop import checkpoint_format

    path = Path(path).expanduser()
    if checkpoint_format(path) == "gguf":
        from tunix_train.interop.gguf import open_gguf

        return open_gguf(path).get_field("tokenizer.ggml.tokens") is not None
    return any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model"))


def run_tokenizer(cfg) -> tuple[str | None, str]:
    """The tokenizer a run reads its text with, and the config key that names it: data.tokenizer;
    else the tokenizer of the checkpoint model.init_from starts from; else the bundled one (None)."""
    if cfg.data.tokenizer:
        return cfg.data.tokenizer, "data.tokenizer"
    if cfg.model.init_from and carries_tokenizer(cfg.model.init_from):
        return cfg.model.init_from, "model.init_from"
    return None, "data.tokenizer"


def load_tokenizer(path: str | Path | None, vocab_size: int, key: str = "data.tokenizer") -> Tokenizer:
    """The tokenizer at `path` (a SentencePiece .model, a tokenizer.json, a .gguf, or a directory
    holding tokenizer.json or tokenizer.model; default: the bundled one), checked against the
    model's vocabulary; errors name `key`."""
    file = Path(path).expanduser() if path else BUNDLED_TOKENIZER
    if file.is_dir():
        found = [file / name for name in ("tokenizer.json", "tokenizer.model") if (file / name).is_file()]
        if not found:
            raise ConfigError(f"{key}: {file} holds no tokenizer.json or tokenizer.model")
        file = found[0]
    if not file.is_file():
        raise ConfigError(f"{key}: no such file {file}")
    try:
        if file.suffix == ".json":
            tokenizer = tokenizer_json(file)
        elif file.suffix == ".gguf":
            from tunix_train.interop.gguf import open_gguf

            tokenizer = gguf_tokenizer(open_gguf(file), file)
        else:
            tokenizer = SentencePieceTokenizer(file)
    except ConfigError as err:
        raise ConfigError(f"{key}: {err}") from None
    except Exception as err:
        kind = "tokenizer.json" if file.suffix == ".json" else "SentencePiece model"
        raise ConfigError(f"{key}: {file} is not a {kind} ({' '.join(str(err).split())})") from None
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"{key}: {file} has {tokenizer.vocab_size} tokens but model.vocab_size={vocab_size}; "
            f"set model.vocab_size >= {tokenizer.vocab_size} or use the model's own tokenizer"
        )
    if tokenizer.eos_id < 0:
        raise ConfigError(f"{key}: {file} defines no EOS token")
    return tokenizer


def bundled_with_pieces(path: Path, pieces: Sequence[str]) -> Path:
    """Writes the bundled SentencePiece model to `path` with `pieces` as user-defined pieces (one
    token each, ids 4096 on) and, as Gemma's, no space put in front of a text: the demos' and
    tests' tokenizer with Gemma's turn, tool or image tokens."""
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(BUNDLED_TOKENIZER.read_bytes())
    model.normalizer_spec.add_dummy_prefix = False
    for symbol in pieces:
        piece = model.pieces.add()
        piece.piece, piece.score, piece.type = (
            symbol,
            0.0,
            sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED,
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())
    return path
