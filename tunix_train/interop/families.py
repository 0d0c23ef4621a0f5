"""Model families as checkpoint files name them. The decoder reads only ModelConfig's fields; a
family is what the files need beside them: transformers' model_type and architecture, the
translation of config.json both ways, the fields every checkpoint of the family fixes, llama.cpp's
architecture name, and the tensor names where the family departs from the shared table (hf.py).

A new family is a `register(Family(...))` call and its config translations: nothing else in the
package changes (tests/test_families.py registers a toy one).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

from tunix_train.config import ConfigError, ModelConfig
from tunix_train.interop import gemma, llama


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # model.family
    hf_model_types: tuple[str, ...]  # config.json model_type values read as this family; the first is written
    hf_architecture: str  # config.json architectures[0], as written
    from_hf: Callable[[dict], dict]  # a config.json (its text_config) -> ModelConfig fields
    to_hf: Callable[[ModelConfig], dict]  # ModelConfig -> config.json after architectures and model_type
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # fields its checkpoints all have
    gguf_architecture: str | None = None  # llama.cpp's general.architecture; None: no GGUF export
    # which GGUF conventions read and write it: "gemma" (gguf.py) or "llama" (gguf_llama.py: Llama, Qwen)
    gguf_conventions: str | None = None
    # llama.cpp holds its Q and K rows with each head's two halves interleaved (its Llama permute)
    gguf_qk_interleaved: bool = False
    hf_names: Mapping[str, str] = dataclasses.field(default_factory=dict)  # our path -> transformers' name
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
            if getattr(cfg, key) != value:
                raise ConfigError(
                    f"model.{key}={getattr(cfg, key)!r}: every {self.name} checkpoint (model.family) has "
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


def of_gguf(architecture: str) -> Family | None:
    return next((f for f in _FAMILIES.values() if f.gguf_architecture == architecture), None)


def gguf_architectures() -> list[str]:
    return [f.gguf_architecture for f in _FAMILIES.values() if f.gguf_architecture]


for _name, _model_types, _architecture in (
    ("gemma", ("gemma",), "GemmaForCausalLM"),
    ("gemma2", ("gemma2",), "Gemma2ForCausalLM"),
    ("gemma3", ("gemma3_text", "gemma3"), "Gemma3ForCausalLM"),
):
    register(
        Family(
            _name,
            _model_types,
            _architecture,
            functools.partial(gemma.gemma_from_hf, family=_name),
            functools.partial(gemma.gemma_to_hf, family=_name),
            gemma.FIXED[_name],
            gguf_architecture=_name,
            gguf_conventions="gemma",
            hf_sequence_classifier="Gemma3TextForSequenceClassification" if _name == "gemma3" else "",
            # Gemma 1 names its pre-MLP norm as the later ones name the norm after attention
            hf_names={"layers.pre_ffw_norm.scale": "post_attention_layernorm.weight"}
            if _name == "gemma"
            else {},
        )
    )
register(
    Family(
        "gemma4",
        ("gemma4_text", "gemma4"),
        "Gemma4ForCausalLM",
        gemma.gemma4_from_hf,
        gemma.gemma4_to_hf,
        gemma.FIXED["gemma4"],
        hf_sequence_classifier=None,
    )
)

# Llama names its pre-MLP norm as Gemma 2-4 name the norm after attention
_PRE_MLP_NORM = {"layers.pre_ffw_norm.scale": "post_attention_layernorm.weight"}
for _name, _architecture, _gguf in (
    ("llama", "LlamaForCausalLM", "llama"),
    ("qwen2", "Qwen2ForCausalLM", "qwen2"),
    ("qwen3", "Qwen3ForCausalLM", "qwen3"),
    ("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3moe"),
):
    register(
        Family(
            _name,
            (_name,),
            _architecture,
            functools.partial(llama.llama_from_hf, family=_name),
            functools.partial(llama.llama_to_hf, family=_name),
            llama.FIXED[_name],
            gguf_architecture=_gguf,
            gguf_conventions="llama",
            gguf_qk_interleaved=_name == "llama",
            hf_names={
                **_PRE_MLP_NORM,
                "layers.moe.router_DE": "mlp.gate.weight",
                "layers.moe.gate_up_EDCM": "mlp.experts.gate_up_proj",
                "layers.moe.down_EMD": "mlp.experts.down_proj",
            },
            split_experts=True,
        )
    )
