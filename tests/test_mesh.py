"""The model on a device mesh (8 host devices, tests/conftest.py): every layout preset on the
meshes data=8, expert=8, data=2 x expert=4 and data=2 x tensor=2 x expert=2, loaded from a native
(FP8/FP4) conversion straight onto its shardings.

Logits: within 1e-5 of the largest one-device logit (a sharded computation sums in another
order; observed about 1e-6). Greedy tokens: identical.
"""

import re

import jax
import numpy as np
import pytest

import dsv4_jax
import hf_oracle as H
from convert.cli import main as convert_main
from dsv4_jax.checkpoint.export_hf import write_hf_checkpoint
from dsv4_jax.model import sharding, xla_cpu
from dsv4_jax.model.cache import init_cache
from dsv4_jax.model.deepseek_v4 import step

MESHES = [{"data": 8}, {"expert": 8}, {"data": 2, "expert": 4}, {"data": 2, "tensor": 2, "expert": 2}]
MESH_IDS = ["data8", "expert8", "data2-expert4", "data2-tensor2-expert2"]


# TINY (every layer kind, hash and learned routing) with experts 64 wide, so that tensor=2 splits
# the FP4 experts' width into whole groups of 32 (their block scales).
CONFIG = dict(H.TINY, moe_intermediate_size=64)


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """A CONFIG checkpoint in the published FP8/FP4 format, converted with --dtype native: its
    linears stay FP8 and its experts FP4 in memory."""
    cfg = dsv4_jax.ModelConfig.from_hf(CONFIG)
    hf = tmp_path_factory.mktemp("hf")
    write_hf_checkpoint(dsv4_jax.init_params(cfg, seed=3, std=0.1), cfg, str(hf), num_shards=2, quantize=True)
    out = tmp_path_factory.mktemp("conv") / "native"
    assert convert_main([str(hf), str(out), "--dtype", "native"]) == 0
    return out


@pytest.fixture(scope="module")
def single(native):
    return dsv4_jax.load(native)


def _ids(cfg, B, S, seed=0):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, S)).astype(np.int32)


@pytest.mark.parametrize("layout", sorted(sharding.PRESETS))
@pytest.mark.parametrize("shape", MESHES, ids=MESH_IDS)
def test_logits_equal_one_device(native, single, layout, shape):
    """A full forward of 140 tokens (ratio-4 and ratio-128 blocks completed) for 6 sequences (not
    a multiple of 8: the model pads the batch to whole sequences per device)."""
    mesh = sharding.make_mesh(shape)
    model = dsv4_jax.load(native, mesh=mesh, layout=layout)
    ids = _ids(model.config, 6, 140)
    want = np.asarray(single(ids))
    got = np.asarray(model(ids))
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.fixture(scope="module")
def greedy_alone(single):
    """A ragged batch crossing ratio-4 and ratio-128 boundaries in its prompts (130 tokens) and
    while decoding, and its greedy tokens on one device."""
    rng = np.random.default_rng(7)
    prompts = [list(map(int, rng.integers(0, single.config.vocab_size, n))) for n in (3, 40, 130, 9)]
    return prompts, dsv4_jax.generate(single, prompts, 12).rows()


# Every layout on the mesh with all three axes, and each other mesh once (the logits test above
# covers every pair): each case compiles generate's programs anew.
GENERATE_CASES = [(layout, MESHES[3]) for layout in sorted(sharding.PRESETS)] + [
    ("dp_attention", MESHES[1]), ("tp_attention", MESHES[2]), ("data_parallel", MESHES[0])]


@pytest.mark.parametrize("layout, shape", GENERATE_CASES,
                         ids=[f"{MESH_IDS[MESHES.index(s)]}-{lay}" for lay, s in GENERATE_CASES])
def test_generate_equals_one_device(native, greedy_alone, layout, shape):
    """generate on the mesh: the batch padded to whole sequences per device, every row prefilled
    and decoded at its own positions with the cache split by rows and donated: the same greedy
    tokens as on one device."""
    prompts, want = greedy_alone
    model = dsv4_jax.load(native, mesh=sharding.make_mesh(shape), layout=layout)
    assert dsv4_jax.generate(model, prompts, 12).rows() == want


def _shard_rows(arr, axis):
    """The sizes of each device's piece of `arr` along `axis`, device by device."""
    return {s.device.id: s.data.shape[axis] for s in arr.addressable_shards}


@pytest.mark.parametrize("shape", MESHES[1:], ids=MESH_IDS[1:])
def test_each_device_holds_its_share(native, shape):
    """dp_attention: each device holds E / (expert x tensor) routed experts (FP4 values and scales
    alike) and, with data-parallel attention, only its sequences' cache rows; attention weights are
    whole on every device."""
    mesh = sharding.make_mesh(shape)
    model = dsv4_jax.load(native, mesh=mesh)
    cfg = model.config
    ep = mesh.shape.get("expert", 1) * mesh.shape.get("tensor", 1)
    w1 = model.params["layers"]["ffn"]["w1"]
    for part in (w1.values, w1.scale):
        assert set(_shard_rows(part, 1).values()) == {cfg.n_routed_experts // ep}
        assert len(part.addressable_shards) == 8
    assert model.params["layers"]["attn"]["wkv"].values.sharding.is_fully_replicated
    cache = jax.device_put(init_cache(cfg, 16, 64), sharding.cache_shardings(init_cache(cfg, 16, 64), mesh,
                                                                             cfg.layout))
    assert set(_shard_rows(cache["csa"]["pool"], 1).values()) == {2}
    assert set(_shard_rows(cache["pos"], 0).values()) == {2}


def test_tp_attention_splits_heads(native):
    """tp_attention on data=2 x tensor=2 x expert=2: query heads, sinks, the vocabulary and the
    experts' width are split over tensor; the one K=V head is whole."""
    mesh = sharding.make_mesh({"data": 2, "tensor": 2, "expert": 2})
    model = dsv4_jax.load(native, mesh=mesh, layout="tp_attention")
    cfg, attn = model.config, model.params["layers"]["attn"]
    assert set(_shard_rows(attn["wq_b"].values, 1).values()) == {cfg.num_heads * cfg.head_dim // 2}
    assert set(_shard_rows(attn["sink"], 1).values()) == {cfg.num_heads // 2}
    assert set(_shard_rows(model.params["head"], 0).values()) == {cfg.vocab_size // 2}
    assert set(_shard_rows(model.params["layers"]["ffn"]["w1"].values, 2).values()) == {cfg.moe_intermediate_size // 2}
    assert attn["wkv"].values.sharding.is_fully_replicated


def test_decode_step_gathers_no_expert_weights(native):
    """The compiled decode step on expert=8 exchanges tokens, never the experts: no all-gather in
    it has the shape of a layer's (or the stack's) routed expert weights."""
    mesh = sharding.make_mesh({"expert": 8})
    model = dsv4_jax.load(native, mesh=mesh)
    cfg = model.config
    cache = init_cache(cfg, 8, 64)
    cache = jax.device_put(cache, sharding.cache_shardings(cache, mesh, cfg.layout))
    with model.on_mesh():
        hlo = jax.jit(step, static_argnums=(3, 4), donate_argnums=1).lower(
            model.params, cache, model.place_rows(np.zeros((8, 1), np.int32)), cfg, True).compile().as_text()
    gathers = [line for line in hlo.splitlines() if re.search(r"= \S+ all-gather(-start)?\(", line)]
    assert gathers, "the tokens are all-gathered"
    w1 = model.params["layers"]["ffn"]["w1"]
    E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    expert_shapes = [f"[{E},{I},{D // 2}]", f"[{E},{D},{I // 2}]", f"[{cfg.num_layers},{E},"]
    for line in gathers:
        result = line.split("=", 1)[1].split("all-gather", 1)[0]
        assert not any(s in result for s in expert_shapes), line.strip()[:200]
    assert w1.values.shape == (cfg.num_layers, E, I, D // 2)


def test_engine_on_a_mesh_equals_one_device(native, greedy_alone):
    """The serving engine on data=2 x expert=4 (dp_attention): its 8 slots split over the devices
    by sequence (each device holds one slot's cache row), requests joining while others decode:
    each request's greedy tokens equal one device's, also when served again from its cached prefix,
    and a third time from the snapshot of its state that the second time saved."""
    from dsv4_jax.runtime.engine import Engine

    prompts, want = greedy_alone
    model = dsv4_jax.load(native, mesh=sharding.make_mesh({"data": 2, "expert": 4}))
    eng = Engine(model, slots=8, max_len=256, prefill_chunk=256)  # every prompt one chunk, as in generate
    assert set(_shard_rows(eng.state.cache["pos"], 0).values()) == {1}
    # the pools split by blocks as the rows: each device's slot draws from its own blocks
    per_device = eng.num_blocks // 8
    assert set(_shard_rows(eng.state.cache["csa"]["pool"], 1).values()) == {per_device}
    assert set(_shard_rows(eng.state.cache["blocks"], 0).values()) == {1}
    reqs = [eng.submit(p, 12) for p in prompts[:2]]
    for _ in range(3):
        eng.step()
    reqs += [eng.submit(p, 12) for p in prompts[2:]]
    eng.run_until_idle()
    assert [r.tokens for r in reqs] == want
    assert all(eng.pool.shard_of(r.slot) == b // per_device for r in reqs for b in eng.table[r.slot][:1])
    # Again: the 130-token prompt goes to the device holding its cached first block and reads it
    # from there (prefix caching), its tokens unchanged.
    hits = eng.counters["prefix_cache_hits"]
    again = [eng.submit(p, 12) for p in prompts[::-1]]
    eng.run_until_idle()
    assert [r.tokens for r in again] == want[::-1]
    assert eng.counters["prefix_cache_hits"] - hits == 128
    # That hit ran the span in a chunk ending at 128 and saved the row's state there, in its
    # device's share of the snapshots (2 a device); a third time the prompt starts from it.
    assert set(_shard_rows(eng.state.snapshots["cache"]["pos"], 0).values()) == {2}
    assert eng.counters["prefix_cache_snapshot_hits"] == 0
    third = [eng.submit(p, 12) for p in prompts]
    eng.run_until_idle()
    assert [r.tokens for r in third] == want and eng.counters["prefix_cache_snapshot_hits"] == 1


def test_bad_meshes_and_layouts(native):
    with pytest.raises(ValueError, match="unknown layout 'nope'"):
        dsv4_jax.load(native, mesh=sharding.make_mesh({"data": 8}), layout="nope")
    with pytest.raises(ValueError, match=r"splits experts \(8\) into 16 pieces|needs 16 devices"):
        sharding.make_mesh({"expert": 16})
    with pytest.raises(ValueError, match="unknown mesh axes"):
        sharding.make_mesh({"model": 8})
    with pytest.raises(ValueError, match="`layout` needs a `mesh`"):
        dsv4_jax.load(native, layout="dp_attention")
    with pytest.raises(ValueError, match="unknown logical axis"):
        sharding.Layout("mine", (("experts2", ("expert",)),))
    tiny = dsv4_jax.ModelConfig.from_hf(CONFIG)
    mesh = sharding.make_mesh({"data": 2, "tensor": 4})
    with pytest.raises(ValueError, match=r"splits heads \(4\)|o_groups \(2\) is not divisible by 4"):
        sharding.check_divisible(tiny, mesh, sharding.PRESETS["tp_attention"])


def test_unsplittable_block_scales_are_an_error(tmp_path):
    """TINY's experts are 16 wide: their FP4 scales (one per 32 inputs) cannot follow a width split
    over tensor=2 (tp_attention); the forward says so instead of computing with the wrong scales."""
    cfg = dsv4_jax.ModelConfig.from_hf(H.TINY)
    write_hf_checkpoint(dsv4_jax.init_params(cfg, seed=3, std=0.1), cfg, str(tmp_path / "hf"), quantize=True)
    assert convert_main([str(tmp_path / "hf"), str(tmp_path / "native"), "--dtype", "native"]) == 0
    model = dsv4_jax.load(tmp_path / "native", mesh=sharding.make_mesh({"data": 4, "tensor": 2}),
                          layout="tp_attention")
    with pytest.raises(ValueError, match=r"splits a fp4 weight \[7, 8, 32, 16\].*block scales"):
        model(_ids(cfg, 4, 8))


@pytest.mark.parametrize("layout, axes, kernel, fp8_activations", [
    ("dp_attention", (None, None), True, False),  # replicated (attention under dp_attention)
    ("tp_attention", (sharding.HEADS, None), True, False),  # output dim split (wq_b)
    ("tp_attention", (None, sharding.HEADS), False, False),  # input dim split (wo_b): XLA's product
    ("tp_attention", (sharding.HEADS, None), True, True),
    ("tp_attention", (None, sharding.HEADS), True, True),  # input dim split: partial products summed
])
def test_quantized_dense_runs_the_kernel_per_device(layout, axes, kernel, fp8_activations):
    """`linear.dense`'s TPU path for an FP8 weight (`linear._kernel`), here with impl "pallas" (the
    TPU kernel in the Pallas interpreter) on data=2 x tensor=2 x expert=2: the kernel runs once per
    device on its rows and its piece of the weight, unless the weight's input dim is split (then
    XLA's partitioned product, whose partial sums add up in fp32). Equals the CPU path within
    fp32 rounding of sums in another order (1e-5 of the largest output). With fp8_activations
    (`dense` takes the kernel on every platform, here the GPU kernel in the interpreter), also
    where the input dim is split: equal to `fp8_activation_matmul_ref` on one device, and not to
    the product of the activations as they are."""
    import pallas_kernels
    from dsv4_jax.model import linear
    from dsv4_jax.model.quantized import QuantizedWeight
    from jax.sharding import NamedSharding

    mesh = sharding.make_mesh(MESHES[3])
    cfg = dsv4_jax.ModelConfig.from_hf(CONFIG).replace(layout=sharding.get_layout(layout), attention_impl="pallas",
                                                       fp8_activations=fp8_activations)
    rng = np.random.default_rng(0)
    n, k = 512, 512 if axes[1] else 384  # a split input dim: whole scale blocks on each device
    values = jax.numpy.asarray(rng.standard_normal((n, k)) * 4, jax.numpy.float8_e4m3fn)
    scale = jax.numpy.asarray(2.0 ** rng.integers(-8, 0, (n // 128, k // 128)), jax.numpy.float32)
    x = rng.standard_normal((8, 3, k)).astype(np.float32)
    w = QuantizedWeight(values, scale, fmt="fp8", axes=axes)
    as_they_are = np.asarray(xla_cpu.dense(w, x))
    want = (np.asarray(pallas_kernels.fp8_activation_matmul_ref(x.reshape(-1, k), w)).reshape(8, 3, n)
            if fp8_activations else as_they_are)

    def placed(a, logical):
        return jax.device_put(a, NamedSharding(mesh, cfg.layout.spec(logical, mesh, a.shape)))

    w_mesh = w.replace(values=placed(values, axes), scale=placed(scale, axes))
    x_mesh = placed(x, (sharding.BATCH, None, None))
    fn = jax.jit(lambda x, w: linear.dense(x, w, cfg))
    with jax.set_mesh(mesh):
        assert ("pallas_call" in str(jax.make_jaxpr(fn)(x_mesh, w_mesh))) == kernel
        got = np.asarray(fn(x_mesh, w_mesh))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    if fp8_activations:
        assert np.abs(got - as_they_are).max() > 1e-3 * np.abs(want).max()


def _ragged_all_to_all_twin(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """`jax.lax.ragged_all_to_all` as its documentation defines it, by all-gathers (XLA:CPU has no
    ragged all-to-all): N slices per sender, slice i going to device i // (N / devices): sender
    s's rows input_offsets[s][i] .. + send_sizes[s][i] land in that device's output at
    output_offsets[s][i]; rows no sender writes keep `output`'s values."""
    me = jax.lax.axis_index(axis_name)
    rows, start, size, src = (jax.lax.all_gather(a, axis_name, axis=0, tiled=False)
                              for a in (operand, output_offsets, send_sizes, input_offsets))
    n, per_device = rows.shape[0], input_offsets.shape[0] // rows.shape[0]
    assert input_offsets.shape[0] == n * per_device and recv_sizes.shape == input_offsets.shape

    def to_me(a):  # [sender, slice] -> the slices each sender sends me, flat `[n per_device]`
        return jax.lax.dynamic_slice_in_dim(a, me * per_device, per_device, axis=1).reshape(-1)

    start, size, src = to_me(start), to_me(size), to_me(src)
    sender_of = jax.numpy.arange(n * per_device) // per_device
    r = jax.numpy.arange(output.shape[0])
    hit = (r[None] >= start[:, None]) & (r[None] < (start + size)[:, None])  # [slice, output row]
    piece = jax.numpy.argmax(hit, axis=0)
    at = jax.numpy.clip(src[piece] + r - start[piece], 0, operand.shape[0] - 1)
    written = hit.any(axis=0).reshape((-1,) + (1,) * (output.ndim - 1))
    return jax.numpy.where(written, rows[sender_of[piece], at], output)


@pytest.mark.parametrize("per_device", [1, 3])
def test_ragged_all_to_all_twin(per_device):
    """The twin on expert=4 against hand-placed rows: device d sends d + 1 rows in each of
    per_device slices to each device, each receiver's stream ordered by slice, then by sender."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    n, N = 4, 4 * per_device
    mesh = jax.make_mesh((n, 2), ("expert", "data"))
    send = np.array([[d + 1] * N for d in range(n)], np.int32)  # [sender, slice]: slice i to device i // per_device
    operand = np.arange(n * 64, dtype=np.float32).reshape(n, 64)  # sender d's rows: 64 d + i
    in_off = np.cumsum(send, axis=1) - send
    j = np.arange(N) % per_device  # each slice's place among its receiver's slices
    out_off = np.array([[sum(send[:, (i // per_device) * per_device + jj].sum() for jj in range(j[i]))
                         + send[:s, i].sum() for i in range(N)] for s in range(n)], np.int32)
    recv = np.array([[send[s, d * per_device + jj] for s in range(n) for jj in range(per_device)]
                     for d in range(n)], np.int32)

    def local(op, io, ss, oo, rs):
        return _ragged_all_to_all_twin(op[0], jax.numpy.full((40,), -1.0), io[0], ss[0], oo[0], rs[0],
                                       axis_name="expert")[None]

    args = [operand, in_off, send, out_off, recv]
    run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("expert"),) * 5, out_specs=P("expert")))
    got = np.asarray(run(*[jax.device_put(a, NamedSharding(mesh, P("expert"))) for a in args]))
    for d in range(n):
        want = [64 * s + in_off[s, i] + r for i in range(d * per_device, (d + 1) * per_device) for s in range(n)
                for r in range(send[s, i])]
        np.testing.assert_array_equal(got[d, :len(want)], want)
        assert (got[d, len(want):] == -1).all()


@pytest.mark.parametrize("layout, shape, capacity", [("dp_attention", MESHES[1], 2), ("dp_attention", MESHES[3], 0.3),
                                                     ("tp_attention", MESHES[2], 2)],
                         ids=["expert8-dp_attention", "data2-tensor2-expert2-dp_attention-rounds",
                              "data2-expert4-tp_attention"])
def test_ragged_all_to_all_exchange_equals_one_device(native, single, monkeypatch, layout, shape, capacity):
    """expert_exchange "ragged_all_to_all" (each (token, expert) pair sent to its expert's device
    and back, `moe._exchanged`), run on CPU with the collective's twin in place of the one XLA:CPU
    lacks and in place of the all-gather the CPU takes: a full forward of 6 sequences x 140 tokens
    gives one device's logits (within 1e-5 of the largest, as the other mesh tests). With a
    capacity of 0.3 T k rows per round, every exchange takes several rounds (a device receives
    T k rows on average). The buffers the exchange leaves unset (`jax.lax.empty`: no memset on
    TPU and GPU, zeros on CPU) start as NaN here, so a value read from a row nothing wrote shows."""
    from dsv4_jax.model import moe

    monkeypatch.setattr(moe, "EXCHANGE_CAPACITY", capacity)
    monkeypatch.setattr(moe, "ragged_all_to_all", _ragged_all_to_all_twin)
    monkeypatch.setattr(moe.jax.lax, "empty", lambda shape, dtype: jax.numpy.full(shape, np.nan, dtype))
    monkeypatch.setattr(moe, "_gathered", lambda *a, gather, **kw: moe._exchanged(*a, **kw))
    mesh = sharding.make_mesh(shape)
    model = dsv4_jax.load(native, mesh=mesh, layout=layout, expert_exchange="ragged_all_to_all")
    assert moe.expert_exchange(model.config, mesh) == "ragged_all_to_all"
    ids = _ids(model.config, 6, 140)
    want = np.asarray(single(ids))
    got = np.asarray(model(ids))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_expert_exchange_rule():
    """`moe.expert_exchange`: "auto" takes the ragged all-to-all when the experts split over more
    than EXCHANGE_CAPACITY (2) devices and the layout allows it; a forced choice the layout
    cannot run is an error naming the axes."""
    from dsv4_jax.model import moe

    cfg = dsv4_jax.ModelConfig.from_hf(dict(CONFIG, num_experts_per_tok=6, n_routed_experts=16))
    dp = cfg.replace(layout=sharding.get_layout("dp_attention"))
    tp = cfg.replace(layout=sharding.get_layout("tp_attention"))
    assert moe.EXCHANGE_CAPACITY == 2
    assert moe.expert_exchange(dp, sharding.make_mesh({"expert": 8})) == "ragged_all_to_all"
    assert moe.expert_exchange(dp, sharding.make_mesh({"data": 2, "expert": 4})) == "ragged_all_to_all"
    assert moe.expert_exchange(dp, sharding.make_mesh({"data": 4, "expert": 2})) == "all_gather"
    assert moe.expert_exchange(tp, sharding.make_mesh({"data": 2, "tensor": 2, "expert": 2})) == "all_gather"
    assert moe.expert_exchange(tp, sharding.make_mesh({"tensor": 2, "expert": 4})) == "ragged_all_to_all"
    assert moe.expert_exchange(dp, sharding.make_mesh({"data": 8})) == "all_gather"  # nothing to exchange
    assert moe.expert_exchange(dp.replace(expert_exchange="all_gather"),
                               sharding.make_mesh({"expert": 8})) == "all_gather"
    assert moe.expert_exchange(dp.replace(expert_exchange="ragged_all_to_all"),
                               sharding.make_mesh({"data": 4, "expert": 2})) == "ragged_all_to_all"
    # the experts split over expert, their width over tensor, which also splits the tokens: each
    # pair's output would need the other tensor half's share from another device's tokens
    lay = sharding.Layout("mine", ((sharding.BATCH, ("expert", "tensor")), (sharding.EXPERTS, ("expert",)),
                                   (sharding.EXPERT_MLP, ("tensor",))))
    with pytest.raises(ValueError, match=r"needs every mesh axis that splits the experts .* layout 'mine'"):
        moe.expert_exchange(dp.replace(layout=lay, expert_exchange="ragged_all_to_all"),
                            sharding.make_mesh({"tensor": 2, "expert": 4}))
    with pytest.raises(ValueError, match="`expert_exchange` must be one of"):
        cfg.replace(expert_exchange="nccl")


def test_exchange_moves_16_bit_rows_in_pieces(monkeypatch):
    """bf16 rows whose halves are whole lanes (D = 256) go through the ragged exchange in two
    pieces, `[rows, 2, D/2]` (`moe.exchange_pieces`, the layout XLA moves them in on TPU): the
    first half's kernel takes the received rows so and the second half gives its output back
    so (impl="pallas": the TPU kernels in the interpreter), and the tokens' sums equal the
    all-gather exchange's (`moe._gathered`) on expert=8, within bf16 rounding of the products
    (tiles of other sizes). The unset buffers start as NaN."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    import pallas_kernels
    from dsv4_jax.model import moe

    monkeypatch.setattr(moe, "ragged_all_to_all", _ragged_all_to_all_twin)
    monkeypatch.setattr(moe.jax.lax, "empty", lambda shape, dtype: jax.numpy.full(shape, np.nan, dtype))
    seen = []
    for name in ("grouped_swiglu", "grouped_matmul"):
        kernel = getattr(pallas_kernels, name)
        monkeypatch.setattr(pallas_kernels, name, lambda x, *a, _k=kernel, **kw: seen.append(
            (x.shape, kw.get("out_pieces"))) or _k(x, *a, **kw))
    n, T, k, E, D, I = 8, 12, 3, 16, 256, 128
    assert moe.exchange_pieces(D, jax.numpy.bfloat16) == 2 and moe.exchange_pieces(D, jax.numpy.float32) == 1
    rng = np.random.default_rng(0)
    x = jax.numpy.asarray(rng.standard_normal((n * T, D)), jax.numpy.bfloat16)
    experts = np.stack([rng.choice(E, k, replace=False) for _ in range(n * T)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (n * T, k)).astype(np.float32)
    w1, w3 = (jax.numpy.asarray(rng.standard_normal((1, E, I, D)) / 16, jax.numpy.bfloat16) for _ in range(2))
    w2 = jax.numpy.asarray(rng.standard_normal((1, E, D, I)) / 16, jax.numpy.bfloat16)
    mesh = jax.make_mesh((n,), ("expert",))
    kw = dict(limit=10.0, ep=("expert",), fp8_activations=False, impl="pallas")
    rows, stack = P("expert"), P(None, "expert")

    def run(fn):
        local = jax.shard_map(lambda *a: fn(*a, jax.numpy.int32(0)), mesh=mesh,
                              in_specs=(rows, rows, rows, stack, stack, stack), out_specs=rows, check_vma=False)
        args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in
                zip((x, experts, weights, w1, w2, w3), (rows, rows, rows, stack, stack, stack))]
        return np.asarray(jax.jit(local)(*args))

    got = run(lambda *a: moe._exchanged(*a, **kw))
    assert (((T * k * moe.EXCHANGE_CAPACITY, 2, D // 2), None) in seen
            and ((T * k * moe.EXCHANGE_CAPACITY, I), 2) in seen)
    want = run(lambda *a: moe._gathered(*a, gather=("expert",), **kw))
    assert np.isfinite(got).all() and got.shape == (n * T, D)
    np.testing.assert_allclose(got, want, rtol=0, atol=2.0 ** -7 * np.abs(want).max())
