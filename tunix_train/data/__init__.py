"""Training data: host-local batches of [accumulation step, example, position] arrays."""
