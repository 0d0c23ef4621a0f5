"""Byte-level BPE tokenizer.json files as Llama 3 and Qwen ship them, trained here with `tokenizers`
on the bundled corpus (600 tokens): Qwen's without BOS, Llama 3's with BOS put in front by its
post-processor."""

import json
import lzma
from pathlib import Path

from tunix_train.data.sources import BUNDLED_CORPUS

SPECIAL = {
    "qwen": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "phi3": ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
    "llama": [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ],
}
SETTINGS = {
    "qwen": {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "tokenizer_class": "Qwen2Tokenizer",
    },
    "phi3": {  # Phi-3's tokens and ends (its own tokenizer is SentencePiece: a byte-level one stands in)
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    },
    "llama": {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    },
}


def byte_level_bpe(
    directory: Path,
    kind: str,
    vocab_size: int = 600,
    texts: tuple[str, ...] = (),
    added: tuple[str, ...] = (),
    template: str | None = None,
) -> Path:
    """tokenizer.json and tokenizer_config.json of `kind` (qwen, llama) in `directory`, split as
    their published tokenizer.json files split text (Qwen's pattern and NFC; Llama 3's pattern,
    whole words in the vocabulary skipping the merges). `texts` are trained on with the corpus;
    `added` become tokens of their own that are not special (as Qwen 2.5's <tool_call>);
    `template` names the chat template tokenizer_config.json carries (trl_template)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    from tunix_train.data.byte_bpe import LLAMA3_SPLIT, QWEN2_SPLIT

    tokenizer = Tokenizer(models.BPE(ignore_merges=kind == "llama"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(LLAMA3_SPLIT if kind == "llama" else QWEN2_SPLIT), behavior="isolated"
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    if kind == "qwen":
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL[kind],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with lzma.open(BUNDLED_CORPUS, "rt") as f:
        corpus = [json.loads(line)["text"] for _, line in zip(range(200), f)]
    tokenizer.train_from_iterator([*corpus, *texts], trainer)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in added])
    if kind == "llama":
        bos = "<|begin_of_text|>"
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = (
        SETTINGS[kind] if template is None else {**SETTINGS[kind], "chat_template": trl_template(template)}
    )
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory


def trl_template(name: str) -> str:
    """TRL's copy of a model's chat template (trl/chat_templates/NAME.jinja)."""
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()
