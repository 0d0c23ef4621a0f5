"""Text generation: the inference engine (engine.py: continuous batching over slots of a sharded KV
cache, cache.py), how tokens are drawn (sampling.py), and the CLI (__main__)."""

from tunix_train.generate.engine import Completion, Engine, Request, Tuning
from tunix_train.generate.sampling import Sampling

__all__ = ["Completion", "Engine", "Request", "Sampling", "Tuning"]
