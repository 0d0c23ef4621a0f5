"""The data section's schema (`data.*`): where the documents come from and how they become rows."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Dict, List, Optional

from tunix_train.config.fields import _changeable, _fixed


class DataSource(enum.Enum):
    shakespeare = "shakespeare"  # the bundled corpus and tokenizer
    text = "text"  # plain-text files
    jsonl = "jsonl"  # one JSON object per line: a text field, or prompt and completion fields
    # the same records as Parquet rows (a .parquet file is read as Parquet under jsonl too)
    parquet = "parquet"
    array_record = "array_record"  # pre-tokenized documents (scripts/pretokenize.py writes them)
    synthetic = "synthetic"  # learnable random sequences, no tokenizer
    reasoning_gym = "reasoning_gym"  # reasoning-gym's generated tasks (data.reasoning_gym)


class TextUnit(enum.Enum):
    """What one document is in a plain-text file."""

    line = "line"
    paragraph = "paragraph"  # separated by blank lines
    file = "file"


@dataclasses.dataclass
class ReasoningGymConfig:
    """data.reasoning_gym (data.source=reasoning_gym, the `tasks` extra): prompts that reasoning-gym
    generates from a seed, the same on every run, each record's `answer` and `entry` (the task's
    own record) there for its verifier (rewards/verified.reasoning_gym)."""

    tasks: List[str] = _fixed(factory=list)  # reasoning-gym dataset names, e.g. [basic_arithmetic]
    # A task's generator settings, e.g. {basic_arithmetic: {min_terms: 2, max_terms: 2}}
    settings: Dict[str, Dict[str, Any]] = _fixed(factory=dict)
    size: int = _fixed(1000)  # training prompts of each task
    eval_size: int = _fixed(100)  # held-out prompts of each task (generated from another seed)
    seed: int = _fixed(0)


@dataclasses.dataclass
class DataConfig:
    source: DataSource = _fixed(DataSource.shakespeare)
    seq_len: int = _fixed(256)  # tokens per packed row
    train_files: List[str] = _fixed(factory=list)  # paths or globs
    # Held-out files; when empty, a fixed eval_fraction of the training documents is held out.
    eval_files: List[str] = _fixed(factory=list)
    eval_fraction: float = _fixed(0.02)
    # A directory written by datasets' save_to_disk (its train split), read instead of train_files
    # under data.source=jsonl or parquet.
    hf_dataset: Optional[str] = _fixed(None)
    tokenizer: Optional[str] = _fixed(None)  # a SentencePiece model; null: the bundled Shakespeare tokenizer
    text_unit: TextUnit = _fixed(TextUnit.paragraph)
    text_field: str = _fixed("text")
    # Supervised fine-tuning on JSONL: the loss is on completion tokens only.
    prompt_field: Optional[str] = _fixed(None)
    completion_field: Optional[str] = _fixed(None)
    # Conversations on JSONL: the records' messages_field holds [{role, content}], rendered with the
    # chat template (tunix_train/data/chat.py; a Jinja file, null: the tokenizer's, else Gemma's turn
    # format); the loss is on the tokens the messages of train_on_roles wrote.
    messages_field: Optional[str] = _fixed(None)
    train_on_roles: List[str] = _fixed(factory=lambda: ["assistant"])
    chat_template: Optional[str] = _fixed(None)
    # Preference pairs (objective=dpo, reward) packed whole into rows of seq_len, first fit, each
    # answer a segment of its own, instead of two padded rows per pair (TRL's padding_free): a
    # micro-batch then holds as many pairs as its rows fit. A rollout's completions (grpo, its
    # family, ppo, on-policy distillation) packed likewise, with their prompts, into the front
    # micro-batches; the step skips those left empty. The next-token objective always packs.
    padding_free: bool = _fixed(False)
    # With model.vision and conversations: the most images one conversation (one row: rows with
    # images are not packed) holds; a row's images pad to this many.
    images_per_row: int = _fixed(1)
    # Gemma 3's pan-and-scan (model.vision's siglip tower): a long image also gives up to this many
    # crops, each an image of its own after it (transformers' do_pan_and_scan with max_num_crops;
    # crops of at least 256 pixels, images at least 1.2 times longer than wide); 0: off
    pan_and_scan_crops: int = _fixed(0)
    # Conversations whose messages' text may write the template's control tokens (<start_of_turn>,
    # <start_of_image>, BOS ...) and have them read as such; false: such a record is a one-line error
    control_tokens_in_messages: bool = _fixed(False)
    reasoning_gym: ReasoningGymConfig = dataclasses.field(default_factory=ReasoningGymConfig)
    prefetch_batches: int = _changeable(4)  # batches prepared ahead of the train step by a background thread


CHAT_ROLES = ("system", "user", "assistant", "tool")  # the roles a conversation's messages may have
