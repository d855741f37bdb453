"""Per-row positions: rows of one cache at different positions advance in one `step`, each with
its own window ring, compression-block phase, pool length, RoPE positions and causal limits, and
a row can be reset and prefilled into while the others hold their state.

Every check compares a row's logits with the full forward of that row's tokens alone, fp32, at
the model parity tolerance: max |diff| <= 1e-4 * max(1, max |logit|) (the same math in another
grouping; observed below 1e-6).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax
import hf_oracle as H
from dsv4_jax.model.cache import init_cache, put_rows, reset_rows, take_rows
from dsv4_jax.model.deepseek_v4 import forward, step

_step = jax.jit(step, static_argnums=(3, 4, 5), donate_argnums=1)
_forward = jax.jit(forward, static_argnums=2)


def _close(a, b):
    return np.abs(a - b).max() <= 1e-4 * max(1.0, np.abs(b).max())


def _full(params, cfg, seq, S=300):
    """The full forward's logits of `seq` alone: one program for every sequence, which is padded
    at the end to S tokens (a causal model's logits at a position do not depend on the tokens
    after it: tests/test_model_parity.py::test_causal)."""
    ids = np.zeros((1, S), np.int32)
    ids[0, :len(seq)] = seq
    return np.asarray(_forward(params, ids, cfg))[0, :len(seq)]


@pytest.fixture(scope="module")
def tiny():
    cfg = dsv4_jax.ModelConfig.from_hf(H.TINY)  # window 8, ratios 4 and 128
    return cfg, dsv4_jax.init_params(cfg, seed=5, std=0.1)


def _run(params, cfg, cache, chunks, seqs, got, widths=(1, 3, 16)):
    """Feeds the cache (row b at position pos[b]) `chunks`: a list of per-row token counts, one
    chunk per call of T = the smallest of `widths` that holds max(counts) (a few shapes, so a few
    compiles), rows padded with random tokens (padding must not matter); collects each row's
    logits per position in `got[b]`."""
    rng = np.random.default_rng(len(chunks))
    for counts in chunks:
        T = min(w for w in widths if w >= max(counts))
        pos = np.asarray(cache["pos"])
        ids = rng.integers(0, cfg.vocab_size, (len(counts), T)).astype(np.int32)
        for b, n in enumerate(counts):
            ids[b, :n] = seqs[b][pos[b]: pos[b] + n]
        logits, cache, *_ = _step(params, cache, jnp.asarray(ids), cfg, False, False, jnp.asarray(counts, jnp.int32))
        logits = np.asarray(logits)
        for b, n in enumerate(counts):
            got[b].extend(logits[b, :n])
    return cache


def test_mixed_positions_equal_full_forward(tiny):
    """Three rows driven by random chunk sizes (1 to 16, a row often idle), so that in one call
    the rows sit at unrelated positions and block phases; every position of every row equals the
    full forward of the row alone. 300 tokens per row cross the window (8), ratio-4 and
    ratio-128 boundaries at different calls in each row."""
    cfg, params = tiny
    S, B = 300, 3
    rng = np.random.default_rng(0)
    seqs = rng.integers(0, cfg.vocab_size, (B, S)).astype(np.int32)
    cache, left, chunks = init_cache(cfg, B, 320), np.full(B, S), []
    while left.any():
        T = int(rng.choice([1, 3, 16]))
        counts = [int(min(left[b], rng.integers(0, T + 1))) for b in range(B)]
        left -= counts
        chunks.append(counts)
    got = [[] for _ in range(B)]
    cache = _run(params, cfg, cache, chunks, seqs, got)
    assert np.asarray(cache["pos"]).tolist() == [S] * B
    for b in range(B):
        assert _close(np.stack(got[b]), _full(params, cfg, seqs[b])), f"row {b}"


def test_row_reset_and_prefilled_while_others_hold(tiny):
    """Row 1 runs 140 tokens, is reset and gets a new 37-token prompt prefilled in chunks (16 inside
    a batch call where row 0 holds with n_valid 0, 16 on its own rows of the cache through
    take_rows / put_rows, as an engine prefills one slot, 5 beside a decode step of row 0), then
    both decode 30 tokens. Both rows equal their sequences' full forward: the reset row shows
    nothing of its previous tokens."""
    cfg, params = tiny
    rng = np.random.default_rng(1)
    a = rng.integers(0, cfg.vocab_size, 200).astype(np.int32)
    old = rng.integers(0, cfg.vocab_size, 140).astype(np.int32)
    new = rng.integers(0, cfg.vocab_size, 67).astype(np.int32)
    cache = init_cache(cfg, 2, 256)
    got = [[], []]
    cache = _run(params, cfg, cache, [[5, 16]] + [[1, 16]] * 7 + [[1, 12]], [a, old], got)
    assert np.asarray(cache["pos"]).tolist() == [13, 140]
    cache = reset_rows(cache, jnp.asarray([False, True]))
    assert np.asarray(cache["pos"]).tolist() == [13, 0]
    got[1] = []
    cache = _run(params, cfg, cache, [[1, 0], [0, 16]], [a, new], got)
    sub = _run(params, cfg, take_rows(cache, jnp.asarray([1])), [[16]], [new], [got[1]])
    cache = put_rows(cache, jnp.asarray([1]), sub)
    cache = _run(params, cfg, cache, [[1, 5]] + [[1, 1]] * 30, [a, new], got)
    assert np.asarray(cache["pos"]).tolist() == [45, 67]
    assert _close(np.stack(got[0]), _full(params, cfg, a[:45]))
    assert _close(np.stack(got[1]), _full(params, cfg, new))


def test_last_only_takes_each_rows_last_real_token(tiny):
    """With last_only, row b's logits are those of its token n_valid[b] - 1 (another program:
    equal within the tolerance, not bit for bit). The shapes of test_mixed_positions_equal_full_forward's
    16-token chunks, whose program the full logits reuse."""
    cfg, params = tiny
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (3, 16)).astype(np.int32)
    n = jnp.asarray([16, 4, 1], jnp.int32)
    full = _step(params, init_cache(cfg, 3, 320), jnp.asarray(ids), cfg, False, False, n).logits
    last, cache, *_ = _step(params, init_cache(cfg, 3, 320), jnp.asarray(ids), cfg, True, False, n)
    assert np.asarray(cache["pos"]).tolist() == [16, 4, 1]
    assert _close(np.asarray(last)[:, 0], np.asarray(full)[np.arange(3), np.asarray(n) - 1])
