"""Tokenizes text or JSONL documents once into an array_record file for data.source=array_record.

    python scripts/pretokenize.py --output tokens.array_record [--tokenizer tokenizer.model] \\
        [--source text|jsonl] [--text-unit paragraph] [--text-field text] FILE_OR_GLOB...

Each record is one document, [BOS] text [EOS], as little-endian int32 token ids.
"""

import argparse
import sys
from pathlib import Path

from tunix_train.config import ConfigError, DataConfig, DataSource, TextUnit
from tunix_train.data.sources import read_documents, write_pretokenized
from tunix_train.data.tokenizer import load_tokenizer, with_bos


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("files", nargs="+")
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--tokenizer", default=None, help="SentencePiece model (default: the bundled one)")
    parser.add_argument("--source", choices=["text", "jsonl"], default="text")
    parser.add_argument("--text-unit", choices=[u.value for u in TextUnit], default="paragraph")
    parser.add_argument("--text-field", default="text")
    args = parser.parse_args()
    try:
        data = DataConfig(
            source=DataSource(args.source),
            text_unit=TextUnit(args.text_unit),
            text_field=args.text_field,
            train_files=args.files,
        )
        tokenizer = load_tokenizer(args.tokenizer, vocab_size=2**31 - 1)
        docs = read_documents(args.files, data, "files")
        if args.output.exists():
            raise ConfigError(f"--output {args.output} exists; choose a new path")
        write_pretokenized(
            args.output, ([*with_bos(tokenizer, tokenizer.encode(d["text"])), tokenizer.eos_id] for d in docs)
        )
    except ConfigError as err:
        print(f"pretokenize: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {len(docs):,} documents to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
