"""The model: decoder.py the math (one implementation for every family, their differences config
fields), factory.py what a config builds, layout.py its structure (and the model keys' checks),
kernels.py the pieces written for the compilers' layouts, moe.py the experts, lora.py the adapters,
quant.py quantized weights. Import the modules themselves: this package's init imports nothing."""
