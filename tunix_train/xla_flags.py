"""XLA flags set before JAX starts its backend (XLA reads XLA_FLAGS once, at that moment)."""

from __future__ import annotations

import os

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


def add_gpu_overlap_flags() -> None:
    """Appends GPU_OVERLAP to XLA_FLAGS; a flag already there keeps the user's value."""
    current = os.environ.get("XLA_FLAGS", "")
    given = {flag.split("=")[0] for flag in current.split()}
    extra = [flag for flag in GPU_OVERLAP if flag.split("=")[0] not in given]
    os.environ["XLA_FLAGS"] = " ".join([current, *extra]).strip()
