"""Export a run's checkpoint as a Hugging Face checkpoint that transformers loads.

    python -m tunix_train.export RUN_DIR_OR_CHECKPOINT OUTPUT_DIR [--adapters]

Writes OUTPUT_DIR/config.json, OUTPUT_DIR/model.safetensors (float32) and the run's tokenizer
(tokenizer.json or tokenizer.model); the latest checkpoint of a run or checkpoints/ folder, or the
given step's folder. A LoRA run exports its adapters merged into the base it started from, or with
--adapters only the adapters, in PEFT's format (adapter_config.json, adapter_model.safetensors).
"""

import argparse
import sys
from pathlib import Path

from tunix_train import exit_codes
from tunix_train.config import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a run directory, its checkpoints/ folder, or a step folder")
    parser.add_argument("output", type=Path, help="a new or empty directory")
    parser.add_argument("--adapters", action="store_true", help="a LoRA run's adapters only, for PEFT")
    args = parser.parse_args(argv)
    try:
        if args.output.exists() and any(args.output.iterdir()):
            raise ConfigError(f"{args.output} is not empty; choose a new output directory")
        from tunix_train import api

        model = api.load(args.checkpoint)
        (model.export_adapters if args.adapters else model.export)(args.output)
    except ConfigError as err:
        print(f"tunix_train.export: error: {err}", file=sys.stderr)
        return exit_codes.CONFIG_ERROR
    what = f"{model.config.name}'s LoRA adapters" if args.adapters else model.config.name
    print(f"exported {what} to {args.output}")
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
