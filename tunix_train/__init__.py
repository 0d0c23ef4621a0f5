"""tunix_train: a mesh-sharded JAX/Flax trainer for Gemma-family decoder models."""
