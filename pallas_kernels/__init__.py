"""The two hot spots of DeepSeek-V4 attention, each with a plain-JAX reference (`*_ref`)."""

from .compressor_ref import compress_ref
from .sparse_attention_ref import sparse_attention_ref

__all__ = ["compress_ref", "sparse_attention_ref"]
