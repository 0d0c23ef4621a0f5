"""Everything that exists for one backend's sake: the only module that says "CPU" or "GPU".

- XLA flags, set before JAX starts its backend (XLA reads XLA_FLAGS once, at that moment);
- whether JAX's persistent compilation cache may be used (not for collectives between CPU devices);
- glibc's malloc settings for a process whose devices are CPUs;
- training options that need a kind of device (cuDNN attention, pinned host memory).
"""

from __future__ import annotations

import ctypes
import logging
import os

import jax
from jax.experimental.compilation_cache import compilation_cache

from tunix_train.config import AttentionImpl, ConfigError, Remat, TrainingConfig

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
# NVIDIA GPUs: deterministic kernels (scatter-adds and reductions without atomics). Without it two
# runs of the default job on an H200 differed after 300 steps (45 of 49 arrays, by up to 0.06); with
# it two runs, and a run killed with -9 after step 200 and rerun, were bit-identical.
GPU_DETERMINISTIC = "--xla_gpu_deterministic_ops=true"
# XLA:CPU: fuse loops that share inputs (Adam's moments and parameter, say) into one loop with
# several outputs, instead of duplicating shared producers into each consumer. A backend option,
# off by default, that XLA reads by its presence; other backends skip options named xla_*.
_CPU_FUSION_OPTION = "xla_cpu_use_multi_output_fusion"
CPU_MULTI_OUTPUT_FUSION = f"--xla_backend_extra_options={_CPU_FUSION_OPTION}"


# XLA:CPU: the dots of a few rows of speculative decoding's verify rounds (k + 1 positions of each
# slot) as its own dots rather than YNNPACK fusions: a 5-position forward of gemma3_small took 3.5
# ms against 4.3 (medians of 30 alternating calls, jaxlib 0.10.2). A compile option of that program
# alone: a decode step's one position per slot was no faster, training's large dots keep the default.
_CPU_SMALL_DOTS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def small_dot_options(mesh: jax.sharding.Mesh) -> dict:
    """jax.jit compiler_options for a program of small dots on `mesh`'s devices."""
    return dict(_CPU_SMALL_DOTS) if mesh.devices.flat[0].platform == "cpu" else {}


def flags_for(training: TrainingConfig, current: str = "") -> list[str]:
    """The flags `training` asks for (xla_gpu_overlap, deterministic, xla_cpu_multi_output_fusion)
    that XLA_FLAGS `current` does not already set: a flag already there keeps the user's value."""
    given = {flag.split("=")[0] for flag in current.split()}
    wanted = [
        *(GPU_OVERLAP if training.xla_gpu_overlap else ()),
        *((GPU_DETERMINISTIC,) if training.deterministic else ()),
    ]
    extra = [flag for flag in wanted if flag.split("=")[0] not in given]
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
            "persistent compilation cache off: collectives between CPU devices deadlock when loaded from it"
        )
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # JAX decides at its first compile whether to use the cache


# glibc malloc on CPU. XLA's CPU runtime mallocs each execution's buffers and frees them when it
# ends. glibc serves a request above 32 MiB (its largest mmap threshold) with a fresh mmap, and a
# thread's arena unmaps a heap as soon as it is empty, so every train step page-faulted its
# temporaries in anew (docs/performance.md). Keeping freed memory in the heap removes the faults;
# the process then holds on to its peak, as a GPU allocator does. mallopt's parameters are from
# glibc's malloc.h.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4
_SETTINGS = (
    (_M_MMAP_MAX, 0),  # no mmap for large requests: they come from the heap and go back to it
    (_M_TRIM_THRESHOLD, 2**31 - 1),  # never give the heap's free top back to the system
    (_M_TOP_PAD, 64 << 20),  # an empty thread heap is kept, not unmapped (glibc's heap_trim)
)


def _is_glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError, AttributeError):  # macOS, musl, Windows
        return False


def keep_freed_memory_on_cpu(mesh: jax.sharding.Mesh) -> bool:
    """Applies _SETTINGS when this process's devices are CPUs and libc is glibc; True if it did.
    GLIBC_TUNABLES naming any glibc.malloc setting leaves malloc as the user set it."""
    if mesh.devices.flat[0].platform != "cpu" or not _is_glibc():
        return False
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    mallopt = ctypes.CDLL(None).mallopt
    if not all(mallopt(param, value) == 1 for param, value in _SETTINGS):
        logging.getLogger(__name__).warning("glibc refused a mallopt setting; CPU steps may page-fault")
        return False
    return True


def prepare(training: TrainingConfig, mesh: jax.sharding.Mesh) -> None:
    """What a run on `mesh` needs of its backend before it compiles anything."""
    validate_training_for_mesh(training, mesh)
    avoid_cache_for_cpu_collectives(mesh)
    keep_freed_memory_on_cpu(mesh)


def validate_training_for_mesh(training: TrainingConfig, mesh: jax.sharding.Mesh) -> None:
    """Training options that need a kind of device, as config errors."""
    device = mesh.devices.flat[0]
    if training.attention is AttentionImpl.cudnn and device.platform != "gpu":
        raise ConfigError(
            f"training.attention=cudnn needs NVIDIA GPUs, and this mesh is on {device.platform}: "
            f"use training.attention=xla"
        )
    kinds = {m.kind for m in device.addressable_memories()}
    if training.remat is Remat.offload_matmul_outputs and "pinned_host" not in kinds:
        raise ConfigError(
            f"training.remat=offload_matmul_outputs needs pinned host memory, which "
            f"{device.platform} devices do not offer: choose another training.remat"
        )
    offloads = {
        "offload_optimizer_state": training.offload_optimizer_state,
        "offload_master_weights": training.offload_master_weights,
        "distill.teacher_offload": training.distill.teacher_offload,
    }
    for key, wanted in offloads.items():
        if wanted and "pinned_host" not in kinds:
            raise ConfigError(
                f"training.{key}=true needs pinned host memory, which {device.platform} "
                f"devices do not offer (they have {sorted(kinds)}): set it to false"
            )


def ragged_dot_is_native() -> bool:
    """Whether jax.lax.ragged_dot computes the filled rows alone (TPUs: megablox); XLA:CPU and
    XLA:GPU compute it densely over every expert (docs/models.md)."""
    return jax.default_backend() == "tpu"
