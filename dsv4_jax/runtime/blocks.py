"""The physical blocks of the cache's paged pools (dsv4_jax/model/cache.py), handed out to
sequences as they grow and taken back when they end or are preempted.

On a mesh the pools are split by blocks over the devices that split the rows (cache.py's
sharding), so a row's blocks must come from its own devices' share: the blocks form `shards`
equal ranges, and row r of `rows` draws from range r // (rows / shards).
"""

from __future__ import annotations


class BlockPool:
    """`num_blocks` blocks (a multiple of `shards`) for `rows` rows (a multiple of `shards`)."""

    def __init__(self, num_blocks: int, rows: int, shards: int = 1):
        if num_blocks % shards or rows % shards:
            raise ValueError(f"{num_blocks} blocks and {rows} rows must both split into {shards} shards")
        self.num_blocks, self.rows_per_shard = num_blocks, rows // shards
        per = num_blocks // shards
        # Lowest ids first: a reused block is likely still in a cache level near the compute.
        self._free = [list(range((s + 1) * per - 1, s * per - 1, -1)) for s in range(shards)]

    def shard_of(self, row: int) -> int:
        return row // self.rows_per_shard

    def free(self, row: int) -> int:
        """Blocks free for `row` (in its shard)."""
        return len(self._free[self.shard_of(row)])

    def take(self, row: int, n: int) -> list[int] | None:
        """n free blocks of row's shard, or None (nothing taken) if it has fewer."""
        pool = self._free[self.shard_of(row)]
        if n > len(pool):
            return None
        return [pool.pop() for _ in range(n)]

    def give(self, row: int, blocks: list[int]) -> None:
        """Returns blocks a row held (to its shard's free list)."""
        pool = self._free[self.shard_of(row)]
        pool.extend(blocks)
        pool.sort(reverse=True)

    @property
    def used(self) -> int:
        return self.num_blocks - sum(map(len, self._free))
