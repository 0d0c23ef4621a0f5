"""Llama 3's and Qwen's chat templates (as TRL ships them, byte for byte the models' own) on their
byte-level BPE tokenizers: the token ids we train on equal transformers' apply_chat_template, and
the loss mask equals the assistant mask transformers computes from TRL's {% generation %}-marked
training variants; each reply stops at the template's end of turn."""

import pytest

transformers = pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[reference]'")
trl = pytest.importorskip("trl", reason="needs TRL (its chat templates): pip install -e '.[reference]'")

from bpe_files import byte_level_bpe, trl_template  # noqa: E402

from tunix_train.config import ConfigError  # noqa: E402
from tunix_train.data.chat import ChatTemplate, find_template  # noqa: E402
from tunix_train.data.tokenizer import load_tokenizer  # noqa: E402

CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "Six."},
]


# (tokenizer, the template the tokenizer carries, TRL's generation-marked variant, end of turn)
CASES = {
    "qwen2_5": ("qwen", "qwen2_5", "qwen2_5_training", "<|im_end|>"),
    "qwen3": ("qwen", "qwen3_training", "qwen3_training", "<|im_end|>"),
    "llama3": ("llama", "llama3", "llama3_training", "<|eot_id|>"),
    "phi3": ("phi3", "phi3_training", "phi3_training", "<|end|>"),  # its own appends EOS past the end
}


@pytest.mark.parametrize("name", CASES)
def test_ids_and_loss_mask_equal_transformers(tmp_path, name):
    kind, template, marked, end_of_turn = CASES[name]
    directory = byte_level_bpe(tmp_path / name, kind, template=template)
    tokenizer = load_tokenizer(directory, 600)
    chat = ChatTemplate(*find_template(None, directory), tokenizer)
    ids, mask = chat.encode(CONVERSATION)

    reference = transformers.AutoTokenizer.from_pretrained(directory).apply_chat_template(
        CONVERSATION,
        chat_template=trl_template(marked),
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    assert ids == reference["input_ids"]
    theirs = [bool(m) for m in reference["assistant_masks"]]
    # Qwen 2.5's marked variant also counts the line breaks around a reply (after
    # '<|im_start|>assistant' and after <|im_end|>); ours spans the reply and its end of turn
    newline = tokenizer.encode("\n")[0]
    beside = [
        ids[i] == newline and ((i + 1 < len(ids) and mask[i + 1]) or (i > 0 and mask[i - 1]))
        for i in range(len(ids))
    ]
    assert [m for m, skip in zip(mask, beside) if not skip] == [
        m for m, skip in zip(theirs, beside) if not skip
    ]
    assert name == "qwen2_5" or mask == theirs
    assert sum(mask) >= 2 * 3  # both replies and their ends of turn
    assert chat.end_of_turn() == end_of_turn and tokenizer.token(chat.end_of_turn_id()) == end_of_turn


def test_a_template_that_rewrites_earlier_turns_is_one_line_naming_the_fix(tmp_path):
    """Qwen 3's own template drops the reasoning of earlier turns, so a message's tokens cannot be
    found by rendering the conversation's start; its generation-marked variant can."""
    directory = byte_level_bpe(tmp_path / "qwen3", "qwen", template="qwen3")
    chat = ChatTemplate(*find_template(None, directory), load_tokenizer(directory, 600))
    with pytest.raises(ConfigError, match=r"use a template with \{% generation %\} markers"):
        chat.encode(CONVERSATION)
