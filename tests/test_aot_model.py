"""The model's `generate` programs compiled ahead of time for one device of TPU v5p, TPU v6e, TPU
v7x and an H100 (dsv4_jax.aot; the `aot` extra) with attention_impl="pallas": `dsv4_jax.model.step` jitted
as generate jits it (static cfg and last_only, the cache donated), for a prefill chunk `[B, T]`
and a decode step `[B, 1]`, from abstract bf16 parameters and cache. The compiled program must
hold every Mosaic kernel the layer stack calls (a silent fallback to the reference fails).
Also the compile helper on a mesh of a whole target, and the target table itself.

The config is the small Flash-shaped one of the parity tests (head_dim 512, index dim 128,
window, ratio-4 and ratio-128 layers): two sparse-attention calls and, per ratio-4 layer kind,
compressor calls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import dsv4_jax
import hf_oracle as H
from dsv4_jax import aot
from dsv4_jax.cache import cache_spec
from dsv4_jax.model import step
from dsv4_jax.params import leaf_dtype, map_spec, param_spec

TARGETS = ["v5p-8", "v6e-8", "tpu7x-8", "h100x1"]
BATCH, MAX_LEN, CHUNK = 2, 256, 16


def _abstract(spec):
    return {k: jax.ShapeDtypeStruct(*v) if isinstance(v, tuple) else _abstract(v) for k, v in spec.items()}


@pytest.mark.parametrize("tokens", [CHUNK, 1], ids=["prefill", "decode"])
@pytest.mark.parametrize("target", TARGETS)
def test_generate_step_compiles_with_pallas(target, tokens):
    cfg = dsv4_jax.ModelConfig.from_hf(H.FLASH_SHAPED).replace(attention_impl="pallas")
    params = map_spec(lambda path, leaf: jax.ShapeDtypeStruct(leaf[0], leaf_dtype(leaf[1], jnp.bfloat16)),
                      param_spec(cfg))
    cache = _abstract(cache_spec(cfg, BATCH, MAX_LEN, jnp.bfloat16))
    ids = jax.ShapeDtypeStruct((BATCH, tokens), jnp.int32)
    jitted = jax.jit(step, static_argnums=(3, 4), donate_argnums=(1,))
    result = aot.compile_for(target, jitted, params, cache, ids, cfg, True)

    kernels = aot.mosaic_kernels(result.compiled, aot.target(target).platform)
    # Layers: window, ratio 4, ratio 128, ratio 4 (one scan body per kind). Sparse attention in the
    # window, ratio-4 and ratio-128 branches; compressors: the ratio-4 kv and indexer ones and the
    # ratio-128 one.
    # TPU: the routed experts of the three kinds through the grouped matmul kernel.
    grouped = ["dsv4_grouped_matmul"] * 3 if aot.target(target).platform == "tpu" else []
    assert sorted(kernels) == ["dsv4_compress"] * 3 + grouped + ["dsv4_sparse_attention"] * 3
    # The cache is donated and comes back in place; logits [B, 1, V] fp32 (last_only).
    assert result.memory["alias_bytes"] > 0
    logits, new_cache = result.compiled.out_info
    assert logits.shape == (BATCH, 1, cfg.vocab_size) and logits.dtype == jnp.float32


@pytest.mark.parametrize("target", ["v5p-8", "h100x8"])
def test_compile_on_a_mesh_reports_per_device_memory(target):
    mesh = aot.mesh(target, {"data": len(aot.topology(target))})
    rows = 1024 * mesh.size
    x = jax.ShapeDtypeStruct((rows, 512), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec("data")))
    w = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)  # no sharding: replicated over the mesh
    result = aot.compile_for(target, jax.jit(lambda x, w: x @ w), x, w, mesh=mesh)
    per_device_args = 1024 * 512 * 2 + 512 * 256 * 2
    assert result.memory["argument_bytes"] == per_device_args
    assert result.memory["output_bytes"] == 1024 * 256 * 2
    assert result.cost["flops"] == pytest.approx(2 * 1024 * 512 * 256, rel=0.01)


def test_targets():
    assert [d.device_kind for d in aot.topology("h200x8")] == ["NVIDIA H200"] * 8
    assert len(aot.topology("v6e-8")) == 8 and aot.topology("v5p-8")[0].platform == "tpu"
    assert "H100" in aot.topology("h100x1")[0].device_kind
    v7x = aot.topology("tpu7x-8")  # two devices (TensorCores) on each of 4 chips
    assert len(v7x) == 8 and v7x[0].device_kind == "TPU7x" and len({tuple(d.coords) for d in v7x}) == 4
    assert aot.target("tpu7x-8").spec.memory_bytes == 96 * 2**30
    with pytest.raises(ValueError, match="unknown compile target"):
        aot.topology("v7x-8")
    with pytest.raises(ValueError, match="need 8 devices"):
        aot.mesh("v5p-8", {"data": 8})


@pytest.mark.parametrize("layout", ["dp_attention", "tp_attention"])
def test_native_decode_step_calls_the_fp8_kernel(tmp_path, layout):
    """The decode step of a small Flash-shaped model with its published FP8/FP4 weights, compiled
    for a whole v5p-8 the way dsv4-plan compiles it: the FP8 linears go through the matmul kernel
    per device (under tp_attention too, where the column-parallel ones are split), the routed
    experts through the grouped matmul kernel (inside the expert-parallel per-device code)."""
    import json

    from dsv4_jax import plan
    from dsv4_jax.presets import FLASH

    small = dict(FLASH, vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 q_lora_rank=128, o_groups=2, o_lora_rank=128, index_n_heads=4, n_routed_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=256, num_hash_layers=1,
                 compress_ratios=[0, 4, 128, 4, 0])
    path = tmp_path / "small.json"
    path.write_text(json.dumps(small))
    mesh = None if layout == "dp_attention" else {"expert": 2, "tensor": 2}
    s = plan.setup(str(path), "v5p-8", layout, mesh, None, "native")
    cache = plan.abstract_cache(s.cfg, s.batch, 1024, s.mesh, s.layout)
    ids = jax.ShapeDtypeStruct((s.batch, 1), jnp.int32, sharding=NamedSharding(s.mesh, s.layout.spec(
        (dsv4_jax.sharding.BATCH, None), s.mesh)))
    jitted = jax.jit(step, static_argnums=(3, 4), donate_argnums=(1,))
    with jax.sharding.use_abstract_mesh(s.mesh.abstract_mesh):
        result = aot.compile_for("v5p-8", jitted, s.params, cache, ids, s.cfg, True, mesh=s.mesh)
    kernels = aot.mosaic_kernels(result.compiled, "tpu")
    assert {"dsv4_fp8_matmul", "dsv4_grouped_matmul", "dsv4_sparse_attention"} <= set(kernels)
