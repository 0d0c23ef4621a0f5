"""Runs a teacher once over a run's batches and stores its top-k log-probabilities per token, for
objective=distill with training.distill.teacher_logits=OUT (offline distillation, MaxText's recipe):

    python scripts/teacher_logits.py --out OUT --steps N training.distill.teacher=PATH \\
        training.distill.top_k=K [the distillation run's other overrides: model, data, batch, mesh]

It reads the batches the run would (the same data, seed, batch shape and mesh), the first N
training steps' and training.eval_batches evaluation batches, and writes them with the teacher's k
likeliest tokens and their log-probabilities (at temperature 1) per position, one Parquet file per
process (tunix_train/data/teacher_logits.py). The teacher's logits are computed
training.loss_chunk_size positions at a time. Bad input is one line and exit code 2; OUT must not
exist. Its last line is JSON: the steps, rows and seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def write(out: Path, steps: int, overrides: list[str], devices=None) -> dict:
    """Writes OUT on `devices` (default: all); returns the figures."""
    import jax
    from jax.experimental import multihost_utils

    from tunix_train.compose import load_config
    from tunix_train.config import ConfigError
    from tunix_train.data import Data
    from tunix_train.data import teacher_logits as stored
    from tunix_train.launch import distributed
    from tunix_train.platform import add_flags
    from tunix_train.sharding import batch_sharding, process_rows, to_global_batch
    from tunix_train.train.forward import Forward, ForwardOptions
    from tunix_train.train.init import COMPUTE_DTYPES
    from tunix_train.train.objectives.base import PROBE
    from tunix_train.train.objectives.distill import Distillation
    from tunix_train.train.setup import setup

    cfg, _ = load_config(["objective=distill", *overrides, f"training.max_steps={steps}"])
    d = cfg.training.distill
    if not d.teacher or not d.top_k:
        raise ConfigError("teacher_logits.py needs training.distill.teacher and training.distill.top_k > 0")
    if out.exists():
        raise ConfigError(f"--out {out} exists; name a new directory")
    add_flags(cfg.training)
    distributed.initialize(cfg.distributed)
    objective = Distillation(cfg)
    data = Data(cfg)
    objective.read(data)  # the teacher's vocabulary and tokenizer against the data's
    run = setup(cfg, devices, objective)
    rows = process_rows(run.mesh, run.micro_batch)
    teacher = run.extras
    spec = teacher.specs["teacher"]
    graphdef, params = teacher.graphdefs["teacher"], teacher.params()["teacher"]
    k, spec_of_batch = d.top_k, batch_sharding(run.mesh).spec

    @jax.jit
    def top_k(params, batch):
        def one(micro):
            options = ForwardOptions(COMPUTE_DTYPES[spec.precision], cfg.training.loss_chunk_size)
            forward = Forward(graphdef, (params,), micro, options, frozen=True)
            return forward.per_token(lambda logits: jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k))

        log_probs, ids = jax.lax.map(one, batch)
        return {"top_log_probs": log_probs, "top_ids": ids}

    writer = stored.Writer(out, jax.process_index(), rows)
    start = time.perf_counter()
    train_batches = data.train_batches(run.micro_batch, rows)
    try:
        with jax.set_mesh(run.mesh):
            for split, batches in (
                ("train", (next(train_batches) for _ in range(steps))),
                ("eval", data.eval_batches(run.micro_batch, rows)),
            ):
                for host in batches:
                    found = top_k(params, to_global_batch(host, run.mesh))
                    local = multihost_utils.global_array_to_host_local_array(found, run.mesh, spec_of_batch)
                    writer.add(split, {**host, **jax.tree.map(jax.device_get, local)})
    finally:
        train_batches.close()
        writer.close()
    if jax.process_index() == 0:
        tokenizer = getattr(data, "tokenizer", None)
        stored.write_meta(
            out,
            {
                "teacher": str(d.teacher),
                "top_k": k,
                "vocab_size": cfg.model.vocab_size,
                "seq_len": cfg.data.seq_len,
                "global_micro_batch": run.micro_batch,
                "accumulation_steps": cfg.training.gradient_accumulation_steps,
                "steps": writer.counts["train"],
                "eval_batches": writer.counts["eval"],
                "processes": jax.process_count(),
                "probe": None if tokenizer is None else tokenizer.encode(PROBE),
            },
        )
    return {
        "steps": writer.counts["train"],
        "eval_batches": writer.counts["eval"],
        "rows_per_step": run.micro_batch * cfg.training.gradient_accumulation_steps,
        "top_k": k,
        "seconds": round(time.perf_counter() - start, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, type=Path, help="a new directory")
    parser.add_argument("--steps", required=True, type=int, help="training steps to store")
    args, overrides = parser.parse_known_args(argv)
    from tunix_train.config import ConfigError

    try:
        figures = write(args.out, args.steps, overrides)
    except ConfigError as err:
        print(f"teacher_logits.py: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
