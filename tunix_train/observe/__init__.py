"""Run output: train.log, metrics.jsonl and TensorBoard events."""
