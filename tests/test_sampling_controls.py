"""The sampling controls (dsv4_jax/runtime/sampling.py) and log-probabilities, against numpy.

- `adjusted` (logit bias, min_tokens, repetition / frequency / presence penalties, a grammar's
  bitmask) and the draw's cut-offs (temperature, min_p, top-k, top-p) each equal a numpy model on
  fixed random logits: fp32 arithmetic in the same order, so within 1e-6.
- In the engine: a greedy request with penalties, logit bias and min_tokens gives the tokens of a
  numpy rollout over the full forward's logits (the tiny model in fp32: the engine's cached steps
  and the full forward agree to about 1e-6, far below the gaps between the top logits here), and
  its log-probabilities are the log-softmax of those logits, within 1e-5.
- None of it compiles a program after warm-up.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax
import hf_oracle as H
from dsv4_jax.model.deepseek_v4 import forward
from dsv4_jax.runtime import decode, sampling
from dsv4_jax.runtime.compile_cache import CompileCounter
from dsv4_jax.runtime.engine import Engine
from dsv4_jax.runtime.request import RequestError, SamplingParams

V = 50
_forward = jax.jit(forward, static_argnums=2)


def numpy_adjusted(logits, p: SamplingParams, drawn: int, counts, prompt, allowed=None):
    """One row's logits after its controls, as the sampling module's doc orders them."""
    x = logits.astype(np.float32).copy()
    for token, bias in p.logit_bias:
        x[token] += np.float32(bias)
    if drawn < p.min_tokens:
        x[list(p.stop_token_ids)] = -np.inf
    seen = (counts > 0) | prompt
    rep = np.float32(p.repetition_penalty)
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    x = x - np.float32(p.frequency_penalty) * counts.astype(np.float32) - np.float32(p.presence_penalty) * (counts > 0)
    if allowed is not None:
        x = np.where(allowed, x, -np.inf)
    return x.astype(np.float32)


def numpy_distribution(x, p: SamplingParams):
    """The probabilities a draw uses for one row's adjusted logits (temperature > 0)."""
    z = x.astype(np.float64) / p.temperature
    order = np.argsort(-z, kind="stable")
    probs = np.exp(z[order] - z[order][0])
    probs /= probs.sum()
    keep = np.ones(len(z), bool)
    if p.top_k:
        keep &= np.arange(len(z)) < p.top_k
    before = np.cumsum(probs) - probs
    keep &= (before < p.top_p) | (np.arange(len(z)) == 0)
    keep &= probs >= p.min_p * probs[0]
    out = np.zeros(len(z))
    out[order[keep]] = probs[keep] / probs[keep].sum()
    return out


def _params(rng, **fixed):
    values = dict(temperature=float(rng.uniform(0.5, 1.5)), top_k=int(rng.choice([0, 5, 20])),
                  top_p=float(rng.choice([1.0, 0.9, 0.5])), seed=int(rng.integers(1 << 30)),
                  stop_token_ids=[int(t) for t in rng.choice(V, 2, replace=False)],
                  min_p=float(rng.choice([0.0, 0.05, 0.2])), presence_penalty=float(rng.uniform(-2, 2)),
                  frequency_penalty=float(rng.uniform(-2, 2)), repetition_penalty=float(rng.uniform(0.5, 2)),
                  logit_bias={str(t): float(rng.uniform(-100, 100)) for t in rng.choice(V, 4, replace=False)},
                  min_tokens=int(rng.integers(0, 4)))
    values.update(fixed)
    return SamplingParams.checked(V, **values)


def test_adjusted_logits_equal_numpy():
    """Six rows, each with its own penalties, bias, min_tokens, token counts, prompt and mask."""
    rng = np.random.default_rng(0)
    R = 6
    params = [_params(rng) for _ in range(R)]
    logits = rng.normal(0, 3, (R, V)).astype(np.float32)
    counts = rng.integers(0, 3, (R, V)).astype(np.int32) * (rng.random((R, V)) < 0.3)
    prompt = rng.random((R, V)) < 0.2
    drawn = rng.integers(0, 5, R).astype(np.int32)
    allowed = rng.random((R, V)) < 0.6
    allowed[0] = True  # a row without a grammar
    s = decode.Sampling.rows(R, V, dict(enumerate(params)), dict(enumerate(drawn.tolist())))
    bits = np.zeros((R, sampling.mask_words(V) * 32), bool)
    bits[:, :V] = allowed
    words = (bits.reshape(R, -1, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1)
    s.controls.mask[:] = words.astype(np.uint32).view(np.int32)
    np.testing.assert_array_equal(np.asarray(sampling.allowed(jnp.asarray(s.controls.mask), V)), allowed)
    state = decode.DecodeState({}, counts=jnp.asarray(counts), prompt=jnp.asarray(prompt))
    got = np.asarray(s.adjusted(jnp.asarray(logits), state))
    for r in range(R):
        want = numpy_adjusted(logits[r], params[r], drawn[r], counts[r], prompt[r], allowed[r])
        np.testing.assert_allclose(got[r], want, rtol=1e-6, atol=1e-6)
        assert (got[r] == -np.inf).sum() == (want == -np.inf).sum()


def test_draw_cut_offs_equal_numpy():
    """temperature, min_p, top-k and top-p: the distribution a row draws from."""
    rng = np.random.default_rng(1)
    R = 8
    params = [_params(rng) for _ in range(R)]
    logits = rng.normal(0, 2, (R, V)).astype(np.float32)
    s = decode.Sampling.rows(R, V, dict(enumerate(params)))
    got = np.asarray(sampling.distribution(jnp.asarray(logits), *s.params))
    for r in range(R):
        np.testing.assert_allclose(got[r], numpy_distribution(logits[r], params[r]), atol=1e-6)
    # and the draws land inside each row's support
    keys = s.keys()
    for _ in range(3):
        tokens = np.asarray(sampling.sample(jnp.asarray(logits), keys, *s.params))
        assert all(got[r, t] > 0 for r, t in enumerate(tokens))
        keys = jax.vmap(lambda k: jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(k), 1)))(keys)


def test_logprobs_are_the_log_softmax_of_the_raw_logits():
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 3, (3, V)).astype(np.float32)
    tokens = np.array([4, 0, 49], np.int32)
    chosen, ids, lps = (np.asarray(x) for x in sampling.logprobs(jnp.asarray(logits), jnp.asarray(tokens), 5))
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(chosen, ref[np.arange(3), tokens], atol=1e-5)
    np.testing.assert_array_equal(ids, np.argsort(-ref, axis=-1, kind="stable")[:, :5])
    np.testing.assert_allclose(lps, np.take_along_axis(ref, ids, -1), atol=1e-5)


@pytest.mark.parametrize("field, value", [
    ("min_p", 1.5), ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0),
    ("logit_bias", {"3": 101}), ("logit_bias", {"x": 1}), ("logit_bias", {str(V): 1}), ("min_tokens", -1),
    ("logprobs", 21)])
def test_bad_controls_name_their_field(field, value):
    with pytest.raises(RequestError) as e:
        SamplingParams.checked(V, **{field: value})
    assert e.value.param == field


@pytest.fixture(scope="module")
def model():
    cfg = dsv4_jax.ModelConfig.from_hf(H.TINY)
    return dsv4_jax.DeepseekV4(dsv4_jax.init_params(cfg, seed=2, std=0.1), cfg)


def test_engine_controls_equal_a_numpy_rollout(model):
    """Greedy requests with penalties, logit bias and min_tokens beside plain ones, in one engine
    (slots at different positions, prompts prefilled in chunks): each request's tokens are the
    argmax of numpy_adjusted over the full forward's logits at each step, its counts those of the
    tokens before; its logprobs that forward's log-softmax. Warm-up first: no request compiles."""
    cfg = model.config
    Vm = cfg.vocab_size
    rng = np.random.default_rng(3)
    eng = Engine(model, slots=4, max_len=192, prefill_chunk=16)
    eng.warmup(decode_runs=1)
    specs = []
    for i, n in enumerate((3, 40, 70, 9, 130)):
        prompt = rng.integers(0, Vm, n).tolist()
        kw = dict(logprobs=4)
        if i % 2 == 0:
            kw.update(repetition_penalty=float(rng.uniform(1.2, 2)), presence_penalty=float(rng.uniform(0.5, 2)),
                      frequency_penalty=float(rng.uniform(0.5, 2)), min_tokens=6,
                      stop_token_ids=[int(t) for t in rng.choice(Vm, 3, replace=False)],
                      logit_bias={str(int(t)): float(rng.uniform(-5, 5)) for t in rng.choice(Vm, 5, replace=False)})
        specs.append((prompt, kw))
    with CompileCounter() as compiles:
        reqs = [eng.submit(p, 12, **kw) for p, kw in specs]
        eng.run_until_idle()
    assert compiles.compiled == 0, compiles.programs
    # every request's sequence in one forward, padded at the end (causal: the logits at a position
    # do not depend on the tokens after it, tests/test_model_parity.py::test_causal)
    seqs = [prompt + r.tokens for (prompt, _), r in zip(specs, reqs)]
    ids = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for b, seq in enumerate(seqs):
        ids[b, :len(seq)] = seq
    full = np.asarray(_forward(model.params, jnp.asarray(ids), cfg))
    for b, ((prompt, kw), r) in enumerate(zip(specs, reqs)):
        assert r.finish_reason in ("stop", "length") and len(r.logprobs) == len(r.tokens)
        p = SamplingParams.checked(Vm, **kw)
        logits = full[b, len(prompt) - 1:len(seqs[b])]
        prompt_seen = np.zeros(Vm, bool)
        prompt_seen[prompt] = True
        for i, token in enumerate(r.tokens):
            counts = np.bincount(r.tokens[:i], minlength=Vm).astype(np.int32)
            x = numpy_adjusted(logits[i], p, i, counts, prompt_seen)
            assert token == int(np.argmax(x)), f"prompt of {len(prompt)}, token {i}"
            ref = logits[i].astype(np.float64)
            ref = ref - np.log(np.exp(ref - ref.max()).sum()) - ref.max()
            lp = r.logprobs[i]
            assert abs(lp.logprob - ref[token]) < 1e-5
            np.testing.assert_allclose(lp.top_logprobs, np.sort(ref)[::-1][:4], atol=1e-5)
            assert ref[lp.top_ids[0]] == ref.max()
        if p.min_tokens:
            assert not set(r.tokens[:p.min_tokens]) & set(p.stop_token_ids)


class _Cycle:
    """A constraint allowing one token a step, from `tokens` in turn, done after all of them."""

    def __init__(self, tokens):
        self.tokens, self.i = tokens, 0

    @property
    def done(self):
        return self.i == len(self.tokens)

    def fill(self, row):
        row[:] = 0
        t = self.tokens[min(self.i, len(self.tokens) - 1)]
        row[t // 32] = np.array(1 << (t % 32), np.uint32).view(np.int32)

    def accept(self, token):
        assert token == self.tokens[self.i]
        self.i += 1


def test_engine_constraints_mask_every_draw(model):
    """Constrained requests (their masks filled while the model's half of the step runs) beside
    free ones, sampled at temperature 1: each draws exactly what its constraint allows and stops
    when it is done; the free ones are their own alone; nothing compiles after warm-up."""
    Vm = model.config.vocab_size
    rng = np.random.default_rng(4)
    eng = Engine(model, slots=4, max_len=192, prefill_chunk=16)
    eng.warmup(decode_runs=1)
    wanted = [rng.integers(0, Vm, n).tolist() for n in (5, 9)]
    prompts = [rng.integers(0, Vm, n).tolist() for n in (7, 50, 20, 3)]
    with CompileCounter() as compiles:
        constrained = [eng.submit(p, 30, temperature=1.0, seed=i, constraint=_Cycle(w))
                       for i, (p, w) in enumerate(zip(prompts, wanted))]
        free = [eng.submit(p, 6, temperature=1.0, seed=7) for p in prompts[2:]]
        eng.run_until_idle()
    assert compiles.compiled == 0, compiles.programs
    for r, w in zip(constrained, wanted):
        assert r.tokens == w and r.finish_reason == "stop"
    for r, p in zip(free, prompts[2:]):
        alone = eng.submit(p, 6, temperature=1.0, seed=7)
        eng.run_until_idle()
        assert r.tokens == alone.tokens


def test_decode_controls_are_sent_when_the_requests_drawing_change(model):
    """The decode step's sampling controls (no request constrained) stay on the device while the
    same requests draw: rebuilt only when a request joins or leaves, not every step; each request
    (sampled, its key counting its tokens) still draws what it draws alone."""
    Vm = model.config.vocab_size
    rng = np.random.default_rng(5)
    eng = Engine(model, slots=4, max_len=192, prefill_chunk=16)
    specs = [(rng.integers(0, Vm, n).tolist(), m, dict(temperature=1.0, seed=i, top_k=int(rng.integers(5, 50)),
                                                         logit_bias={str(int(rng.integers(Vm))): 4.0}))
             for i, (n, m) in enumerate(((5, 6), (30, 14), (12, 9)))]
    reqs = [eng.submit(p, m, **kw) for p, m, kw in specs]
    built, decode_steps = [], 0
    while eng.step():
        if eng._controls is not None and (not built or eng._controls[1] is not built[-1][1]):
            built.append(eng._controls)
        decode_steps += any(r.tokens for r in reqs)
    keys = [key for key, _ in built]
    assert all(a != b for a, b in zip(keys, keys[1:])), keys  # a rebuild only for other requests
    # each request joins the drawing once and leaves once: at most 2 n - 1 sets of them in turn
    assert len(built) <= 2 * len(reqs) - 1 < decode_steps, (len(built), decode_steps)
    for r, (p, m, kw) in zip(reqs, specs):
        alone = eng.submit(p, m, **kw)
        eng.run_until_idle()
        assert r.tokens == alone.tokens
