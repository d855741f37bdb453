"""The model with attention_impl="pallas" (the kernels interpreted on CPU: the Mosaic TPU ones, and
the Pallas-Triton kernel of the indexer's scores, which runs on GPU only) against the plain-JAX
references: same logits (fp32, 1e-5 of the logit range: only summation order differs)
and the same greedy tokens."""

import numpy as np

import dsv4_jax
import hf_oracle as H


def test_pallas_path_matches_reference():
    cfg = dsv4_jax.ModelConfig.from_hf(H.FLASH_SHAPED).replace(index_topk=8)  # head_dim 512, index dim 128
    params = dsv4_jax.init_params(cfg, seed=4, std=0.1)
    ref = dsv4_jax.DeepseekV4(params, cfg.replace(attention_impl="ref"))
    pal = dsv4_jax.DeepseekV4(params, cfg.replace(attention_impl="pallas"))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(1, 40))
    a, b = np.asarray(ref(ids)), np.asarray(pal(ids))
    assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()
    np.testing.assert_array_equal(a.argmax(-1), b.argmax(-1))
    g_ref = dsv4_jax.generate(ref, ids[:, :20], 6).rows()
    assert g_ref == dsv4_jax.generate(pal, ids[:, :20], 6).rows()
