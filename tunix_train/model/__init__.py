"""The Gemma decoder family."""

from tunix_train.model.gemma import Gemma, layer_windows

__all__ = ["Gemma", "layer_windows"]
