"""Text generation: the inference engine (engine.py: continuous batching over slots of a sharded KV
cache, cache.py), how tokens are drawn (sampling.py), and the CLI (__main__).

The names below load on first use, so that `python -m tunix_train.generate` reads --mesh_shape
(and gives the process its fake CPU devices: cpu_devices.py) before JAX starts."""

import importlib

_MODULE_OF = {"Completion": "engine", "Engine": "engine", "Request": "engine", "Tuning": "engine"}
_MODULE_OF["Sampling"] = "sampling"
__all__ = ["Completion", "Engine", "Request", "Sampling", "Tuning"]


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'tunix_train.generate' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tunix_train.generate.{_MODULE_OF[name]}"), name)
