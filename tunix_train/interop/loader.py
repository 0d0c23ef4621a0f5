"""Loading a model from any checkpoint this package reads, in one place.

`source(path)` decides the format once: a GGUF file, a Hugging Face directory, or a tunix_train run
(its directory, its checkpoints/ folder, or one step's folder); and gives the Config the weights
were written with. `load(source, mesh)` puts the parameters on the mesh: a file's through its
importer (hf.py, gguf.py), a run's through orbax (checkpoint.py), a LoRA run's adapters merged into
the base its run started from, that base checked against the checkpoint's record of it. Training
asks it for the same two things: which weights train (`weights_for_run`, reading a GGUF base's
block types) and model.init_from's weights (`init_from`).

The file formats, LoRA (model/lora.py, model/weights.py) and quantization (model/quant.py) are
modules of their own; this one only chooses among them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh
from omegaconf import OmegaConf

from tunix_train.checkpoint import frozen_as_recorded, resolve_resume_path, restore_params
from tunix_train.config import (
    BaseQuantization,
    Config,
    ConfigError,
    LoraConfig,
    ModelConfig,
    Objective,
    upgraded,
    with_fields,
)
from tunix_train.interop import checkpoint_format, gguf, hf, importer
from tunix_train.interop.config_file import checked_fields
from tunix_train.model import quant
from tunix_train.model.params import ParamsPlan, plan_params
from tunix_train.model.weights import ByLayer, Weights


@dataclasses.dataclass(frozen=True)
class Source:
    path: Path
    kind: str  # "gguf", "hf" or "run"
    cfg: Config  # a file's model fields (the rest defaults), or a run's whole saved config
    # a PPO run's checkpoint holds its critic (the value head, model.score_head), which is not part of
    # the language model it trained: cfg says score_head=false, and load() leaves the head out
    critic: bool = False


def source(path: str | Path) -> Source:
    path = Path(path).expanduser().resolve()
    kind = checkpoint_format(path)
    if kind == "gguf":
        cfg = Config(
            model=with_fields(ModelConfig(name=path.stem), gguf.model_fields(gguf.open_gguf(path), path))
        )
        checked_fields(cfg.model, str(path))
    elif kind == "hf":
        config = hf.read_hf_config(path)
        try:
            fields = hf.model_fields_from_hf(config)
        except (KeyError, TypeError, AttributeError, ValueError, ZeroDivisionError) as err:
            said = f"has no {err.args[0]!r}" if isinstance(err, KeyError) else f"cannot be read ({err})"
            raise ConfigError(f"model.init_from: {path / 'config.json'} {said}"[:300]) from None
        model = ModelConfig(name=path.name, vision=hf.vision_from_directory(path))
        cfg = Config(model=with_fields(model, fields))
        checked_fields(cfg.model, str(path / "config.json"))
    else:
        resolve_resume_path(str(path))
        cfg = run_config(path)
        t = cfg.training
        if t.objective is Objective.ppo:
            model = dataclasses.replace(cfg.model, score_head=False)
            return Source(path, kind, dataclasses.replace(cfg, model=model), critic=True)
    return Source(path, kind, cfg)


def run_config(path: Path) -> Config:
    """The Config saved in a run directory (found from the run, checkpoints or step folder)."""
    for folder in (path, *path.parents):
        saved = folder / ".hydra" / "config.yaml"
        if saved.is_file():
            recorded = upgraded(OmegaConf.to_container(OmegaConf.load(saved)))
            return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), recorded))
    raise ConfigError(f"{path}: no .hydra/config.yaml in it or above it; is it a tunix_train run?")


def weights_for_run(cfg: Config, keeps_reference: bool) -> Weights:
    """Which of the run's weights train (model/weights.py); a GGUF base's projection types read from
    model.init_from, before the devices start."""
    gguf_base = (
        cfg.training.lora.rank is not None and cfg.training.lora.base_quantization is BaseQuantization.gguf
    )
    return Weights.for_run(cfg, keeps_reference, gguf.projection_types(cfg.model) if gguf_base else ())


def init_from(cfg: Config, abstract_base: Any, by_layer: ByLayer | None = None) -> nnx.State:
    """model.init_from's weights (a Hugging Face directory or a GGUF file) in the shapes and
    shardings of `abstract_base`; by_layer: as hf.load_params_from takes it (a QLoRA base quantized
    as its layers are read)."""
    path = Path(cfg.model.init_from)
    return importer(path).load_params(path, cfg.model, abstract_base, by_layer)


@dataclasses.dataclass
class Loaded:
    source: Source
    params: nnx.State  # on the mesh; a LoRA run's adapters merged into its base
    adapters: nnx.State | None  # a LoRA run's adapters
    lora: LoraConfig | None


def load(src: Source, mesh: Mesh) -> Loaded:
    """The parameters of `src` on `mesh` (see the module docstring)."""
    cfg = src.cfg
    weights = weights_for_run(cfg, keeps_reference=False)  # a run's LoRA adapters, if it had them
    model = dataclasses.replace(cfg.model, score_head=True) if src.critic else cfg.model
    plan = plan_params(model, mesh, cfg.training.seed, weights)
    if src.kind != "run":
        return Loaded(src, importer(src.path).load_params(src.path, cfg.model, plan.abstract), None, None)
    params, record = restore_params(str(src.path), plan.trainable)
    if src.critic:  # trained whole, or beside LoRA's adapters: either way among `params`
        params = nnx.State({name: leaf for name, leaf in params.items() if name != "score_DO"})
    if weights.lora is None:
        return Loaded(src, params, None, None)
    with jax.set_mesh(mesh):  # the base comes from where the run started
        base = frozen_as_recorded(cfg, record.get("frozen"), lambda: _starting_base(cfg, plan, weights))
        return Loaded(src, weights.merged(params, base), params, weights.lora)


def load_like(path: str | Path, model: ModelConfig, abstract: Any, dtype: Any) -> nnx.State:
    """The parameters of the checkpoint at `path` (any format) as a frozen model holds them: in
    `dtype`, in `abstract`'s shapes and shardings (a teacher, a reward model; a LoRA run's merged)."""
    if checkpoint_format(path) != "run":  # read straight into the shapes, dtypes and shardings
        return importer(path).load_params(Path(path), model, abstract)
    params = load(source(path), jax.tree.leaves(abstract)[0].sharding.mesh).params
    return jax.device_put(quant.cast(params, dtype), jax.tree.map(lambda x: x.sharding, abstract))


def _starting_base(cfg: Config, plan: ParamsPlan, weights: Weights) -> nnx.State:
    """A LoRA run's frozen base as the run started it: model.init_from's weights, or fresh from
    training.seed."""
    if not cfg.model.init_from:
        return plan.fresh_frozen()
    return weights.frozen_base(init_from(cfg, plan.base))
