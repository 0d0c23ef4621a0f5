"""Which weights train, which stay frozen, and the models an objective runs from them.

Full fine-tuning trains every parameter. Objectives that compare with the starting model (DPO,
GRPO) then keep a frozen copy of it as their reference, sharded like the parameters. With LoRA only
the adapters train: the base is frozen (held in training.lora.base_dtype, its projections quantized
under training.lora.base_quantization), and the reference is the same base with the adapters
switched off, so there is no second copy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_train.config import BaseDtype, BaseQuantization, Config, ConfigError, LoraConfig
from tunix_train.model import quant
from tunix_train.model.lora import ADAPTED_WEIGHTS, INPUT_DIMS, TOWER_ADAPTED_WEIGHTS, Adapter, merged
from tunix_train.sharding import layer_sharding

# (our path, the stacked leaf's ShapeDtypeStruct, read_layer) -> the leaf built layer by layer, or
# None (what interop's loaders call as their layers are read: interop/hf.py load_params_from)
ByLayer = Callable[[str, jax.ShapeDtypeStruct, Callable[[int], jax.Array]], Any]

_BASE_DTYPES = {BaseDtype.fp32: jnp.float32, BaseDtype.bf16: jnp.bfloat16}
BLOCK_AXES = ("head_dim", "mlp")  # nf4's blocks run along a projection's feature axis, never fsdp's embed


def _quantized(kind: BaseQuantization, path: tuple, weight: nnx.Param, dtype) -> nnx.Param:
    """A stacked projection [layers, ...], cast to `dtype`, as `kind`: int8 per output channel, nf4
    along its BLOCK_AXES. One layer at a time: the quantizer's float32 temporaries are a layer's, not
    the stack's (gemma3_27b's stacks at once asked an H200 for 292 GiB)."""
    axes, x = weight.get_metadata()["axes"], weight[...]
    assert axes[0] == "layers", (path, axes)
    block = next(i for i, a in enumerate(axes) if a in BLOCK_AXES) - len(axes)
    if kind is BaseQuantization.nf4 and x.shape[block] % quant.NF4_BLOCK:
        raise ConfigError(
            f"training.lora.base_quantization=nf4: {'.'.join(map(str, path))} has {axes[block]} "
            f"{x.shape[block]}, not a multiple of the block size {quant.NF4_BLOCK}; use int8 or none"
        )
    return weight.replace(jax.lax.map(_layer_quantizer(kind, path[-1], block, dtype), x))


def _layer_quantizer(kind: BaseQuantization, name: str, block: int, dtype):
    """One layer of projection `name` -> Quantized of `kind` (nf4's blocks along axis `block`)."""
    inputs = tuple(range(INPUT_DIMS[name]))  # a layer's input axes
    return lambda layer: quant.quantize(layer.astype(dtype), kind.value, inputs, block)


class GgufTensor(NamedTuple):
    """A projection of a GGUF base: its GGML type in each layer, and its [out, in] -> ours layout."""

    path: str  # ours, e.g. layers.attn.q_DNH
    types: tuple[int, ...]
    layout: tuple  # quant.Quantized.layout


def _gguf_stand_in(tensor: GgufTensor, weight: nnx.Param, dtype) -> nnx.Param:
    """The shape a GGUF base's projection takes (its rows, padded to the widest layer's bytes), read
    as `dtype`: for planning. The blocks themselves come from the file (interop/gguf.py), never from here."""
    out, in_, _ = tensor.layout
    width = max(quant.row_bytes(quant.Q(t), math.prod(in_)) for t in tensor.types)
    layers = weight.shape[0]
    return weight.replace(
        quant.Quantized(
            jnp.zeros((layers, math.prod(out), width), jnp.uint8),
            jnp.zeros((layers,), jnp.int32),
            "gguf",
            0,
            jnp.dtype(dtype),
            tuple(sorted(set(tensor.types))),
            tensor.layout,
        )
    )


@dataclasses.dataclass(frozen=True)
class Weights:
    lora: LoraConfig | None  # None: full fine-tuning
    keeps_reference: bool  # the objective reads a reference model
    gguf: tuple[GgufTensor, ...] = ()  # base_quantization=gguf: the file's projections

    @classmethod
    def for_run(cls, cfg: Config, keeps_reference: bool, gguf_projections=()) -> Weights:
        """gguf_projections: under base_quantization=gguf, the file's projection types
        (interop/loader.weights_for_run reads them)."""
        lora = cfg.training.lora
        if lora.rank is None:
            return cls(None, keeps_reference)
        if lora.base_quantization is not BaseQuantization.gguf:
            return cls(lora, keeps_reference)
        return cls(lora, keeps_reference, tuple(GgufTensor(*t) for t in gguf_projections))

    def split(self, model_params: nnx.State) -> tuple[nnx.State, nnx.State | None]:
        """A model's parameters (with its adapters, if any) -> (trainable, frozen)."""
        if self.lora is None:
            return model_params, (jax.tree.map(jnp.copy, model_params) if self.keeps_reference else None)
        adapters, base = nnx.split_state(model_params, Adapter, ...)
        return adapters, self.frozen_base(base)

    @property
    def _base_dtype(self):
        return _BASE_DTYPES[self.lora.base_dtype]

    def as_loaded(self, base: nnx.State) -> nnx.State:
        """The base as model.init_from loads it: LoRA's already in training.lora.base_dtype (a bf16
        base's load holds half the bytes of a float32 one), full fine-tuning's as trained."""
        return base if self.lora is None else quant.cast(base, self._base_dtype)

    def frozen_base(self, base: nnx.State) -> nnx.State:
        """LoRA's base parameters as the run holds them frozen (in training.lora.base_dtype)."""
        dtype, kind = self._base_dtype, self.lora.base_quantization
        if kind is BaseQuantization.none:
            return quant.cast(base, dtype)
        gguf = {t.path: t for t in self.gguf}

        def frozen(path, w):
            if path[-1] not in INPUT_DIMS or quant.is_quantized(w.get_value()):  # a GGUF base's, loaded
                return w.replace(w.get_value().astype(dtype))
            if kind is BaseQuantization.gguf:
                return _gguf_stand_in(gguf[".".join(path)], w, dtype)
            return _quantized(kind, path, w, dtype)

        return nnx.from_flat_state([(path, frozen(path, w)) for path, w in nnx.to_flat_state(base)])

    def layer_by_layer(self, frozen: nnx.State) -> ByLayer | None:
        """For model.init_from under int8 or nf4: quantizes each projection as its layers are read
        into stacks in `frozen`'s shardings (the plan's abstract), so that no projection is ever
        whole and dense on the devices (gemma3_27b's bf16 base is 54 GB); None for other runs."""
        if self.lora is None or self.lora.base_quantization not in (
            BaseQuantization.int8,
            BaseQuantization.nf4,
        ):
            return None
        kind, dtype = self.lora.base_quantization, self._base_dtype
        targets = {".".join(path): w.get_value() for path, w in nnx.to_flat_state(frozen)}

        def build(path: str, leaf, read_layer):
            target = targets.get(path)
            if not quant.is_quantized(target):
                return None
            shardings = jax.tree.map(lambda a: a.sharding, target)
            quantize = jax.jit(
                _layer_quantizer(kind, path.split(".")[-1], target.axis, dtype),
                out_shardings=jax.tree.map(layer_sharding, shardings),
            )
            put = jax.jit(
                lambda stack, layer, r: jax.tree.map(
                    lambda s, x: jax.lax.dynamic_update_index_in_dim(s, x, r, 0), stack, layer
                ),
                donate_argnums=0,
                out_shardings=shardings,
            )
            stack = jax.jit(
                lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), target), out_shardings=shardings
            )()
            for r in range(leaf.shape[0]):
                stack = put(stack, quantize(read_layer(r)), r)
            return stack

        return build

    @property
    def loads_quantized(self) -> bool:
        """Whether model.init_from's base loads quantized (its GGUF blocks): into the frozen shapes."""
        return bool(self.gguf)

    def policy(self, params, frozen) -> tuple:
        """The states that nnx.merge makes the trained model from."""
        return (params,) if self.lora is None else (frozen, params)

    def reference(self, params, frozen, switch_off=jnp.zeros_like) -> tuple:
        """The states of the reference model: the frozen copy, or the base with zero adapters
        (`switch_off` maps each adapter; for shardings, pass the identity)."""
        return (frozen,) if self.lora is None else (frozen, jax.tree.map(switch_off, params))

    @property
    def engine_lora(self) -> LoraConfig | None:
        """The adapters the engine's model carries: LoRA's over a quantized base, else none."""
        quantized = self.lora is not None and self.lora.base_quantization is not BaseQuantization.none
        return self.lora if quantized else None

    def for_engine(self, params, frozen) -> nnx.State:
        """What the engine samples from: the merged parameters; over a quantized base the base and
        the adapters as they are (merging would dequantize the whole base; the engine dequantizes
        each layer where it reads it, and applies the adapters beside it)."""
        if self.engine_lora is not None:
            return nnx.merge_state(frozen, params)
        return self.merged(params, frozen)

    def merged(self, params, frozen) -> nnx.State:
        """The trained model as plain parameters (no adapters; LoRA's base in its dtype, dequantized,
        plus (alpha / rank) · A B): what the engine and the exporters read."""
        if self.lora is None:
            return params
        flat = dict(nnx.to_flat_state(quant.dense(frozen)))
        adapters = dict(nnx.to_flat_state(params))
        scale = self.lora.alpha / self.lora.rank
        for path in [p for p in adapters if p[-1] not in ("a", "b")]:  # a head: trained whole
            head = adapters.pop(path)
            flat[path] = nnx.Param(head.get_value(), axes=head.get_metadata()["axes"])
        for path in {p[:-1] for p in adapters}:
            names = TOWER_ADAPTED_WEIGHTS if path[0] == "vision" else ADAPTED_WEIGHTS
            weight_path = (*path[:-1], names[path[-1]])
            base = flat[weight_path]
            flat[weight_path] = base.replace(
                merged(base[...], adapters[(*path, "a")][...], adapters[(*path, "b")][...], scale)
            )
        return nnx.from_flat_state(flat)


FULL_FINE_TUNING = Weights(None, False)  # every parameter trains, nothing is frozen
