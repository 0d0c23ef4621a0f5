"""The Gemma decoder family: gemma.py the math, layout.py its structure (and the model keys'
checks), kernels.py the pieces written for the compilers' layouts, moe.py the experts, lora.py the
adapters. Import the modules themselves: this package's init imports nothing."""
