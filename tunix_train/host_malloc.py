"""glibc malloc settings for a process whose devices are CPUs.

XLA's CPU runtime mallocs each execution's buffers and frees them when it ends. glibc serves a
request above 32 MiB (its largest mmap threshold) with a fresh mmap, and a thread's arena unmaps a
heap as soon as it is empty, so every train step page-faulted its temporaries in anew: 42,000
faults and 80 ms of kernel time per step in the CPU benchmark (docs/performance.md). Keeping freed
memory in the heap removes them; the process then holds on to its peak, as a GPU allocator does."""

from __future__ import annotations

import ctypes
import logging
import os

import jax

# mallopt parameters, from glibc's malloc.h
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
