"""The grain pipeline: shuffle, tokenize, pack, batch, read ahead; per-process, checkpointable.

Row slots make the global batch independent of the number of processes. A micro-batch has B rows
(the global micro-batch); row j of every micro-batch comes from slot j, a stream of its own: the
documents at positions j, j+B, j+2B, ... of the seeded, per-epoch reshuffled document order, tokenized
and packed into rows of seq_len tokens. A process builds only the slots of the rows its devices hold,
so it reads only its share of the documents, and the rows are the same whatever the process count.

Host batches are dicts of [A, B_local, T] arrays: inputs, targets, loss_mask, positions, segment_ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import grain
import numpy as np
from grain.experimental import (
    ConcatThenSplitIterDataset,
    FirstFitPackIterDataset,
    ThreadPrefetchIterDataset,
    ZipIterDataset,
)

from tunix_train.config import ConfigError, VisionConfig
from tunix_train.data.images import conversation_images, has_images, split_images
from tunix_train.data.tokenizer import Tokenizer, with_bos

PACKED = ("inputs", "targets", "loss_mask")


class DocumentFeatures:
    """A document -> next-token pairs within it: inputs, targets and the loss mask on targets.

    Text becomes [BOS] text [EOS]. With a prompt and a completion, [BOS] prompt completion [EOS]
    with the loss on the completion and EOS only. A conversation is its chat template's rendering
    (BOS included where the template writes it), the loss on the tokens of `roles`, and must fit a
    row of seq_len. Pre-tokenized documents are used as stored.

    With `vision` (model.vision), every document also gives its images' pixel values [n, C, H, W]
    (`images`; n may be 0): a conversation's image parts, each as many image tokens as the tower
    gives (the chat template's image_tokens), never in the loss; at most images_per_row of them.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        chat=None,
        roles=("assistant",),
        seq_len: int | None = None,
        vision: VisionConfig | None = None,
        images_per_row: int = 1,
        pan_and_scan_crops: int = 0,
    ):
        self.tokenizer, self.vocab_size, self.chat, self.roles, self.seq_len = (
            tokenizer,
            vocab_size,
            chat,
            roles,
            seq_len,
        )
        self.vision, self.images_per_row, self.pan_and_scan_crops = vision, images_per_row, pan_and_scan_crops

    def __call__(self, doc: dict[str, Any]) -> dict[str, np.ndarray]:
        images, crops = self._pixels(doc) if self.vision is not None else (None, None)
        row = self._tokens(doc, images, crops)
        if images is not None:
            row["images"] = self._placed(doc, row["inputs"], images)
        return row

    def _tokens(self, doc: dict[str, Any], images=None, crops=None) -> dict[str, np.ndarray]:
        first_loss_target = 0
        if "messages" in doc:
            tools = {"tools": doc["tools"]} if "tools" in doc else {}
            messages = doc["messages"]
            if self.seq_len is not None and len(messages) > self.seq_len:  # before rendering them
                raise ConfigError(
                    f"{doc['where']}: a conversation of {len(messages)} messages, each at least a token, "
                    f"cannot fit a row of data.seq_len={self.seq_len}: shorten it or raise data.seq_len"
                )
            if has_images(messages):
                if self.vision is None:
                    raise ConfigError(
                        f"{doc['where']}: a conversation with images, but this model reads none "
                        f"(model.vision is null): use a model with an image tower (gemma3_4b and up)"
                    )
                messages = split_images(messages)[0]
            try:
                ids, mask = self.chat.encode(messages, self.roles, images=images, crops=crops, **tools)
            except ConfigError as err:
                raise ConfigError(f"{doc['where']}: {err}") from None
            if self.seq_len is not None and len(ids) - 1 > self.seq_len:
                raise ConfigError(
                    f"{doc['where']}: a conversation of {len(ids)} tokens (its images' included) is "
                    f"longer than a row of data.seq_len={self.seq_len}: raise data.seq_len or shorten it"
                )
            return {
                "inputs": np.asarray(ids[:-1], np.int32),
                "targets": np.asarray(ids[1:], np.int32),
                "loss_mask": np.asarray(mask[1:], np.float32),
            }
        if "tokens" in doc:
            ids = np.asarray(doc["tokens"], np.int32)
            if ids.size and (ids.max() >= self.vocab_size or ids.min() < 0):
                raise ValueError(
                    f"a pre-tokenized document has token id {ids.max()} outside "
                    f"model.vocab_size={self.vocab_size}"
                )
        else:
            tok = self.tokenizer
            if "prompt" in doc:
                start = with_bos(tok, tok.encode(doc["prompt"]))
                ids = [*start, *tok.encode(doc["completion"]), tok.eos_id]
                first_loss_target = len(start) - 1  # targets[i] is ids[i + 1]: the first completion token
            else:
                ids = [*with_bos(tok, tok.encode(doc["text"])), tok.eos_id]
            ids = np.asarray(ids, np.int32)
        loss_mask = (np.arange(len(ids) - 1) >= first_loss_target).astype(np.float32)
        return {"inputs": ids[:-1], "targets": ids[1:], "loss_mask": loss_mask}

    def _pixels(self, doc: dict[str, Any]) -> tuple[np.ndarray, list[int]]:
        """The document's images as the tower takes them [n, *image_shape] (each followed by its
        pan-and-scan crops, with data.pan_and_scan_crops), and how many crops followed each."""
        return conversation_images(
            doc.get("messages", []),
            doc.get("images", []),
            self.vision,
            self.images_per_row,
            Path(doc.get("folder", ".")),
            doc.get("where", "a document"),
            self.pan_and_scan_crops,
        )

    def _placed(self, doc: dict[str, Any], inputs: np.ndarray, images: np.ndarray) -> np.ndarray:
        """The images, checked against the runs of image tokens the template placed (one line
        naming the record for a mismatch)."""
        is_image = inputs == self.vision.image_token_id
        # the last token of a document is a target only, so the row's inputs may end before it
        placed = int(np.sum(is_image[1:] & ~is_image[:-1]) + (is_image[:1].sum()))
        if placed != len(images):
            raise ConfigError(
                f"{doc.get('where', 'a document')}: {len(images)} images but the chat template placed "
                f"{placed}: each image part must become one image (a template that writes "
                f"{self.chat.image_tokens.marker} for it)"
            )
        return images


def _as_row(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """grain's packed element -> one row of the model's batch format."""
    return {
        "inputs": packed["inputs"],
        "targets": packed["targets"],
        "loss_mask": packed["loss_mask"].astype(np.float32),
        "positions": packed["inputs_positions"].astype(np.int32),
        "segment_ids": packed["inputs_segment_ids"].astype(np.int32),
    }


def _stack_rows(rows: tuple[dict[str, np.ndarray], ...]) -> dict[str, np.ndarray]:
    return {name: np.stack([row[name] for row in rows]) for name in rows[0]}


def _as_grain_wrote_it(state: Any) -> Any:
    """A state that went through JSON (a checkpoint) as grain's get_state returned it: its packer's
    `remainder_slices` back to (start, stop) tuples. Grain (0.2.18, packing_concat_then_split.py)
    tests a slot for "no remainder" by comparing with the tuple (-1, -1); the list [-1, -1] that
    JSON gives back never equals it, and the resumed slot read one document too many."""
    if isinstance(state, dict):
        return {
            key: {f: tuple(s) for f, s in value.items()}
            if key == "remainder_slices"
            else _as_grain_wrote_it(value)
            for key, value in state.items()
        }
    if isinstance(state, list):
        return [_as_grain_wrote_it(value) for value in state]
    return state


class _HostBatches:
    """An iterator of host batches over a grain dataset, with get_state/set_state for exact resumption."""

    def _start(self, batches, prefetch: int) -> None:
        self._dataset = ThreadPrefetchIterDataset(batches, prefetch_buffer_size=prefetch)
        self._iterator = iter(self._dataset)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._iterator)

    def get_state(self) -> dict[str, Any]:
        return self._iterator.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self._iterator.set_state(_as_grain_wrote_it(state))

    def close(self) -> None:
        """Stops the read-ahead thread (grain's iterators complain if left to interpreter exit)."""
        self._iterator.close()
        self._iterator = self._dataset = None


class PackedBatches(_HostBatches):
    """Packed rows of documents, each as `features` makes it (DocumentFeatures: tokens and loss
    masks)."""

    def __init__(
        self,
        documents: Sequence[dict[str, Any]],
        features: Callable[[dict[str, Any]], dict[str, np.ndarray]],
        *,
        seq_len: int,
        accumulation_steps: int,
        global_micro_batch: int,
        seed: int | None,
        rows: range | None = None,
        prefetch: int = 4,
    ):
        """rows: the micro-batch rows this process holds (default all); seed None keeps the document
        order (evaluation), otherwise it is reshuffled every epoch."""
        streams = _slot_streams(
            _ordered(documents, seed), global_micro_batch, rows, self._prepared(features, seq_len)
        )
        self._start(self._rows(streams, seq_len).batch(accumulation_steps), prefetch)

    def _prepared(self, features: Callable, seq_len: int) -> Callable:
        return lambda docs: docs.map(features)

    def _rows(self, streams: list, seq_len: int):
        slots = [ConcatThenSplitIterDataset(s, length_struct={f: seq_len for f in PACKED}) for s in streams]
        return ZipIterDataset(slots).map(_stack_rows).map(_as_row)


class UnpackedBatches(PackedBatches):
    """One document per row, padded to seq_len (positions past it a segment of their own, out of
    the loss), with its images padded to the features' images_per_row [I, C, H, W]: how rows with
    images are batched, so that no image is split between rows. Row slots as PackedBatches'."""

    def _prepared(self, features: DocumentFeatures, seq_len: int) -> Callable:
        return lambda docs: docs.map(features).map(lambda doc: _padded(doc, seq_len, features.images_per_row))

    def _rows(self, streams: list, seq_len: int):
        return ZipIterDataset(streams).map(_stack_rows)


def _slot_streams(ordered, per_micro_batch: int, slots: range | None, prepare=lambda items: items) -> list:
    """Slot j's stream for each slot this process holds (default all): items j, j + N, j + 2N, ...
    of `ordered` (N slots per global micro-batch), `prepare`d, read in the calling thread."""
    return [
        prepare(ordered[slot::per_micro_batch]).to_iter_dataset(
            grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        )
        for slot in (range(per_micro_batch) if slots is None else slots)
    ]


def _ordered(items: Sequence, seed: int | None):
    """`items` endlessly, reshuffled every epoch from `seed` (None: in order)."""
    ordered = grain.MapDataset.source(items)
    return (ordered if seed is None else ordered.shuffle(seed=seed)).repeat()


def _empty_row(seq_len: int) -> dict[str, np.ndarray]:
    """A row of seq_len padding positions (segment 0, no loss), to fill from its start."""
    return {
        "inputs": np.zeros(seq_len, np.int32),
        "targets": np.zeros(seq_len, np.int32),
        "loss_mask": np.zeros(seq_len, np.float32),
        "positions": np.arange(seq_len, dtype=np.int32),
        "segment_ids": np.zeros(seq_len, np.int32),
    }


def _padded(doc: dict[str, np.ndarray], seq_len: int, images_per_row: int) -> dict[str, np.ndarray]:
    """A document's features as one row of seq_len positions and images_per_row images."""
    n, row = len(doc["inputs"]), _empty_row(seq_len)
    for name in PACKED:
        row[name][:n] = doc[name][:seq_len]
    row["segment_ids"][:n] = 1
    images = doc["images"]
    row["images"] = np.zeros((images_per_row, *images.shape[1:]), np.float32)
    row["images"][: len(images)] = images
    return row


class GroupBatches(_HostBatches):
    """Batches of whole groups of rows, never split or packed: a DPO pair (chosen, rejected), a
    GRPO prompt. Each group is a dict of [k, ...] arrays; micro-batch slot j holds the groups at
    positions j, j+G, j+2G, ... of the seeded, per-epoch reshuffled order (G: groups per global
    micro-batch), and its k rows are rows j·k ... j·k + k - 1 of the micro-batch, so a group stays
    in one micro-batch on one device. Host batches are dicts of [A, rows of this process, ...]."""

    def __init__(
        self,
        groups: Sequence[dict[str, np.ndarray]],
        *,
        accumulation_steps: int,
        groups_per_micro_batch: int,
        seed: int | None,
        slots: range | None = None,
        prefetch: int = 4,
    ):
        streams = _slot_streams(_ordered(groups, seed), groups_per_micro_batch, slots)
        self._start(ZipIterDataset(streams).map(_concatenate_groups).batch(accumulation_steps), prefetch)


class PackedPairs(PackedBatches):
    """Preference pairs packed whole into rows of seq_len (data.padding_free): a pair (its two padded
    rows, chosen then rejected, as DirectPreference builds them) is one sequence of its rows' used
    positions, each row keeping its own positions; grain's first-fit packing fills `bins` rows at a
    time per row slot (slots as PackedBatches'). In a row, pair j's chosen answer is segment 2j + 1
    and its rejected one 2j + 2 (so no answer attends to another, and segment - 1 is the answer's
    index in the row: even chosen, odd rejected)."""

    def __init__(self, pairs: Sequence[dict[str, np.ndarray]], bins: int = 4, **slots: Any):
        """slots: PackedBatches' keywords (seq_len, accumulation_steps, global_micro_batch, seed,
        rows, prefetch)."""
        self._bins, self._names = bins, list(pair_sequence(pairs[0]))
        super().__init__(pairs, pair_sequence, **slots)

    def _rows(self, streams: list, seq_len: int):
        lengths = {name: seq_len for name in self._names}
        slots = [
            FirstFitPackIterDataset(s, length_struct=lengths, num_packing_bins=self._bins, shuffle_bins=False)
            for s in streams
        ]
        return ZipIterDataset([slot.map(_pair_row) for slot in slots]).map(_stack_rows)


def pair_sequence(pair: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A pair's two rows [2, T] as one sequence of their used positions (segment_ids > 0), with
    `answer` 0 on the chosen one's and 1 on the rejected one's."""
    used = [int((pair["segment_ids"][k] > 0).sum()) for k in (0, 1)]
    sequence = {
        name: np.concatenate([x[k, : used[k]] for k in (0, 1)])
        for name, x in pair.items()
        if name != "segment_ids"
    }
    sequence["answer"] = np.repeat(np.arange(2, dtype=np.int32), used)
    return sequence


def _pair_row(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    pair = packed["inputs_segment_ids"]  # 1, 2, ...: the row's pairs; 0: padding
    row = {name: x for name, x in packed.items() if not name.endswith(("_segment_ids", "_positions"))}
    row["segment_ids"] = np.where(pair > 0, 2 * pair - 1 + row.pop("answer"), 0).astype(np.int32)
    return row


def _concatenate_groups(groups: tuple[dict[str, np.ndarray], ...]) -> dict[str, np.ndarray]:
    return {name: np.concatenate([g[name] for g in groups]) for name in groups[0]}


def scored_row(ids: list[int], seq_len: int) -> dict[str, np.ndarray]:
    """[BOS] prompt answer [EOS] as one padded row whose inputs hold every token (a
    scalar head reads the last, the EOS: loss_mask marks it); targets are unused."""
    row, n = _empty_row(seq_len), len(ids)
    row["inputs"][:n] = ids
    row["segment_ids"][:n] = 1
    row["loss_mask"][n - 1] = 1.0
    return row


def padded_row(prompt: list[int], completion: list[int], seq_len: int) -> dict[str, np.ndarray]:
    """[BOS] prompt completion [EOS] as one unpacked row of seq_len positions (prompt already
    holding BOS, completion EOS): the loss mask on the completion's tokens, padding after."""
    ids = np.asarray([*prompt, *completion], np.int32)
    n, row = len(ids) - 1, _empty_row(seq_len)
    row["inputs"][:n], row["targets"][:n] = ids[:-1], ids[1:]
    row["loss_mask"][len(prompt) - 1 : n] = 1.0  # targets[i] = ids[i + 1]: from the first completion token
    row["segment_ids"][:n] = 1
    return row
