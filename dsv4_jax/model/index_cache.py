"""IndexCache: which ratio-4 layers compute their indexer's top-k and which reuse the last one.

Only ratio-4 layers take part, counted by their rank among ratio-4 layers; rank 0 always
computes (index-cache.md). A reusing layer skips its indexer's query and weight projections,
scoring and top-k, and attends with its own query and KV at the reused entries.
"""

from __future__ import annotations

import dataclasses

from .config import ModelConfig
from .layer_kinds import CSA


@dataclasses.dataclass(frozen=True)
class IndexCacheSchedule:
    csa_layers: tuple[int, ...]  # ids of the ratio-4 layers
    computing: tuple[int, ...]  # those that compute their top-k
    reusing: tuple[int, ...]  # those that reuse the previous computing layer's

    def to_dict(self) -> dict:
        return {"c4_layers": list(self.csa_layers), "compute_layers": list(self.computing),
                "skip_layers": len(self.reusing), "skip_layer_ids": list(self.reusing)}

    def describe(self) -> str:
        return (f"IndexCache: {len(self.csa_layers)} ratio-4 layers, {len(self.computing)} compute their top-k, "
                f"{len(self.reusing)} reuse it: {list(self.reusing)}")


def index_cache_schedule(cfg: ModelConfig) -> IndexCacheSchedule:
    """The effective schedule of cfg (every ratio-4 layer computes when use_index_cache is off)."""
    csa = cfg.layers_of_ratio(CSA)
    reuse = []
    if cfg.use_index_cache:
        pat = cfg.index_topk_pattern
        for rank, layer in enumerate(csa):
            if pat is not None:
                skip = rank < len(pat) and pat[rank] == "S"
            else:
                skip = rank % cfg.index_topk_freq != 0
            if skip:
                reuse.append(layer)
    return IndexCacheSchedule(csa, tuple(i for i in csa if i not in reuse), tuple(reuse))
