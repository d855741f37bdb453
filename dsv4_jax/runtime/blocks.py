"""The physical blocks of the cache's paged pools (dsv4_jax/model/cache.py), handed out to
sequences as they grow and taken back when they end or are preempted, and the prefix cache over
them.

On a mesh the pools are split by blocks over the devices that split the rows (cache.py's
sharding), so a row's blocks must come from its own devices' share: the blocks form `shards`
equal ranges, and row r of `rows` draws from range r // (rows / shards).

Prefix caching: a full block (every entry of its block_size positions computed) is known by a
hash chain over the tokens up to its end (`chain`), so equal keys mean equal prefixes. A block
stays cached after the last sequence holding it lets it go, until a block is needed and none is
free: then the least recently released cached block is evicted (the later blocks of a sequence
first, since a block is only found through the blocks before it). A request looks its prefix up
block by block (`lookup`) and shares the blocks found; each block counts the sequences holding it
(a forked sequence holds its parent's full blocks too: `hold`).
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np


def chain(previous: bytes, tokens) -> bytes:
    """The key of a block of `tokens` (ints) after the block keyed `previous` (b"" for the first)."""
    return hashlib.blake2b(previous + np.asarray(tokens, np.int64).tobytes(), digest_size=16).digest()


class BlockPool:
    """`num_blocks` blocks (a multiple of `shards`) for `rows` rows (a multiple of `shards`); with
    `caching`, full blocks kept by key for later requests (module doc)."""

    def __init__(self, num_blocks: int, rows: int, shards: int = 1, caching: bool = False):
        if num_blocks % shards or rows % shards:
            raise ValueError(f"{num_blocks} blocks and {rows} rows must both split into {shards} shards")
        self.num_blocks, self.rows_per_shard, self.caching = num_blocks, rows // shards, caching
        per = num_blocks // shards
        # Lowest ids first: a reused block is likely still in a cache level near the compute.
        self._free = [list(range((s + 1) * per - 1, s * per - 1, -1)) for s in range(shards)]
        self._refs = np.zeros(num_blocks, np.int32)  # sequences holding each block
        self._key: dict[int, tuple[int, bytes]] = {}  # cached block -> (shard, key)
        self._by_key: dict[tuple[int, bytes], int] = {}
        self._idle = [collections.OrderedDict() for _ in range(shards)]  # cached, unheld: least recent first

    def shard_of(self, row: int) -> int:
        return row // self.rows_per_shard

    def free(self, row: int) -> int:
        """Blocks `take` can give `row` (in its shard): the free ones and the cached unheld ones."""
        s = self.shard_of(row)
        return len(self._free[s]) + len(self._idle[s])

    def take(self, row: int, n: int) -> list[int] | None:
        """n blocks of row's shard, free ones first, then evicting the least recently released
        cached ones; None (nothing taken) if it has fewer."""
        s = self.shard_of(row)
        if n > self.free(row):
            return None
        out = []
        for _ in range(n):
            if self._free[s]:
                b = self._free[s].pop()
            else:
                b, _ = self._idle[s].popitem(last=False)
                del self._by_key[self._key.pop(b)]
            self._refs[b] = 1
            out.append(b)
        return out

    def give(self, row: int, blocks: list[int]) -> None:
        """Lets go of blocks a row held (in order): a block no sequence holds any more is free
        again, or with a key cached until evicted."""
        s = self.shard_of(row)
        for b in reversed(blocks):  # the sequence's last blocks evicted first
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._key:
                    self._idle[s][b] = None
                else:
                    self._free[s].append(b)
        self._free[s].sort(reverse=True)

    def found(self, row: int, keys: list[bytes]) -> int:
        """How many of `keys`' first blocks `lookup` would find for row (nothing held)."""
        s, n = self.shard_of(row), 0
        while n < len(keys) and (s, keys[n]) in self._by_key:
            n += 1
        return n

    def lookup(self, row: int, keys: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `keys` (a sequence's block keys in order)
        in row's shard, each now held once more by the caller."""
        s, out = self.shard_of(row), []
        for key in keys:
            b = self._by_key.get((s, key))
            if b is None:
                break
            out.append(b)
        self.hold(row, out)
        return out

    def hold(self, row: int, blocks: list[int]) -> None:
        """Each of blocks (of row's shard: cached, or held by another sequence, as the full
        blocks of a prompt that a fork shares) held once more."""
        s = self.shard_of(row)
        for b in blocks:
            self._idle[s].pop(b, None)
            self._refs[b] += 1

    def cache(self, row: int, block: int, key: bytes) -> None:
        """Records that `block` (held by row) is full and holds the prefix keyed `key`; a no-op
        without caching or when another block holds that prefix already."""
        k = (self.shard_of(row), key)
        if self.caching and k not in self._by_key and block not in self._key:
            self._by_key[k], self._key[block] = block, k

    @property
    def used(self) -> int:
        """Blocks some sequence holds."""
        return int(np.count_nonzero(self._refs))

    @property
    def cached(self) -> int:
        """Blocks holding a cached prefix (held or not)."""
        return len(self._key)


class SnapshotIndex:
    """Where the engine keeps the row states it saved for prefix caching (decode.DecodeState's
    `snapshots`, `size` of them, a multiple of `shards`): each known by the key of the block it
    ends with (`chain`: the state after those tokens), in the same shard ranges as the rows. A
    new one takes a free place, else the least recently used one's; one a request is about to
    start from is pinned until it has."""

    def __init__(self, size: int, shards: int = 1):
        if size % shards:
            raise ValueError(f"{size} snapshots must split into {shards} shards")
        per = size // shards
        self._free = [list(range((s + 1) * per - 1, s * per - 1, -1)) for s in range(shards)]
        self._by_key = [collections.OrderedDict() for _ in range(shards)]  # key -> place, least recent first
        self._pinned: collections.Counter = collections.Counter()

    def find(self, shard: int, key: bytes) -> int | None:
        """The place of the state saved at the end of the block keyed `key`, now most recently
        used; None if there is none."""
        at = self._by_key[shard].get(key)
        if at is not None:
            self._by_key[shard].move_to_end(key)
        return at

    def place_for(self, shard: int, key: bytes) -> int | None:
        """Where to save the state at the end of the block keyed `key`: a free place or the least
        recently used unpinned one's (forgotten); None when it is kept already or every place is
        pinned."""
        known = self._by_key[shard]
        if key in known:
            known.move_to_end(key)
            return None
        if self._free[shard]:
            at = self._free[shard].pop()
        else:
            old = next((k for k, a in known.items() if not self._pinned[a]), None)
            if old is None:
                return None
            at = known.pop(old)
        known[key] = at
        return at

    def pin(self, at: int) -> None:
        self._pinned[at] += 1

    def unpin(self, at: int) -> None:
        self._pinned[at] -= 1

    def __len__(self) -> int:
        return sum(map(len, self._by_key))
