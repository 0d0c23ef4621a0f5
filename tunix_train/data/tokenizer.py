"""The tokenizer interface and its SentencePiece implementation (also loads Gemma's tokenizer.model)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from tunix_train.config import ConfigError

BUNDLED_TOKENIZER = Path(__file__).parent / "corpus" / "shakespeare_4k.model"


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class SentencePieceTokenizer:
    def __init__(self, path: Path):
        import sentencepiece as spm

        self.path = path
        self._sp = spm.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self._sp.vocab_size()
        self.bos_id, self.eos_id = self._sp.bos_id(), self._sp.eos_id()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(list(ids))


def load_tokenizer(path: str | None, vocab_size: int) -> SentencePieceTokenizer:
    """The tokenizer at `path` (default: the bundled one), checked against the model's vocabulary."""
    file = Path(path).expanduser() if path else BUNDLED_TOKENIZER
    if not file.is_file():
        raise ConfigError(f"data.tokenizer: no such file {file}")
    try:
        tokenizer = SentencePieceTokenizer(file)
    except (RuntimeError, OSError) as err:
        raise ConfigError(f"data.tokenizer: {file} is not a SentencePiece model ({err})") from None
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(f"data.tokenizer: {file} has {tokenizer.vocab_size} tokens but "
                          f"model.vocab_size={vocab_size}; set model.vocab_size >= {tokenizer.vocab_size}")
    if min(tokenizer.bos_id, tokenizer.eos_id) < 0:
        raise ConfigError(f"data.tokenizer: {file} defines no BOS or EOS token")
    return tokenizer
