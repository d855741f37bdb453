"""The hot spots of DeepSeek-V4 (sparse attention, the lightning indexer's scores, the KV
compressor, matmuls by the published FP8/FP4 weights, with the activations as they are or
quantized to FP8 as the reference does, the hyper-connections' passes over the streams):
Pallas kernels with a choice of implementation (`impl`: "pallas", "ref", "auto"), and their
plain-JAX references (`*_ref`)."""

from .compressor import compress
from .compressor_ref import compress_ref
from .fp8_activations import act_quant, fp8_activation_matmul
from .fp8_activations_ref import act_quant_rounded, fp8_activation_matmul_ref
from .grouped_matmul import block_diagonal_matmul, grouped_matmul, grouped_swiglu
from .grouped_matmul_ref import grouped_matmul_ref, grouped_swiglu_ref, swiglu
from .hyper_connection import hc_collapse, hc_expand
from .hyper_connection_ref import hc_collapse_ref, hc_expand_ref
from .indexer_scores import indexer_scores
from .indexer_scores_ref import indexer_scores_ref
from .quantized_matmul import quantized_matmul
from .quantized_matmul_ref import quantized_matmul_ref
from .sparse_attention import sparse_attention
from .sparse_attention_ref import sparse_attention_ref

__all__ = ["act_quant", "act_quant_rounded", "block_diagonal_matmul", "compress", "compress_ref", "fp8_activation_matmul",
           "fp8_activation_matmul_ref", "grouped_matmul", "grouped_matmul_ref", "grouped_swiglu", "grouped_swiglu_ref",
           "hc_collapse", "hc_collapse_ref", "hc_expand", "hc_expand_ref", "indexer_scores", "indexer_scores_ref",
           "quantized_matmul", "quantized_matmul_ref", "sparse_attention", "sparse_attention_ref", "swiglu"]


def sparse_attention_mgpu_status() -> bool:
    """Whether impl="pallas" on CUDA lowers to a Mosaic GPU kernel (else: the reference)."""
    from .sparse_attention_mgpu import HAVE_KERNEL
    return HAVE_KERNEL


def compress_mgpu_status() -> bool:
    """Whether impl="pallas" on CUDA lowers to a Mosaic GPU kernel (else: the reference)."""
    from .compressor_mgpu import HAVE_KERNEL
    return HAVE_KERNEL
