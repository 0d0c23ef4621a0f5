"""A model family as checkpoint files know it. The decoder reads only ModelConfig's fields; a
family is what the files need beside them: transformers' model_type and architecture, the
translation of config.json both ways, the fields every checkpoint of the family fixes, its GGUF
conventions (llama.cpp's architecture, metadata and Q/K layout: GgufConventions), the tensor names
where it departs from the shared table (tensor_names.py) and the tensors its files fuse.

Each family is one module of this package that calls `register(Family(...))`; the readers and
writers ask the family and never compare its name (tests/test_house.py holds that).
tests/test_families.py registers a toy one in the test alone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from tunix_train.config import ConfigError, ModelConfig, field_of


@dataclasses.dataclass(frozen=True)
class GgufFile:
    """What a family's GGUF conventions read of a file: `field(key)` any metadata value (None if
    absent), `key(name)` its {architecture}.name value, the tensors' names, `shape(name)` (GGML
    order: [in, out]) and `data(name)` (dequantized, float32)."""

    architecture: str
    field: Callable[..., Any]
    names: frozenset[str]
    shape: Callable[[str], tuple[int, ...]]
    data: Callable[[str], Any]
    path: Path

    def key(self, name: str, default: Any = None) -> Any:
        return self.field(f"{self.architecture}.{name}", default)


class GgufConventions(Protocol):
    """How llama.cpp holds one family (interop/gguf_gemma.py, gguf_llama.py implement it)."""

    architecture: str  # general.architecture
    qk_interleaved: bool  # Q and K rows with each head's two halves interleaved (llama.cpp's Llama permute)
    stacked_experts: bool  # the experts as three stacked tensors (ffn_gate_exps, ffn_up_exps, ffn_down_exps)

    def fields(self, file: GgufFile) -> dict[str, Any]:
        """ModelConfig fields of the file (before the family's fixed ones)."""

    def write_metadata(self, writer, cfg: ModelConfig) -> None:
        """The {arch}.* keys beyond the sizes every family writes (gguf_export._metadata)."""

    def extra_tensors(self, cfg: ModelConfig) -> dict[str, Any]:
        """Tensors the file holds beside the weights (llama3's rope_freqs), by their GGUF names."""

    def check_exportable(self, cfg: ModelConfig) -> None:
        """A ConfigError naming what a file of this architecture cannot hold."""

    def claims(self, file: GgufFile) -> bool:
        """Whether a file of this architecture is this family's rather than the architecture's
        first family (Mistral's files say `llama`)."""


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # model.family
    hf_model_types: tuple[str, ...]  # config.json model_type values read as this family; the first is written
    hf_architecture: str  # config.json architectures[0], as written
    from_hf: Callable[[dict], dict]  # a config.json (its text_config) -> ModelConfig fields
    to_hf: Callable[[ModelConfig], dict]  # ModelConfig -> config.json after architectures and model_type
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # fields its checkpoints all have
    gguf: GgufConventions | None = None  # None: no GGUF in or out
    hf_names: Mapping[str, str] = dataclasses.field(default_factory=dict)  # our path -> transformers' name
    # tensors its checkpoints fuse: transformers' per-layer name -> the paths (tensor_names.SPECS)
    # whose rows it holds one after another (Phi-3's qkv_proj, gate_up_proj)
    fused: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # checkpoints store each expert's gate, up and down as tensors of their own (hf._PerExpertFiles)
    split_experts: bool = False
    # transformers' class of this family with a scalar head (model.score_head: a reward model);
    # "": its ForCausalLM's name with ForSequenceClassification; None: transformers has none
    hf_sequence_classifier: str | None = ""

    def fields_from_hf(self, hf: dict) -> dict[str, Any]:
        """ModelConfig fields of a config.json; one that lacks a key the family needs, or holds a
        value of the wrong kind, is a one-line ConfigError naming it."""
        try:
            fields = self.from_hf(hf)
        except ConfigError:
            raise
        except KeyError as err:
            raise ConfigError(
                f"model.init_from: config.json of model_type {hf.get('model_type')!r} lacks {err.args[0]!r}"
            ) from None
        except (TypeError, ValueError, AttributeError) as err:
            raise ConfigError(
                f"model.init_from: config.json holds a value of the wrong kind ({err})"
            ) from None
        if any("ForSequenceClassification" in a for a in hf.get("architectures") or ()):
            fields["score_head"] = True  # a reward model's checkpoint
        return {"family": self.name, **fields, **self.fixed}

    def check(self, cfg: ModelConfig) -> None:
        """A ConfigError naming the first field of `cfg` that this family's checkpoints cannot hold."""
        for key, value in self.fixed.items():
            if field_of(cfg, key) != value:
                raise ConfigError(
                    f"model.{key}={field_of(cfg, key)!r}: every {self.name} checkpoint (model.family) has "
                    f"{key}={value!r}; this model cannot be written as {self.name}"
                )

    def hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        """config.json for this family's transformers model (check first); with model.score_head
        its ...ForSequenceClassification of one label."""
        self.check(cfg)
        if not cfg.score_head:
            return {
                "architectures": [self.hf_architecture],
                "model_type": self.hf_model_types[0],
                **self.to_hf(cfg),
            }
        if self.hf_sequence_classifier is None:
            raise ConfigError(
                f"model.score_head: transformers has no {self.name} model with a scalar head to write "
                f"this reward model as"
            )
        architecture = self.hf_sequence_classifier or self.hf_architecture.replace(
            "ForCausalLM", "ForSequenceClassification"
        )
        return {
            "architectures": [architecture],
            "model_type": self.hf_model_types[0],
            **self.to_hf(cfg),
            "num_labels": 1,
            "id2label": {"0": "LABEL_0"},
            "label2id": {"LABEL_0": 0},
        }


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    _FAMILIES[family.name] = family
    return family


def named(name: str) -> Family:
    if name not in _FAMILIES:
        raise ConfigError(
            f"model.family={name!r} is no family this package knows ({', '.join(_FAMILIES)}); declare one "
            f"of them, or register yours with tunix_train.interop.families.register"
        )
    return _FAMILIES[name]


def of_hf(hf: dict, source: str = "model.init_from") -> Family:
    """The family of a config.json (its text_config), by its model_type."""
    model_type = hf.get("model_type")
    for family in _FAMILIES.values():
        if model_type in family.hf_model_types:
            return family
    known = ", ".join(t for f in _FAMILIES.values() for t in f.hf_model_types)
    raise ConfigError(f"{source}: model_type {model_type!r} is not one this package reads ({known})")


def of_gguf(file: GgufFile) -> Family | None:
    """The family of a GGUF file: the one of its architecture that claims it, else the first
    registered for the architecture."""
    matching = [f for f in _FAMILIES.values() if f.gguf and f.gguf.architecture == file.architecture]
    return next((f for f in matching[1:] if f.gguf.claims(file)), matching[0] if matching else None)


def gguf_architectures() -> list[str]:
    return list(dict.fromkeys(f.gguf.architecture for f in _FAMILIES.values() if f.gguf))
