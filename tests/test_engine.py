"""The serving engine: continuous batching over cache slots (dsv4_jax/runtime/engine.py).

A request's greedy tokens must be those `generate` gives for its prompt alone, whatever else runs
beside it: same program math in another grouping (fp32; observed logit differences about 1e-6),
so the argmax agrees. The engine cuts prompts at multiples of its prefill chunk as generate does
(both at 32 here).
"""

import importlib

import jax
import numpy as np
import pytest

import dsv4_jax
import hf_oracle as H
from dsv4_jax.runtime.engine import Engine, QueueFull

SLOTS, CHUNK, MAX_LEN = 4, 32, 384
generate_module = importlib.import_module("dsv4_jax.runtime.generate")  # the module (dsv4_jax.generate is the function)


@pytest.fixture(scope="module")
def model():
    cfg = dsv4_jax.ModelConfig.from_hf(H.TINY)  # window 8, ratios 4 and 128
    return dsv4_jax.DeepseekV4(dsv4_jax.init_params(cfg, seed=2, std=0.1), cfg)


@pytest.fixture(scope="module")
def engine(model):
    eng = Engine(model, slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK)
    # decode (whole, in halves), penalty history, fork, block table rows 1 / 2 / 4, prefill rows 1 / 2 / 4 x 16 / 32
    assert eng.warmup() == 4 + 3 + 3 * 2
    return eng


@pytest.fixture(scope="module")
def alone(model):
    """generate on one prompt alone, prefilling in the engine's chunks, with the engine's cache
    length (one set of programs for every prompt, shared with StaticEngine's)."""
    cache = {}

    def run(prompt, n):
        key = (tuple(prompt), n)
        if key not in cache:
            mp = pytest.MonkeyPatch()
            mp.setattr(generate_module, "PREFILL_CHUNK", CHUNK)
            try:
                cache[key] = dsv4_jax.generate(model, [prompt], n, max_len=MAX_LEN).rows()[0]
            finally:
                mp.undo()
        return cache[key]

    return run


class _Compiles:
    """Counts XLA compilations (every backend compile jax reports) while active."""

    def __init__(self):
        self.n = 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            self.n += 1


COMPILES = _Compiles()


def test_warmup_runs_every_program_and_changes_no_state(model):
    """warm-up runs each program on random ids in rows that hold: afterwards the state is a new
    engine's, leaf for leaf, and a request compiles nothing. (The `engine` fixture's sizes: the
    programs compiled here are those it warms up.)"""
    eng = Engine(model, slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK)
    # decode (whole, in halves), penalty history, fork, block table rows 1 / 2 / 4, prefill rows 1 / 2 / 4 x 16 / 32
    assert eng.warmup(decode_runs=2) == 4 + 3 + 3 * 2
    fresh = jax.tree.leaves(eng._new_state())
    after = jax.tree.leaves(eng.state)
    assert len(after) == len(fresh) and all(np.array_equal(a, b) for a, b in zip(after, fresh))
    before = COMPILES.n
    r = eng.submit([3, 1, 4, 1, 5], 3)
    eng.run_until_idle()
    assert len(r.tokens) == 3 and COMPILES.n == before


def test_continuous_batching_matches_generate(engine, alone, model):
    """36 requests of 1 to 300 prompt tokens and 1 to 40 new ones (window 8, ratio-4 and ratio-128
    boundaries crossed in prompts and in decoding), arriving a few at a time while others decode
    (4 slots, so most wait, and long prompts prefill in chunks beside decoding slots): each
    request's tokens equal generate on its prompt alone, and nothing compiles after warm-up."""
    rng = np.random.default_rng(0)
    V = model.config.vocab_size
    specs = [(int(rng.choice([1, 3, 9, 40, 131, 260, 300])), int(rng.integers(1, 41))) for _ in range(36)]
    before = COMPILES.n
    reqs, arrivals = [], list(range(36))
    while arrivals or engine.running or engine.waiting:
        for _ in range(int(rng.integers(0, 4))):
            if arrivals:
                n, m = specs[arrivals.pop(0)]
                reqs.append(engine.submit(list(map(int, rng.integers(0, V, n))), m))
        engine.step()
    assert COMPILES.n == before, "the engine compiled after warm-up"
    assert engine.counters["finished_length"] >= 36 and not engine.running and len(engine.free) == SLOTS
    for r in reqs:
        assert r.finish_reason == "length" and len(r.tokens) == r.max_tokens
        assert r.tokens == alone(r.prompt, r.max_tokens), f"prompt of {len(r.prompt)} tokens"


def test_reused_slot_equals_a_fresh_cache(engine, alone, model):
    """A slot that just held a 300-token request gives a short request what a fresh cache gives."""
    rng = np.random.default_rng(1)
    V = model.config.vocab_size
    long = [engine.submit(list(map(int, rng.integers(0, V, 300))), 12) for _ in range(SLOTS)]
    engine.run_until_idle()
    short = list(map(int, rng.integers(0, V, 5)))
    r = engine.submit(short, 20)
    engine.run_until_idle()
    assert {x.slot for x in long} == set(range(SLOTS)) and r.tokens == alone(short, 20)


def test_stop_tokens_cancel_and_streaming(engine, model):
    rng = np.random.default_rng(2)
    V = model.config.vocab_size
    prompt = list(map(int, rng.integers(0, V, 20)))
    free = engine.submit(prompt, 16)
    engine.run_until_idle()
    stop = free.tokens[5]
    seen = []
    r = engine.submit(prompt, 16, stop_token_ids=[stop], on_token=lambda req, t: seen.append(t))
    c = engine.submit(prompt, 16)
    engine.step()
    engine.cancel(c)
    engine.run_until_idle()
    first = free.tokens.index(stop)
    assert r.finish_reason == "stop" and r.tokens == free.tokens[: first + 1]
    assert seen == r.tokens + [None]  # each token as it came, then the end
    assert c.finish_reason == "cancelled" and len(c.tokens) < 16 and len(engine.free) == SLOTS


def test_sampling_is_per_request(engine, model):
    """A sampled request's tokens depend on its seed only, not on what runs beside it."""
    rng = np.random.default_rng(3)
    V = model.config.vocab_size
    prompt = list(map(int, rng.integers(0, V, 12)))
    kw = dict(temperature=1.0, top_k=20, top_p=0.9)
    a = engine.submit(prompt, 16, seed=7, **kw)
    engine.run_until_idle()
    others = [engine.submit(list(map(int, rng.integers(0, V, 30))), 10, seed=s, **kw) for s in range(2)]
    b = engine.submit(prompt, 16, seed=7, **kw)
    c = engine.submit(prompt, 16, seed=8, **kw)
    engine.run_until_idle()
    assert a.tokens == b.tokens and a.tokens != c.tokens and all(len(o.tokens) == 10 for o in others)


def test_bad_requests_and_a_full_queue(model):
    eng = Engine(model, slots=2, max_len=64, prefill_chunk=16, max_queue=2)
    V = model.config.vocab_size
    with pytest.raises(ValueError, match="maximum context length is 64 tokens. However, your request has 64 input"):
        eng.submit([1] * 64, 1)
    with pytest.raises(ValueError, match="you requested 70 tokens"):
        eng.submit([1] * 10, 60)
    with pytest.raises(ValueError, match=f"token id {V} is outside the vocabulary"):
        eng.submit([1, V], 4)
    with pytest.raises(ValueError, match="prompt is empty"):
        eng.submit([], 4)
    for _ in range(2 + 2):  # the free slots take 2 at the next step: they never count against the queue
        eng.submit([1, 2], 4)
    with pytest.raises(QueueFull, match="2 requests are waiting for a slot already"):
        eng.submit([1, 2], 4)
    eng.step()  # admitted 2: the slots are taken, 2 still wait
    assert eng.stats()["waiting"] == 2
    with pytest.raises(QueueFull):
        eng.submit([1, 2], 4)
    with pytest.raises(ValueError, match="prefill_chunk must be a power of two"):
        Engine(model, slots=2, max_len=64, prefill_chunk=24)


def test_static_engine_runs_whole_batches_through_generate(model, alone):
    """The baseline of dsv4-serve --scheduler static: the waiting requests go through generate as
    one batch, a request arriving meanwhile waits for the next, every token of a batch comes when
    it ends, and each request gets generate's tokens for its prompt alone, cut to its own limit
    and stop ids."""
    from dsv4_jax.runtime.engine import StaticEngine

    rng = np.random.default_rng(4)
    V = model.config.vocab_size
    eng = StaticEngine(model, slots=2, max_len=MAX_LEN)
    prompts = [list(map(int, rng.integers(0, V, n))) for n in (5, 30, 17)]
    stop = alone(prompts[1], 12)[3]
    seen = []
    first = [eng.submit(prompts[0], 12, on_token=lambda r, t: seen.append((r.id, t))),
             eng.submit(prompts[1], 12, stop_token_ids=[stop])]
    later = eng.submit(prompts[2], 6)
    assert eng.step()  # the first two, as one batch
    assert all(r.done for r in first) and not later.done and later in eng.waiting
    assert seen == [(first[0].id, t) for t in first[0].tokens] + [(first[0].id, None)]
    assert eng.step() and later.done and not eng.step()
    assert first[0].tokens == alone(prompts[0], 12) and first[0].finish_reason == "length"
    want = alone(prompts[1], 12)
    assert first[1].tokens == want[: want.index(stop) + 1] and first[1].finish_reason == "stop"
    assert later.tokens == alone(prompts[2], 6) and len(eng.free) == 2


def test_static_engine_runs_each_request_with_its_own_sampling(model):
    """One static batch of a greedy request and a sampled one, each with its own stop id: each
    request gets the tokens generate gives it alone with its own settings (temperature, top_k,
    top_p, seed and stop ids), not those of the batch's first request."""
    from dsv4_jax.runtime.engine import StaticEngine

    rng = np.random.default_rng(5)
    V = model.config.vocab_size
    prompts = [list(map(int, rng.integers(0, V, n))) for n in (9, 21)]
    asks = [dict(), dict(temperature=1.0, top_k=20, top_p=0.9, seed=11)]
    free = [dsv4_jax.generate(model, [p], 12, max_len=MAX_LEN, **a).rows()[0] for p, a in zip(prompts, asks)]
    stops = [free[0][7], free[1][4]]
    eng = StaticEngine(model, slots=2, max_len=MAX_LEN)
    reqs = [eng.submit(p, 12, stop_token_ids=[s], **a) for p, a, s in zip(prompts, asks, stops)]
    assert eng.step() and all(r.done for r in reqs)
    for r, p, a, s in zip(reqs, prompts, asks, stops):
        assert r.tokens == dsv4_jax.generate(model, [p], 12, eos_token_id=s, max_len=MAX_LEN, **a).rows()[0]
        assert r.finish_reason == "stop" and r.tokens[-1] == s


def test_drafts_asked_of_an_engine_without_speculation(engine):
    with pytest.raises(ValueError, match="speculative decoding is off here"):
        engine.submit([1, 2, 3], 4, speculative_tokens=2)
    assert engine.submit([1, 2, 3], 1, speculative_tokens=0).sampling.speculative_tokens == 0


def test_n_choices_fork_one_prefill(engine, model, alone):
    """An n = 4 sampled request, its choices after the first submitted `after` it (as the server
    does): the prompt (a full block of 128 tokens and 22 more) is prefilled once, the three other
    choices forked from it in the step that ends it, sharing its full block (5 blocks in use, not
    4 x 2), and each choice's tokens are those its seed gives alone; nothing compiles. Greedy,
    n = 2 gives one answer twice, generate's."""
    rng = np.random.default_rng(6)
    V = model.config.vocab_size
    prompt = list(map(int, rng.integers(0, V, 150)))
    kw = dict(temperature=1.0, top_k=20, top_p=0.9)
    engine.run_until_idle()  # what earlier tests left queued
    before, c = COMPILES.n, engine.counters
    prefilled, forked = c["prompt_tokens"], c["forked_requests"]
    first = engine.submit(prompt, 12, seed=7, **kw)
    reqs = [first] + [engine.submit(prompt, 12, seed=7 + i, after=first, **kw) for i in range(1, 4)]
    while not first.tokens:
        engine.step()
    assert [len(r.tokens) for r in reqs] == [1] * 4 and engine.pool.used == 1 + 4
    engine.run_until_idle()
    assert COMPILES.n == before, "the fork compiled after warm-up"
    assert c["prompt_tokens"] - prefilled == len(prompt) and c["forked_requests"] - forked == 3
    for i, r in enumerate(reqs):
        single = engine.submit(prompt, 12, seed=7 + i, **kw)
        engine.run_until_idle()
        assert r.tokens == single.tokens and len(r.tokens) == 12
    assert len({tuple(r.tokens) for r in reqs}) > 1
    greedy = engine.submit(prompt[:40], 10)
    other = engine.submit(prompt[:40], 10, after=greedy)
    engine.run_until_idle()
    assert greedy.tokens == other.tokens == alone(prompt[:40], 10) and c["forked_requests"] - forked == 4
