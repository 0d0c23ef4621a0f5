"""N fake CPU devices in one process, for tests, the planner, the launchers and the benchmarks.
XLA reads XLA_FLAGS once, when JAX starts its backend: set this environment before that. Imports
no JAX."""

from __future__ import annotations

import os
from typing import Mapping


def cpu_devices_env(count: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's environment) with JAX on the CPU, split into `count` devices
    (the flag appended after any flags already there)."""
    env = dict(os.environ if env is None else env)
    flags = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"
    return {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags.strip()}


def use_cpu_devices(count: int) -> None:
    """This process's JAX on `count` fake CPU devices (before JAX starts its backend)."""
    os.environ.update(cpu_devices_env(count))
