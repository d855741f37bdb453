"""`dsv4-convert`: an HF DeepSeek-V4 checkpoint (safetensors, either naming) into a dsv4-jax
directory (config.json, an Orbax checkpoint of the parameters, the MTP block, the tokenizer
files). The reading and writing it drives live in dsv4_jax/checkpoint/."""
