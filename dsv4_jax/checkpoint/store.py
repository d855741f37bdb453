"""The converted checkpoint's trees as Orbax PyTree checkpoints, written slice by slice.

A directory written here is what `orbax.checkpoint.PyTreeCheckpointHandler(use_ocdbt=False,
use_zarr3=True)` saves, and Orbax restores it (`PyTreeCheckpointer().restore(DIR)` gives numpy
arrays; `StandardCheckpointer().restore(DIR, target)` with `jax.ShapeDtypeStruct` leaves gives
jax Arrays on the target's shardings, each device reading its own shard):

    DIR/_CHECKPOINT_METADATA      Orbax's checkpoint metadata (item handler, timestamps)
    DIR/_METADATA                 Orbax's tree metadata: every leaf's key path, value type
                                  "np.ndarray", use_zarr3, and our custom_metadata
                                  {"format": FORMAT, "leaves": {key: meta}}
    DIR/<a.b.c>/                  one zarr v3 array per leaf (tree path joined with ".")
    DIR/<a.b.c>.values, .scale    a quantized leaf: the subtree {"values", "scale"}
                                  (meta["kind"] "fp8" or "fp4"; dsv4_jax/model/quantized.py)

`key` is the dotted tree path of a logical leaf (`layers.attn.wq_a`, `mtp.0.e_proj.weight`);
meta holds "kind" ("float", "int", "fp8", "fp4"), the logical "shape", the stored "dtype" of a
float / int leaf, and "lead" (how many leading stacked axes; layer / expert slices are written one
at a time).

Instead of Orbax's writer (which needs the whole array in memory), each array is created with
tensorstore directly: uncompressed (`bytes` codec, little endian), chunks one stacked slice (one
layer, one expert) split along its first remaining axis down to at most 64 MiB, so every write
covers whole chunks (no read-modify-write). The writer holds at most `max_inflight` bytes of
source data in flight; the metadata files are written last, by `close()`.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import deque

import numpy as np

FORMAT = "dsv4_jax.orbax/1"
METADATA = "_METADATA"
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
CHUNK_BYTES = 64 << 20
_HANDLER = "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"
_DICT_KEY = 2  # orbax tree_metadata KeyType.DICT


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


def _spec(path: str, shape, dtype, lead: int) -> dict:
    dt = np.dtype(dtype)
    return {
        "driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.abspath(path)},
        # Write every chunk, all-zero ones too: the loader's damage check expects each chunk file.
        "store_data_equal_to_fill_value": True,
        "metadata": {
            "shape": list(shape), "data_type": dt.name,
            "chunk_grid": {"name": "regular",
                           "configuration": {"chunk_shape": _chunk_shape(shape, lead, dt.itemsize)}},
            "chunk_key_encoding": {"name": "default"},
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        },
    }


def array_name(path: tuple[str, ...]) -> str:
    """The directory of a tree path's array, as Orbax names it."""
    return ".".join(path)


class CheckpointWriter:
    """Creates the leaf arrays of one Orbax PyTree checkpoint and writes slices into them."""

    def __init__(self, directory: str, max_inflight: int = 256 << 20):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.ctx = _context()
        self.arrays: dict[tuple, object] = {}
        self.meta: dict[str, dict] = {}
        self.pending: deque = deque()
        self.inflight = 0
        self.max_inflight = max_inflight
        self.bytes_written = 0
        self.init_ns = time.time_ns()

    def _create(self, path: tuple, shape, dtype, lead: int) -> None:
        for other in self.arrays:  # a path cannot be both a leaf and a subtree
            n = min(len(other), len(path))
            if other[:n] == path[:n]:
                raise ValueError(f"{self.directory}: {array_name(path)!r} clashes with {array_name(other)!r}")
        t = _ts().open(_spec(os.path.join(self.directory, array_name(path)), shape, dtype, lead),
                       create=True, context=self.ctx).result()
        self.arrays[path] = t

    def create(self, path: tuple[str, ...], kind: str, shape, *, dtype=None, lead: int = 0) -> None:
        """A float/int leaf of `shape` in `dtype`, or a quantized one ("fp8"/"fp4") of logical
        shape (stored as the subtree path + ("values",), path + ("scale",))."""
        from dsv4_jax.model.quantized import storage_shapes

        path = tuple(path)
        shape = tuple(int(s) for s in shape)
        meta = {"kind": kind, "shape": list(shape), "lead": lead}
        if kind in ("fp8", "fp4"):
            for part, (s, d) in storage_shapes(shape, kind).items():
                self._create(path + (part,), s, d, lead)
        else:
            meta["dtype"] = np.dtype(dtype).name
            self._create(path, shape, dtype, lead)
        self.meta[array_name(path)] = meta

    def write(self, path: tuple[str, ...], index: tuple, arr: np.ndarray) -> None:
        """arr into the array at tree `path` (a leaf, or a quantized leaf's path + ("values",) /
        ("scale",)) at the leading `index` (() for the whole array)."""
        t = self.arrays[tuple(path)]
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

    def abort(self) -> None:
        """Waits for the writes in flight, ignoring their errors: after an error elsewhere, so
        that nothing lands in the directory once it has been removed."""
        while self.pending:
            fut, _ = self.pending.popleft()
            try:
                fut.result()
            except Exception:  # noqa: BLE001  the error being handled is the one to report
                pass
        self.inflight = 0

    def close(self, extra: dict | None = None) -> None:
        """Waits for every write, then writes Orbax's `_METADATA` (custom_metadata: FORMAT, the
        leaves' meta and `extra`) and `_CHECKPOINT_METADATA`."""
        while self.pending:
            self._retire()
        tree = {}
        for path in sorted(self.arrays):
            tree[str(path)] = {"key_metadata": [{"key": k, "key_type": _DICT_KEY} for k in path],
                               "value_metadata": {"value_type": "np.ndarray", "skip_deserialize": False}}
        custom = {"format": FORMAT, **(extra or {}), "leaves": self.meta}
        _dump(os.path.join(self.directory, METADATA),
              {"tree_metadata": tree, "use_ocdbt": False, "use_zarr3": True,
               "store_array_data_equal_to_fill_value": True, "custom_metadata": custom})
        _dump(os.path.join(self.directory, CHECKPOINT_METADATA),
              {"item_handlers": _HANDLER, "metrics": {}, "performance_metrics": {},
               "init_timestamp_nsecs": self.init_ns, "commit_timestamp_nsecs": time.time_ns(),
               "custom_metadata": {}})


def _dump(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)


def read_custom_metadata(directory: str) -> dict | None:
    """Our custom_metadata of an Orbax checkpoint written by CheckpointWriter (None for another
    Orbax checkpoint, e.g. one saved by Orbax itself)."""
    try:
        with open(os.path.join(directory, METADATA)) as f:
            custom = json.load(f).get("custom_metadata")
    except (OSError, json.JSONDecodeError):
        return None
    return custom if isinstance(custom, dict) and custom.get("format") == FORMAT else None
