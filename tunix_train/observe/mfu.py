"""Model FLOPs utilization: the architecture's training FLOPs per token over the devices' peak.

Per token, one training step (forward + backward = 3 x forward) costs
  6 x (matmul parameters of all layers)          projections and MLP
  6 x embed_dim x vocab_size                     the logits (tied embedding used as output)
  12 x heads x head_dim x (keys attended)        per layer: scores and the weighted sum
where "keys attended" is the mean number of positions a query sees: (S + 1) / 2 for a causal
global layer, and for a sliding-window layer the mean of min(t + 1, window). Layers count their own
shapes (Gemma 4's global layers, KV-sharing layers without key/value projections); of the experts
only the k a token is routed to count (active parameters), with the router.
"""

from __future__ import annotations

import time

import numpy as np

from tunix_train.config import ModelConfig
from tunix_train.model.layout import layer_shapes, layer_windows

# Dense peak FLOP/s per device from vendors' data sheets, by compute dtype. On NVIDIA GPUs XLA runs
# float32 matmuls as TF32 by default, so float32 uses the TF32 tensor-core figure.
PEAK_FLOPS = {
    "H100": {"bf16": 989e12, "fp32": 494e12},  # SXM
    "H200": {"bf16": 989e12, "fp32": 494e12},
    "A100": {"bf16": 312e12, "fp32": 156e12},
    "TPU v4": {"bf16": 275e12, "fp32": 275e12},
    "TPU v5 lite": {"bf16": 197e12, "fp32": 197e12},  # v5e
    "TPU v5p": {"bf16": 459e12, "fp32": 459e12},
    "TPU v6 lite": {"bf16": 918e12, "fp32": 918e12},  # v6e (Trillium)
}


def mean_keys_attended(seq_len: int, window: int) -> float:
    t = np.arange(seq_len)
    return float(np.minimum(t + 1, window).mean())


def active_matmul_params(cfg: ModelConfig) -> int:
    """Matmul parameters a token goes through: every layer's projections and MLP, its k experts and
    the router, the per-layer inputs' projections; not the embedding lookups."""
    D, N, P = cfg.embed_dim, cfg.num_heads, cfg.gemma4.per_layer_input_dim
    total = D * cfg.num_layers * P  # the projection of the embeddings to the per-layer inputs
    for shape in layer_shapes(cfg):
        H, K = shape.head_dim, shape.num_kv_heads
        kv_projections = 0 if shape.shares_kv else 1 if shape.k_eq_v else 2
        total += 2 * D * N * H + kv_projections * D * K * H + 3 * D * shape.mlp_dim + 2 * D * P
        if cfg.moe.experts:
            total += D * cfg.moe.experts + cfg.moe.experts_per_token * 3 * D * cfg.moe.hidden_dim
    return total


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    attention = sum(
        12 * cfg.num_heads * shape.head_dim * mean_keys_attended(seq_len, int(w))
        for shape, w in zip(layer_shapes(cfg), layer_windows(cfg))
    )
    return 6 * active_matmul_params(cfg) + 6 * cfg.embed_dim * cfg.vocab_size + attention


def peak_flops_per_device(device_kind: str, dtype: str) -> float | None:
    """The table's figure for a device kind as JAX names it (e.g. 'NVIDIA H100 80GB HBM3'), or None."""
    for name, peaks in PEAK_FLOPS.items():
        if name.lower() in device_kind.lower():
            return peaks[dtype]
    return None


def matmul_sampler(dtype: str = "fp32", devices=None, size: int = 1024):
    """A function of seconds -> FLOP/s of a size x size matmul in the compute dtype, run on each of
    `devices` (default: this process's first) at once and summed, over that many seconds. Compiled
    once, so that it can sample the peak again and again between other work."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = list(devices or jax.local_devices()[:1])
    jnp_dtype = jnp.bfloat16 if dtype == "bf16" else jnp.float32
    mesh = Mesh(np.array(devices), ("d",))
    x = jax.device_put(jnp.ones((len(devices), size, size), jnp_dtype), NamedSharding(mesh, P("d")))
    matmul = jax.jit(lambda a: jnp.einsum("dij,djk->dik", a, a))
    matmul(x).block_until_ready()

    def sample(seconds: float) -> float:
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            matmul(x).block_until_ready()
            calls += 1
        return 2 * size**3 * len(devices) * calls / (time.perf_counter() - start)

    return sample


class Peak:
    """Peak FLOP/s per device, MFU's denominator, and where the figure comes from: the config, a
    data sheet, or (a machine with no table entry: a CPU) measured, the best of several short
    matmul samples, so that a machine busy for a moment at start-up does not lower it. A measured
    peak that the run itself then beats was measured low: `revise` measures it again."""

    SAMPLES, SECONDS = 5, 0.05

    def __init__(self, value: float, source: str, sample=None):
        self.value, self.source, self._sample = value, source, sample

    @classmethod
    def for_run(cls, configured: float | None, dtype: str) -> Peak:
        import jax

        if configured:
            return cls(configured, "training.peak_flops_per_device")
        kind = jax.devices()[0].device_kind
        if table := peak_flops_per_device(kind, dtype):
            return cls(table, f"data sheet, {kind}")
        sample = matmul_sampler(dtype)
        return cls(cls._best(sample), f"measured {dtype} matmul on {kind}", sample)

    @classmethod
    def _best(cls, sample) -> float:
        return max(sample(cls.SECONDS) for _ in range(cls.SAMPLES))

    def revise(self, observed: float) -> str | None:
        """When the run's FLOP/s per device (`observed`) exceed a measured peak: the peak measured
        again, at least `observed`, and a line saying so; otherwise None."""
        if self._sample is None or observed <= self.value:
            return None
        before, self.value = self.value, max(observed, self._best(self._sample))
        return (
            f"MFU peak revised: the run reached {observed / 1e12:.3f} TFLOP/s per device, above the peak "
            f"measured at start-up ({before / 1e12:.3f}); measured again: {self.value / 1e12:.3f} TFLOP/s"
        )


def device_memory_in_use() -> float | None:
    """Bytes in use on the first local device, where the backend reports it (not on CPU)."""
    import jax

    stats = jax.local_devices()[0].memory_stats()
    return float(stats["bytes_in_use"]) if stats and "bytes_in_use" in stats else None
