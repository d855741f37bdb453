"""The model's `generate` programs compiled ahead of time for one device of TPU v5p, TPU v6e, TPU
v7x and an H100 (dsv4_jax.tools.aot; the `aot` extra) with attention_impl="pallas": `dsv4_jax.model.deepseek_v4.step` jitted
as generate jits it (static cfg and last_only, the cache donated), for a prefill chunk `[B, T]`
and a decode step `[B, 1]`, from abstract bf16 parameters and cache. The compiled program must
hold every Mosaic kernel the layer stack calls (a silent fallback to the reference fails).
Also the compile helper on a mesh of a whole target, and the target table itself.

The config is the small Flash-shaped one of the parity tests (head_dim 512, index dim 128,
window, ratio-4 and ratio-128 layers): two sparse-attention calls and, per ratio-4 layer kind,
compressor calls.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import dsv4_jax
import hf_oracle as H
from dsv4_jax.tools import aot
from dsv4_jax.model.cache import blocks_per_row, cache_spec, default_block_size
from dsv4_jax.model.deepseek_v4 import step
from dsv4_jax.model.params import leaf_dtype, map_spec, param_spec

TARGETS = ["v5p-8", "v6e-8", "tpu7x-8", "h100x1"]
BATCH, MAX_LEN, CHUNK = 2, 256, 16


def _abstract(spec):
    return {k: jax.ShapeDtypeStruct(*v) if isinstance(v, tuple) else _abstract(v) for k, v in spec.items()}


# The FP8 cache (its compressed entries and window rings as 584-byte records, which the attention
# kernels decode as they gather them) on one TPU and one GPU target.
CASES = [(t, "auto") for t in TARGETS] + [("v5p-8", "fp8"), ("h100x1", "fp8")]


@pytest.mark.parametrize("tokens", [CHUNK, 1], ids=["prefill", "decode"])
@pytest.mark.parametrize("target, kv_cache_dtype", CASES)
def test_generate_step_compiles_with_pallas(target, kv_cache_dtype, tokens):
    cfg = dsv4_jax.ModelConfig.from_hf(H.FLASH_SHAPED).replace(attention_impl="pallas")
    params = map_spec(lambda path, leaf: jax.ShapeDtypeStruct(leaf[0], leaf_dtype(leaf[1], jnp.bfloat16)),
                      param_spec(cfg))
    # pools of more blocks than the rows' tables name, as the engine's are
    blocks = 2 * BATCH * blocks_per_row(MAX_LEN, default_block_size(cfg)) + 1
    cache = _abstract(cache_spec(cfg, BATCH, MAX_LEN, jnp.bfloat16, num_blocks=blocks, kv_cache_dtype=kv_cache_dtype))
    ids = jax.ShapeDtypeStruct((BATCH, tokens), jnp.int32)
    jitted = jax.jit(step, static_argnums=(3, 4), donate_argnums=(1,))
    result = aot.compile_for(target, jitted, params, cache, ids, cfg, True)

    kernels = aot.kernel_calls(result.compiled, aot.target(target).platform)
    # Layers: window, ratio 4, ratio 128, ratio 4 (one scan body per kind). Sparse attention in the
    # window, ratio-4 and ratio-128 branches; compressors: the ratio-4 kv and indexer ones and the
    # ratio-128 one.
    # The grouped matmul kernel: the routed experts' second product (one MoE for the three kinds),
    # and the output projection's wo_a (once, outside the layer-kind switch); the experts' first
    # two products are one fused kernel with their activation (grouped_swiglu).
    # On CUDA, records go to the Pallas-Triton kernel (Mosaic GPU's TMA cannot copy a 584-byte row).
    # The ratio-4 branch scores its cached keys and the chunk's own by the indexer's kernel on CUDA;
    # on TPU the cached keys when they are FP8 records (over bf16 keys, the chunk's own too, XLA
    # computes the scores there).
    cuda = aot.target(target).platform == "cuda"
    grouped = (["dsv4_grouped_matmul_gpu"] * 2 + ["dsv4_grouped_swiglu_gpu"] if cuda
               else ["dsv4_grouped_matmul"] * 2 + ["dsv4_grouped_swiglu"])
    attention = "dsv4_sparse_attention" + ("_fp8" if cuda and kv_cache_dtype == "fp8" else "")
    scores = ["dsv4_indexer_scores_gpu"] * 2 if cuda else ["dsv4_indexer_scores"] * (kv_cache_dtype == "fp8")
    # The hyper-connections' GPU kernels (any hidden size; this model's is off TPU's 128 lanes, so
    # the TPU programs take the reference): the collapse (mixes, sum) before the scan body's two
    # sub-layers and the head's, the expansion after each sub-layer.
    hyper = ["dsv4_hc_mixes_gpu", "dsv4_hc_sum_gpu"] * 3 + ["dsv4_hc_expand_gpu"] * 2 if cuda else []
    # On CUDA the queries' norm and rotation before each branch's attention (the TPU kernel does both).
    queries = ["dsv4_query_norm_rope_gpu"] * 3 if cuda else []
    assert sorted(kernels) == sorted(["dsv4_compress"] * 3 + grouped + [attention] * 3 + scores + hyper + queries)
    if kv_cache_dtype == "fp8":
        # No XLA op decodes records: the program's e4m3 arrays of NoPE values `[B, n, 448]` (or
        # `[B, n, 7, 64]`) and of indexer keys `[B, n, 128]` (or `[B, n, 2, 64]`) are the chunk's
        # own rows, entries and keys being encoded, n <= T; the kernels decode the cached ones.
        text = result.compiled.as_text()
        shapes = [[int(x) for x in dims.split(",")] for dims in re.findall(r"f8e4m3fn\[([0-9,]+)\]", text)]
        for d in (cfg.head_dim - cfg.rope_head_dim, cfg.index_head_dim):
            values = [sh for sh in shapes if sh[-1] == d or sh[-2:] == [d // 64, 64]]
            assert values and all(sh[1] <= tokens for sh in values), (d, values)
    if tokens == 1:
        # Decode gathers the rows it reads straight from the stacks of layers' pools
        # (cache.pool_view / pool_entries): no instruction holds one layer's whole pool, which a
        # layer sliced out of its stack first becomes (XLA copied it on TPU in every step).
        for group in ("csa", "indexer"):
            layers, *pool = cache[group]["pool"].shape
            assert layers == 2
            assert not _layer_sized(result.compiled.as_text(), ",".join(map(str, pool))), group
    # The cache is donated and comes back in place; logits [B, 1, V] fp32 (last_only).
    assert result.memory["alias_bytes"] > 0
    logits = result.compiled.out_info.logits
    assert logits.shape == (BATCH, 1, cfg.vocab_size) and logits.dtype == jnp.float32
    out = result.compiled.out_info.cache
    stacks = [out[k]["pool"] for k in ("csa", "hca")] + [out[k]["ring"] for k in ("window", "csa", "hca")]
    want = ((584 // 4,), jnp.uint32) if kv_cache_dtype == "fp8" else ((cfg.head_dim,), jnp.bfloat16)
    assert all((a.shape[-1:], a.dtype) == want for a in stacks)


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


# Instructions that move no data of their own (a kernel reads its operands in place).
_NO_COPY = (" parameter(", " custom-call(", " bitcast(", " get-tuple-element(", " tuple(", " while(",
            " conditional(", " call(")


# The bf16 leaves the model multiplies in fp32 (params.py): a step that converted them to fp32,
# or back to bf16 for a TPU product, would copy their stacks whole.
_FP32_PRODUCTS = {("head",), ("layers", "ffn", "gate"), ("csa", "compressor", "wkv"), ("csa", "compressor", "wgate"),
                  ("csa", "indexer", "compressor", "wkv"), ("csa", "indexer", "compressor", "wgate"),
                  ("hca", "compressor", "wkv"), ("hca", "compressor", "wgate")}


def _weight_shapes(params, split_input=lambda axis: False) -> set[tuple[str, str]]:
    """The per-device stored shapes (dtype and dims as HLO prints them, e.g. ("f8e4m3fn",
    "256,128")) of the stacked quantized weights the kernels read (the FP8 linears, the routed
    experts): each stack's, one layer's and, for the routed experts, one expert's; and the whole
    stacks of the bf16 weights (every layer stack, among them those multiplied in fp32,
    `_FP32_PRODUCTS`, and the head). (One layer's bf16 slice is not among them: XLA:GPU copies it
    out for the prefill chunk's GEMM.) Not the quantized ones whose input dim `split_input(its
    logical axis)` says the layout splits: they stay on XLA's partitioned product, which re-lays
    them out (`linear` module doc; a known gap)."""
    from dsv4_jax.model.quantized import QuantizedWeight

    shapes = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))[0]:
        keys = tuple(k.key for k in path)
        if keys in _FP32_PRODUCTS:
            assert leaf.dtype == jnp.bfloat16, keys
        if isinstance(leaf, QuantizedWeight):
            if keys[0] in ("layers", "csa", "hca") and not split_input(leaf.axes[1]):
                local = leaf.values.sharding.shard_shape(leaf.values.shape)
                dtype = "f8e4m3fn" if leaf.fmt == "fp8" else "u8"
                for lead in range(len(local) - 1):
                    shapes.add((dtype, ",".join(map(str, local[lead:]))))
        elif leaf.dtype == jnp.bfloat16 and (keys == ("head",) or keys[0] in ("layers", "csa", "hca")):
            shapes.add(("bf16", ",".join(map(str, leaf.sharding.shard_shape(leaf.shape)))))
    return shapes


def _unfused(text: str) -> list[str]:
    """The instruction lines of a compiled program outside fusion bodies that do something: not
    kernels, parameters or plumbing."""
    from dsv4_jax.tools.plan import _Module

    mod = _Module(text)
    fused = {c for body in mod.comps.values() for line in body
             for c in re.findall(r"kind=k\w+,.*? calls=%([\w.\-]+)", line)}
    return [line for name, body in mod.comps.items() if name not in fused for line in body[1:]
            if re.match(r"\s+(?:ROOT )?%\S+ = ", line) and not any(op in line for op in _NO_COPY)]


def _copies(text: str, shapes: set[tuple[str, str]]) -> list[str]:
    """The instructions of a compiled program (`_unfused`) whose result has one of `shapes` as its
    dtype and trailing dims (with any leading ones): copies or re-layouts of those weights. (An
    asynchronous copy into a TPU core's own memory, S(1), is the prefetch of what a kernel reads,
    not a copy in HBM.)"""
    found = []
    for line in _unfused(text):
        result = re.match(r"\s+(?:ROOT )?%\S+ = (\S+) ", line).group(1)
        if " copy-" in line and "S(1)" in result:
            continue
        arrays = re.findall(r"(\w+)\[([\d,]*)\]", result)
        if any(dtype == d and ("," + dims).endswith("," + w) for dtype, dims in arrays for d, w in shapes):
            found.append(line.strip()[:200])
    return found


def _layer_sized(text: str, dims: str) -> list[str]:
    """The instructions of a compiled program (`_unfused`) whose result is `[dims]` or `[1, dims]`."""
    pattern = re.compile(rf"^\s+(?:ROOT )?%\S+ = \w+\[(?:1,)?{dims}\]")
    return [line.strip()[:200] for line in _unfused(text) if pattern.match(line)]


@pytest.mark.parametrize("target,layout,tokens", [("v5p-8", "dp_attention", 1), ("v5p-8", "tp_attention", 1),
                                                  ("v5p-8", "dp_attention", 16), ("tpu7x-8", "dp_attention", 1),
                                                  ("tpu7x-8", "dp_attention", 16), ("h200x8", "dp_attention", 1),
                                                  ("h200x8", "dp_attention", 16)],
                         ids=["v5p-dp-decode", "v5p-tp-decode", "v5p-dp-prefill", "tpu7x-dp-decode",
                              "tpu7x-dp-prefill", "h200-dp-decode", "h200-dp-prefill"])
def test_native_step_reads_the_stored_weights_in_place(tmp_path, target, layout, tokens):
    """The decode step and a prefill chunk of a small Flash-shaped model with its published
    FP8/FP4 weights, compiled for a whole v5p-8 or h200x8 the way dsv4-plan compiles them: the
    FP8 linears go through the matmul kernel per device (under tp_attention too, where the
    column-parallel ones are split), the routed experts and wo_a through the grouped matmul
    kernel (the experts' first half through the fused one), the streams through the
    hyper-connections' kernels, and no instruction but a kernel's call touches a whole layer's
    (or expert's) weight: no copy, re-layout or dequantization of one. Under dp_attention the routed experts' tokens go
    by ragged all-to-all, their rows arriving in the kernel's groups (`_rows_arrive_grouped`)."""
    s, result = _compiled_small(tmp_path, target, layout, tokens)
    platform = aot.target(target).platform
    suffix = "_gpu" if platform == "cuda" else ""
    kernels = aot.kernel_calls(result.compiled, platform)
    assert {"dsv4_fp8_matmul" + suffix, "dsv4_grouped_matmul" + suffix, "dsv4_sparse_attention"} <= set(kernels)
    assert "dsv4_grouped_swiglu" + suffix in kernels  # the experts' first half, fused
    # the hyper-connections' kernels: the collapse before each sub-layer (twice in the scan body)
    # and the head's, the expansion after each (twice); on GPU the collapse is two kernels
    hyper = ({"dsv4_hc_collapse": 3, "dsv4_hc_expand": 2} if platform == "tpu" else
             {"dsv4_hc_mixes_gpu": 3, "dsv4_hc_sum_gpu": 3, "dsv4_hc_expand_gpu": 2})
    assert {k: kernels.count(k) for k in set(kernels) if k.startswith("dsv4_hc_")} == hyper
    assert not _copies(result.compiled.as_text(), _weight_shapes(s.params, lambda a: bool(s.layout.axes(a, s.mesh))))
    # the routed experts' tokens go as moe.expert_exchange says: by ragged all-to-all under
    # dp_attention (experts over 4 or 8 devices), by all-gather under tp_attention on v5p-8
    # (over expert=2)
    from dsv4_jax.model.moe import expert_exchange

    ragged = expert_exchange(s.cfg, s.mesh) == "ragged_all_to_all"
    assert ragged == (layout == "dp_attention")
    assert ("ragged-all-to-all" in result.compiled.as_text()) == ragged
    if ragged:
        _rows_arrive_grouped(s, result.compiled.as_text(), tokens)


def _rows_arrive_grouped(s, text: str, tokens: int):
    """In the ragged exchange, the rows a device receives arrive in its experts' groups and the
    outputs leave from there (`moe._exchanged`): no computation that runs the grouped matmul
    and the all-to-all sorts or gathers anything of the received buffer's C rows."""
    from dsv4_jax.model import moe
    from dsv4_jax.model.moe import exchange_rows
    from dsv4_jax.tools import plan

    capacity = exchange_rows(plan.local_tokens(s, tokens), s.cfg.num_experts_per_tok,
                             s.shards(dsv4_jax.model.sharding.EXPERTS))
    module = plan._Module(text)
    rounds = [lines for lines in module.comps.values()
              if any("ragged" in line for line in lines) and any("grouped_matmul" in line for line in lines)]
    assert rounds
    # (a sort of C keys, or a gather of C rows)
    of_buffer = re.compile(rf"%[\w.\-]*(sort[\w.\-]* = \(?\w+\[{capacity}\]|gather[\w.\-]* = \w+\[{capacity},)")
    assert not [line for lines in rounds for line in lines if of_buffer.search(line)]
    if aot.target(s.target).platform == "tpu":
        # The bf16 rows move in two pieces, `[C, 2, D/2]` (`moe.exchange_pieces`), which the
        # experts' kernels read and write in place: no op re-lays the received rows or the
        # outputs out (a copy, fusion, reshape or SparseCore data-format call of C rows).
        d = s.cfg.hidden_size
        assert moe.exchange_pieces(d, jnp.bfloat16) == 2
        relaid = re.compile(rf"= bf16\[{capacity},(2,{d // 2}|{d})\]\{{[^}}]*\}} (copy|fusion|reshape|transpose)\(")
        assert not [line[:160] for lines in rounds for line in lines if relaid.search(line)]
        assert "sparse-core-data-format" not in text


@pytest.mark.parametrize("target", ["v5p-8", "tpu7x-8", "h200x8"])
def test_bf16_step_reads_the_weight_stacks_in_place(tmp_path, monkeypatch, target):
    """The decode step of the small model with bf16 weights (dsv4-plan --weight-dtype bfloat16),
    compiled for a whole target: no instruction but a kernel's call copies or re-lays out a whole
    weight stack. On tpu7x-8 the stacks XLA's own products read are given (16, 128) tiles
    (`sharding.product_tiled`); laid out by default, the same step re-lays them out."""
    s, result = _compiled_small(tmp_path, target, "dp_attention", 1, weight_dtype="bfloat16")
    stacks = _weight_shapes(s.params)
    assert not _copies(result.compiled.as_text(), stacks)
    leaves = [(tuple(k.key for k in p), x) for p, x in jax.tree_util.tree_flatten_with_path(s.params)[0]]
    tiled = {p for p, x in leaves if getattr(x.format, "layout", None) and x.format.layout.tiling[0] == (16, 128)}
    if target != "tpu7x-8":
        assert not tiled
        return
    # the dense linears, the router and the compressors: every bf16 stack but the kernels'
    # operands (wo_a and the routed experts)
    assert tiled == {p for p, x in leaves if x.dtype == jnp.bfloat16 and p[0] in ("layers", "csa", "hca")
                     and p[-1] not in ("wo_a", "w1", "w2", "w3")}
    assert len(tiled) == 16
    monkeypatch.setattr(dsv4_jax.model.sharding, "_PRODUCT_TILES", {})
    s, result = _compiled_small(tmp_path, target, "dp_attention", 1, weight_dtype="bfloat16")
    assert len(_copies(result.compiled.as_text(), stacks)) >= len(tiled)


def _compiled_small(tmp_path, target: str, layout: str, tokens: int, expert_exchange: str = "auto",
                    weight_dtype: str = "native", **options):
    """A small Flash-shaped model with its published FP8/FP4 weights (or `weight_dtype`, as
    dsv4-plan's), its decode step (tokens 1) or a prefill chunk compiled for a whole target as
    dsv4-plan compiles them: (plan.Setup, aot.Result). tp_attention runs on expert=devices/2 x
    tensor=2; options: the model's run-time options."""
    import dataclasses
    import json

    from dsv4_jax.tools import plan
    from dsv4_jax.model.presets import FLASH

    # (a vocabulary of 2 head_dim tokens would give the head the shape of a layer's compressor weight)
    small = dict(FLASH, vocab_size=1280, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 q_lora_rank=128, o_groups=2, o_lora_rank=128, index_n_heads=16, n_routed_experts=16,
                 num_experts_per_tok=2, moe_intermediate_size=256, num_hash_layers=1,
                 compress_ratios=[0, 4, 128, 4, 0])
    path = tmp_path / "small.json"
    path.write_text(json.dumps(small))
    mesh = None if layout == "dp_attention" else {"expert": aot.target(target).devices // 2, "tensor": 2}
    s = plan.setup(str(path), target, layout, mesh, None, weight_dtype, expert_exchange)
    s = dataclasses.replace(s, cfg=s.cfg.replace(**options))
    cache = plan.abstract_cache(s.cfg, s.batch, 1024, s.mesh, s.layout)
    ids = jax.ShapeDtypeStruct((s.batch, tokens), jnp.int32, sharding=NamedSharding(s.mesh, s.layout.spec(
        (dsv4_jax.model.sharding.BATCH, None), s.mesh)))
    jitted = jax.jit(step, static_argnums=(3, 4), donate_argnums=(1,))
    with jax.sharding.use_abstract_mesh(s.mesh.abstract_mesh):
        return s, aot.compile_for(target, jitted, s.params, cache, ids, s.cfg, True, mesh=s.mesh)


def test_expert_exchange_collective_bytes(tmp_path):
    """The routed experts' tokens by ragged all-to-all against all-gather + reduce-scatter, both
    compiled for a whole h200x8 (decode; the in-place test above compiles the ragged one for
    v5p-8 decode and prefill too): each program holds its own collectives, and the ragged
    all-to-all sends fewer bytes (dsv4-plan's collective_bytes): each device sends its pairs
    (top-2) and gets their outputs back, where the all-gather sends its rows to every other
    device and reduce-scatters fp32 outputs."""
    target, tokens = "h200x8", 1
    from dsv4_jax.tools import plan

    sent = {}
    for exchange in ("ragged_all_to_all", "all_gather"):
        s, result = _compiled_small(tmp_path, target, "dp_attention", tokens, exchange)
        text = result.compiled.as_text()
        assert ("ragged-all-to-all" in text) == (exchange == "ragged_all_to_all")
        assert bool(re.search(r" reduce-scatter(-start)?\(", text)) == (exchange == "all_gather")
        sent[exchange] = plan.program_cost(text, 1.0, plan.branch_shares(s.cfg),
                                           aot.target(target).platform)["collective_bytes"]
    assert 0 < sent["ragged_all_to_all"] < sent["all_gather"]


def test_fp8_activations_take_the_fp8_tensor_core_kernel(tmp_path):
    """With fp8_activations, the FP8 linears of a prefill chunk on h200x8 (tp_attention: wo_b and
    the shared expert's w2 split by their input dim, their partial products summed) all go
    through the FP8-activation kernel, none through the bf16-activation one; dsv4-plan's cost
    counts the kernel's flops apart (`fp8_flops`)."""
    from dsv4_jax.tools import plan

    s, result = _compiled_small(tmp_path, "h200x8", "tp_attention", 16, fp8_activations=True)
    kernels = aot.kernel_calls(result.compiled, "cuda")
    assert "dsv4_fp8_activation_matmul_gpu" in kernels
    assert "dsv4_fp8_matmul_gpu" not in kernels
    # dsv4-plan counts their declared flops apart, to run at the FP8 rate in its roofline
    cost = plan.program_cost(result.compiled.as_text(), 1.0, plan.branch_shares(s.cfg), "cuda")
    assert 0 < cost["fp8_flops"] < cost["flops"]


def test_fp8_activations_feed_the_v7x_mxu_fp8(tmp_path):
    """With fp8_activations on tpu7x-8 (prefill chunk, default layout), the FP8 linears run the
    FP8-activation kernel (e4m3 x e4m3 on v7x's MXU: tests/test_fp8_activations.py reads its
    matmuls), the bf16-activation FP8 kernel none of them, and dsv4-plan counts the kernel's
    flops apart (`fp8_flops`) at the FP8 rate."""
    from dsv4_jax.tools import plan
    from pallas_kernels import fp8_activations_tpu

    s, result = _compiled_small(tmp_path, "tpu7x-8", "dp_attention", 16, fp8_activations=True)
    calls = aot.kernel_calls(result.compiled, "tpu")
    assert fp8_activations_tpu.KERNEL_NAME in calls and "dsv4_fp8_matmul" not in calls
    cost = plan.program_cost(result.compiled.as_text(), 1.0, plan.branch_shares(s.cfg), "tpu")
    assert 0 < cost["fp8_flops"] < cost["flops"]
    plain = _compiled_small(tmp_path, "tpu7x-8", "dp_attention", 16)[1].compiled
    assert fp8_activations_tpu.KERNEL_NAME not in aot.kernel_calls(plain, "tpu")
    assert plan.program_cost(plain.as_text(), 1.0, plan.branch_shares(s.cfg), "tpu")["fp8_flops"] == 0
