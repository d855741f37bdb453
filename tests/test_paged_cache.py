"""The paged pools of the cache (dsv4_jax/model/cache.py) and the engine that hands their blocks out
(dsv4_jax/runtime/engine.py, blocks.py): reads and writes through a block table, a shuffled table
giving the logits of the contiguous one, admission by free blocks and preemption.

fp32 throughout: a table only moves where entries sit, so the logits must be equal bit for bit."""

from __future__ import annotations

import jax

jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import dsv4_jax  # noqa: E402
import hf_oracle as H  # noqa: E402
from dsv4_jax.model.cache import (block_bytes, blocks_per_row, init_cache, pool_entries, pool_view,  # noqa: E402
                                  pool_write)
from dsv4_jax.model.deepseek_v4 import step  # noqa: E402
from dsv4_jax.runtime import decode  # noqa: E402
from dsv4_jax.runtime.blocks import BlockPool  # noqa: E402
from dsv4_jax.runtime.engine import Engine  # noqa: E402

CFG = dsv4_jax.ModelConfig.from_hf(H.TINY)  # window 8, ratios 4 and 128: blocks of 128 tokens at least


def test_pool_reads_and_writes_follow_the_table():
    rng = np.random.default_rng(0)
    NB, E, d, B, nb = 7, 4, 3, 2, 3
    pool = rng.standard_normal((NB, E, d)).astype(np.float32)
    pools = np.stack([pool, pool + 100])  # two layers' pools
    table = np.array([[5, 0, 3], [2, 6, 1]], np.int32)
    for layer in (0, 1):
        view = np.asarray(pool_view(jnp.asarray(pools), jnp.int32(layer), jnp.asarray(table)))
        for b in range(B):
            for e in range(nb * E):
                np.testing.assert_array_equal(view[b, e], pools[layer, table[b, e // E], e % E])
        ids = rng.integers(0, nb * E, (B, 2, 5))
        got = np.asarray(pool_entries(jnp.asarray(pools), jnp.int32(layer), jnp.asarray(table), jnp.asarray(ids)))
        np.testing.assert_array_equal(got, view[np.arange(B)[:, None, None], ids])
    # writes: entries 1 and 9 of row 0, 11 of row 1; -1 and nb * E are dropped
    at = np.array([[1, 9, -1], [11, nb * E, -1]], np.int32)
    values = rng.standard_normal((B, 3, d)).astype(np.float32)
    out = np.asarray(pool_write(jnp.asarray(pools), 1, jnp.asarray(table), jnp.asarray(at), jnp.asarray(values)))
    want = pools.copy()
    want[1, table[0, 0], 1], want[1, table[0, 2], 1], want[1, table[1, 2], 3] = values[0, 0], values[0, 1], values[1, 0]
    np.testing.assert_array_equal(out, want)
    # out-of-range layer: nothing written
    np.testing.assert_array_equal(
        np.asarray(pool_write(jnp.asarray(pools), 2, jnp.asarray(table), jnp.asarray(at), jnp.asarray(values))), pools)


def test_grouped_pool_access_equals_the_plain_one():
    """groups=2 (a mesh splitting rows and blocks in two): each row's blocks in its own half,
    the reads and writes equal the plain ones."""
    rng = np.random.default_rng(1)
    NB, E, d, nb = 8, 2, 3, 2
    pool = jnp.asarray(rng.standard_normal((NB, E, d)), jnp.float32)
    pools = jnp.stack([pool, -pool])
    table = jnp.asarray([[3, 0], [1, 2], [6, 5], [4, 7]], jnp.int32)  # rows 0-1 in blocks 0-3, rows 2-3 in 4-7
    ids = jnp.asarray(rng.integers(0, nb * E, (4, 3)), jnp.int32)
    for layer in (jnp.int32(0), jnp.int32(1)):
        np.testing.assert_array_equal(pool_view(pools, layer, table, 2), pool_view(pools, layer, table))
        np.testing.assert_array_equal(pool_entries(pools, layer, table, ids, 2), pool_entries(pools, layer, table, ids))
    at = jnp.asarray([[0, 3], [2, -1], [1, nb * E], [3, 0]], jnp.int32)
    values = jnp.asarray(rng.standard_normal((4, 2, d)), jnp.float32)
    np.testing.assert_array_equal(pool_write(pools, 0, table, at, values, 2), pool_write(pools, 0, table, at, values))


@pytest.mark.parametrize("block_size", [128, 256])
def test_a_shuffled_block_table_gives_the_same_logits(block_size):
    """Two rows of ragged prompts (long enough to fill ratio-128 entries), prefilled in two chunks,
    then decoded: pools twice as large as the rows need, held in the contiguous layout against
    held in a random order, interleaved. Both caches have the same shapes, so one program runs
    both, and only the table's values differ."""
    params = dsv4_jax.init_params(CFG, seed=3, std=0.1)
    B, max_len = 2, 600
    nb = blocks_per_row(max_len, block_size)
    assert init_cache(CFG, B, max_len, jnp.float32, block_size=block_size)["csa"]["pool"].shape[1] == B * nb
    plain = init_cache(CFG, B, max_len, jnp.float32, block_size=block_size, num_blocks=2 * B * nb + 1)
    assert plain["blocks"].tolist() == np.arange(B * nb).reshape(B, nb).tolist()
    assert plain["csa"]["pool"].shape[1:3] == (2 * B * nb + 1, block_size // 4)
    paged = dict(plain)
    paged["blocks"] = jnp.asarray(np.random.default_rng(1).permutation(2 * B * nb + 1)[:B * nb].reshape(B, nb),
                                  jnp.int32)
    rng = np.random.default_rng(2)
    ids = rng.integers(0, CFG.vocab_size, (B, 520)).astype(np.int32)
    n1 = np.array([300, 170], np.int32)
    n2 = np.array([220, 200], np.int32)
    run = jax.jit(step, static_argnums=3)
    decode_ids = rng.integers(0, CFG.vocab_size, (12, B, 1)).astype(np.int32)
    logits = []
    for cache in (plain, paged):
        out1 = run(params, cache, jnp.asarray(ids[:, :300]), CFG, n_valid=jnp.asarray(n1))
        # (padded to the first chunk's 300 tokens: one program for both chunks)
        chunk2 = np.stack([np.pad(ids[0, 300:520], (0, 80)), np.pad(ids[1, 170:370], (0, 100))])
        out2 = run(params, out1.cache, jnp.asarray(chunk2), CFG, n_valid=jnp.asarray(n2))
        seen, c = [out1.logits, out2.logits], out2.cache
        for t in range(12):
            o = run(params, c, jnp.asarray(decode_ids[t]), CFG)
            seen.append(o.logits)
            c = o.cache
        logits.append(seen)
        assert c["pos"].tolist() == [532, 382]
    for a, b in zip(*logits, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_block_size_must_be_a_multiple_of_every_ratio():
    with pytest.raises(ValueError, match=r"block size 192 must be a positive multiple of 128 .*\[4, 128\]"):
        init_cache(CFG, 1, 512, block_size=192)


def test_block_pool_hands_out_each_shard_its_own_blocks():
    pool = BlockPool(8, rows=4, shards=2)
    assert pool.take(0, 3) == [0, 1, 2] and pool.take(3, 2) == [4, 5]
    assert pool.take(1, 2) is None and pool.free(1) == 1 and pool.used == 5
    pool.give(0, [2, 0])
    assert pool.take(1, 3) == [0, 2, 3] and pool.used == 6


# ---- the engine ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return dsv4_jax.DeepseekV4(dsv4_jax.init_params(CFG, seed=2, std=0.1), CFG, mtp=dsv4_jax.init_mtp_params(CFG, 3))


_ALONE: dict = {}


def _alone(model, prompt, n, max_len=256, **sampling):
    """generate on one prompt alone, in the engine's chunks of 64 and at a cache length of max_len
    (the engine's: one set of programs for every prompt), each answer computed once in the module."""
    from dsv4_jax.runtime import generate as generate_module

    key = (tuple(prompt), n, max_len, tuple(sorted(sampling.items())))
    if key in _ALONE:
        return _ALONE[key]
    mp = pytest.MonkeyPatch()
    mp.setattr(generate_module, "PREFILL_CHUNK", 64)
    try:
        _ALONE[key] = dsv4_jax.generate(model, [prompt], n, max_len=max_len, **sampling).rows()[0]
        return _ALONE[key]
    finally:
        mp.undo()


@pytest.mark.parametrize("k", [0, 2])
def test_preempted_requests_finish_as_alone(model, k):
    """Pools of 4 blocks of 128 tokens for 4 slots: each request needs 2 blocks once past 128
    tokens, so decoding runs out and the newest requests are preempted, prefilled anew and go on.
    Every request gets the tokens it gets alone: greedy, sampled (without speculation), and with
    k drafts a round from the MTP block."""
    per = block_bytes(CFG, 128, jnp.float32)
    eng = Engine(model, slots=4, max_len=256, prefill_chunk=64, kv_cache_memory=4 * per, speculative_tokens=k)
    assert eng.num_blocks == 4
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (100, 90, 110, 60)]
    sampled = {} if k else dict(temperature=0.9, top_k=20, seed=7)
    reqs = [eng.submit(p, 40, **(sampled if i == 1 else {})) for i, p in enumerate(prompts)]
    peak = 0
    while eng.step() or eng.waiting:
        peak = max(peak, eng.pool.used)
        assert eng.pool.used <= eng.num_blocks
    assert eng.counters["preemptions"] > 0 and any(r.preempted for r in reqs)
    assert eng.pool.used == 0 and peak == 4
    for i, (r, p) in enumerate(zip(reqs, prompts)):
        assert r.finish_reason == "length"
        assert r.tokens == _alone(model, p, 40, **(sampled if i == 1 else {})), i


def test_a_step_sends_only_the_table_rows_given_blocks(model, monkeypatch):
    """Four requests of 120 to 127 prompt tokens, each given its second block as its decoding
    crosses position 128: the table goes to the device a few rows at a time (decode.set_table,
    the rows padded to a power of two), each request's row once for its first blocks and once for
    its second, and after every step each running request's device row holds its blocks and every
    reuse point is the host's."""
    sent = []
    set_table = decode.set_table

    def spy(state, rows, blocks, shared):
        sent.append(np.asarray(rows))
        return set_table(state, rows, blocks, shared)

    monkeypatch.setattr(decode, "set_table", spy)
    eng = Engine(model, slots=4, max_len=256, prefill_chunk=64)
    rng = np.random.default_rng(8)
    reqs = [eng.submit(rng.integers(0, CFG.vocab_size, n).tolist(), 12) for n in (120, 127, 124, 126)]
    while eng.step():
        table, shared = np.asarray(eng.state.cache["blocks"]), np.asarray(eng.state.cache["shared"])
        for r in eng.running.values():
            assert table[r.slot, :len(r.blocks)].tolist() == r.blocks
        assert shared.tolist() == eng.shared.tolist()
    assert all(r.finish_reason == "length" and len(r.blocks) == 0 for r in reqs)
    real = [rows[rows < eng.slots] for rows in sent]
    assert all(len(rows) == min(1 << (len(r) - 1).bit_length(), eng.slots) for rows, r in zip(sent, real))
    assert sorted(np.concatenate(real).tolist()) == sorted(list(range(4)) * 2)  # every row at first, then each once
    assert len(sent) > 2 and all(len(r) < eng.slots for r in real[1:])


def test_admission_waits_for_blocks(model):
    """A request is admitted only when the blocks for its whole prompt are free: with 3 blocks of
    128 tokens, a 300-token prompt (3 blocks) waits while a 100-token one holds a block."""
    per = block_bytes(CFG, 128, jnp.float32)
    eng = Engine(model, slots=2, max_len=384, prefill_chunk=64, kv_cache_memory=3 * per + per // 2)
    assert eng.num_blocks == 3
    rng = np.random.default_rng(6)
    short = eng.submit(rng.integers(0, CFG.vocab_size, 100).tolist(), 4)
    long = eng.submit(rng.integers(0, CFG.vocab_size, 300).tolist(), 4)
    eng.step()
    assert short.slot is not None and long.slot is None and eng.pool.used == 1
    eng.run_until_idle()
    assert short.finish_reason == long.finish_reason == "length" and long.preempted == 0


def test_too_little_cache_memory_is_refused(model):
    per = block_bytes(CFG, 128, jnp.float32)
    with pytest.raises(ValueError, match=r"kv_cache_memory .* holds 1 blocks of 128 tokens .* max_len 256 tokens "
                                         r"needs 2"):
        Engine(model, slots=2, max_len=256, kv_cache_memory=per + 1)


def test_default_cache_memory_is_what_the_device_has_free(model, monkeypatch):
    """Without kv_cache_memory the pools take 90 % of the device's free memory less the slots'
    rings and states and the snapshots (read off the allocated state here); a device reporting no memory (this
    CPU) gets one max_len sequence per slot; too little free memory is the kv_cache_memory error."""
    from dsv4_jax.runtime import engine as engine_module

    assert engine_module.device_free_bytes(jax.devices()[:1]) is None  # XLA:CPU reports none
    assert Engine(model, slots=2, max_len=256).num_blocks == 2 * 2
    per = block_bytes(CFG, 128, jnp.float32)
    free = 50 * per
    monkeypatch.setattr(engine_module, "device_free_bytes", lambda devices: free)
    eng = Engine(model, slots=2, max_len=256)
    rows = sum(x.nbytes for path, x in jax.tree_util.tree_leaves_with_path(eng.state.cache)
               if getattr(path[-1], "key", None) != "pool")
    rows += sum(x.nbytes for x in jax.tree.leaves(eng.state.snapshots))  # prefix caching's: 2 a slot
    assert eng.num_blocks == (int(free * 0.9) - rows) // per > 2 * 2
    monkeypatch.setattr(engine_module, "device_free_bytes", lambda devices: per)
    with pytest.raises(ValueError, match="kv_cache_memory .* holds 0 blocks"):
        Engine(model, slots=2, max_len=256)

