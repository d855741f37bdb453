"""Checkpoints on disk: HF safetensors (either naming, FP8/FP4 as published), the converted
directory (config.json plus Orbax), and `load` over both. Built on dsv4_jax.model."""
