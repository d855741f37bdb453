"""Reading HF safetensors checkpoints (single file or sharded), one tensor at a time.

The file format is parsed here (8-byte little-endian header length, a JSON header, then raw
little-endian data), so every dtype the DeepSeek-V4 checkpoints use (BF16, F8_E4M3, F8_E8M0,
I8-packed FP4, I64, ...) maps through ml_dtypes, and a truncated or corrupt file is reported
with its name instead of failing deep inside a library.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Iterator

import ml_dtypes
import numpy as np

log = logging.getLogger("dsv4_jax")

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as the model it claims to be; the message names the file
    or tensor."""


def _header(path: str) -> tuple[dict, int]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file (no header)")
        n = int.from_bytes(raw, "little")
        if n > min(size - 8, _MAX_HEADER):
            raise CheckpointError(f"{path}: corrupt or truncated safetensors header (claims {n} bytes)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header")
    header.pop("__metadata__", None)
    data_start = 8 + n
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name!r}") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(DTYPES[dtype]).itemsize
        if end - begin != nbytes or begin < 0:
            raise CheckpointError(f"{path}: tensor {name!r} has inconsistent offsets for {dtype}{shape}")
        if data_start + end > size:
            raise CheckpointError(
                f"{path}: truncated file: tensor {name!r} ends at byte {data_start + end}, file has {size}")
    return header, data_start


def checkpoint_files(directory: str) -> list[str]:
    """The safetensors files of a checkpoint directory, via the shard index when there is one."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid shard index ({e})") from None
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(directory, name)):
                raise CheckpointError(f"missing shard {name} (listed in {index})")
        return [os.path.join(directory, f) for f in files]
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors files in {directory}")
    return [os.path.join(directory, f) for f in files]


def iter_file(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (name, array) for every tensor of one safetensors file, in file order. Arrays
    are views of a memory map, so only the tensor in hand is read."""
    header, data_start = _header(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = info["data_offsets"]
        yield name, mm[data_start + begin: data_start + end].view(DTYPES[info["dtype"]]).reshape(info["shape"])


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Writes tensors (numpy / ml_dtypes arrays) as one safetensors file."""
    names = {np.dtype(v): k for k, v in DTYPES.items()}
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, arr in tensors.items():
        dt = np.dtype(arr.dtype)
        if dt not in names:
            raise CheckpointError(f"tensor {name!r}: dtype {dt} cannot be stored in safetensors")
        header[name] = {"dtype": names[dt], "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())


class TensorEntry(tuple):
    """(file path, byte offset of the data section, header info) of one tensor."""

    @property
    def path(self) -> str:
        return self[0]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self[2]["shape"])

    @property
    def dtype(self) -> str:
        return self[2]["dtype"]

    @property
    def nbytes(self) -> int:
        begin, end = self[2]["data_offsets"]
        return end - begin


def scan_checkpoint(directory: str) -> dict[str, TensorEntry]:
    """Reads every shard's header (no tensor data): name -> TensorEntry, in file/offset order.
    A tensor present in two shards is an error naming it."""
    out: dict[str, TensorEntry] = {}
    for path in checkpoint_files(directory):
        header, data_start = _header(path)
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if name in out:
                raise CheckpointError(f"{path}: tensor {name!r} appears twice in the checkpoint "
                                      f"(also in {os.path.basename(out[name].path)})")
            out[name] = TensorEntry((path, data_start, info))
    return out


def read_tensor(entry: TensorEntry) -> np.ndarray:
    """The tensor's data as a read-only view of a memory map (read from disk on access)."""
    path, data_start, info = entry
    begin, end = info["data_offsets"]
    if end == begin:
        return np.empty(info["shape"], DTYPES[info["dtype"]])
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start + begin, shape=(end - begin,))
    return mm.view(DTYPES[info["dtype"]]).reshape(info["shape"])
