"""Input speed: tokens/s the data pipeline alone delivers vs tokens/s the train step consumes.

    python scripts/data_benchmark.py [hydra overrides...] [--seconds 10] [--train-steps 10]

Both are measured in this one run, for the same config (by default the default job).
"""

import argparse
import time

import jax

from tunix_train.compose import load_config
from tunix_train.data import Data
from tunix_train.sharding import to_global_batch
from tunix_train.train.setup import setup


def pipeline_tokens_per_sec(data: Data, micro_batch: int, seconds: float) -> float:
    batches = data.train_batches(micro_batch)
    try:
        next(batches)  # start-up (thread, first documents) is not steady state
        tokens, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            tokens += next(batches)["inputs"].size
        return tokens / (time.perf_counter() - start)
    finally:
        batches.close()


def train_tokens_per_sec(cfg, data: Data, steps: int, devices=None) -> float:
    """Steady-state tokens/s of the compiled train step, with every batch already on the devices."""
    run = setup(cfg, devices)
    batches = data.train_batches(run.micro_batch)
    try:
        with jax.set_mesh(run.mesh):
            host = [next(batches) for _ in range(steps + 1)]  # data is ready: time the step alone
            device = [to_global_batch(b, run.mesh) for b in host]
            state = run.plan.create()
            step = run.step_fn.lower(state, device[0]).compile()
            state, metrics = step(state, device[0])
            jax.block_until_ready(metrics)
            start = time.perf_counter()
            for batch in device[1:]:
                state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            return sum(b["inputs"].size for b in host[1:]) / (time.perf_counter() - start)
    finally:
        batches.close()


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--train-steps", type=int, default=10)
    args, overrides = parser.parse_known_args()
    cfg, _ = load_config(overrides)
    data = Data(cfg)
    micro_batch = setup(cfg).micro_batch
    pipeline = pipeline_tokens_per_sec(data, micro_batch, args.seconds)
    training = train_tokens_per_sec(cfg, data, args.train_steps)
    print(
        f"config: model={cfg.model.name} data={cfg.data.source.value} seq_len={cfg.data.seq_len} "
        f"rows/micro-step={micro_batch} accumulation={cfg.training.gradient_accumulation_steps} "
        f"devices={jax.device_count()}"
    )
    print(f"pipeline alone: {pipeline:12,.0f} tokens/s")
    print(f"train step:     {training:12,.0f} tokens/s")
    print(f"ratio:          {pipeline / training:12.1f}x")


if __name__ == "__main__":
    main()
