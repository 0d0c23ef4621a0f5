"""Train a Gemma-family model: python run_training.py [hydra overrides...], or tunix-train.

Exit codes (tunix_train/exit_codes.py): 0 done, 2 a config error, 3 a non-finite step
(nan_policy=stop), 75 preempted (SIGTERM: checkpoint saved, restart me), other: a failure.
"""

import sys
from pathlib import Path

from tunix_train import exit_codes
from tunix_train.compose import load_config
from tunix_train.config import ConfigError


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, run = load_config(sys.argv[1:] if argv is None else argv)
        from tunix_train.platform import add_flags  # imports jax: after the cheap config checks

        add_flags(cfg.training)  # before the backend starts
        from tunix_train.launch import distributed

        how = distributed.initialize(cfg.distributed)  # before anything asks JAX for devices
        distributed.check_devices()
        from tunix_train.train.loop import train
        from tunix_train.train.signals import RunStopped

        try:
            train(cfg, Path(run["run_dir"]), run["overrides"], processes=how)
        except RunStopped as stopped:
            print(f"tunix_train: {stopped}", file=sys.stderr if stopped.exit_code else sys.stdout)
            return stopped.exit_code
    except ConfigError as err:
        print(f"tunix_train: error: {err}", file=sys.stderr)
        return exit_codes.CONFIG_ERROR
    return exit_codes.OK
