"""The Gemma decoder family: gemma.py the math, layout.py its structure, kernels.py the pieces
written for the compilers' layouts."""

from flax import nnx

from tunix_train.config import AttentionImpl, LoraConfig, ModelConfig, Remat
from tunix_train.model.gemma import Gemma, LayerRunner
from tunix_train.model.layout import layer_windows
from tunix_train.sharding import LOGICAL_RULES, Rules


def model_graphdef(model_cfg: ModelConfig, remat: Remat, scan_unroll: int = 1,
                   attention: AttentionImpl = AttentionImpl.xla, rules: Rules = LOGICAL_RULES,
                   parallel: LayerRunner | None = None, lora: LoraConfig | None = None) -> nnx.GraphDef:
    """The model's static structure, without allocating any parameter."""
    return nnx.graphdef(nnx.eval_shape(
        lambda: Gemma(model_cfg, nnx.Rngs(0), remat, scan_unroll, attention, rules, parallel, lora)))


__all__ = ["Gemma", "layer_windows", "model_graphdef"]
