"""Documents from files: plain text, records (JSON lines, Parquet, a saved `datasets` directory:
text, prompt/completion, conversations, an objective's whole records), pre-tokenized array_record.

Every reader returns a random-access sequence of records: {"text": str}, {"prompt": str,
"completion": str}, {"messages": [{role, content}], "where": file:line} or {"tokens": int32 array}.
Bad input is a ConfigError naming the file or key.
"""

from __future__ import annotations

import glob
import gzip
import json
import lzma
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from tunix_train.config import ConfigError, DataConfig, DataSource, TextUnit
from tunix_train.data.chat import check_messages
from tunix_train.data.images import has_images

BUNDLED_CORPUS = Path(__file__).parent / "corpus" / "shakespeare.jsonl.xz"
EVAL_SPLIT_SEED = 0  # the held-out documents do not change with training.seed


def expand(patterns: Sequence[str], key: str) -> list[Path]:
    files = []
    for pattern in patterns:
        matches = sorted(glob.glob(str(Path(pattern).expanduser()), recursive=True))
        if not matches:
            raise ConfigError(f"{key}: no file matches {pattern!r}")
        files += [Path(m) for m in matches if Path(m).is_file()]
    return files


def _read_text(path: Path) -> str:
    opener = {".gz": gzip.open, ".xz": lzma.open}.get(path.suffix, open)
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError, EOFError, lzma.LZMAError) as err:
        raise ConfigError(f"{path}: cannot read it as UTF-8 text ({err})") from None


def _text_documents(path: Path, unit: TextUnit) -> list[dict[str, str]]:
    text = _read_text(path)
    pieces = {
        TextUnit.file: [text],
        TextUnit.line: text.splitlines(),
        TextUnit.paragraph: re.split(r"\n\s*\n", text),
    }[unit]
    return [{"text": p.strip("\n")} for p in pieces if p.strip()]


def _record_documents(
    path: Path, data: DataConfig, required: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """The documents of a file of records (JSON lines, Parquet) or of a saved `datasets` directory.
    With `required` (an objective's fields, e.g. DPO's prompt, chosen, rejected) each record is
    kept whole and must hold those as strings or conversations."""
    records = _records(path)
    if required is not None:
        return [_whole_record(record, path, number, required) for number, record in records]
    if data.messages_field:
        return [
            {
                "messages": check_messages(
                    record.get(data.messages_field) if isinstance(record, dict) else None,
                    f"{path}:{number}",
                    data.messages_field,
                    parts=True,
                ),
                "where": f"{path}:{number}",
                # image parts' files are relative to the data file; `images`: those the parts leave unnamed
                "folder": str(path if path.is_dir() else path.parent),
                **({"images": record["images"]} if isinstance(record.get("images"), list) else {}),
                **_tools(record, f"{path}:{number}"),
            }
            for number, record in records
        ]
    fields = (
        {"prompt": data.prompt_field, "completion": data.completion_field}
        if data.prompt_field
        else {"text": data.text_field}
    )
    docs = []
    for number, record in records:
        doc = {}
        for name, field in fields.items():
            value = record.get(field) if isinstance(record, dict) else None
            if not isinstance(value, str):
                key = {
                    "text": "data.text_field",
                    "prompt": "data.prompt_field",
                    "completion": "data.completion_field",
                }[name]
                raise ConfigError(f"{path}:{number}: no string field {field!r} ({key})")
            doc[name] = value
        docs.append(doc)
    return docs


def _records(path: Path) -> list[tuple[int, Any]]:
    """(line or row number from 1, record) of a JSON-lines file, a Parquet file (by its
    extension, with pyarrow) or a directory written by `datasets`' save_to_disk (its train split)."""
    if path.is_dir():
        rows = _dataset_rows(path)
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError(f"{path}: reading Parquet needs pyarrow: pip install -e '.[data]'") from None
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as err:  # pyarrow's errors for a file that is not Parquet
            raise ConfigError(f"{path}: cannot read it as Parquet ({' '.join(str(err).split())})") from None
    else:
        return list(_json_lines(path))
    return list(enumerate(rows, start=1))


def _dataset_rows(path: Path) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"data.hf_dataset: reading {path} needs datasets: pip install -e '.[data]'"
        ) from None
    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as err:
        raise ConfigError(
            f"data.hf_dataset: {path} is not a directory written by datasets' save_to_disk "
            f"({' '.join(str(err).split())})"
        ) from None
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise ConfigError(f"data.hf_dataset: {path} has no train split (it has {', '.join(dataset)})")
        dataset = dataset["train"]
    return dataset.to_list()


def _whole_record(record: Any, path: Path, number: int, required: Sequence[str]) -> dict[str, Any]:
    """The record, each required field a string or a conversation ([{role, content}])."""
    for field in required:
        value = record.get(field) if isinstance(record, dict) else None
        if isinstance(value, list):
            check_messages(value, f"{path}:{number}", field, parts=True)
            if has_images(value):  # read later from elsewhere: each path made absolute, checked now
                from tunix_train.data.images import anchored

                record = {
                    **record,
                    field: anchored(value, path if path.is_dir() else path.parent, f"{path}:{number}"),
                }
        elif not isinstance(value, str):
            raise ConfigError(
                f"{path}:{number}: no string or messages field {field!r} (the objective reads "
                f"{', '.join(required)} from every line)"
            )
    if isinstance(record, dict) and isinstance(record.get("images"), list):  # the parts' images, in order
        from tunix_train.data.images import anchored_paths

        folder = path if path.is_dir() else path.parent
        record = {**record, "images": anchored_paths(record["images"], folder, f"{path}:{number}")}
    return record


def _json_lines(path: Path):
    """(line number, parsed JSON) of every non-blank line."""
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}:{number}: not valid JSON ({err.msg})") from None


class _ArrayRecordDocuments(Sequence):
    """Pre-tokenized documents: each record is the little-endian int32 token ids of one document."""

    def __init__(self, paths: list[Path]):
        from grain.sources import ArrayRecordDataSource

        self._source = ArrayRecordDataSource([str(p) for p in paths])

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        return {"tokens": np.frombuffer(self._source[index], dtype="<i4")}


def write_pretokenized(path: Path, documents: Sequence[np.ndarray]) -> None:
    """Writes token-id documents in the array_record format that data.source=array_record reads."""
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(path), "group_size:1")  # one record per chunk: fast random access
    try:
        for tokens in documents:
            writer.write(np.asarray(tokens, dtype="<i4").tobytes())
    finally:
        writer.close()


def read_documents(
    patterns: Sequence[str], data: DataConfig, key: str, required: Sequence[str] | None = None
) -> Sequence[dict[str, Any]]:
    """All documents of the files matching `patterns`; `key` names the config key in errors;
    `required`: the string fields every JSON-lines record must hold (kept whole)."""
    if data.source is DataSource.shakespeare:
        files, source = [BUNDLED_CORPUS], DataSource.jsonl
    elif data.hf_dataset and key == "data.train_files":
        files, source = [Path(data.hf_dataset).expanduser()], DataSource.jsonl
        if not files[0].is_dir():
            raise ConfigError(f"data.hf_dataset: no such directory {files[0]}")
    else:
        files, source = expand(patterns, key), data.source
    if not files:
        raise ConfigError(f"{key}: {list(patterns)} matches only directories")
    if source is DataSource.array_record:
        for path in files:
            if path.stat().st_size == 0:
                raise ConfigError(f"{key}: {path} is empty")
        try:
            docs = _ArrayRecordDocuments(files)
        except Exception as err:  # array_record raises plain RuntimeErrors for bad files
            raise ConfigError(
                f"{key}: cannot read {[str(f) for f in files]} as array_record ({err})"
            ) from None
        if len(docs) == 0:
            raise ConfigError(f"{key}: {[str(f) for f in files]} hold no documents")
        return docs
    docs = []
    for path in files:
        found = (
            _text_documents(path, data.text_unit)
            if source is DataSource.text
            else _record_documents(path, data, required)
        )
        if not found:
            raise ConfigError(f"{key}: {path} is empty (no documents)")
        docs += found
    return docs


def _tools(record: Any, where: str) -> dict[str, Any]:
    """A conversation's `tools` (as in TRL's datasets: the JSON schemas offered to the model, which
    the chat template renders), when it has them."""
    tools = record.get("tools") if isinstance(record, dict) else None
    if tools is None:
        return {}
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ConfigError(f'{where}: \'tools\' must be a list of JSON schemas ({{"type": "function", ...}})')
    return {"tools": tools}


class _Subset(Sequence):
    def __init__(self, docs: Sequence, indices: np.ndarray):
        self._docs, self._indices = docs, indices

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, index: int):
        return self._docs[int(self._indices[index])]


def prompt_source(data: DataConfig) -> str:
    """The config key that names where the training documents come from, for errors about them."""
    if data.source is DataSource.reasoning_gym:
        return "data.reasoning_gym"
    return "data.hf_dataset" if data.hf_dataset else "data.train_files"


def train_and_eval_documents(
    data: DataConfig, required: Sequence[str] | None = None
) -> tuple[Sequence, Sequence]:
    """The training documents and the held-out ones (eval_files, or a fixed eval_fraction;
    reasoning-gym's from their own seed)."""
    if data.source is DataSource.reasoning_gym:
        from tunix_train.data import reasoning_gym

        return reasoning_gym.documents(data.reasoning_gym, False), reasoning_gym.documents(
            data.reasoning_gym, True
        )
    docs = read_documents(data.train_files, data, "data.train_files", required)
    if data.eval_files:
        return docs, read_documents(data.eval_files, data, "data.eval_files", required)
    held_out = int(round(len(docs) * data.eval_fraction))
    if data.eval_fraction > 0 and held_out == 0 or held_out == len(docs):
        raise ConfigError(
            f"data.eval_fraction={data.eval_fraction} of {len(docs)} documents leaves "
            f"an empty split; set data.eval_files or change the fraction"
        )
    order = np.random.default_rng(EVAL_SPLIT_SEED).permutation(len(docs))
    return _Subset(docs, np.sort(order[held_out:])), _Subset(docs, np.sort(order[:held_out]))
