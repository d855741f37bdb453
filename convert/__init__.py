"""HF DeepSeek-V4 checkpoints (safetensors, both namings) into our parameter tree."""

from .load_hf import read_hf_checkpoint
from .names import checkpoint_layout, is_mtp, official_name
from .safetensors_io import CheckpointError

__all__ = ["CheckpointError", "checkpoint_layout", "is_mtp", "official_name", "read_hf_checkpoint"]
