"""The schema's field marks (tunix_train/config/): whether a resumed run may change a field."""

from __future__ import annotations

import dataclasses
from typing import Any


class ConfigError(ValueError):
    """A bad configuration; the message is one line that names the offending key."""


def require_positive(values: dict[str, Any]) -> None:
    """A ConfigError naming the first key (full name) whose value is not positive."""
    for key, value in values.items():
        if value <= 0:
            raise ConfigError(f"{key}={value} must be positive")


_RESUME = "changeable_on_resume"  # the field metadata that marks a field


def _changeable(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING) -> Any:
    """A field whose value a resumed run may change (the mesh, logging, checkpointing, ...)."""
    return dataclasses.field(default=default, default_factory=factory, metadata={_RESUME: True})


def _fixed(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING) -> Any:
    """A field that a resumed run must keep: another value makes another run."""
    return dataclasses.field(default=default, default_factory=factory, metadata={_RESUME: False})
