"""IndexCache: the schedule, reuse in the stack, both compressor semantics, and bad patterns."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax
import hf_oracle as H
from dsv4_jax.model import attention
from dsv4_jax.model.cache import init_cache
from dsv4_jax.model.config import ConfigError
from dsv4_jax.model.index_cache import index_cache_schedule
from dsv4_jax.model.deepseek_v4 import forward, step
from test_config import FLASH, PRO

BASE = dsv4_jax.ModelConfig.from_hf(H.TINY)  # ratio-4 layers 1, 3, 6


def test_flash_and_pro_schedules():
    flash = index_cache_schedule(dsv4_jax.ModelConfig.from_hf(dict(FLASH, use_index_cache=True, index_topk_freq=2)))
    assert (len(flash.csa_layers), len(flash.computing), len(flash.reusing)) == (21, 11, 10)
    assert flash.reusing == (4, 8, 12, 16, 20, 24, 28, 32, 36, 40)
    assert flash.to_dict()["skip_layer_ids"] == list(flash.reusing)
    pro = index_cache_schedule(dsv4_jax.ModelConfig.from_hf(dict(PRO, use_index_cache=True, index_topk_freq=2)))
    assert (len(pro.csa_layers), len(pro.computing), len(pro.reusing)) == (30, 15, 15)
    assert pro.reusing == tuple(range(4, 61, 4))
    off = index_cache_schedule(dsv4_jax.ModelConfig.from_hf(dict(FLASH, index_topk_freq=2)))
    assert off.reusing == () and len(off.computing) == 21
    freq4 = index_cache_schedule(dsv4_jax.ModelConfig.from_hf(dict(FLASH, use_index_cache=True, index_topk_freq=4)))
    assert freq4.computing == (2, 10, 18, 26, 34, 42)


def test_pattern_wins_over_frequency_and_short_patterns_compute():
    cfg = BASE.replace(use_index_cache=True, index_topk_freq=3, index_topk_pattern="FS")
    s = index_cache_schedule(cfg)
    assert s.reusing == (3,) and s.computing == (1, 6)  # rank 2 is past the pattern: computes
    assert index_cache_schedule(BASE.replace(use_index_cache=True, index_topk_pattern="FSS")).reusing == (3, 6)


@pytest.mark.parametrize("change, msg", [
    (dict(index_topk_pattern="FXS"), r"string of F and S, got 'FXS'"),
    (dict(index_topk_pattern="SFF"), r"must start with F.*'SFF'"),
    (dict(index_topk_pattern="FSSF"), r"'FSSF' has 4 entries for 3 ratio-4 layers"),
    (dict(index_topk_pattern=""), r"non-empty string"),
    (dict(index_topk_freq=0), r"`index_topk_freq` must be an integer >= 1, got 0"),
    (dict(use_index_cache="yes"), r"`use_index_cache` must be true or false"),
])
def test_bad_settings(change, msg):
    with pytest.raises(ConfigError, match=msg):
        BASE.replace(**{"use_index_cache": True, **change})


def test_settable_from_config_json_and_keywords(tmp_path):
    cfg = dsv4_jax.ModelConfig.from_hf(dict(H.TINY, use_index_cache=True, index_topk_freq=2,
                                            index_cache_skip_compressor=True))
    assert cfg.use_index_cache and cfg.index_topk_freq == 2 and cfg.index_cache_skip_compressor
    from dsv4_jax.checkpoint.export_hf import write_hf_checkpoint
    write_hf_checkpoint(dsv4_jax.init_params(BASE, 0), BASE, str(tmp_path))
    m = dsv4_jax.load(tmp_path, use_index_cache=True, index_topk_pattern="FS")
    assert index_cache_schedule(m.config).reusing == (3,)
    with pytest.raises(TypeError, match="unknown model options"):
        dsv4_jax.load(tmp_path, index_cache=True)


@pytest.fixture(scope="module")
def params():
    return dsv4_jax.init_params(BASE, seed=1, std=0.1)


def _ids(n, batch=2, seed=0):
    return np.random.default_rng(seed).integers(0, BASE.vocab_size, size=(batch, n)).astype(np.int32)


def test_freq_one_equals_off(params):
    ids = _ids(60)
    on = np.asarray(jax.jit(forward, static_argnums=2)(params, ids, BASE.replace(use_index_cache=True)))
    off = np.asarray(jax.jit(forward, static_argnums=2)(params, ids, BASE))
    np.testing.assert_array_equal(on, off)


def _attended_indices(params, cfg, ids, monkeypatch):
    """The compressed-row indices each layer's attention received (None for window-only
    layers), in layer order: a callback in each layer kind's attention reports them as the
    compiled forward runs its layers (the layer scan runs one switch branch a layer)."""
    seen = []
    real = attention.attend

    def spy(q, rope, ring, kv, comp_rows, comp_idx, *rest):
        if comp_idx is None:
            jax.debug.callback(lambda: seen.append(None), ordered=True)
        else:
            jax.debug.callback(lambda i: seen.append(np.asarray(i)), comp_idx, ordered=True)
        return real(q, rope, ring, kv, comp_rows, comp_idx, *rest)

    monkeypatch.setattr(attention, "attend", spy)
    jax.block_until_ready(jax.jit(lambda p, i: forward(p, i, cfg))(params, ids))  # traced here, with the spy
    jax.effects_barrier()
    assert len(seen) == cfg.num_layers
    return seen


def test_reusing_layer_attends_at_the_computing_layers_entries(params, monkeypatch):
    """Layer 3 (rank 1) reuses layer 1's (rank 0) top-k; layer 6 (rank 2) computes its own.
    The mapping from entry ids to compressed rows is the same on every ratio-4 layer, so equal
    rows mean equal entries."""
    ids = _ids(48, batch=1)
    on = _attended_indices(params, BASE.replace(use_index_cache=True, index_topk_freq=2), ids, monkeypatch)
    off = _attended_indices(params, BASE, ids, monkeypatch)
    np.testing.assert_array_equal(on[3], on[1])
    np.testing.assert_array_equal(on[1], off[1])  # the computing layer is unchanged
    assert (off[3] != off[1]).any()  # without reuse layer 3 would choose otherwise
    assert (on[6] != on[3]).any()  # rank 2 computes again


@pytest.mark.parametrize("skip_compressor", [False, True])
def test_decode_equals_full_forward_with_reuse(params, skip_compressor):
    cfg = BASE.replace(use_index_cache=True, index_topk_freq=2, index_cache_skip_compressor=skip_compressor)
    cache = init_cache(cfg, 2, 100)
    if skip_compressor:  # reusing layers keep no indexer keys
        assert cache["indexer"]["pool"].shape[0] == 2
    else:
        assert cache["indexer"]["pool"].shape[0] == 3
    ids = _ids(90, seed=3)
    full = np.asarray(jax.jit(forward, static_argnums=2)(params, ids, cfg))
    jstep = jax.jit(step, static_argnums=(3, 4), donate_argnums=1)
    out, pos = [], 0
    for c in (7, 30, 1, 1, 1, 2, 48):
        # the chunk padded to 1 or 48 tokens, n_valid its real ones (two programs, not five)
        T = 1 if c == 1 else 48
        chunk = np.zeros((2, T), np.int32)
        chunk[:, :c] = ids[:, pos:pos + c]
        logits, cache, *_ = jstep(params, cache, chunk, cfg, False, n_valid=jnp.full((2,), c, jnp.int32))
        out.append(np.asarray(logits)[:, :c])
        pos += c
    out = np.concatenate(out, axis=1)
    assert np.abs(out - full).max() <= 1e-4 * max(1.0, np.abs(full).max())
    np.testing.assert_array_equal(out.argmax(-1), full.argmax(-1))
    off = np.asarray(jax.jit(forward, static_argnums=2)(params, ids, BASE))
    assert np.abs(full - off).max() > 1e-3  # reuse changed what layer 3 attends to


def test_measured_reuse(params):
    cfg = BASE.replace(use_index_cache=True, index_topk_freq=2)
    reuse = jax.jit(step, static_argnums=(3, 4, 5))(params, init_cache(cfg, 2, 64), _ids(64), cfg, False, True).reuse
    for v in reuse:
        v = np.asarray(v)
        assert np.isnan(v[[0, 1, 2, 4, 5, 6]]).all() and np.isfinite(v[3])
    assert 0.0 <= reuse.overlap[3] < 1.0  # random weights: layer 3 would choose otherwise
    assert 0.0 < reuse.attention_js[3] <= np.log(2) and 0.0 < reuse.dropped_mass[3] <= 1.0
    same = BASE.replace(use_index_cache=True, index_topk_freq=1)
    none = jax.jit(step, static_argnums=(3, 4, 5))(params, init_cache(same, 2, 64), _ids(64), same, False,
                                                   True).reuse
    assert all(np.isnan(np.asarray(v)).all() for v in none)


def _attention_numpy(q, keys, sink, scale):
    """One query's per-head softmax over its keys `[n, D]` and the sink: `[H, n]` (the sink's share
    left out)."""
    logits = np.concatenate([q @ keys.T * scale, sink[:, None]], axis=1)
    p = np.exp(logits - logits.max(1, keepdims=True))
    return (p / p.sum(1, keepdims=True))[:, :-1]


@pytest.mark.parametrize("T,p0", [(5, 7), (1, 20), (6, 0)])
def test_reuse_measures_equal_a_numpy_model(T, p0):
    """`attention.reuse_measures` against the two attention distributions written out key by key
    (window keys from the ring and the chunk, chosen rows, sink), fp64: overlap, Jensen-Shannon
    divergence and dropped mass, each within 1e-5 (fp32 sums of at most 16 keys). Own and reused
    ids share some entries, miss others, and pad with -1."""
    rng = np.random.default_rng(T * 100 + p0)
    B, H, D, W, R, Nc, K = 2, 3, 8, 4, 6, 10, 4
    cfg = BASE.replace(sliding_window=W, head_dim=D)
    q = rng.normal(size=(B, T, H, D)).astype(np.float32)
    ring = rng.normal(size=(B, R, D)).astype(np.float32)
    kv = rng.normal(size=(B, T, D)).astype(np.float32)
    rows = rng.normal(size=(B, Nc, D)).astype(np.float32)
    sink = rng.normal(size=(H,)).astype(np.float32)
    perm = np.stack([np.stack([rng.permutation(Nc) for _ in range(T)]) for _ in range(B)]).astype(np.int32)
    own = perm[..., :K].copy()
    reused = np.concatenate([perm[..., [2, K, 0]], np.full((B, T, 1), -1, np.int32)], axis=-1)  # 2 shared, other order
    own[:, 0, 2:] = -1
    got = np.asarray(attention.reuse_measures(q, ring, kv, rows, own, reused, sink, np.full((B,), p0, np.int32),
                                              cfg))
    scale = D ** -0.5
    overlaps, jss, drops = [], [], []
    for b in range(B):
        for t in range(T):
            pos = p0 + t
            window = [ring[b, s % R] if s < p0 else kv[b, s - p0] for s in range(max(0, pos - W + 1), pos + 1)]
            a_ids, b_ids = [i for i in own[b, t] if i >= 0], [i for i in reused[b, t] if i >= 0]
            keys = sorted(set(a_ids) | set(b_ids))
            def dist(ids):  # [H, window + keys], zero on the keys not chosen
                p = _attention_numpy(q[b, t].astype(np.float64), np.array(window + [rows[b, i] for i in ids]),
                                     sink.astype(np.float64), scale)
                full = np.zeros((H, len(window) + len(keys)))
                full[:, :len(window)] = p[:, :len(window)]
                for j, i in enumerate(ids):
                    full[:, len(window) + keys.index(i)] = p[:, len(window) + j]
                return full
            pa, pb = dist(a_ids), dist(b_ids)
            sink_a, sink_b = 1 - pa.sum(1), 1 - pb.sum(1)
            m = (pa + pb) / 2
            def kl(p, r):
                return np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1) / np.where(r > 0, r, 1)), 0), 1)
            js = 0.5 * (kl(pa, m) + kl(pb, m)) + 0.5 * (kl(sink_a[:, None], ((sink_a + sink_b) / 2)[:, None])
                                                         + kl(sink_b[:, None], ((sink_a + sink_b) / 2)[:, None]))
            dropped = sum(pa[:, len(window) + keys.index(i)] for i in a_ids if i not in b_ids) if a_ids else 0
            if a_ids:
                overlaps.append(np.mean([i in b_ids for i in a_ids]))
                jss.append(js.mean())
                drops.append(np.mean(dropped))
    np.testing.assert_allclose(got, [np.mean(overlaps), np.mean(jss), np.mean(drops)], atol=1e-5)
    assert 0 < np.mean(drops) and np.mean(overlaps) < 1  # the case is not trivial
    same = np.asarray(attention.reuse_measures(q, ring, kv, rows, own, own, sink, np.full((B,), p0, np.int32), cfg))
    np.testing.assert_allclose(same, [1, 0, 0], atol=1e-6)


def test_report_json(tmp_path, capsys):
    """The report's command runs and prints the fields it promises (values are measured, not
    asserted beyond their ranges)."""
    from dsv4_jax.checkpoint.export_hf import write_hf_checkpoint
    from dsv4_jax.tools.index_cache_report import main

    write_hf_checkpoint(dsv4_jax.init_params(BASE, 1, std=0.1), BASE, str(tmp_path))
    off = ["--compile-cache", "off"]
    assert main(["--ckpt", str(tmp_path), "--prompt-len", "24", "--num-prompts", "2", "--new-tokens", "4", *off]) == 0
    import json
    out = json.loads(capsys.readouterr().out)
    assert out["schedule"]["skip_layer_ids"] == [3]
    # index_topk 4: positions from 4 * 5 - 1 = 19 see 5 or more ratio-4 entries and choose
    assert out["indexer_choice"]["meaningful"] and out["indexer_choice"]["prompt_positions_choosing"] == 24 - 19
    assert out["indexer_choice"]["generated_positions_choosing"] == 4
    layer = out["per_reusing_layer"]["3"]
    assert 0 <= layer["overlap"] <= 1 and 0 <= layer["attention_js"] <= np.log(2) and 0 <= layer["dropped_mass"] <= 1
    assert out["kl_next_token"]["mean"] >= 0 and 0 <= out["greedy_agreement"]["fraction_equal"] <= 1
    assert all(v > 0 for k, v in out["time_s"].items() if k != "note")
    assert main(["--ckpt", str(tmp_path), "--pattern", "F", "--prompt-len", "8", *off]) == 1  # nothing reuses
    assert "reuses on no layer" in capsys.readouterr().err
    # 12-token prompts and 4 new tokens: no position sees more than index_topk entries, reuse
    # cannot change anything, and the report says so instead of overlap 1.0 and KL 0
    assert main(["--ckpt", str(tmp_path), "--prompt-len", "12", "--num-prompts", "2", "--new-tokens", "4", *off]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["indexer_choice"] | {"note": None} == {
        "index_topk": 4, "ratio4_entries_at_prompt_end": 3, "prompt_positions_choosing": 0,
        "generated_positions_choosing": 0, "meaningful": False, "note": None}
    assert out["per_reusing_layer"] == {"3": {"overlap": None, "attention_js": None, "dropped_mass": None}}
    assert out["kl_next_token"]["mean"] is None and out["greedy_agreement"]["fraction_equal"] is None
    assert "warning: prompts of 12 tokens never see more than index_topk=4" in captured.err
