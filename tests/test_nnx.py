"""The model as Flax NNX modules (dsv4_jax/model/blocks.py, deepseek_v4.DeepseekV4): what `load`
returns, what its state holds, what Orbax stores, and fine-tuning with optax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from hf_oracle import TINY

import dsv4_jax
from convert.cli import convert
from dsv4_jax.checkpoint.export_hf import write_hf_checkpoint
from dsv4_jax.model import blocks
from dsv4_jax.model.params import is_spec_leaf, param_spec
from dsv4_jax.tools.random_checkpoint import mtp_tensors

CFG = dsv4_jax.ModelConfig.from_hf(TINY)  # 8 layers of kinds 0 / 4 / 128, 2 hash-routed


def _paths(tree, prefix=()) -> set:
    if not isinstance(tree, dict) or is_spec_leaf(tree):
        return {prefix}
    return set().union(*(_paths(v, prefix + (k,)) for k, v in tree.items()))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A converted directory (fp32) with the MTP block, and its HF source."""
    root = tmp_path_factory.mktemp("nnx")
    hf = root / "hf"
    write_hf_checkpoint(dsv4_jax.init_params(CFG, seed=3), CFG, str(hf), dtype=np.float32,
                        mtp=mtp_tensors(CFG, seed=4))
    convert(str(hf), str(root / "out"), dtype="float32")
    return hf, root / "out"


def test_load_returns_the_module_of_blocks(converted):
    for path in converted:
        model = dsv4_jax.load(path, mtp=True)
        assert isinstance(model, nnx.Module) and isinstance(model, dsv4_jax.DeepseekV4)
        assert isinstance(model.layers, blocks.DecoderLayers) and isinstance(model.layers.attn, blocks.Attention)
        assert isinstance(model.layers.ffn, blocks.MoE) and isinstance(model.layers.hc_attn, blocks.HyperConnection)
        assert isinstance(model.csa.indexer, blocks.Indexer) and isinstance(model.hca.compressor, blocks.Compressor)
        assert isinstance(model.mtp, blocks.MTPBlock)
        shown = repr(model)  # what nnx.display shows
        for name in ("DecoderLayers", "Attention", "MoE", "Indexer", "Compressor", "MTPBlock", "RoutingTable"):
            assert name in shown


def test_a_block_takes_arrays_only():
    params = dsv4_jax.init_params(CFG)
    params["layers"]["attn"]["wq_a"] = list(params["layers"]["attn"]["wq_a"])
    with pytest.raises(TypeError, match="Attention.wq_a: a weight must be an array or a QuantizedWeight, got list"):
        dsv4_jax.DeepseekV4(params, CFG)


def test_param_state_holds_every_parameter(converted):
    model = dsv4_jax.load(converted[1], mtp=True)
    spec = _paths(param_spec(CFG))
    float_state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    mtp = float_state.pop("mtp")
    # every parameter is an nnx.Param but the hash layers' integer table, a RoutingTable
    assert _paths(float_state) == spec - {("tid2eid",)}
    assert set(nnx.to_pure_dict(nnx.state(model, blocks.RoutingTable))) == {"tid2eid"}
    assert _paths(mtp) == _paths(dsv4_jax.init_mtp_params(CFG))
    # model.params is that state as the programs take it
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(model.params), jax.tree.leaves(
            nnx.to_pure_dict(nnx.state(model)) | {"mtp": None})):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


def test_orbax_stores_the_state(converted):
    """What the converter writes is nnx.state(model): params/ the main model's, mtp/ the MTP
    block's (`model.mtp`); plain Orbax restores both, tree and values."""
    model = dsv4_jax.load(converted[1], mtp=True)
    state = nnx.to_pure_dict(nnx.state(model))
    with ocp.StandardCheckpointer() as ckptr:
        stored = {**ckptr.restore(converted[1] / "params"), "mtp": ckptr.restore(converted[1] / "mtp")}
    assert jax.tree.structure(stored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(stored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fine_tuning_with_optax_lowers_the_loss():
    """A few AdamW steps through nnx.Optimizer on a tiny model: the loss on the batch falls, the
    routing table stays, and generate runs on the tuned weights. attention_impl="ref": the
    kernels have no reverse mode."""
    cfg = CFG.replace(attention_impl="ref")
    model = dsv4_jax.DeepseekV4(dsv4_jax.init_params(cfg, seed=1, std=0.1), cfg)
    table = np.asarray(model.tid2eid.get_value())
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 17)).astype(np.int32)
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)

    def loss_fn(m):
        logits = m(ids[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], axis=-1))

    @nnx.jit
    def train_step(m, opt):
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.Param))(m)
        opt.update(m, grads)
        return loss

    losses = [float(train_step(model, optimizer)) for _ in range(6)]
    assert all(np.isfinite(losses)) and all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.8 * losses[0], losses
    np.testing.assert_array_equal(np.asarray(model.tid2eid.get_value()), table)
    # generate reads the tuned weights: its first greedy token is the tuned model's argmax
    out = dsv4_jax.generate(model, ids[:, :8].tolist(), 1)
    np.testing.assert_array_equal(out.tokens[:, 0], np.argmax(np.asarray(model(ids[:, :8]))[:, -1], -1))
