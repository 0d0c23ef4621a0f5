"""Other formats in and out: Hugging Face safetensors checkpoints (hf.py)."""
