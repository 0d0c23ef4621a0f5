"""Where api.load's `path` goes: the code it reaches stays in few units (top-level packages or
modules) and calls back up the import order (tests/test_imports.py's LAYERS) at most 3 times.

Counted while it runs (sys.setprofile): every tunix_train call made while a call that was passed the
path, or a path inside it, is running, below api.load itself; its unit, and the calls from a unit
into one above it (callbacks)."""

import sys
from pathlib import Path

import jax
from conftest import config
from test_imports import LAYER

from tunix_train import api
from tunix_train.interop import hf
from tunix_train.model.params import model_params


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "tunix_train" else None


def _reached(load, path: Path) -> tuple[list[str], set[tuple[str, str]]]:
    """The units the path reaches, in order, and the calls that climb (caller, callee module)."""
    targets = (str(path), str(path.resolve()))
    inside, calls, started = [], [], []

    def holds(frame) -> bool:
        return any(isinstance(v, (str, Path)) and str(v).startswith(targets) for v in frame.f_locals.values())

    def profile(frame, event, _):
        module = frame.f_globals.get("__name__", "")
        if event == "call":
            if not started:  # api.load's own frame is where the path starts, not where it goes
                if frame.f_code.co_name == "load" and module.startswith("tunix_train"):
                    started.append(frame)
                return
            if not module.startswith("tunix_train") or not (inside or holds(frame)):
                return
            caller = frame.f_back
            while caller is not None and not caller.f_globals.get("__name__", "").startswith("tunix_train"):
                caller = caller.f_back
            calls.append((caller.f_globals["__name__"] if caller else "", module))
            if holds(frame):
                inside.append(frame)
        elif event == "return" and inside and frame is inside[-1]:
            inside.pop()

    sys.setprofile(profile)
    try:
        load()
    finally:
        sys.setprofile(None)
    units = list(dict.fromkeys(_unit(m) for _, m in calls))
    climbs = {
        (a, b)
        for a, b in calls
        if _unit(a) and _unit(b) and _unit(a) != _unit(b) and LAYER[_unit(b)] < LAYER[_unit(a)]
    }
    return units, climbs


def test_api_load_of_a_hugging_face_directory_reaches_few_units(tmp_path):
    cfg = config()
    hf.export(model_params(cfg.model, jax.random.key(0)), cfg.model, tmp_path / "hf")
    units, climbs = _reached(lambda: api.load(tmp_path / "hf", devices=jax.devices()[:2]), tmp_path / "hf")
    assert "interop" in units and "train" not in units, units
    print(f"units {units}, climbs {sorted(climbs)}")
    assert len(units) <= 8 and len(climbs) <= 3, (units, climbs)
