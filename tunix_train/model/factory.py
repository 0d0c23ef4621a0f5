"""The model a config describes: the one place that chooses what to build. Today that is the decoder
for every family (their differences are its config fields); a model with more parts (a vision
tower before the decoder, a value head after it) is chosen here, and everything that builds a
model (training, the engine, loading) comes through it."""

from __future__ import annotations

from flax import nnx

from tunix_train.config import ModelConfig
from tunix_train.model.decoder import Decoder


def build_model(cfg: ModelConfig, rngs: nnx.Rngs, **options) -> Decoder:
    """The model of `cfg` with fresh parameters from `rngs`; options as Decoder takes them (loop,
    attention, rules, parallel, lora, experts)."""
    return Decoder(cfg, rngs, **options)


def model_structure(cfg: ModelConfig, **options) -> nnx.GraphDef:
    """The model's static structure, without allocating any parameter."""
    return nnx.graphdef(nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0), **options)))
