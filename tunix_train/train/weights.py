"""Which weights train, which stay frozen, and the models an objective runs from them.

Full fine-tuning trains every parameter. Objectives that compare with the starting model (DPO,
GRPO) then keep a frozen copy of it as their reference, sharded like the parameters. With LoRA only
the adapters train: the base is frozen (held in training.lora.base_dtype), and the reference is the
same base with the adapters switched off, so there is no second copy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_train.config import BaseDtype, LoraConfig, TrainingConfig
from tunix_train.model.lora import ADAPTED_WEIGHTS
from tunix_train.model.lora import Adapter, merged

_BASE_DTYPES = {BaseDtype.fp32: jnp.float32, BaseDtype.bf16: jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class Weights:
    lora: LoraConfig | None  # None: full fine-tuning
    keeps_reference: bool  # the objective reads a reference model

    @classmethod
    def for_run(cls, training: TrainingConfig, keeps_reference: bool) -> Weights:
        return cls(training.lora if training.lora.rank is not None else None, keeps_reference)

    def split(self, model_params: nnx.State) -> tuple[nnx.State, nnx.State | None]:
        """A model's parameters (with its adapters, if any) -> (trainable, frozen)."""
        if self.lora is None:
            return model_params, (jax.tree.map(jnp.copy, model_params) if self.keeps_reference else None)
        adapters, base = nnx.split_state(model_params, Adapter, ...)
        return adapters, self.frozen_base(base)

    def frozen_base(self, base: nnx.State) -> nnx.State:
        """LoRA's base parameters as the run holds them frozen (in training.lora.base_dtype)."""
        dtype = _BASE_DTYPES[self.lora.base_dtype]
        return jax.tree.map(lambda x: x.astype(dtype), base)

    def policy(self, params, frozen) -> tuple:
        """The states that nnx.merge makes the trained model from."""
        return (params,) if self.lora is None else (frozen, params)

    def reference(self, params, frozen, switch_off=jnp.zeros_like) -> tuple:
        """The states of the reference model: the frozen copy, or the base with zero adapters
        (`switch_off` maps each adapter; for shardings, pass the identity)."""
        return (frozen,) if self.lora is None else (frozen, jax.tree.map(switch_off, params))

    def merged(self, params, frozen) -> nnx.State:
        """The trained model as plain parameters (no adapters; LoRA's base in its dtype plus
        (alpha / rank) · A B): what the engine and the exporters read."""
        if self.lora is None:
            return params
        flat = dict(nnx.to_flat_state(frozen))
        adapters = dict(nnx.to_flat_state(params))
        scale = self.lora.alpha / self.lora.rank
        for path in {p[:-1] for p in adapters}:
            weight_path = (*path[:-1], ADAPTED_WEIGHTS[path[-1]])
            base = flat[weight_path]
            flat[weight_path] = base.replace(merged(base[...], adapters[(*path, "a")][...],
                                                   adapters[(*path, "b")][...], scale))
        return nnx.from_flat_state(flat)


FULL_FINE_TUNING = Weights(None, False)  # every parameter trains, nothing is frozen
