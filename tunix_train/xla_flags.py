"""Compiler settings decided before compiling: XLA flags set before JAX starts its backend (XLA
reads XLA_FLAGS once, at that moment), and whether JAX's persistent compilation cache may be used."""

from __future__ import annotations

import logging
import os

import jax
from jax.experimental.compilation_cache import compilation_cache

from tunix_train.config import TrainingConfig

# NVIDIA GPUs: schedule collectives to overlap computation, and pipeline the scanned layers'
# collectives (the next layer's fsdp all-gather runs during this layer's compute). Other
# backends ignore them.
GPU_OVERLAP = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
)
# XLA:CPU: fuse loops that share inputs (Adam's moments and parameter, say) into one loop with
# several outputs, instead of duplicating shared producers into each consumer. A backend option,
# off by default, that XLA reads by its presence; other backends skip options named xla_*.
_CPU_FUSION_OPTION = "xla_cpu_use_multi_output_fusion"
CPU_MULTI_OUTPUT_FUSION = f"--xla_backend_extra_options={_CPU_FUSION_OPTION}"


def flags_for(training: TrainingConfig, current: str = "") -> list[str]:
    """The flags `training` asks for (xla_gpu_overlap, xla_cpu_multi_output_fusion) that XLA_FLAGS
    `current` does not already set: a flag already there keeps the user's value."""
    given = {flag.split("=")[0] for flag in current.split()}
    extra = [flag for flag in GPU_OVERLAP if flag.split("=")[0] not in given] if training.xla_gpu_overlap else []
    if training.xla_cpu_multi_output_fusion and _CPU_FUSION_OPTION not in current:
        extra.append(CPU_MULTI_OUTPUT_FUSION)  # backend options from several flags are merged
    return extra


def add_flags(training: TrainingConfig) -> None:
    """Appends flags_for(training) to XLA_FLAGS; call it before the backend starts."""
    current = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = " ".join([current, *flags_for(training, current)]).strip()


def avoid_cache_for_cpu_collectives(mesh: jax.sharding.Mesh) -> None:
    """Turns off JAX's persistent compilation cache when this process runs collectives between CPU
    devices: jaxlib 0.10.2's CPU runtime loses the order of collectives in an executable loaded
    from the cache, and its devices then wait in different collectives until XLA aborts the
    process (docs/performance.md). Executables already loaded stay; later compiles are fresh."""
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    if len(local) < 2 or local[0].platform != "cpu" or not jax.config.jax_enable_compilation_cache:
        return
    if jax.config.jax_compilation_cache_dir:
        logging.getLogger(__name__).warning(
            "persistent compilation cache off: collectives between CPU devices deadlock when loaded from it")
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # JAX decides at its first compile whether to use the cache
