"""Deterministic mode (Engine(deterministic=True), `dsv4-serve --deterministic`): in bf16, a
request's tokens do not depend on what runs beside it or on where its prompt starts running.

Each step is the one decode program over all slots and a prompt goes in a token a step, so a
row's arithmetic is the same alone or in a full batch, whatever the others hold, and a restart
inside a cached prefix reads the entries the prefix holds. The checks are exact, token for token
in bf16. (The default mode, which prefills in chunks of varying rows and lengths, gave the same
tokens batched and alone for these requests on XLA:CPU too; it promises nothing of the kind.)
"""

import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax
import hf_oracle as H
from dsv4_jax.model.params import cast_params
from dsv4_jax.runtime.compile_cache import CompileCounter
from dsv4_jax.runtime.engine import Engine, EngineConfigError


@pytest.fixture(scope="module")
def model():
    cfg = dsv4_jax.ModelConfig.from_hf(H.TINY)  # window 8, ratios 4 and 128
    return dsv4_jax.DeepseekV4(cast_params(dsv4_jax.init_params(cfg, seed=2, std=0.1), cfg, jnp.bfloat16), cfg)


def _engine(model, **kw):
    eng = Engine(model, slots=kw.pop("slots", 4), max_len=384, prefill_chunk=32, deterministic=True, **kw)
    eng.warmup(decode_runs=1)
    return eng


def test_batched_equals_alone_in_bf16(model):
    """16 concurrent requests (prompts of 2 to 300 tokens, 12 new tokens; greedy, and seeded
    sampling at temperature 0.9) through 4 slots, arriving while others run: each equals the same
    request alone in the same engine, and alone in an engine of another slot count; nothing
    compiles after warm-up."""
    rng = np.random.default_rng(0)
    V = model.config.vocab_size
    lengths = [2, 300, 17, 129, 64, 5, 200, 33, 256, 9, 128, 3, 90, 150, 40, 280]
    specs = [(rng.integers(0, V, n).tolist(), dict(temperature=0.9, seed=i) if i % 3 == 0 else {})
             for i, n in enumerate(lengths)]
    eng = _engine(model)
    with CompileCounter() as compiles:
        reqs = []
        for i, (prompt, kw) in enumerate(specs):
            reqs.append(eng.submit(prompt, 12, **kw))
            if i % 4 == 3:
                for _ in range(7):  # the others arrive while these run
                    eng.step()
        eng.run_until_idle()
        alone = []
        for prompt, kw in specs:
            r = eng.submit(prompt, 12, **kw)
            eng.run_until_idle()
            alone.append(r.tokens)
    assert compiles.compiled == 0, compiles.programs
    assert [r.tokens for r in reqs] == alone
    other = _engine(model, slots=2)
    for (prompt, kw), tokens in zip(specs[:6], alone):
        r = other.submit(prompt, 12, **kw)
        other.run_until_idle()
        assert r.tokens == tokens


def test_a_prefix_cache_hit_changes_nothing(model):
    """A request whose prompt starts with a cached prefix restarts inside it (recompute_span
    before the reuse point) instead of at 0: the same tokens as with caching off."""
    rng = np.random.default_rng(1)
    V = model.config.vocab_size
    prefix = rng.integers(0, V, 256).tolist()
    prompts = [prefix + rng.integers(0, V, n).tolist() for n in (3, 40, 100)]
    on = _engine(model)
    warm = on.submit(prefix + [1, 2, 3], 2)
    on.run_until_idle()
    assert warm.finish_reason == "length"
    hits = on.counters["prefix_cache_hits"]
    got = [on.submit(p, 10) for p in prompts]
    on.run_until_idle()
    assert on.counters["prefix_cache_hits"] > hits
    off = _engine(model, enable_prefix_caching=False)
    want = [off.submit(p, 10) for p in prompts]
    off.run_until_idle()
    assert [r.tokens for r in got] == [r.tokens for r in want]


def test_no_speculation_in_deterministic_mode(model):
    with pytest.raises(EngineConfigError) as e:
        Engine(model, slots=2, max_len=64, deterministic=True, speculative_tokens=2)
    assert e.value.param == "deterministic"
