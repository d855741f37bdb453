"""Whole-model parity with transformers' DeepseekV4ForCausalLM (fp32, every parameter random).

Tolerance: max |logit diff| <= 1e-4 * max(1, max |logit|) and the same argmax at every
position. Both sides compute in fp32; what remains is summation order inside matmuls and
reductions (observed: a few 1e-6), far below the tolerance, while any semantic slip (a wrong
mask, rope, routing or Sinkhorn step) moves logits by 1e-2 or more.
"""

import numpy as np
import pytest

import dsv4_jax
import hf_oracle as H

TINY_HC2 = dict(H.TINY, hc_mult=2, compress_ratios=[128, 4, 0, 4, 128, 4, 0], num_hash_layers=3, seed_offset=1)


def _lengths(window):
    return sorted({1, 3, 4, 5, 8, 9, window - 1, window, window + 1, 127, 128, 129, 257})


CASES = {
    # window 8, index top-4: the indexer must choose from 20 tokens on
    "tiny_hc4": (H.TINY, _lengths(8) + [300]),
    "tiny_hc2": (TINY_HC2, [1, 4, 7, 8, 9, 129, 260]),
    # window 128, index top-16 of up to 75 visible entries
    "flash_shaped": (H.FLASH_SHAPED, _lengths(128) + [300]),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    d, lengths = CASES[request.param]
    d = dict(d)
    seed = 1 + d.pop("seed_offset", 0)
    hf = H.make_model(d, seed=seed)
    path = tmp_path_factory.mktemp(request.param)
    H.save(hf, d, str(path))
    return hf, dsv4_jax.load(path), d, lengths


def test_logits_match_transformers(pair):
    hf, model, d, lengths = pair
    rng = np.random.default_rng(0)
    for S in lengths:
        ids = rng.integers(0, d["vocab_size"], size=(2, S))
        ref = H.logits(hf, ids).numpy()
        out = np.asarray(model(ids))
        assert out.shape == ref.shape and out.dtype == np.float32
        err = np.abs(out - ref).max()
        assert err <= 1e-4 * max(1.0, np.abs(ref).max()), f"S={S}: max |diff| {err}"
        np.testing.assert_array_equal(out.argmax(-1), ref.argmax(-1), err_msg=f"S={S}")


def test_causal(pair):
    """Appending tokens never changes earlier logits (the compressor and indexer respect
    causality across block boundaries). Two rows, 129 and max(lengths) tokens: shapes
    test_logits_match_transformers compiled."""
    _, model, d, lengths = pair
    ids = np.random.default_rng(1).integers(0, d["vocab_size"], size=(2, max(lengths)))
    short = np.asarray(model(ids[:, :129]))
    full = np.asarray(model(ids))
    np.testing.assert_allclose(full[:, :129], short, rtol=0, atol=1e-5)
