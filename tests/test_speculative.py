"""Speculative decoding with the MTP block (dsv4_jax/runtime/speculative.py).

Greedy output with speculation must be token for token the output without it: the verification
runs the same fp32 math in chunks of k + 1 (logits equal to about 1e-6, test_generate's
tolerance), so the argmax agrees. Random weights make the block's drafts almost never right, so
drafts are also forced from the known continuation, right for exactly the first j of each round.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax
from convert.cli import main as convert_main
from dsv4_jax.runtime.generate import run_request
from dsv4_jax.runtime.request import validate_request
from dsv4_jax.tools.random_checkpoint import write_random_checkpoint
from dsv4_jax.runtime.speculative import accept
from dsv4_jax.tools.bench_speculative import ForcedDrafts


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny preset (window 32; layers of ratio 4 and 128) with its MTP block, in float32."""
    hf = write_random_checkpoint(str(tmp_path_factory.mktemp("rc") / "hf"), "tiny", with_mtp=True)
    out = tmp_path_factory.mktemp("conv") / "f32"
    assert convert_main([hf, str(out), "--dtype", "float32"]) == 0
    return dsv4_jax.load(out, mtp=True)


@pytest.fixture(scope="module")
def prompts(model):
    """A ragged batch: prompts of 3, 40 and 150 tokens (window and both ratios crossed in the
    prompts; 40 new tokens cross them again while decoding)."""
    rng = np.random.default_rng(0)
    return [list(map(int, rng.integers(2, model.config.vocab_size, n))) for n in (3, 40, 150)]


@pytest.fixture(scope="module")
def reference(model, prompts):
    return dsv4_jax.generate(model, prompts, 40, eos_token_id=None)


@pytest.fixture(scope="module")
def continuation(model, prompts):
    """The greedy continuation past the 40 tokens too (the last round's drafts reach beyond)."""
    return dsv4_jax.generate(model, prompts, 48, eos_token_id=None).tokens


@pytest.mark.parametrize("k", [1, 4])  # one draft, and the deepest chain of drafts
def test_greedy_with_the_block_equals_without(model, prompts, reference, k):
    out = dsv4_jax.generate(model, prompts, 40, eos_token_id=None, speculative_tokens=k)
    assert out.rows() == reference.rows()
    s = out.speculation
    assert s["spec_decode_num_draft_tokens"] == k * s["spec_decode_num_drafts"]
    assert [f"spec_decode_num_accepted_tokens_pos_{i}" in s for i in range(k + 1)] == [True] * k + [False]
    assert reference.speculation is None


def _forced(model, prompts, continuation, k, right, eos=None):
    req = validate_request(prompts, model.config, 40, eos_token_id=eos, speculative_tokens=k)
    drafter = ForcedDrafts(continuation, np.asarray(right, np.int32), np.ones(len(prompts), np.float32))
    return run_request(model, model.config, req, drafter)


@pytest.mark.parametrize("k, right", [(3, [3, 3, 3]), (3, [0, 0, 0]), (4, [1, 2, 3]), (2, [2, 0, 1])],
                         ids=["always right", "always wrong", "first j, j per row", "k 2, j per row"])
def test_forced_drafts_keep_the_output_and_count_exactly(model, prompts, reference, continuation, k, right):
    """Each round row b's first j_b drafts are right and the rest wrong: the output is unchanged,
    row b emits j_b + 1 tokens a round (its first token comes from the prefill), and the counters
    say exactly that: accepted = sum over rows of rounds_b x j_b."""
    out = _forced(model, prompts, continuation, k, right)
    assert out.rows() == reference.rows()
    rounds = [-(-(40 - 1) // (j + 1)) for j in right]
    s = out.speculation
    assert s["rounds"] == max(rounds) and s["spec_decode_num_drafts"] == sum(rounds)
    assert s["spec_decode_num_draft_tokens"] == k * sum(rounds)
    assert s["spec_decode_num_accepted_tokens"] == sum(r * j for r, j in zip(rounds, right))
    assert [s[f"spec_decode_num_accepted_tokens_pos_{i}"] for i in range(k)] == \
        [sum(r for r, j in zip(rounds, right) if j > i) for i in range(k)]
    assert s["acceptance_length"] == pytest.approx(1 + s["spec_decode_num_accepted_tokens"] / s["spec_decode_num_drafts"])


def test_eos_inside_kept_drafts_stops_the_row(model, prompts, reference, continuation):
    """A stop id among a round's kept drafts ends the row there, as without speculation."""
    eos = int(reference.tokens[2, 10])
    want = dsv4_jax.generate(model, prompts, 40, eos_token_id=eos).rows()
    assert _forced(model, prompts, continuation, 4, [4, 4, 4], eos=eos).rows() == want


def _emitted(target, draft, n, seed=0):
    """n rounds of `accept` on one row: (first token, second token or -1, kept) per round, with the
    drafts drawn from `draft`."""
    k = draft.shape[0]
    keys = jax.random.split(jax.random.PRNGKey(seed), n)

    def one(key):
        kd, ka = jax.random.split(key)
        drafts = jax.random.categorical(kd, jnp.log(draft), axis=-1).astype(jnp.int32)
        kept, nxt = accept(target[None], draft[None], drafts[None], jax.random.key_data(ka)[None])
        toks = jnp.where(jnp.arange(k + 1) < kept[0], jnp.pad(drafts, (0, 1)), nxt[0])
        return toks[0], jnp.where(kept[0] >= 1, toks[1], -1), kept[0]

    return [np.asarray(x) for x in jax.jit(jax.vmap(one))(keys)]


def test_rejection_sampling_keeps_the_target_distribution():
    """40,000 rounds with drafts from q (unlike p): the first token is distributed as p at the
    first position, the second (when the first draft was kept) as p at the second, within 0.012
    absolute (about 5 standard errors); a draft equal to p is always kept."""
    p = jnp.asarray([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.1, 0.4, 0.3, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = jnp.asarray([[0.1, 0.1, 0.1, 0.2, 0.5], [0.3, 0.3, 0.2, 0.1, 0.1]])
    first, second, kept = _emitted(p, q, 40000)
    np.testing.assert_allclose(np.bincount(first, minlength=5) / len(first), p[0], atol=0.012)
    seconds = second[second >= 0]
    assert len(seconds) > 5000
    np.testing.assert_allclose(np.bincount(seconds, minlength=5) / len(seconds), p[1], atol=0.012)
    _, _, kept_same = _emitted(p, p[:2], 2000, seed=1)
    assert (kept_same == 2).all() and (kept < 2).any()


def test_bad_speculative_requests(model, prompts):
    with pytest.raises(ValueError, match="speculative_tokens must be between 0 \\(off\\) and 8"):
        dsv4_jax.generate(model, prompts, 4, speculative_tokens=9)
    with pytest.raises(TypeError, match="speculative_tokens must be an integer"):
        dsv4_jax.generate(model, prompts, 4, speculative_tokens=1.5)
    with pytest.raises(ValueError, match=r"length is 156 tokens\. However, you requested 158 tokens \(150 in the "
                                         r"messages, 4 in the completion, 4 for speculative decoding\)"):
        dsv4_jax.generate(model, prompts, 4, speculative_tokens=4, max_len=156)
    plain = dsv4_jax.DeepseekV4(model.params, model.config)
    with pytest.raises(ValueError, match="needs the checkpoint's MTP block"):
        dsv4_jax.generate(plain, prompts, 4, speculative_tokens=2)


@pytest.fixture(scope="module")
def alone_in_chunks_of_16(model):
    """generate on one prompt alone, its prompt cut in the engine's chunks of 16, at a cache length
    of 256 (one set of programs for every prompt), each answer computed once."""
    import sys

    cache = {}

    def run(prompt, n):
        key = (tuple(prompt), n)
        if key not in cache:
            mp = pytest.MonkeyPatch()
            mp.setattr(sys.modules["dsv4_jax.runtime.generate"], "PREFILL_CHUNK", 16)
            try:
                cache[key] = dsv4_jax.generate(model, [prompt], n, eos_token_id=None, max_len=256).rows()[0]
            finally:
                mp.undo()
        return cache[key]

    return run


def test_engine_speculates_per_request(model, prompts, alone_in_chunks_of_16):
    """The engine with 3 drafts a round, requests asking for 3, 1, 2 and 0 of them (and a fifth
    waiting for a slot): every request's greedy tokens equal generate's alone, and the counters
    add up (each round of a request proposes its own number of drafts)."""
    from dsv4_jax.runtime.engine import Engine

    eng = Engine(model, slots=4, max_len=256, prefill_chunk=16, speculative_tokens=3)
    asks = [3, 1, 2, 0, 3]
    reqs = [eng.submit(p, 30, speculative_tokens=k) for p, k in zip(prompts + prompts[:2], asks)]
    eng.run_until_idle()
    for r in reqs:
        assert r.tokens == alone_in_chunks_of_16(r.prompt, 30)
    s = eng.stats()
    assert s["spec_decode_num_draft_tokens"] <= 3 * s["spec_decode_num_drafts"] and s["spec_decode_num_drafts"] >= 29 * 4
    with pytest.raises(ValueError, match=r"speculative_tokens must be between 0 \(off\) and 3, got 4"):
        eng.submit(prompts[0], 4, speculative_tokens=4)


def test_engine_warmup_with_speculation_changes_no_state(model, prompts, alone_in_chunks_of_16):
    """warm-up runs the verification round and the prefill (MTP block included) on random ids in
    rows that hold: the state after it is a new engine's, leaf for leaf, and a request then gets
    generate's tokens."""
    from dsv4_jax.runtime.engine import Engine

    eng = Engine(model, slots=1, max_len=64, prefill_chunk=16, speculative_tokens=2)
    assert eng.warmup(decode_runs=2) == 4  # verification, penalty history, block table, prefill
    fresh, after = jax.tree.leaves(eng._new_state()), jax.tree.leaves(eng.state)
    assert len(after) == len(fresh) and all(np.array_equal(a, b) for a, b in zip(after, fresh))
    r = eng.submit(prompts[1][:20], 6)
    eng.run_until_idle()
    assert r.tokens == alone_in_chunks_of_16(prompts[1][:20], 6)


def test_engine_speculates_on_fp8_records(model, prompts):
    """kv_cache_dtype "fp8": the MTP block's ring holds FP8 records as the main model's rings do,
    and greedy tokens with 3 drafts a round equal those without speculation."""
    from dsv4_jax.runtime.engine import Engine

    tokens = {}
    for k in (3, 0):
        eng = Engine(model, slots=3, max_len=256, prefill_chunk=16, speculative_tokens=k, kv_cache_dtype="fp8")
        reqs = [eng.submit(p, 30) for p in prompts]
        eng.run_until_idle()
        tokens[k] = [r.tokens for r in reqs]
        if k:
            assert eng.state.mtp_cache["window"]["ring"].dtype == jnp.uint32
            assert eng.state.cache["window"]["ring"].dtype == jnp.uint32
    assert tokens[3] == tokens[0]


def test_server_speculates(model, tmp_path_factory, prompts, alone_in_chunks_of_16):
    """dsv4-serve --speculative-tokens 2: concurrent greedy completions equal generate's tokens; the
    spec-decode counters are on /metrics (per position too); a request may ask for fewer drafts,
    not more."""
    import threading
    import time

    import httpx
    import uvicorn

    from convert.cli import convert
    from dsv4_jax.serving import serve

    root = tmp_path_factory.mktemp("spec-serve")
    convert(write_random_checkpoint(str(root / "hf"), "tiny", with_mtp=True), str(root / "ckpt"), dtype="float32")
    args = serve.parse_args(["--ckpt", str(root / "ckpt"), "--dtype", "float32", "--slots", "2", "--max-len", "256",
                             "--prefill-chunk", "16", "--speculative-tokens", "2", "--compile-cache", "off"])
    service = serve.load_service(args, log=lambda m: None)
    sock = serve.listen_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(serve.create_app(service), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.05)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        def complete(prompt, extra=None):
            body = {"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True, **(extra or {})}
            return httpx.post(url + "/v1/completions", json=body, timeout=300)

        results = [None] * 3
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, complete(prompts[i], {"speculative_tokens": i})))
                   for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for p, r in zip(prompts, results):
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20
        want = [alone_in_chunks_of_16(p, 20) for p in prompts]
        got = [service.tokenizer.decode(w, skip_special_tokens=True) for w in want]
        assert [r.json()["choices"][0]["text"] for r in results] == got
        metrics = httpx.get(url + "/metrics").text
        assert "dsv4:spec_decode_num_drafts_total" in metrics and 'spec_decode_num_accepted_tokens_per_pos' in metrics
        bad = complete(prompts[0], {"speculative_tokens": 3})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative_tokens"
    finally:
        server.should_exit = True
        thread.join(60)
