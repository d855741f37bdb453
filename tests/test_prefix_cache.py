"""Prefix caching (dsv4_jax/runtime/blocks.py, engine.py; the shared blocks in dsv4_jax/model/cache.py):
a row restarted inside a cached prefix, `recompute_span` tokens before the reuse point, gives the
logits of a run from position 0, and fewer tokens do not; a row started from a snapshot (the
state saved where a chunk ended on a block's end) gives them exactly; the engine with the cache
gives every request the tokens it gets without it, with and without speculation, with snapshots
and with the span recomputed; the pool's and the snapshots' keys, holds and least-recently-used
eviction; the n choices of a request forked from one prefill.

fp32 throughout. A restarted row runs its chunks at other offsets than a run from position 0, so
its logits equal those within fp32 rounding (observed about 2e-6 on logits of about 2; asserted
1e-5), and greedy tokens are identical. A snapshot saved on the chunk boundaries a run from
position 0 has gives that run's prefill values bit for bit."""

from __future__ import annotations

import jax

jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import dsv4_jax  # noqa: E402
import hf_oracle as H  # noqa: E402
from dsv4_jax.model.cache import init_cache, layers_to_run, recompute_span  # noqa: E402
from dsv4_jax.model.deepseek_v4 import step  # noqa: E402
from dsv4_jax.runtime.blocks import BlockPool, SnapshotIndex, chain  # noqa: E402
from dsv4_jax.runtime import decode  # noqa: E402
from dsv4_jax.runtime.engine import Engine  # noqa: E402

CFG = dsv4_jax.ModelConfig.from_hf(H.TINY)  # 7 layers, window 8, ratios 4 and 128: blocks of 128 tokens
TOL = 1e-5
_run = jax.jit(step, static_argnums=3)
CHUNK_WIDTHS = (176, 304)  # a restart's chunk, padded: at most 301 tokens, and within the cache from 248 on


def _restarted(params, prefix, start) -> dict:
    """A two-row cache whose row 1 is restarted at `start` over the blocks row 0 filled with
    `prefix` (its rings and compressor states hold another prompt's values)."""
    P = len(prefix)
    cache = init_cache(CFG, 2, 512, jnp.float32)
    rng = np.random.default_rng(9)
    seq = np.stack([np.concatenate([prefix, rng.integers(0, CFG.vocab_size, 40)]),
                    rng.integers(0, CFG.vocab_size, P + 40)])
    cache = dict(_run(params, cache, jnp.asarray(seq), CFG).cache)
    cache["blocks"] = cache["blocks"].at[1, :P // 128].set(cache["blocks"][0, :P // 128])
    cache["shared"] = jnp.asarray([0, P], jnp.int32)
    cache["pos"] = cache["pos"].at[1].set(start)
    return cache


def _logits_after_restart(params, prefix, suffix, follow, start):
    """Row 1 of a `_restarted` cache fed prefix[start:] + suffix (one chunk, padded to the next of
    CHUNK_WIDTHS as the engine pads its chunks: two programs for every restart point), then
    `follow` one token a step: its logits at the suffix's positions and at each step."""
    P = len(prefix)
    cache = _restarted(params, prefix, start)
    chunk = np.concatenate([prefix[start:], suffix])
    ids = np.zeros((2, min(w for w in CHUNK_WIDTHS if w >= len(chunk))), np.int32)
    ids[1, :len(chunk)] = chunk
    out = _run(params, cache, jnp.asarray(ids), CFG, n_valid=jnp.asarray([0, len(chunk)]))
    seen, cache = [out.logits[1, P - start:len(chunk)]], out.cache
    for t in follow:
        out = _run(params, cache, jnp.asarray([[0], [t]]), CFG, n_valid=jnp.asarray([0, 1]))
        seen.append(out.logits[1])
        cache = out.cache
    return np.concatenate(seen)


def test_recomputing_the_span_rebuilds_the_state_at_the_reuse_point():
    """A 256-token cached prefix (two blocks): restarted at 0, at the span before the reuse point
    or anywhere earlier, the row's logits after it are a run's from position 0; restarted later,
    the window rings and compressor states at the reuse point are wrong and so are the logits of
    the positions that read them."""
    params = dsv4_jax.init_params(CFG, seed=4, std=0.1)
    rng = np.random.default_rng(0)
    prefix, suffix, follow = (rng.integers(0, CFG.vocab_size, n) for n in (256, 45, 6))
    span = recompute_span(CFG)
    assert span == 6 * 7 + 7  # (layers - 1) x (window - 1) + the last layer's window
    cache = init_cache(CFG, 1, 512, jnp.float32)
    out = _run(params, cache, jnp.asarray(np.concatenate([prefix, suffix])[None]), CFG)
    want, cache = [out.logits[0, 256:]], out.cache
    for t in follow:
        out = _run(params, cache, jnp.asarray([[t]]), CFG)
        want.append(out.logits[0])
        cache = out.cache
    want = np.concatenate(want)
    for start in (0, 4, 128, 256 - span):
        got = _logits_after_restart(params, prefix, suffix, follow, start)
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL, err_msg=f"restart at {start}")
    for start in (256 - span // 2, 256 - 8):
        got = _logits_after_restart(params, prefix, suffix, follow, start)
        assert np.abs(got - want).max() > 100 * TOL, start


def test_span_chunks_run_only_the_layers_they_need():
    """The span fed in chunks of 8 tokens, each through the first `layers_to_run` layers only
    (2 to 7 of 7): the logits after it are a run's from position 0; one layer fewer in a single
    chunk, and they are not."""
    params = dsv4_jax.init_params(CFG, seed=4, std=0.1)
    rng = np.random.default_rng(1)
    prefix, suffix = rng.integers(0, CFG.vocab_size, 256), rng.integers(0, CFG.vocab_size, 45)
    cache = init_cache(CFG, 1, 512, jnp.float32)
    want = _run(params, cache, jnp.asarray(np.concatenate([prefix, suffix])[None]), CFG).logits[0, 256:]
    start = 256 - recompute_span(CFG)
    plan = [(a, layers_to_run(CFG, start, min(a + 8, 256))) for a in range(start, 256, 8)]
    assert [d for _, d in plan] == [2, 3, 4, 5, 6, 7, 7]
    suffix_ids = np.zeros((2, 48), np.int32)
    suffix_ids[1, :45] = suffix
    for short in (None, 3):  # the chunk whose depth is cut by one
        cache = _restarted(params, prefix, start)
        for j, (a, depth) in enumerate(plan):
            ids = np.zeros((2, 8), np.int32)
            ids[1, :min(8, 256 - a)] = prefix[a:a + 8]
            cache = _run(params, cache, jnp.asarray(ids), CFG, n_valid=jnp.asarray([0, min(8, 256 - a)]),
                         depth=jnp.int32(depth - (j == short))).cache
        got = _run(params, cache, jnp.asarray(suffix_ids), CFG, n_valid=jnp.asarray([0, 45])).logits[1, :45]
        if short is None:
            np.testing.assert_allclose(got, want, rtol=0, atol=TOL)
        else:
            assert np.abs(got - want).max() > 100 * TOL


def test_block_pool_keys_holds_and_eviction():
    pool = BlockPool(4, rows=2, caching=True)
    keys = [chain(b"", [1, 2])]
    keys.append(chain(keys[0], [3, 4]))
    assert chain(b"", [1, 2]) == keys[0] and chain(b"", [1, 3]) != keys[0]
    a = pool.take(0, 3)
    pool.cache(0, a[0], keys[0])
    pool.cache(0, a[1], keys[1])
    pool.cache(0, a[2], keys[1])  # a second block with a cached prefix: not cached
    assert pool.cached == 2 and pool.lookup(1, keys) == a[:2] and pool.used == 3
    pool.give(0, a)
    assert pool.used == 2 and pool.free(0) == 2  # a[2] free again, a[0] and a[1] still held by row 1
    pool.give(1, a[:2])
    assert pool.used == 0 and pool.free(0) == 4 and pool.cached == 2
    assert pool.lookup(0, [chain(b"", [9])] + keys) == []  # a prefix is found from its first block on
    # two free blocks, then the cached ones evicted: the later block of the sequence first
    assert sorted(pool.take(0, 2)) == sorted({0, 1, 2, 3} - set(a[:2]))
    assert pool.take(0, 1) == [a[1]] and pool.lookup(0, keys) == [a[0]] and pool.cached == 1
    assert pool.take(0, 1) is None
    off = BlockPool(2, rows=1)
    b = off.take(0, 1)
    off.cache(0, b[0], keys[0])
    assert off.cached == 0 and off.lookup(0, keys) == []


def test_snapshot_index_keys_pins_and_eviction():
    """Two shards of two places each: a key is kept once, found in its own shard only, the least
    recently used (stored or found) evicted first, a pinned place never."""
    idx = SnapshotIndex(4, shards=2)
    a, b, c, d = (chain(b"", [i]) for i in range(4))
    pa, pb = idx.place_for(0, a), idx.place_for(0, b)
    assert {pa, pb} == {0, 1} and idx.place_for(0, a) is None and len(idx) == 2
    assert idx.find(1, a) is None and idx.place_for(1, a) in (2, 3)  # shard 1 keeps its own
    assert idx.find(0, a) == pa  # now b is the least recently used of shard 0
    assert idx.place_for(0, c) == pb and idx.find(0, b) is None
    idx.pin(pa)
    assert idx.place_for(0, d) == pb and idx.find(0, c) is None and idx.find(0, a) == pa  # c evicted, a pinned
    idx.pin(pb)
    assert idx.place_for(0, b) is None  # every place pinned: nothing saved
    idx.unpin(pa)
    assert idx.place_for(0, b) == pa and idx.find(0, a) is None
    with pytest.raises(ValueError, match="split"):
        SnapshotIndex(3, shards=2)


# ---- the engine ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return dsv4_jax.DeepseekV4(dsv4_jax.init_params(CFG, seed=2, std=0.1), CFG, mtp=dsv4_jax.init_mtp_params(CFG, 3))


# Where a request leaves the cached prefix, after its last full block (reuse point 128 or 256):
# 5 tokens on (inside the window of the reuse point and a ratio-4 block), 14 (past the window,
# inside a ratio-4 block), 44 (on a ratio-4 boundary inside a ratio-128 block), 0 (at the reuse point).
SHARED = (133, 270, 300, 256)


def _requests(seed: int):
    """32 requests over 4 shared prefixes, suffixes of 1 to 60 tokens, a few of them sampled."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, CFG.vocab_size, n).tolist() for n in SHARED]
    reqs = []
    for i in range(32):
        p = prefixes[i % 4] + rng.integers(0, CFG.vocab_size, int(rng.integers(1, 61))).tolist()
        sampling = dict(temperature=0.8, top_k=30, seed=i) if i % 5 == 0 else {}
        reqs.append((p, 6, sampling))
    return prefixes, reqs


def _serve(model, k: int, caching: bool, prefixes, reqs, chunk: int, snapshots: int | None = None):
    """Serves one request per prefix first (their blocks cached as they finish), then the 32 at
    once; returns (each of the 32's tokens, the engine)."""
    eng = Engine(model, slots=8, max_len=400, prefill_chunk=chunk, speculative_tokens=k,
                 enable_prefix_caching=caching, prefix_snapshots=snapshots)
    for p in prefixes:
        eng.submit(p + [1, 2, 3], 2)
    eng.run_until_idle()
    out = [eng.submit(p, n, **s) for p, n, s in reqs]
    eng.run_until_idle()
    assert all(r.finish_reason == "length" for r in out)
    return [r.tokens for r in out], eng


@pytest.mark.parametrize("k, chunk", [(0, 64), (2, 16)])
def test_cached_prefixes_give_the_tokens_of_no_cache(model, k, chunk, monkeypatch):
    """32 concurrent requests over 4 prefixes, each leaving its prefix at another point of the
    window and the compressed blocks: with the prefix cache each request gets the tokens it gets
    without it (greedy and sampled; with k drafts a round from the MTP block, whose state the
    snapshots keep and the recomputed span rebuilds too), while most of its prompt comes from the
    cache. With snapshots (the default) every request starts from the state its prefix's first
    request left at the prefix's last block's end (chunks of 16 and 64 both end there); with none
    (`prefix_snapshots=0`) the span runs again: in chunks of 16 its first chunks run only their
    lowest layers (`layers_to_run`); in chunks of 64, every chunk reaches past the span's last
    layer's start."""
    prefixes, reqs = _requests(k)
    want, off = _serve(model, k, False, prefixes, reqs, chunk)
    got, snap = _serve(model, k, True, prefixes, reqs, chunk)
    assert got == want
    assert snap.counters["prefix_cache_snapshot_hits"] == 32
    assert snap.counters["prompt_tokens"] == (sum(len(p) + 3 for p in prefixes)
                                              + sum(len(p) - min(n, len(p) - 1) // 128 * 128
                                                    for p, _, _ in reqs for n in SHARED if p[:n] in prefixes))
    depths = []
    prefill = decode.prefill

    def spy(*args, **kwargs):
        depths.append(int(args[-1]))
        return prefill(*args, **kwargs)

    monkeypatch.setattr(decode, "prefill", spy)
    got, eng = _serve(model, k, True, prefixes, reqs, chunk, snapshots=0)
    assert got == want
    assert (min(depths) < CFG.num_layers) == (chunk == 16)
    c = eng.counters
    assert "prefix_cache_snapshot_hits" not in c
    assert "prefix_cache_hits" not in off.counters and off.pool.cached == 0
    hits = sum(min(n, len(p) - 1) // 128 * 128 for p, _, _ in reqs for n in SHARED if p[:n] in prefixes)
    assert c["prefix_cache_hits"] >= hits > 0
    assert c["prefix_cache_queries"] == sum(len(p) + 3 for p in prefixes) + sum(len(p) for p, _, _ in reqs)
    # the recomputed span only: every cached token before it was never run again
    span = recompute_span(CFG, 1 if k else 0)
    assert c["prompt_tokens"] <= off.counters["prompt_tokens"] - c["prefix_cache_hits"] + span * (36 - 4) + 36
    assert eng.pool.used == 0 and eng.pool.cached > 0


def test_a_rebuilt_reuse_point_is_kept_and_a_snapshot_is_exact(model):
    """A block filled while decoding is cached with no snapshot at its end (decode steps save
    none): the first request to reuse it (a follow-up turn: the prompt, the reply, more) runs the
    span before it in a chunk that ends there, and saves the state there; the next one starts from
    that snapshot and runs only its own tokens. Both get the tokens and log-probabilities they get
    without the cache, to fp32 rounding (the span's chunks end elsewhere than a run's from 0). A
    request reusing a prefix whose first request's chunk ended at the prefix's last block (chunks
    of 64 from 0) starts from the state saved there: its prefill's log-probabilities are a run's
    from 0 bit for bit."""
    rng = np.random.default_rng(7)
    first, cold = (rng.integers(0, CFG.vocab_size, n).tolist() for n in (100, 300))
    tails = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (20, 35, 9)]

    def serve(caching: bool):
        eng = Engine(model, slots=8, max_len=400, prefill_chunk=64, enable_prefix_caching=caching)
        a = eng.submit(first, 40)
        eng.run_until_idle()
        turn = first + a.tokens  # 140 tokens: its first block filled by decode steps
        out, seen = [], []
        for prompt in (turn + tails[0], turn + tails[1], cold, cold[:256] + tails[2]):
            before = eng.counters["prompt_tokens"]
            out.append(eng.submit(prompt, 8, logprobs=0))
            eng.run_until_idle()
            seen.append((eng.counters["prompt_tokens"] - before, eng.counters.get("prefix_cache_snapshot_hits")))
        return out, seen

    (want, _), (got, seen) = serve(False), serve(True)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    span = recompute_span(CFG)
    assert seen == [(160 - (128 - span), 0), (175 - 128, 1), (300, 1), (265 - 256, 2)]
    for i, (g, w) in enumerate(zip(got, want)):
        diff = [abs(x.logprob - y.logprob) for x, y in zip(g.logprobs, w.logprobs)]
        assert max(diff) <= TOL, (i, diff)
    # The first token's, drawn by the prefill, from the snapshot: exact. (The decode steps after it
    # run every slot, whose other rows hold what each engine left there: fp32 rounding.)
    assert got[3].logprobs[0].logprob == want[3].logprobs[0].logprob


def test_preempted_request_reuses_its_own_blocks(model):
    """A request preempted for lack of blocks finds its own full blocks in the cache when it comes
    back (they stay cached while unheld), so only the span before them runs again; its tokens are
    those it gets alone."""
    from dsv4_jax.model.cache import block_bytes

    per = block_bytes(CFG, 128, jnp.float32)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (250, 245)]
    def serve(caching: bool) -> tuple[list, Engine]:
        eng = Engine(model, slots=2, max_len=384, prefill_chunk=64, kv_cache_memory=5 * per,
                     enable_prefix_caching=caching)
        reqs = [eng.submit(p, 40) for p in prompts]
        eng.run_until_idle()
        assert eng.counters["preemptions"] > 0
        return [r.tokens for r in reqs], eng

    (want, plain), (got, eng) = serve(False), serve(True)
    assert got == want and eng.counters["prefix_cache_hits"] >= 128
    assert eng.counters["prompt_tokens"] < plain.counters["prompt_tokens"]


@pytest.mark.parametrize("k, caching", [(0, True), (2, True), (0, False)], ids=["cache", "cache-k2", "no-cache"])
def test_n_choices_fork_with_speculation_preemption_and_no_cache(model, k, caching):
    """n = 4 sampled choices of a 200-token prompt (a full block and 72 tokens), the three after
    the first forked from its prefill: one prefill, its full block shared (5 blocks in use); with
    7 blocks in all, the choices' third blocks run short and forked choices are preempted (their
    shared block let go by reference count) and prefilled anew from their own prompt and tokens;
    each choice's tokens are those its seed gives alone. With speculation (k = 2: the MTP block's
    row, carry and pending row forked too) and without the prefix cache."""
    from dsv4_jax.model.cache import block_bytes

    per = block_bytes(CFG, 128, jnp.float32)
    prompt = np.random.default_rng(4).integers(0, CFG.vocab_size, 200).tolist()
    kw = dict(temperature=0.8, top_k=30)
    eng = Engine(model, slots=4, max_len=320, prefill_chunk=64, speculative_tokens=k, kv_cache_memory=7 * per,
                 enable_prefix_caching=caching)
    first = eng.submit(prompt, 70, seed=5, **kw)
    reqs = [first] + [eng.submit(prompt, 70, seed=5 + i, after=first, **kw) for i in range(1, 4)]
    while not first.tokens:
        eng.step()
    assert [len(r.tokens) for r in reqs] == [1] * 4 and eng.pool.used == 1 + 4
    assert eng.counters["prompt_tokens"] == len(prompt) and eng.counters["forked_requests"] == 3
    eng.run_until_idle()
    assert eng.counters["preemptions"] > 0 and max(r.preempted for r in reqs[1:]) > 0 and eng.pool.used == 0
    for i, r in enumerate(reqs):
        single = eng.submit(prompt, 70, seed=5 + i, **kw)
        eng.run_until_idle()
        assert r.tokens == single.tokens and len(r.tokens) == 70
    assert len({tuple(r.tokens) for r in reqs}) > 1
