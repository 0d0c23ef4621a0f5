"""A small Python API for notebooks: load a checkpoint onto a mesh and compute logits.

    from tunix_train import api
    model = api.load("outputs/default/2026-11-22/10-00-00")       # a run (its latest checkpoint)
    model = api.load("/models/gemma-3-1b-pt", mesh_shape=[[4, 1], ["fsdp", "tp"]])  # Hugging Face
    logits = model.logits([[2, 651, 6037]])                           # [batch, positions, vocab]

`path` is a Hugging Face Gemma directory (config.json + safetensors), or a tunix_train run
directory, its checkpoints/ folder, or one step's folder.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from omegaconf import OmegaConf

from tunix_train.checkpoint import resolve_resume_path, restore_from
from tunix_train.config import Config, ConfigError, ModelConfig, Remat
from tunix_train.interop import hf
from tunix_train.plan import MemoryErrors
from tunix_train.sharding import make_mesh, validate_model_for_mesh
from tunix_train.train.init import model_graphdef, plan_train_state
from tunix_train.train.optimizer import make_optimizer


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    mesh: Mesh
    params: nnx.State  # sharded over `mesh`

    def __post_init__(self):
        graphdef = model_graphdef(self.config, Remat.none)
        self._forward = jax.jit(lambda params, micro: nnx.merge(graphdef, params)(
            micro["inputs"], micro["positions"], micro["segment_ids"]))

    def logits(self, tokens: Any, positions: Any = None, segment_ids: Any = None) -> np.ndarray:
        """float32 next-token logits [B, T, V] for token ids [B, T] (one document per row by default)."""
        tokens = jnp.asarray(tokens, jnp.int32)
        B, T = tokens.shape
        micro = {"inputs": tokens,
                 "positions": jnp.broadcast_to(jnp.arange(T), (B, T)) if positions is None else jnp.asarray(positions),
                 "segment_ids": jnp.ones((B, T), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids)}
        with jax.set_mesh(self.mesh):
            return np.asarray(self._forward(self.params, micro))


def run_config(path: Path) -> Config:
    """The Config saved in a run directory (found from the run, checkpoints or step folder)."""
    for folder in (path, *path.parents):
        saved = folder / ".hydra" / "config.yaml"
        if saved.is_file():
            return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(saved)))
    raise ConfigError(f"{path}: no .hydra/config.yaml in it or above it; is it a tunix_train run?")


def load(path: str | Path, mesh_shape: Any = None, devices: list[jax.Device] | None = None) -> LoadedModel:
    """Parameters of a Hugging Face or native checkpoint, sharded over `mesh_shape` (default: all
    devices on fsdp)."""
    path = Path(path).expanduser().resolve()
    mesh_shape = mesh_shape or [[-1], ["fsdp"]]
    if (path / "config.json").is_file():
        cfg = Config(model=ModelConfig(name=path.name, **hf.model_fields_from_hf(hf.read_hf_config(path))))
    else:
        resolve_resume_path(str(path))
        cfg = run_config(path)
    mesh = make_mesh(mesh_shape, devices)
    validate_model_for_mesh(cfg.model, mesh)
    optimizer, _ = make_optimizer(cfg.training)
    plan = plan_train_state(cfg.model, optimizer, mesh, cfg.training.seed)
    with MemoryErrors(cfg, mesh, training=False):
        if (path / "config.json").is_file():
            params = hf.load_params(path, cfg.model, plan.abstract.params)
        else:
            params = restore_from(str(path), plan.abstract)[0].params
    return LoadedModel(cfg.model, mesh, params)
