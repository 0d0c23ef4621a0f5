"""The Gemma decoder family: gemma.py the math, layout.py its structure, kernels.py the pieces
written for the compilers' layouts, moe.py the experts."""

from tunix_train.model.gemma import Gemma, LayerRunner
from tunix_train.model.layout import layer_windows

__all__ = ["Gemma", "LayerRunner", "layer_windows"]
