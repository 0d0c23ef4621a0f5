"""lm-evaluation-harness tasks on a checkpoint (a run, a Hugging Face directory, a GGUF file):

    python -m tunix_train.evaluate PATH --tasks arc_easy,hellaswag [--num_fewshot 5] [--limit 100]
    python -m tunix_train.evaluate PATH --tasks my_task --include_path my_tasks/ \
        [--mesh_shape '[[4],["fsdp"]]'] [--batch_size 8] [--max_length 2048] [--add_bos_token false]

Prints lm-eval's table, then its results as one JSON line ({"results": {task: {"acc,none": ...}}}).
lm-eval's own tasks fetch their data from the Hugging Face hub; --include_path reads local ones.
Bad input is a one-line error and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from tunix_train import exit_codes
from tunix_train.cpu_devices import mesh_shape_argument


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tunix_train.evaluate", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "path", help="a tunix_train run (or one checkpoint), a Hugging Face directory, a GGUF file"
    )
    parser.add_argument("--tasks", required=True, help="lm-eval task names or YAML files, comma-separated")
    parser.add_argument("--include_path", default=None, help="a folder of lm-eval task YAMLs")
    parser.add_argument("--num_fewshot", type=int, default=None)
    parser.add_argument(
        "--limit", type=float, default=None, help="at most this many examples a task (<1: a fraction)"
    )
    parser.add_argument("--batch_size", type=int, default=8, help="rows scored at once")
    parser.add_argument(
        "--max_length", type=int, default=None, help="tokens a row holds (default: the model's context)"
    )
    parser.add_argument("--add_bos_token", choices=("true", "false"), default=None,
                        help="BOS before each text (default: where the tokenizer adds one)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="of sampled generations")
    parser.add_argument(
        "--mesh_shape", default=None, help="JSON [[sizes], [axis names]] (default: all devices on fsdp)"
    )
    args = parser.parse_args(argv)
    if args.batch_size < 1 or (args.max_length is not None and args.max_length < 2):
        parser.error("--batch_size must be at least 1 and --max_length at least 2")
    if args.num_fewshot is not None and args.num_fewshot < 0 or args.limit is not None and args.limit <= 0:
        parser.error("--num_fewshot must be at least 0 and --limit positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _arguments(sys.argv[1:] if argv is None else argv)
    from tunix_train.config import ConfigError
    from tunix_train.evaluate import headline, lm_eval_module, run_tasks

    try:
        mesh_shape = mesh_shape_argument(args.mesh_shape)
        tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
        if not tasks:
            raise ConfigError("--tasks names no task")
        limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
        results = run_tasks(
            args.path,
            tasks,
            args.include_path,
            args.num_fewshot,
            limit,
            mesh_shape=mesh_shape,
            batch_size=args.batch_size,
            max_length=args.max_length,
            add_bos_token=None if args.add_bos_token is None else args.add_bos_token == "true",
            seed=args.seed,
        )
    except (ConfigError, ValueError) as err:
        print(f"tunix_train.evaluate: error: {' '.join(str(err).split())}", file=sys.stderr)
        return exit_codes.CONFIG_ERROR
    print(lm_eval_module().utils.make_table(results))
    print(json.dumps(headline(results)))
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
