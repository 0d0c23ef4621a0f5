"""Compile time of the train step against depth: scanned layers keep it flat.

python scripts/compile_time.py [model=gemma3_small] [--layers 2 8 32]
"""

import argparse
import time

import jax

from tunix_train.compose import load_config
from tunix_train.data.synthetic import SyntheticBatches
from tunix_train.platform import add_flags
from tunix_train.sharding import to_global_batch
from tunix_train.train.setup import setup


def compile_seconds(overrides: list[str]) -> float:
    cfg, _ = load_config(["data=synthetic", *overrides])
    add_flags(cfg.training)  # as run_training.py does, before the backend starts (a second call adds nothing)
    run = setup(cfg)
    data = SyntheticBatches(
        seq_len=cfg.data.seq_len,
        vocab_size=cfg.model.vocab_size,
        accumulation_steps=cfg.training.gradient_accumulation_steps,
        global_micro_batch=run.micro_batch,
        seed=0,
    )
    with jax.set_mesh(run.mesh):
        start = time.perf_counter()
        run.step_fn.lower(run.plan.abstract, to_global_batch(next(data), run.mesh)).compile()
        return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    args, overrides = parser.parse_known_args()
    print(f"{'layers':>6}  {'compile s':>9}")
    for n in args.layers:
        print(f"{n:>6}  {compile_seconds([*overrides, f'model.num_layers={n}']):>9.2f}")


if __name__ == "__main__":
    main()
