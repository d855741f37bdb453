"""The kinds of attention layer, by compress ratio: the one table that the config, the
parameters, the cache, the layer switch, the checkpoint names and the plan read.

Every layer attends to a sliding window of its last tokens. A compressed kind also pools each
`ratio` tokens into one compressed entry (architecture.md §4-5): ratio 4 (CSA) over two
overlapping spans, with a lightning indexer choosing the top-k entries a query sees; ratio 128
(HCA) over one span, every visible entry seen.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LayerKind:
    name: str  # the group its own parameters and cache live under, and its branch of the layer switch
    ratio: int  # tokens per compressed entry (0: a window-only layer)
    layer_type: str  # its name in an HF config's `layer_types`
    overlap: bool  # entries pool two overlapping spans: a compressor twice as wide, two spans of state
    indexer: bool  # a lightning indexer chooses the entries a query attends to (else: every visible one)

    def compressor_width(self, d: int) -> int:
        """Columns of the compressor's projections for entries of width d."""
        return 2 * d if self.overlap else d

    def state_rows(self, lookahead: int = 0) -> int:
        """Rows of compressor state a sequence keeps (attention.compress_chunk): one folding the
        open block's tokens, with overlap one more folding the block before it; plus `lookahead`
        rows for drafts a verification may reject."""
        return (2 if self.overlap else 1) + lookahead


KINDS = (LayerKind("window", 0, "sliding_attention", overlap=False, indexer=False),
         LayerKind("csa", 4, "compressed_sparse_attention", overlap=True, indexer=True),
         LayerKind("hca", 128, "heavily_compressed_attention", overlap=False, indexer=False))
WINDOW, CSA, HCA = (k.ratio for k in KINDS)
COMPRESSED = tuple(k for k in KINDS if k.ratio)
BY_RATIO = {k.ratio: k for k in KINDS}
