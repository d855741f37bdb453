"""The converted checkpoint's array store: one zarr v3 array per leaf, written slice by slice.

    DIR/index.json          {"format": FORMAT, "leaves": {key: meta}}
    DIR/<key>/              a float / int leaf (zarr v3, uncompressed, little endian)
    DIR/<key>/values, /scale  a quantized leaf (meta["kind"] "fp8" or "fp4"; dsv4_jax/quantized.py)

`key` is the dotted parameter path (`layers.attn.wq_a`) or an `mtp.*` tensor name; meta holds
"kind" ("float", "int", "fp8", "fp4"), the logical "shape", the stored "dtype" of a float/int
leaf, and "lead" (how many leading stacked axes; layer / expert slices are written one at a time).

Chunks are one stacked slice (one layer, one expert) split along its first remaining axis down
to at most 64 MiB, so every write covers whole chunks (no read-modify-write), and the writer
holds at most `max_inflight` bytes of source data in flight. Readers read any slice (a device
shard) without touching the rest.
"""

from __future__ import annotations

import json
import math
import os
from collections import deque

import numpy as np

FORMAT = "dsv4_jax.zarr3/1"
INDEX = "index.json"
CHUNK_BYTES = 64 << 20


def _ts():
    import tensorstore

    return tensorstore


def _context():
    return _ts().Context({"cache_pool": {"total_bytes_limit": 0},
                          "data_copy_concurrency": {"limit": max(2, os.cpu_count() or 2)}})


def _chunk_shape(shape, lead: int, itemsize: int) -> list[int]:
    chunk = [1] * lead + list(shape[lead:])
    for ax in range(lead, len(chunk)):
        while math.prod(chunk) * itemsize > CHUNK_BYTES and chunk[ax] > 1:
            chunk[ax] = -(-chunk[ax] // 2)
        if math.prod(chunk) * itemsize <= CHUNK_BYTES:
            break
    return [max(c, 1) for c in chunk]


def _spec(path: str, shape=None, dtype=None, lead: int = 0) -> dict:
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.abspath(path)}}
    if shape is not None:
        dt = np.dtype(dtype)
        spec["metadata"] = {
            "shape": list(shape), "data_type": dt.name,
            "chunk_grid": {"name": "regular",
                           "configuration": {"chunk_shape": _chunk_shape(shape, lead, dt.itemsize)}},
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        }
    return spec


class StoreWriter:
    """Creates the arrays of a store and writes slices into them."""

    def __init__(self, directory: str, max_inflight: int = 256 << 20):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.ctx = _context()
        self.arrays: dict[str, object] = {}
        self.meta: dict[str, dict] = {}
        self.pending: deque = deque()
        self.inflight = 0
        self.max_inflight = max_inflight
        self.bytes_written = 0

    def _create(self, name: str, shape, dtype, lead: int):
        t = _ts().open(_spec(os.path.join(self.directory, name), shape, dtype, lead),
                       create=True, context=self.ctx).result()
        self.arrays[name] = t

    def create(self, key: str, kind: str, shape, *, dtype=None, lead: int = 0) -> None:
        """A float/int leaf of `shape` in `dtype`, or a quantized one ("fp8"/"fp4") of logical shape."""
        from dsv4_jax.quantized import storage_shapes

        shape = tuple(int(s) for s in shape)
        meta = {"kind": kind, "shape": list(shape), "lead": lead}
        if kind in ("fp8", "fp4"):
            for part, (s, d) in storage_shapes(shape, kind).items():
                self._create(f"{key}/{part}", s, d, lead)
        else:
            meta["dtype"] = np.dtype(dtype).name
            self._create(key, shape, dtype, lead)
        self.meta[key] = meta

    def write(self, name: str, index: tuple, arr: np.ndarray) -> None:
        """arr into array `name` (a key, or `key/values`, `key/scale`) at the leading index."""
        t = self.arrays[name]
        arr = np.ascontiguousarray(arr, dtype=t.dtype.numpy_dtype)
        self.pending.append((t[tuple(index)].write(arr) if index else t.write(arr), arr))
        self.inflight += arr.nbytes
        self.bytes_written += arr.nbytes
        while self.inflight > self.max_inflight:
            self._retire()

    def _retire(self) -> None:
        fut, arr = self.pending.popleft()
        fut.result()
        self.inflight -= arr.nbytes

    def close(self, extra: dict | None = None) -> None:
        while self.pending:
            self._retire()
        with open(os.path.join(self.directory, INDEX), "w") as f:
            json.dump({"format": FORMAT, **(extra or {}), "leaves": self.meta}, f, indent=1)


class StoreReader:
    def __init__(self, directory: str):
        self.directory = directory
        with open(os.path.join(directory, INDEX)) as f:
            index = json.load(f)
        if index.get("format") != FORMAT:
            raise ValueError(f"{directory}: not a {FORMAT} store (format {index.get('format')!r})")
        self.index = index
        self.leaves: dict[str, dict] = index["leaves"]
        self.ctx = _context()
        self._open: dict[str, object] = {}

    def array(self, name: str):
        if name not in self._open:
            self._open[name] = _ts().open(_spec(os.path.join(self.directory, name)), open=True,
                                          context=self.ctx).result()
        return self._open[name]

    def read(self, name: str, index=()) -> np.ndarray:
        t = self.array(name)
        return np.asarray((t[index] if index != () else t).read().result())
