"""Byte-level BPE vocabularies (Llama 3's, Qwen's) in GGUF files, both ways, as llama.cpp's
converter writes them (tokenizer.ggml.model = gpt2: tokens, token types, merges and `pre`, the name
of the pre-tokenizer that splits text before the merges) and as transformers' GGUF loader and
llama.cpp read them back (integrations/gguf/gguf_tokenizer_mapping.py; llama-vocab.cpp).

The converter names `pre` by hashing the tokens of a probe text, which only a published vocabulary
matches; here it is named by the split pattern itself, the thing `pre` stands for. A pattern that
none of the names below stands for is refused: llama.cpp would split its text otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path

from tunix_train.config import ConfigError

# transformers' Qwen2 PRETOKENIZE_REGEX; Llama 3's tokenizer.json split (convert_slow_tokenizer.py)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's `pre` -> (the split pattern, None: GPT-2's own inside ByteLevel; whether whole words in
# the vocabulary skip the merges, as llama.cpp sets it for that pre-tokenizer)
SPLITS = {"gpt-2": (None, False), "llama-bpe": (LLAMA3_SPLIT, True), "qwen2": (QWEN2_SPLIT, False)}
_CONTROL, _USER_DEFINED, _NORMAL = 3, 4, 1


def _pre_of(spec: dict | None) -> str | None:
    """The `pre` of a tokenizer.json pre_tokenizer: a byte-level one llama.cpp names, '?' for a
    byte-level one it does not, None for one that is not byte-level."""
    if spec is None:
        return None
    if spec.get("type") == "ByteLevel":
        return "gpt-2" if spec.get("use_regex", True) else "?"
    parts = spec.get("pretokenizers") if spec.get("type") == "Sequence" else None
    if not parts or not any(p.get("type") == "ByteLevel" for p in parts):
        return None
    split = parts[0] if len(parts) == 2 and parts[1].get("use_regex") is False else {}
    pattern = (split.get("pattern") or {}).get("Regex") if split.get("type") == "Split" else None
    if split.get("behavior") != "Isolated" or split.get("invert"):
        return "?"
    return next((pre for pre, (regex, _) in SPLITS.items() if regex == pattern), "?")


def gguf_fields(backend, vocab_size: int, path: Path) -> tuple[str, list[str], list[int], list[str]] | None:
    """(pre, tokens, token types, merges) of a byte-level BPE `tokenizers.Tokenizer`, or None for a
    vocabulary that is not byte-level; one line for one llama.cpp would split otherwise."""
    spec = json.loads(backend.to_str())
    pre = _pre_of(spec.get("pre_tokenizer"))
    if pre is None:
        return None
    model = spec.get("model") or {}
    if pre == "?" or model.get("type") != "BPE" or bool(model.get("ignore_merges")) != SPLITS[pre][1]:
        raise ConfigError(
            f"{path}: a byte-level BPE whose pre-tokenizer (or ignore_merges) is none that llama.cpp "
            f"names ({', '.join(SPLITS)}): a GGUF cannot carry it; export a Hugging Face checkpoint"
        )
    added = backend.get_added_tokens_decoder()
    tokens = [backend.id_to_token(i) for i in range(vocab_size)]
    types = [
        (_CONTROL if added[i].special else _USER_DEFINED) if i in added else _NORMAL
        for i in range(vocab_size)
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return pre, tokens, types, merges


def from_gguf(field, path: Path):
    """The `tokenizers.Tokenizer` a GGUF's gpt2 vocabulary describes (`field(key)` reads its
    metadata), with Qwen's NFC normalizer where pre is qwen2, as Qwen's tokenizer.json has it."""
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import BPE

    pre = field("tokenizer.ggml.pre") or "gpt-2"
    if pre not in SPLITS:
        raise ConfigError(
            f"{path}: tokenizer.ggml.pre={pre!r} is a pre-tokenizer this package does not split "
            f"text with ({', '.join(SPLITS)}); pass data.tokenizer"
        )
    pattern, ignore_merges = SPLITS[pre]
    tokens, types = list(field("tokenizer.ggml.tokens")), list(field("tokenizer.ggml.token_type") or [])
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges") or []]
    for i, merge in enumerate(merges):
        if len(merge) != 2 or merge[0] not in vocab or merge[1] not in vocab:
            raise ConfigError(
                f"{path}: tokenizer.ggml.merges[{i}] {' '.join(merge)!r} is not two tokens of its "
                f"vocabulary separated by a space; the file is damaged"
            )
    backend = Backend(BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pattern is None)
    backend.pre_tokenizer = (
        byte_level
        if pattern is None
        else pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"), byte_level])
    )
    if pre == "qwen2":
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, types) if kind == _CONTROL]
    )
    backend.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, types)
            if kind == _USER_DEFINED
        ]
    )
    return backend, pre
