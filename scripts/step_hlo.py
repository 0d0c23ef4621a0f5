"""The optimized HLO of a config's train and eval steps, for checking that a refactor compiles to
the same program:

    python scripts/step_hlo.py --cpu-devices 4 --out /tmp/hlo overrides...

Writes train.hlo and eval.hlo, and score.hlo for an objective with a scoring pass (PPO), XLA's
source locations and op names stripped (they name Python files and lines), and ends with one JSON
line of their sha256 digests and instruction counts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path


def _stripped(text: str) -> str:
    """The program without XLA's tables of source locations (the sections FileNames to
    StackFrames, rows `N ...`) and the instructions' metadata."""
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    tables = re.compile(r"^(FileNames|FunctionNames|FileLocations|StackFrames)$|^\d+ ")
    return "\n".join(line for line in text.splitlines() if line.strip() and not tables.match(line))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-devices", type=int, default=None)
    parser.add_argument("--out", type=Path, required=True)
    args, overrides = parser.parse_known_args(argv)
    if args.cpu_devices:
        from tunix_train.cpu_devices import use_cpu_devices

        use_cpu_devices(args.cpu_devices)
    import jax

    from tunix_train.compose import load_config
    from tunix_train.platform import add_flags
    from tunix_train.train.setup import setup
    from tunix_train.train.step import abstract_batch

    cfg, _ = load_config(overrides)
    add_flags(cfg.training)
    run = setup(cfg)
    t = cfg.training
    figures = {}
    args.out.mkdir(parents=True, exist_ok=True)
    with jax.set_mesh(run.mesh):
        batch = abstract_batch(
            run.mesh,
            t.gradient_accumulation_steps,
            run.micro_batch,
            cfg.data.seq_len,
            run.objective.batch_dtypes,
        )
        eval_batch = abstract_batch(
            run.mesh, 1, run.micro_batch, cfg.data.seq_len, run.objective.batch_dtypes
        )
        programs = {
            "train": run.step_fn.lower(run.plan.abstract, batch),
            "eval": run.eval_fn.lower(run.plan.abstract.params, run.plan.abstract.frozen, eval_batch),
        }
        if run.objective.scores:  # a scoring pass (PPO's critic)
            programs["score"] = run.score_fn.lower(run.plan.abstract.params, run.plan.abstract.frozen, batch)
        for name, lowered in programs.items():
            text = _stripped(lowered.compile().as_text())
            (args.out / f"{name}.hlo").write_text(text)
            figures[f"{name}_sha256"] = hashlib.sha256(text.encode()).hexdigest()[:16]
            figures[f"{name}_instructions"] = sum(" = " in line for line in text.splitlines())
    print(json.dumps(figures))


if __name__ == "__main__":
    main(sys.argv[1:])
