"""The shapes the compiled programs see, from buckets, so that requests of nearby sizes share a
program: batch rows (1, 2, 4, 8, then multiples of 8), cache lengths (128 x 1, 2, 3, 4, 6, 8,
12, ...), and prefill chunks (PREFILL_CHUNK tokens of every row, the last cut to a power of two
from MIN_PREFILL_CHUNK)."""

from __future__ import annotations

import numpy as np

PREFILL_CHUNK = 512
MIN_PREFILL_CHUNK = 16


def batch_bucket(rows: int) -> int:
    """Rows the compiled programs hold for a batch of `rows`: 1, 2, 4, 8, then multiples of 8."""
    return 1 << (rows - 1).bit_length() if rows <= 8 else -(-rows // 8) * 8


def length_bucket(tokens: int) -> int:
    """The default cache length for `tokens`: the first of 128 x (1, 2, 3, 4, 6, 8, 12, ...) that
    holds them (at most 1.5x what they need beyond 256)."""
    units, b = -(-tokens // 128), 1
    while True:
        if b >= units:
            return 128 * b
        if b >= 2 and b * 3 // 2 >= units:
            return 128 * (b * 3 // 2)
        b *= 2


def chunk_bucket(n: int, largest: int = PREFILL_CHUNK) -> int:
    """The compiled chunk length for a chunk of n tokens: a power of two from MIN_PREFILL_CHUNK up
    to `largest`."""
    return min(max(MIN_PREFILL_CHUNK, 1 << (n - 1).bit_length()), largest)


def prefill_plan(lengths, chunk: int = PREFILL_CHUNK) -> list[tuple[int, np.ndarray]]:
    """The prefill chunks of prompts of `lengths` `[B]`: (compiled chunk length, tokens of each row
    in it `[B]`), chunk k holding tokens k*chunk .. of every row."""
    lengths = np.asarray(lengths)
    plan, start = [], 0
    while start < lengths.max():
        n = np.clip(lengths - start, 0, chunk).astype(np.int32)
        plan.append((chunk_bucket(int(n.max()), chunk), n))
        start += chunk
    return plan


def prefill_chunks(prompts: np.ndarray, lengths: np.ndarray, chunk: int = PREFILL_CHUNK):
    """The chunks `prefill_plan` cuts prompts (int32 `[B, >= max(lengths)]`) into: (ids `[B, T]`,
    each row's real tokens in it `[B]`, the rows whose prompt ends in it `[B]`)."""
    start = 0
    for T, n in prefill_plan(lengths, chunk):
        ids = np.zeros((len(lengths), T), np.int32)
        width = min(T, prompts.shape[1] - start)
        ids[:, :width] = prompts[:, start: start + width]
        yield ids, n, (lengths > start) & (lengths <= start + chunk)
        start += chunk
