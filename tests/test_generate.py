"""The inference engine: caches, chunked prefill, decode, `generate`, and its errors.

Tolerance for logits: as the model parity tests, max |diff| <= 1e-4 * max(1, max |logit|);
cached decode and chunked prefill run the same fp32 math as the full forward in a different
grouping (observed: below 1e-6).
"""

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import dsv4_jax
import hf_oracle as H
from dsv4_jax.model.cache import cache_bytes, init_cache
from dsv4_jax.runtime.compile_cache import CompileCounter
from dsv4_jax.runtime.buckets import batch_bucket, length_bucket, prefill_plan
from dsv4_jax.runtime import decode
from dsv4_jax.runtime.sampling import sample
from dsv4_jax.model import layer_weights
from dsv4_jax.model.layer_weights import PerExpert, PerLayer, unstack_layers
from dsv4_jax.model.deepseek_v4 import forward, step

_step = jax.jit(step, static_argnums=(3, 4), donate_argnums=1)
_forward = jax.jit(forward, static_argnums=2)


def _close(a, b):
    return np.abs(a - b).max() <= 1e-4 * max(1.0, np.abs(b).max())


def _chunk(params, cache, ids, cfg, widths=(1, 32, 128)):
    """step on the chunk ids `[B, c]` padded to the smallest of `widths` that holds it, n_valid c
    for every row (padding is neither stored nor advances a row): a few programs for every chunk
    length. Returns (the c tokens' logits, the cache)."""
    B, c = ids.shape
    padded = np.zeros((B, min(w for w in widths if w >= c)), np.int32)
    padded[:, :c] = ids
    logits, cache, *_ = _step(params, cache, padded, cfg, False, n_valid=jnp.full((B,), c, jnp.int32))
    return np.asarray(logits)[:, :c], cache


@pytest.fixture(scope="module")
def hf_and_ours(tmp_path_factory):
    d = dict(H.TINY)
    hf = H.make_model(d, seed=1)
    path = tmp_path_factory.mktemp("gen")
    H.save(hf, d, str(path))
    return hf, dsv4_jax.load(path)


@pytest.fixture(scope="module")
def tiny():
    cfg = dsv4_jax.ModelConfig.from_hf(H.TINY)
    return cfg, dsv4_jax.init_params(cfg, seed=2, std=0.1)


def test_greedy_equals_transformers_generate(hf_and_ours):
    """200 greedy tokens after prompts of 3, 9, 40 and 130 tokens (window 8, ratio 4 and 128
    boundaries crossed in the prompt and during decoding), as one ragged batch."""
    hf, model = hf_and_ours
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, model.config.vocab_size, n))) for n in (3, 9, 40, 130)]
    ours = dsv4_jax.generate(model, prompts, 200).rows()
    hf.generation_config.eos_token_id = None
    for p, mine in zip(prompts, ours):
        ids = torch.tensor([p])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=200, do_sample=False)
        assert mine == ref[0, len(p):].tolist(), f"prompt of {len(p)} tokens"


def test_decode_logits_equal_full_forward(tiny):
    cfg, params = tiny
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, 150)).astype(np.int32)
    full = np.asarray(_forward(params, ids, cfg))
    cache = init_cache(cfg, 2, 256)  # (test_chunked_prefill_equals_one_pass's programs)
    logits, cache = _chunk(params, cache, ids[:, :6], cfg)
    out = [logits]
    for t in range(6, 150):
        logits, cache = _chunk(params, cache, ids[:, t:t + 1], cfg)
        out.append(logits)
    out = np.concatenate(out, axis=1)
    assert np.asarray(cache["pos"]).tolist() == [150, 150]
    for t in range(150):
        assert _close(out[:, t], full[:, t]), f"position {t}"
    np.testing.assert_array_equal(out.argmax(-1), full.argmax(-1))


@pytest.mark.parametrize("chunks", [[3, 5, 2, 70, 1, 49, 20], [128, 22]])
def test_chunked_prefill_equals_one_pass(tiny, chunks):
    """Chunk boundaries inside compression blocks (ratio 4 and 128) and inside the window (each
    chunk padded to 1, 32 or 128 tokens, n_valid its real ones)."""
    cfg, params = tiny
    S = sum(chunks)
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, size=(2, S)).astype(np.int32)
    full = np.asarray(_forward(params, ids, cfg))
    cache, pos, out = init_cache(cfg, 2, 256), 0, []
    for c in chunks:
        logits, cache = _chunk(params, cache, ids[:, pos:pos + c], cfg)
        out.append(logits)
        pos += c
    assert _close(np.concatenate(out, axis=1), full)


def test_ragged_batch_rows_equal_alone(tiny):
    """docs/generate.md's statement, in fp32: each row of a ragged batch (here 3 rows, padded to a
    bucket of 4) gives the greedy tokens it gives alone. Every row's prompt is prefilled at its own
    positions (the 1- and 7-token rows hold while the 33-token row's chunk runs), then the rows
    decode from their own positions."""
    cfg, params = tiny
    model = dsv4_jax.DeepseekV4(params, cfg)
    rng = np.random.default_rng(3)
    prompts = [list(map(int, rng.integers(0, cfg.vocab_size, n))) for n in (1, 7, 33)]
    batch = dsv4_jax.generate(model, prompts, 24).rows()
    for p, row in zip(prompts, batch):
        assert row == dsv4_jax.generate(model, [p], 24).rows()[0]


def test_requests_in_one_bucket_compile_nothing_new(tiny):
    """Batch, max_len and the decode loop's buffer come from buckets: after two requests of a
    bucket (4 rows, max_len 128; prefill chunks of 32 and 128), others with new prompt
    lengths (the issue's [[1,2,3],[4,5]] -> [[1,2,3,7],[4,5]], with a third row here), a new
    max_new_tokens, 3 or 4 rows, other sampling settings and stop ids compile no program. A
    request in a new bucket does compile, which shows that the count sees compilations."""
    cfg, params = tiny
    model = dsv4_jax.DeepseekV4(params, cfg)
    rng = np.random.default_rng(4)

    def ids(*lengths):
        return [list(map(int, rng.integers(0, cfg.vocab_size, n))) for n in lengths]

    dsv4_jax.generate(model, ids(3, 2, 20), 8)  # one prefill chunk of 32 (20 tokens and less per row)
    dsv4_jax.generate(model, ids(16, 40, 100), 8)  # one of 128
    with CompileCounter() as c:
        dsv4_jax.generate(model, ids(4, 2, 20), 8)
        dsv4_jax.generate(model, ids(4, 2, 20), 9)
        dsv4_jax.generate(model, ids(30, 25, 17, 90), 20, temperature=0.7, top_k=5, top_p=0.9, seed=3,
                          eos_token_id=[1, 2])
    assert c.programs == []
    with CompileCounter() as c:
        dsv4_jax.generate(model, ids(3), 200)  # 1 row, 203 tokens: max_len 256
    assert c.compiled >= 1


def test_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, 24]
    assert [length_bucket(n) for n in (1, 128, 129, 256, 257, 384, 385, 513, 769, 1025, 1537)] == \
        [128, 128, 256, 256, 384, 384, 512, 768, 1024, 1536, 2048]


def test_eos_stops_a_row(tiny):
    cfg, params = tiny
    model = dsv4_jax.DeepseekV4(params, cfg)
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    free = dsv4_jax.generate(model, prompts, 12)
    eos = int(free.tokens[0, 3])
    stopped = dsv4_jax.generate(model, prompts, 12, eos_token_id=eos)
    first = list(free.tokens[0]).index(eos)
    assert stopped.lengths[0] == first + 1 and stopped.rows()[0] == free.rows()[0][: first + 1]
    row1 = free.rows()[1]
    expect = row1[: row1.index(eos) + 1] if eos in row1 else row1
    assert stopped.rows()[1] == expect
    assert (stopped.tokens[0, first + 1:] == 0).all()
    # several stop ids (generation_config.json's list form): a row stops at the first of any
    several = [int(free.tokens[0, 3]), int(free.tokens[1, 2])]
    stopped = dsv4_jax.generate(model, prompts, 12, eos_token_id=several)
    for row, free_row in zip(stopped.rows(), free.rows()):
        ends = [i for i, t in enumerate(free_row) if t in several]
        assert ends and row == free_row[: ends[0] + 1]


def test_sampling_is_reproducible(tiny):
    cfg, params = tiny
    model = dsv4_jax.DeepseekV4(params, cfg)
    kw = dict(temperature=1.0, top_k=20, top_p=0.9)
    a = dsv4_jax.generate(model, [[1, 2, 3]], 16, seed=7, **kw).rows()
    assert a == dsv4_jax.generate(model, [[1, 2, 3]], 16, seed=7, **kw).rows()
    assert a != dsv4_jax.generate(model, [[1, 2, 3]], 16, seed=8, **kw).rows()


def _draws(logits, n, **kw):
    keys = jax.random.split(jax.random.PRNGKey(0), n)
    fn = jax.jit(lambda keys: sample(jnp.broadcast_to(logits, (n, logits.shape[-1])), jax.random.key_data(keys),
                                     *kw.values()))
    return np.asarray(fn(keys))


def test_top_k_top_p_on_the_distribution():
    """20,000 draws per setting: only allowed tokens appear, at their renormalised
    probabilities (within 0.015 absolute, about 5 standard errors)."""
    logits = jnp.log(jnp.array([[0.30, 0.25, 0.20, 0.10, 0.08, 0.04, 0.02, 0.01]]))

    def freqs(**kw):
        d = _draws(logits, 20000, temperature=jnp.float32(kw.get("t", 1.0)), top_k=jnp.int32(kw.get("k", 0)),
                   top_p=jnp.float32(kw.get("p", 1.0)))
        return np.bincount(d, minlength=8) / len(d)

    p = np.array([0.30, 0.25, 0.20, 0.10, 0.08, 0.04, 0.02, 0.01])
    np.testing.assert_allclose(freqs(), p / p.sum(), atol=0.015)
    f = freqs(k=3)
    assert (f[3:] == 0).all()
    np.testing.assert_allclose(f[:3], p[:3] / p[:3].sum(), atol=0.015)
    f = freqs(p=0.6)  # 0.30 + 0.25 < 0.6 <= 0.75: the top three
    assert (f[3:] == 0).all() and (f[:3] > 0).all()
    f = freqs(k=2, p=0.9)
    assert (f[2:] == 0).all()
    greedy = _draws(logits, 10, temperature=jnp.float32(0.0), top_k=jnp.int32(0), top_p=jnp.float32(1.0))
    assert (greedy == 0).all()


@pytest.mark.parametrize("kw, err, msg", [
    (dict(prompts=[[1] * 50], max_len=40), ValueError,
     r"^This model's maximum context length is 40 tokens\. However, your request has 50 input tokens\."),
    (dict(prompts=[[1] * 30], max_len=40), ValueError,
     r"maximum context length is 40 tokens\. However, you requested 46 tokens \(30 in the messages, 16 in the "),
    (dict(prompts=[[1, 2], []]), ValueError, r"prompt\[1\] is empty"),
    (dict(prompts=[]), ValueError, "prompts is empty"),
    (dict(prompts=[[1, 96]]), ValueError, r"^prompt: token id 96 is outside the vocabulary \[0, 96\)"),
    (dict(prompts=[[1, -1]]), ValueError, "token id -1 is outside"),
    (dict(prompts=[[1, 2], [3, 96]]), ValueError, r"^prompt\[1\]: token id 96 is outside"),
    (dict(prompts=[[1, 2.0]]), TypeError, "prompt holds a non-integer token 2.0"),
    (dict(prompts=[1, 2, 3]), TypeError, r"got a flat list of integers \(one prompt is \[\[1, \.\.\.\]\]\)"),
    (dict(prompts="1 2 3"), TypeError, "prompts must be a list of token-id lists"),
    (dict(prompts=np.ones((2, 3), np.float32)), TypeError, "integer array"),
    (dict(prompts=[[1]], temperature=-0.5), ValueError, "temperature"),
    (dict(prompts=[[1]], temperature="hot"), TypeError, "temperature must be a number"),
    (dict(prompts=[[1]], temperature=1e39), ValueError, "temperature must be a finite number"),
    (dict(prompts=[[1]], top_k=-1), ValueError, "top_k"),
    (dict(prompts=[[1]], top_k=2 ** 40), ValueError, r"top_k must be between 0 \(no top-k\) and the vocabulary size 96"),
    (dict(prompts=[[1]], top_k=2.0), TypeError, "top_k must be an integer"),
    (dict(prompts=[[1]], top_p=0.0), ValueError, "top_p"),
    (dict(prompts=[[1]], top_p=1.5), ValueError, "top_p"),
    (dict(prompts=[[1]], max_new_tokens=0), ValueError, "max_new_tokens"),
    (dict(prompts=[[1]], max_new_tokens=2 ** 40), ValueError, r"maximum context length is 1024 tokens\. However, you"),
    (dict(prompts=[[1]], max_len=2048), ValueError, r"max_len must be between 1 and the model's max_position_embeddings"),
    (dict(prompts=[[1]], eos_token_id=1000), ValueError, "eos_token_id"),
    (dict(prompts=[[1]], eos_token_id=True), TypeError, "eos_token_id must be an integer, got True"),
    (dict(prompts=[[1]], eos_token_id=[]), ValueError, "eos_token_id"),
    (dict(prompts=[[1]], seed=2 ** 70), ValueError, "seed must fit in 64 bits"),
    (dict(prompts=[[1]], temprature=0.5), TypeError,
     r"^generate\(\) got an unexpected keyword argument 'temprature' \(did you mean 'temperature'\?\)$"),
    (dict(prompts=[[1]], use_index_cache="yes"), ValueError, "use_index_cache"),
])
def test_bad_requests_fail_before_compiling(tiny, kw, err, msg):
    cfg, params = tiny
    kw = dict(kw)
    prompts = kw.pop("prompts")
    kw.setdefault("max_new_tokens", 16)
    with CompileCounter() as c, pytest.raises(err, match=msg):
        dsv4_jax.generate(dsv4_jax.DeepseekV4(params, cfg), prompts, **kw)
    assert c.programs == []


def test_numpy_and_jax_values_are_accepted(tiny):
    """Rows as 1-D numpy / jax integer arrays, numpy / jax scalars for the numbers: the same
    tokens as plain Python values."""
    cfg, params = tiny
    model = dsv4_jax.DeepseekV4(params, cfg)
    plain = dsv4_jax.generate(model, [[5, 6, 7], [9, 10]], 6, temperature=0.8, top_k=10, top_p=0.9, seed=1).rows()
    other = dsv4_jax.generate(model, [jnp.array([5, 6, 7]), np.array([9, 10], np.int64)], np.int64(6),
                              temperature=np.float32(0.8), top_k=jnp.int32(10), top_p=jnp.float32(0.9),
                              seed=np.uint8(1)).rows()
    assert other == plain


def _cache_copies(hlo: str, cache) -> list[str]:
    shapes = {",".join(map(str, x.shape)) for x in jax.tree.leaves(cache) if x.ndim >= 3}
    found = []
    for line in hlo.splitlines():
        m = re.search(r"= \w+\[([\d,]*)\]\S* copy\(", line)
        if m and m.group(1) in shapes:
            found.append(line.strip())
    return found


def test_decode_has_no_cache_sized_copy():
    """layer-stack.md: branches read caches, writes come after the switch, the cache is
    donated; a copy of any cache stack in the compiled decode program would cost a full cache
    copy per layer per token. Checked on the decode step and on generate's whole loop."""
    cfg = dsv4_jax.ModelConfig.from_hf(H.FLASH_SHAPED)
    params = dsv4_jax.init_params(cfg, seed=0)
    cache = init_cache(cfg, 2, 1024)
    hlo = jax.jit(step, static_argnums=(3, 4), donate_argnums=1).lower(
        params, cache, jnp.zeros((2, 1), jnp.int32), cfg, True).compile().as_text()
    assert "scatter" in hlo or "dynamic-update-slice" in hlo
    assert _cache_copies(hlo, cache) == []
    i32 = jnp.int32
    loop = decode.decode_loop.lower(params, decode.DecodeState(cache), jnp.zeros((2,), i32), jnp.zeros((2, 1024), i32),
                                    jnp.zeros((2,), bool), i32(8), decode.Sampling.rows(2, cfg.vocab_size), jnp.full((1,), -1, i32),
                                    cfg).compile().as_text()
    assert _cache_copies(loop, cache) == []


def _computations_under_branches(hlo: str) -> tuple[dict, set]:
    """The compiled module's computations (name -> instruction lines), and the names of those that
    run only inside a `conditional`'s branches (its branch computations and what they call)."""
    comps, name = {}, None
    for line in hlo.splitlines():
        m = re.match(r"(?:ENTRY )?%(\S+) .*\{$", line)
        if m:
            name = m.group(1)
            comps[name] = []
        elif name and line.startswith("  "):
            comps[name].append(line)
    todo = [b for lines in comps.values() for line in lines if " conditional(" in line
            for b in re.findall(r"%([\w.\-]+)", re.search(r"branch_computations=\{([^}]*)\}", line).group(1))]
    under = set()
    while todo:
        c = todo.pop()
        if c not in under:
            under.add(c)
            todo += [n for line in comps[c] for n in re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", line)]
    return comps, under


@pytest.mark.parametrize("ratio,lookahead", [(128, 0), (128, 3), (4, 0), (4, 2)])
def test_compressor_state_folds_any_chunking(ratio, lookahead):
    """A compressor keeps folds + lookahead state rows (the open block folded into one row, with
    overlap the block before it into another, and a ring of the last `lookahead` positions): fed
    a sequence in chunks of random sizes, one token at a time, and (with lookahead) in
    verification-like steps whose trailing drafts are partly rejected and fed again, two rows
    with their own positions and padding, every block's entry equals the whole sequence's in one
    chunk. Tolerance 1e-5 relative: folding changes only the order of the fp32 softmax's sums
    (observed ~1e-7)."""
    from dsv4_jax.model import attention
    from dsv4_jax.model.layer_kinds import BY_RATIO
    from dsv4_jax.model.rope import layer_inv_freqs

    cfg = dsv4_jax.ModelConfig.from_hf(H.TINY)
    params = dsv4_jax.init_params(cfg, seed=3, std=0.5)
    kind = BY_RATIO[ratio]
    cp = jax.tree.map(lambda a: a[0], params[kind.name]["compressor"])
    freqs = jnp.asarray(layer_inv_freqs(cfg)[1])
    C, d = cp["wkv"].shape[0], cfg.head_dim
    S, B = 3 * ratio + 50 if ratio > 4 else 61, 2
    rng = np.random.default_rng(lookahead)
    x = jnp.asarray(rng.standard_normal((B, S, cfg.hidden_size)), jnp.float32)
    run = jax.jit(partial(attention.compress_chunk, ratio=ratio, freqs=freqs, cfg=cfg))
    rows = kind.state_rows(lookahead)
    zero = jnp.zeros((B, kind.state_rows(), C))
    want = np.asarray(run(cp, x, zero, zero, jnp.zeros((B,), jnp.int32))[0])[:, :S // ratio]

    sa, sz = jnp.zeros((B, rows, C)), jnp.zeros((B, rows, C))
    pos, folded = np.zeros(B, np.int64), np.zeros(B, np.int64)
    got = np.full((B, S // ratio, d), np.nan, np.float32)
    while (pos < S).any():
        real = np.array([min(int(rng.choice([1, 1, 2, 3, 7, 64, 200])), S - p) for p in pos])
        drafts = np.array([min(int(rng.integers(0, lookahead + 1)), S - p - r) if r == 1 else 0
                           for p, r in zip(pos, real)])
        kept = np.array([int(rng.integers(0, dr + 1)) for dr in drafts])  # the drafts a verification keeps
        T = int((real + drafts).max())
        idx = np.minimum(pos[:, None] + np.arange(T)[None, :], S - 1)
        chunk = jnp.take_along_axis(x, jnp.asarray(idx)[..., None], axis=1)
        noise = rng.standard_normal(chunk.shape).astype(np.float32)  # rejected drafts: other tokens
        chunk = jnp.where(jnp.asarray(np.arange(T)[None, :, None] >= (real + kept)[:, None, None]), noise, chunk)
        n_valid = jnp.asarray(real + drafts, jnp.int32)
        entries, n_new, w = run(cp, chunk, sa, sz, jnp.asarray(pos, jnp.int32), n_valid=n_valid,
                                folded=jnp.asarray(folded, jnp.int32))
        b = jnp.arange(B)[:, None]
        sa, sz = (s.at[b, w.slots].set(v, mode="drop") for s, v in ((sa, w.a), (sz, w.z)))
        folded = np.asarray(attention.fold_point(jnp.asarray(pos, jnp.int32), n_valid, lookahead))
        for r in range(B):
            for i in range(int(n_new[r])):
                e = pos[r] // ratio + i
                if (e + 1) * ratio <= pos[r] + real[r] + kept[r]:  # completed by kept tokens only
                    got[r, e] = np.asarray(entries[r, i])
        pos = pos + real + kept  # a step after a rejection starts right after the kept drafts
    assert sa.shape[1] == (2 if kind.overlap else 1) + lookahead
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _weight_copies(hlo: str, shapes: set[str]) -> list[str]:
    """Dynamic-slice and gather instructions (ops or fusions, by name) whose result is one of
    `shapes` (a layer's weight, or one expert's, possibly several stacked: `[n, ...]`): a weight
    copied out of its stack inside the layer loop."""
    found = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = f32\[([\d,]*)\]", line)
        if m and re.search(r"dynamic[-_]slice|gather", m.group(1)) and (
                m.group(2) in shapes or m.group(2).split(",", 1)[-1] in shapes):
            found.append(line.strip()[:160])
    return found


def test_cpu_decode_reads_weights_in_place(monkeypatch):
    """layer_weights.py: on CPU generate splits the large stacked weights into one buffer per
    layer, and the routed experts into one per (layer, expert) (unstack_layers) before the decode
    loop, so no layer's weight and no expert is sliced or gathered out (copied) per token; the
    plain step (stacked weights) does copy them, which is what this guards."""
    cfg = dsv4_jax.ModelConfig.from_hf(H.FLASH_SHAPED)
    params = jax.tree.map(jnp.asarray, dsv4_jax.init_params(cfg, seed=0))
    monkeypatch.setattr(layer_weights, "MIN_ELEMENTS", 1 << 10)  # this model's experts are smaller than flash-mini's
    split = unstack_layers(params)
    is_split = lambda x: isinstance(x, (PerLayer, PerExpert))  # noqa: E731
    parts = [x for x in jax.tree.leaves(split, is_leaf=is_split) if is_split(x)]
    experts = [x for x in parts if isinstance(x, PerExpert)]
    assert len(experts) == 3 and all(len(x.parts) == cfg.num_layers * cfg.n_routed_experts for x in experts)
    shapes = {",".join(map(str, x.parts[0].shape)) for x in parts}
    cache = init_cache(cfg, 2, 1024)
    i32 = jnp.int32
    stepped = jax.jit(step, static_argnums=(3, 4)).lower(
        params, cache, jnp.zeros((2, 1), i32), cfg, True).compile().as_text()
    copied = _weight_copies(stepped, shapes)  # the stacked layout does copy layers and experts out
    assert any("gather" in c for c in copied) and any("gather" not in c for c in copied)
    loop = decode.decode_loop.lower(split, decode.DecodeState(cache), jnp.zeros((2,), i32), jnp.zeros((2, 1024), i32),
                                    jnp.zeros((2,), bool), i32(8), decode.Sampling.rows(2, cfg.vocab_size), jnp.full((1,), -1, i32),
                                    cfg).compile().as_text()
    assert _weight_copies(loop, shapes) == []


def test_cache_bytes_follow_kinds():
    cfg = dsv4_jax.ModelConfig.from_hf(H.FLASH_SHAPED)  # kinds [0, 4, 128, 4]
    b = cache_bytes(cfg, 4096, batch=1, dtype=jnp.bfloat16)
    ring = 128 * 512 * 2
    assert b["window"] == ring
    assert b["hca"] == ring + (4096 // 128) * 512 * 2 + 2 * 1 * 512 * 4  # the state: one folded row
    assert b["csa"] == 2 * (ring + 1024 * 512 * 2 + 2 * 2 * 1024 * 4 + 1024 * 128 * 2 + 2 * 2 * 256 * 4)
    assert b["total"] == b["window"] + b["csa"] + b["hca"]
    real = init_cache(cfg, 1, 4096, jnp.bfloat16)
    # minus the position counter, the reuse point, the fold point and the block table (4096 tokens:
    # 32 blocks of 128)
    assert real["blocks"].shape == (1, 32) and real["shared"].shape == real["folded"].shape == (1,)
    assert b["total"] == sum(x.nbytes for x in jax.tree.leaves(real)) - 4 - 4 - 4 - 32 * 4


def test_prefill_plan_cuts_each_row_as_alone():
    """Chunk k holds tokens k*512 .. of every row; the compiled length is the power of two (from
    16) that holds the chunk's longest part."""
    plan = prefill_plan([1, 7, 513, 1500])
    assert [T for T, _ in plan] == [512, 512, 512]
    assert [n.tolist() for _, n in plan] == [[1, 7, 512, 512], [0, 0, 1, 512], [0, 0, 0, 476]]
    assert [T for T, _ in prefill_plan([5])] == [16] and [T for T, _ in prefill_plan([40, 3])] == [64]
    for lengths in ([1], [7, 300], [512, 1024, 1], [1500]):
        assert np.array_equal(sum(n for _, n in prefill_plan(lengths)), lengths)
