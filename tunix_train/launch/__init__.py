"""Starting runs: the local launcher (`python -m tunix_train.launch`, local.py), jax.distributed
set-up in each process (distributed.py) and what each process sees (`python -m
tunix_train.launch.devices`)."""

from tunix_train.launch.local import main

__all__ = ["main"]
