"""Export a run's checkpoint as a Hugging Face checkpoint that transformers loads, or as a GGUF
file that llama.cpp, Ollama and LM Studio run.

    python -m tunix_train.export RUN_DIR_OR_CHECKPOINT OUTPUT_DIR [--adapters]
    python -m tunix_train.export RUN_OR_PATH OUT.gguf --format gguf [--dtype f16] [--overwrite]
        [--mmproj MMPROJ.gguf]
    python -m tunix_train.export LORA_RUN ADAPTER.gguf --format gguf --adapters [--dtype f16]

Writes OUTPUT_DIR/config.json, OUTPUT_DIR/model.safetensors (float32) and the run's tokenizer
(tokenizer.json or tokenizer.model) with its chat template (chat_template.jinja); the latest
checkpoint of a run or checkpoints/ folder, or the given step's folder. A LoRA run exports its
adapters merged into the base it started from, or with --adapters only the adapters, in PEFT's
format (adapter_config.json, adapter_model.safetensors; a reward model's head in
modules_to_save). --format gguf writes one file (the weights in --dtype f32, f16, bf16, q8_0 or
q4_0, the tokenizer, the chat template; a LoRA run merged), from a run or any checkpoint
tunix_train reads; an existing file is replaced only with --overwrite.
--format gguf --adapters writes a LoRA run's adapters alone as a llama.cpp LoRA adapter (--dtype f32,
f16, bf16 or q8_0) to apply on top of the base's GGUF file. --mmproj writes a Gemma 3 or 4 model's
image tower as llama.cpp's projector file beside it (f32 with --dtype f32, else f16).
"""

import argparse
import sys
from pathlib import Path

from tunix_train import exit_codes
from tunix_train.config import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", help="a run directory, its checkpoints/ folder, or a step folder")
    parser.add_argument("output", type=Path, help="a new or empty directory")
    parser.add_argument("--adapters", action="store_true", help="a LoRA run's adapters only, for PEFT")
    parser.add_argument("--format", choices=["hf", "gguf"], default="hf")
    parser.add_argument("--dtype", default="f16", help="GGUF: f32, f16, bf16, q8_0 or q4_0")
    parser.add_argument("--overwrite", action="store_true", help="GGUF: replace an existing file")
    parser.add_argument(
        "--mmproj", type=Path, metavar="FILE", help="GGUF: also the image tower, as llama.cpp's mmproj file"
    )
    args = parser.parse_args(argv)
    try:
        from tunix_train.interop.gguf_export import ADAPTER_DTYPES, DTYPES

        if args.format == "gguf":
            allowed = ADAPTER_DTYPES if args.adapters else DTYPES
            if args.dtype not in allowed:
                raise ConfigError(
                    f"--dtype {args.dtype}: GGUF {'adapter ' if args.adapters else ''}export writes "
                    f"{', '.join(allowed)}"
                )
            if args.output.exists() and not args.overwrite:
                raise ConfigError(f"{args.output} exists: pass --overwrite to replace it")
        elif args.mmproj is not None:
            raise ConfigError("--mmproj goes with --format gguf")
        elif args.output.exists() and any(args.output.iterdir()):
            raise ConfigError(f"{args.output} is not empty; choose a new output directory")
        from tunix_train import api

        model = api.load(args.checkpoint)
        if args.adapters:
            model.export_adapters(
                args.output, args.format if args.format == "gguf" else "peft", args.dtype, args.overwrite
            )
        elif args.format == "gguf":
            model.export_gguf(args.output, args.dtype, args.overwrite, args.mmproj)
        else:
            model.export(args.output)
    except ConfigError as err:
        print(f"tunix_train.export: error: {err}", file=sys.stderr)
        return exit_codes.CONFIG_ERROR
    what = f"{model.config.name}'s LoRA adapters" if args.adapters else model.config.name
    print(f"exported {what} to {args.output}")
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
