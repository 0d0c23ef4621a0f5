"""N fake CPU devices in one process, for tests, the planner, the launchers and the benchmarks.
XLA reads XLA_FLAGS once, when JAX starts its backend: set this environment before that. Imports
no JAX."""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Mapping


def cpu_devices_env(count: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's environment) with JAX on the CPU, split into `count` devices
    (the flag appended after any flags already there)."""
    env = dict(os.environ if env is None else env)
    flags = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"
    return {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags.strip()}


def use_cpu_devices(count: int) -> None:
    """This process's JAX on `count` fake CPU devices (before JAX starts its backend)."""
    os.environ.update(cpu_devices_env(count))


def mesh_shape_argument(text: str | None, flag: str = "--mesh_shape") -> Any:
    """A command's --mesh_shape (JSON [[sizes], [axis names]]; None: the default mesh), parsed. On
    CPUs, before JAX starts and unless XLA_FLAGS names a device count, the process gets as many
    fake devices as the mesh holds. A ValueError says why the text is not JSON."""
    try:
        mesh_shape = json.loads(text) if text else None
    except json.JSONDecodeError as err:
        raise ValueError(f"{flag} is not JSON ({err})") from None
    flags = os.environ.get("XLA_FLAGS", "")
    if mesh_shape and "jax" not in sys.modules and "device_count" not in flags:
        sizes = [s for s in mesh_shape[0] if isinstance(s, int) and s > 0]
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={math.prod(sizes)}".strip()
    return mesh_shape
