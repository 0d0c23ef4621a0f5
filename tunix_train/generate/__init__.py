"""Text generation: a sampler with a sharded KV cache (sampler.py, cache.py) and its CLI (__main__)."""

from tunix_train.generate.sampler import Sampler, Sampling

__all__ = ["Sampler", "Sampling"]
