"""Training and evaluation data: host-local batches of [accumulation step, row, position] arrays.

`Data(cfg)` reads and checks a run's documents and tokenizer once; its `train_batches` and
`eval_batches` are the entry points, each reading only this process's rows.
"""

from __future__ import annotations

import itertools

import numpy as np

from tunix_train.config import Config, DataSource
from tunix_train.data.chat import ChatTemplate, find_template
from tunix_train.data.images import ImageTokens
from tunix_train.data.pipeline import DocumentFeatures, PackedBatches, UnpackedBatches
from tunix_train.data.sources import train_and_eval_documents
from tunix_train.data.synthetic import SyntheticBatches
from tunix_train.data.tokenizer import load_tokenizer, run_tokenizer

_EVAL_SEED_OFFSET = 1_000_003  # synthetic evaluation data: a stream disjoint from training's


class Data:
    """The documents and tokenizer of a run, read and checked once."""

    def __init__(self, cfg: Config, required_fields=None):
        """required_fields: the JSON-lines fields an objective reads (records are kept whole)."""
        self.cfg = cfg
        self.synthetic = cfg.data.source is DataSource.synthetic
        # conversations for a model with an image tower: rows of one conversation and its images
        self.vision = cfg.model.vision if cfg.data.messages_field else None
        if not self.synthetic:
            source, key = run_tokenizer(cfg)
            self.tokenizer = load_tokenizer(source, cfg.model.vocab_size, key)
            self.train_docs, self.eval_docs = train_and_eval_documents(cfg.data, required_fields)
            self._chat_source, self._chat = source, None
            self.features = DocumentFeatures(
                self.tokenizer,
                cfg.model.vocab_size,
                self.chat if cfg.data.messages_field else None,
                tuple(cfg.data.train_on_roles),
                cfg.data.seq_len,
                self.vision,
                cfg.data.images_per_row,
                cfg.data.pan_and_scan_crops,
            )
            if (
                cfg.data.messages_field
            ):  # each conversation rendered once now: a bad one stops the run before it starts
                for doc in itertools.chain(self.train_docs, self.eval_docs):
                    self.features(doc)

    @property
    def chat(self) -> ChatTemplate:
        """The chat template (data.chat_template, else the tokenizer's, else Gemma's turn format),
        read when first needed: a run without conversations never reads it."""
        if self._chat is None:
            vision = self.cfg.model.vision
            image_tokens = None if vision is None else ImageTokens.for_model(self.tokenizer, vision)
            self._chat = ChatTemplate(
                *find_template(self.cfg.data.chat_template, self._chat_source), self.tokenizer, image_tokens
            )
            self._chat.allow_control_tokens = self.cfg.data.control_tokens_in_messages
        return self._chat

    def _batches(self, docs, *, accumulation_steps, global_micro_batch, seed, shuffle, rows):
        d = self.cfg.data
        if self.synthetic:
            return SyntheticBatches(
                seq_len=d.seq_len,
                vocab_size=self.cfg.model.vocab_size,
                accumulation_steps=accumulation_steps,
                global_micro_batch=global_micro_batch,
                seed=seed,
                rows=rows,
            )
        rows_of = PackedBatches if self.vision is None else UnpackedBatches  # rows with images: unpacked
        return rows_of(
            docs,
            self.features,
            seq_len=d.seq_len,
            accumulation_steps=accumulation_steps,
            global_micro_batch=global_micro_batch,
            seed=seed if shuffle else None,
            rows=rows,
            prefetch=d.prefetch_batches,
        )

    def train_batches(self, global_micro_batch: int, rows: range | None = None):
        """Endless, seeded, checkpointable training batches of [A, rows of this process, T]."""
        t = self.cfg.training
        return self._batches(
            None if self.synthetic else self.train_docs,
            accumulation_steps=t.gradient_accumulation_steps,
            global_micro_batch=global_micro_batch,
            seed=t.seed,
            shuffle=True,
            rows=rows,
        )

    def eval_batches(self, global_micro_batch: int, rows: range | None = None) -> list[dict[str, np.ndarray]]:
        """The fixed held-out batches of every evaluation, [1, rows of this process, T] each."""
        batches = self._batches(
            None if self.synthetic else self.eval_docs,
            accumulation_steps=1,
            global_micro_batch=global_micro_batch,
            seed=self.cfg.training.seed + _EVAL_SEED_OFFSET,
            shuffle=False,
            rows=rows,
        )
        try:
            return list(itertools.islice(batches, self.cfg.training.eval_batches))
        finally:
            batches.close()
