"""`dsv4-plan`: what a full-size DeepSeek-V4 needs on a TPU or GPU slice, from the real compilers.

    dsv4-plan flash --target v5p-8 [--layout dp_attention] [--mesh expert=4] [--batch 4]
              [--max-len 8192] [--prefill-chunk 512] [--weight-dtype native|bfloat16]
              [--expert-exchange auto|all_gather|ragged_all_to_all] [--fp8-activations]
              [--kv-cache-dtype auto|fp8] [--seq-len N]
    python -m dsv4_jax.tools.plan pro --target h200x8 ...

The model is `flash` or `pro` (dsv4_jax/model/presets.py) or a path to a config.json. The decode step
(`model.step` with T = 1, the cache donated, attention_impl "pallas") and one prefill chunk
(T = --prefill-chunk tokens per sequence) are compiled ahead of time for the target
(dsv4_jax/tools/aot.py) from abstract inputs: ShapeDtypeStructs carrying the layout's NamedShardings
over the target's devices, no weights. With --weight-dtype native (the default) the leaves the
published checkpoints store FP8/FP4 (`params.NATIVE_QUANT`) are QuantizedWeights with their stored
shapes and every other leaf has the dtype `load(..., dtype=bfloat16)` gives it (bf16, and fp32
for the leaves the model keeps in fp32: norms, hyper-connections, the gate, compressors, the
head); with bfloat16 every weight leaf is a bf16 array.

The JSON it prints (one object):
  per_device   parameter_bytes, cache_bytes (the shards this device holds, as the compiled decode
               step lays them out: a TPU pads each array's minor dims to whole tiles; their
               shapes' bytes: cache_shape_bytes), temp_bytes (XLA's
               memory analysis: the larger of the two programs'), other_bytes (their outputs that
               do not alias an input, and the generated code), total_bytes, memory_bytes (the
               device's HBM) and fits (total_bytes <= memory_bytes)
  decode, prefill
               flops and bytes_accessed per device: XLA's cost analysis of the compiled program
               with every loop counted as many times as it runs (`program_cost`), min_bytes (what
               the step cannot avoid reading, `min_bytes`), their ratio, roofline_ms (the larger
               of bytes_accessed / HBM bandwidth and flops / peak bf16 flops, fp8_flops, those
               of the FP8 tensor-core kernel, at the peak FP8 rate), tokens_per_s for
               the whole batch, and the same at min_bytes; collective_bytes: what a device sends
               in the program's collectives (`_Module.collective_bytes`)
  cache        for --kv-cache-dtype (auto: bf16; fp8: DeepSeek's 584-byte records for the compressed
               entries, as dsv4-serve's flag) and sequences of --seq-len tokens (default --max-len):
               block_bytes (a block of 128 tokens in every pool of a device), bytes_per_sequence
               (a sequence's window rings, compressor states and blocks on the devices holding it)
               and the same in bf16, from the arrays' shapes; laid_out_block_bytes and
               laid_out_bytes_per_sequence, the same as the compiled decode step lays the arrays
               out (`layout_padding`); free_bytes (a device's memory left by its parameter shards and
               the programs' needs at --batch and --max-len) and sequences_per_device (how many such
               laid-out sequences that holds), sequences (times the pieces the layout splits sequences into)
  max_context  the longest max_len (a multiple of 128) at which both programs fit for --batch,
               found by compiling (`find_max_context`; its lengths and bytes: max_context_search)
The layout, mesh, expert_exchange (`moe.expert_exchange`'s choice), fp8_activations, batch and
lengths are echoed; docs/plan.md has runs.
Bad input exits 1 with one line on stderr.
"""

from __future__ import annotations

from . import aot  # first: it lets JAX's CUDA plugin register without a GPU

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from dsv4_jax.model import sharding  # noqa: E402
from dsv4_jax.model.cache import (KV_CACHE_DTYPES, blocks_per_row, cache_spec,  # noqa: E402
                                  default_block_size)
from dsv4_jax.model.config import EXPERT_EXCHANGES, ConfigError, ModelConfig  # noqa: E402
from dsv4_jax.model.layer_kinds import COMPRESSED  # noqa: E402
from dsv4_jax.model.deepseek_v4 import step  # noqa: E402
from dsv4_jax.model.moe import (ROUTED_SCOPE, exchange_pieces, exchange_rows,  # noqa: E402
                                expert_exchange as expert_exchange_of)
from dsv4_jax.model.params import NATIVE_QUANT, leaf_dtype, map_spec, param_spec  # noqa: E402
from dsv4_jax.model.presets import PRESETS, preset  # noqa: E402
from dsv4_jax.model.quantized import QuantizedWeight, storage_shapes  # noqa: E402
from pallas_kernels import (fp8_activations_gpu, fp8_activations_tpu, grouped_matmul_gpu,  # noqa: E402
                            grouped_matmul_tpu)
from pallas_kernels._dispatch import DECLARED_COST  # noqa: E402

WEIGHT_DTYPES = ("native", "bfloat16")
CONTEXT_STEP = 128  # max_context is a multiple of the ratio-128 block
VERIFY = 3  # compiled checks of a predicted max_context


class PlanError(ValueError):
    """Input the plan cannot be made for; the message is the one line the CLI prints."""


# ---- the model's abstract inputs ------------------------------------------------------------

def model_config(model: str) -> ModelConfig:
    """A preset name ("flash", "pro") or a path to a config.json (or a checkpoint directory)."""
    if model in PRESETS:
        return preset(model)
    if not os.path.exists(model):
        raise PlanError(f"unknown model {model!r}: give {' or '.join(PRESETS)}, or a path to a config.json")
    try:
        return ModelConfig.from_hf(model)
    except ConfigError as e:
        raise PlanError(f"{model}: {e}") from None


def abstract_params(cfg: ModelConfig, weight_dtype: str, mesh, layout: sharding.Layout) -> dict:
    """The parameter tree as ShapeDtypeStructs on their shardings (QuantizedWeights of them for
    the native leaves), in the layouts `load` puts them in (`sharding.product_tiled`)."""
    def leaf(path, spec_leaf):
        shape, cls = spec_leaf
        if weight_dtype == "native" and path in NATIVE_QUANT:
            fmt = NATIVE_QUANT[path]
            st = storage_shapes(tuple(shape), fmt)
            return QuantizedWeight(jax.ShapeDtypeStruct(*st["values"]), jax.ShapeDtypeStruct(*st["scale"]),
                                   fmt=fmt, dtype_name="bfloat16", axes=sharding.matrix_axes(path))
        return jax.ShapeDtypeStruct(tuple(shape), leaf_dtype(cls, jnp.bfloat16))

    params = map_spec(leaf, param_spec(cfg))
    return sharding.product_tiled(_placed(params, sharding.param_shardings(params, mesh, layout)))


def abstract_cache(cfg: ModelConfig, batch: int, max_len: int, mesh, layout: sharding.Layout,
                   kv_cache_dtype: str = "auto") -> dict:
    """The bf16 cache (fp32 compressor states; the compressed entries as FP8 records with
    kv_cache_dtype "fp8") as ShapeDtypeStructs, rows split over `batch`."""
    def walk(spec):
        return {k: jax.ShapeDtypeStruct(*v) if isinstance(v, tuple) else walk(v) for k, v in spec.items()}

    cache = walk(cache_spec(cfg, batch, max_len, jnp.bfloat16, kv_cache_dtype=kv_cache_dtype))
    return _placed(cache, sharding.cache_shardings(cache, mesh, layout))


def _placed(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def device_bytes(tree) -> int:
    """Bytes of one device's shards of a tree of sharded ShapeDtypeStructs (every device holds
    the same amount under these layouts)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class Setup:
    """What one plan compiles: the model on the target's mesh."""

    target: str
    cfg: ModelConfig  # with attention_impl "pallas" and the layout
    mesh: jax.sharding.Mesh
    batch: int
    weight_dtype: str
    kv_cache_dtype: str = "auto"

    @property
    def layout(self) -> sharding.Layout:
        return self.cfg.layout

    def shards(self, logical: str) -> int:
        return self.layout.shards(logical, self.mesh)

    @functools.cached_property
    def params(self) -> dict:
        return abstract_params(self.cfg, self.weight_dtype, self.mesh, self.layout)


def setup(model: str, target: str, layout: str | None, mesh_axes: dict[str, int] | None, batch: int | None,
          weight_dtype: str, expert_exchange: str = "auto", fp8_activations: bool = False,
          kv_cache_dtype: str = "auto") -> Setup:
    """Checks the input and builds the Setup (PlanError names the first problem). batch None:
    one sequence per piece the layout splits sequences into."""
    cfg = model_config(model)
    try:
        t = aot.target(target)
        lay = sharding.get_layout(layout)
    except ValueError as e:
        raise PlanError(str(e)) from None
    if weight_dtype not in WEIGHT_DTYPES:
        raise PlanError(f"unknown --weight-dtype {weight_dtype!r}; choose one of {', '.join(WEIGHT_DTYPES)}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise PlanError(f"unknown --kv-cache-dtype {kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    axes = {"expert": t.devices} if mesh_axes is None else mesh_axes
    if math.prod(axes.values()) != t.devices:
        raise PlanError(f"mesh {axes} has {math.prod(axes.values())} devices; {target} has {t.devices}")
    mesh = sharding.make_mesh(axes, devices=aot.topology(target))
    try:
        sharding.check_divisible(cfg, mesh, lay)
    except ValueError as e:
        raise PlanError(str(e)) from None
    rows = lay.shards(sharding.BATCH, mesh)
    batch = rows if batch is None else batch
    if batch < 1 or batch % rows:
        raise PlanError(f"--batch {batch} must be a positive multiple of {rows}, the pieces layout {lay.name!r} "
                        f"splits sequences into on mesh {axes}")
    try:
        cfg = cfg.replace(attention_impl="pallas", layout=lay, expert_exchange=expert_exchange,
                          fp8_activations=fp8_activations)
        expert_exchange_of(cfg, mesh)
    except ValueError as e:
        raise PlanError(str(e)) from None
    return Setup(target, cfg, mesh, batch, weight_dtype, kv_cache_dtype)


# ---- compiling ---------------------------------------------------------------------------------

@dataclasses.dataclass
class Compiled:
    """One compiled program: XLA's memory analysis (bytes per device), its cost with loops
    counted (`program_cost`) and the factor by which each cache leaf's layout (the compiler's
    choice) pads it (`layout_padding`); `memory` None when the compiler found it does not fit."""

    memory: dict | None
    cost: dict | None
    error: str | None = None
    cache_padding: dict | None = None


def laid_out_bytes(shape: tuple[int, ...], dtype, layout) -> int:
    """Bytes an array of `shape` takes in device memory in `layout` (a jax Layout: the order of
    its dims and the tile of its minor ones): its minor dims padded to whole tiles, as a TPU lays
    out HBM. With no tiling (GPU), its shape's bytes."""
    dims = [shape[i] for i in layout.major_to_minor]
    for k, t in enumerate(reversed(layout.tiling[0] if layout.tiling else ())):
        dims[-1 - k] = -(-dims[-1 - k] // t) * t
    return math.prod(dims) * jnp.dtype(dtype).itemsize


def layout_padding(cache: dict, formats: dict) -> dict:
    """Per cache leaf (its path, e.g. "csa/pool"), the bytes of its shard as laid out over its
    shard's bytes (>= 1): a TPU pads an array's last dim to 128 lanes, so a pool of 146-word
    records (584 bytes) takes 256 words an entry in the row-major tiling the attention kernel
    gathers from."""
    out = {}
    for (path, leaf), fmt in zip(jax.tree_util.tree_flatten_with_path(cache)[0], jax.tree.leaves(formats)):
        shape = leaf.sharding.shard_shape(leaf.shape)
        out["/".join(k.key for k in path)] = laid_out_bytes(shape, leaf.dtype, fmt.layout) / (
            math.prod(shape) * leaf.dtype.itemsize)
    return out


def compile_step(s: Setup, max_len: int, tokens: int) -> Compiled:
    """Compiles `step` for [batch, tokens] ids at max_len (tokens 1: the decode step; the cache
    donated, logits of each row's last token, as generate jits it)."""
    cache = abstract_cache(s.cfg, s.batch, max_len, s.mesh, s.layout, s.kv_cache_dtype)
    rows = NamedSharding(s.mesh, s.layout.spec((sharding.BATCH, None), s.mesh))
    ids = jax.ShapeDtypeStruct((s.batch, tokens), jnp.int32, sharding=rows)
    jitted = jax.jit(step, static_argnums=(3, 4), donate_argnums=(1,))
    # The model's per-device code looks up the mesh it runs on (sharding.active); an abstract
    # mesh suffices to trace, and set_mesh would make eager ops run on compile-only devices.
    try:
        with jax.sharding.use_abstract_mesh(s.mesh.abstract_mesh):
            result = aot.compile_for(s.target, jitted, s.params, cache, ids, s.cfg, True, mesh=s.mesh)
    except Exception as e:  # noqa: BLE001  (the compiler's out-of-memory verdict is an answer, not a failure)
        if "RESOURCE_EXHAUSTED" in str(e) or "Ran out of memory" in str(e):
            return Compiled(None, None, str(e).strip().splitlines()[0][:300])
        raise
    platform = aot.target(s.target).platform
    return Compiled(result.memory, program_cost(result.compiled.as_text(), EXCHANGE_ROUNDS,
                                                branch_shares(s.cfg), platform, unchosen_expert_bytes(s, tokens),
                                                routed_flop_share(s, tokens, platform)),
                    cache_padding=layout_padding(cache, result.compiled.input_formats[0][1]))


def memory_need(c: Compiled) -> int | None:
    """Bytes a program needs on a device besides its arguments: its temporaries, the outputs that
    do not alias a donated input, and its code."""
    m = c.memory
    if m is None:
        return None
    return m["temp_bytes"] + m["output_bytes"] - m["alias_bytes"] + m["generated_code_bytes"]


# ---- cost with loops counted -----------------------------------------------------------------

_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) \(.*\{$")
_WHILE = re.compile(r"condition=%([\w.\-]+), body=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRUE_FALSE = re.compile(r"true_computation=%([\w.\-]+), false_computation=%([\w.\-]+)")
_CALL = re.compile(r" call\(.*to_apply=%([\w.\-]+)")
_CALLS = re.compile(r"(?:calls|to_apply)=%([\w.\-]+)")
_NAME = re.compile(r"%([\w.\-]+)")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z\-]+)\((.*)$")
_INT_CONSTANT = re.compile(r"s32\[\]\S* constant\((\d+)\)")
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_DECLARED = re.compile(r'"cost_estimate":\{"flops":"(\d+)","transcendentals":"\d+","bytes_accessed":"(\d+)"')
_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|f8e4m3fn|f8e5m2|bf16|f16|f32|f64)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2,
          "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
ATTENTION_KERNEL = "dsv4_sparse_attention"
# the routed experts' kernels by name (their op_name's, `aot.kernel_name`: a kernel's line also
# names its operands, another kernel's output among them), with the expert weights a call reads
# (`unchosen_bytes` is one's)
GROUPED_KERNELS = {grouped_matmul_tpu.NAME: 1, grouped_matmul_gpu.NAME: 1, grouped_matmul_tpu.SWIGLU_NAME: 2,
                   grouped_matmul_gpu.SWIGLU_NAME: 2}
KERNEL_CALLS = sum(aot.KERNEL_CUSTOM_CALLS.values(), ())
# the kernels whose declared flops are FP8 products
FP8_KERNELS = (fp8_activations_gpu.KERNEL_NAME, fp8_activations_tpu.KERNEL_NAME)


# bytes one device sends per operand byte, by the collective's opcode (synchronous or -start) and
# its group size n (`_Module.collective_bytes`)
_COLLECTIVES = {}
for _op, _share in (("all-gather", lambda n: n - 1), ("reduce-scatter", lambda n: (n - 1) / n),
                    ("all-to-all", lambda n: (n - 1) / n), ("all-reduce", lambda n: 2 * (n - 1) / n),
                    ("collective-permute", lambda n: 1.0), ("ragged-all-to-all", lambda n: (n - 1) / n)):
    _COLLECTIVES[_op] = _COLLECTIVES[_op + "-start"] = _share
_GROUPS_LISTED = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[[\d,]*?(\d+)\]<=")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}")


def _group_size(line: str) -> int:
    """How many devices a collective's groups hold: its replica_groups listed ({{0,1,2,3},...}),
    as an iota ([groups,size]<=[n]) or as mesh axes (mesh['axis_0'=2,'axis_1'=4] {'axis_0'},
    perhaps with device_ids between)."""
    m = _GROUPS_LISTED.search(line)
    if m:
        return len(m.group(1).split(","))
    m = _GROUPS_IOTA.search(line)
    if m:
        return int(m.group(1))
    m = _GROUPS_MESH.search(line)
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2)))
    raise ValueError(f"a collective without replica groups dsv4-plan can read: {line.strip()[:200]}")


def _shape_bytes(text: str) -> int:
    return sum(_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in _SHAPE.findall(text))


def _dims(type_text: str) -> tuple[int, ...]:
    """The dimensions of an array type (`f8e4m3fn[256,4096]{1,0}`); () for anything else."""
    m = _SHAPE.search(type_text)
    return tuple(int(d) for d in m.group(2).split(",") if d) if m else ()


def _contracted(line: str, op: str, lhs: tuple[int, ...], rhs: tuple[int, ...]) -> int:
    """How many products each output element of a dot or convolution sums: a dot's contracting
    dims of its lhs; a convolution's lhs feature dim ("f" in dim_labels) times its window."""
    if op == "dot":
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
        return math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if m else 1
    labels = re.search(r"dim_labels=(\w+)_(\w+)->", line)
    if not labels:
        return 1
    lhs_labels, rhs_labels = labels.groups()
    window = math.prod(rhs[i] for i, c in enumerate(rhs_labels) if c.isdigit())
    return lhs[lhs_labels.index("f")] * window


class _Module:
    """An optimized HLO module's text, split into computations, and XLA's cost analysis of any
    of them run as the entry."""

    def __init__(self, text: str):
        lines = text.splitlines()
        partitions = re.search(r"num_partitions=(\d+)", lines[0])
        self.header = "HloModule part" + (f", num_partitions={partitions.group(1)}" if partitions else "")
        self.comps: dict[str, list[str]] = {}
        current = None
        for line in lines[1:]:
            m = _HEADER.match(line)
            if m:
                current = m.group(2)
                self.comps[current] = [line]
                if m.group(1):
                    self.entry = current
            elif current is not None:
                self.comps[current].append(line)
                if line == "}":
                    current = None

    @functools.cache
    def xla(self, comp: str) -> np.ndarray:
        """[flops, bytes accessed, collective bytes, FP8 flops] of computation `comp`: the first
        two by XLA's HloCostAnalysis, which counts a while loop's body once and a conditional's
        costliest branch, the third (`collective_bytes`) and the fourth (`fp8_product_flops`:
        XLA's own products of two FP8 operands; a kernel's are its declared ones) counted the
        same way."""
        from jax._src.lib import _jax  # the HLO cost analysis has no public entry point
        from jaxlib import _hlo

        parts = [self.header]
        for name, body in self.comps.items():
            first = body[0].removeprefix("ENTRY ")
            parts.append("\n".join([("ENTRY " if name == comp else "") + first] + body[1:]))
        # (the text's stack frame ids point into a table the text does not carry)
        module = _hlo.hlo_module_from_text(re.sub(r" stack_frame_id=\d+", "", "\n\n".join(parts)))
        cost = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
        return np.array([max(float(cost.get("flops", 0)), 0.0), max(float(cost.get("bytes accessed", 0)), 0.0),
                         self.collective_bytes(comp), self.fp8_product_flops(comp)])

    @functools.cache
    def types(self, comp: str) -> dict[str, str]:
        """Each instruction's result type in computation `comp` (`f8e4m3fn[256,4096]{1,0}`), by name."""
        out = {}
        for line in self.comps[comp][1:]:
            m = _INSTRUCTION.match(line)
            if m:
                out[m.group(1)] = m.group(2)
        return out

    @functools.cache
    def _total(self, comp: str, own: str) -> float:
        """The sum over computation `comp`'s instructions of getattr(self, own)(comp, match), where
        that is not None, and else of the `_total` of the computations an instruction calls: a
        while body once and a conditional's costliest branch, as `xla` counts."""
        total = 0.0
        for line in self.comps[comp][1:]:
            m = _INSTRUCTION.match(line)
            figure = getattr(self, own)(comp, m) if m else None
            if figure is not None:
                total += figure
                continue
            b = _BRANCHES.search(line) or _TRUE_FALSE.search(line)
            if b and " conditional(" in line:
                names = ([x.strip().lstrip("%") for x in b.group(1).split(",")] if b.re is _BRANCHES
                         else list(b.groups()))
                total += max(self._total(n, own) for n in names)
                continue
            w = _WHILE.search(line)
            called = [w.group(2)] if w and " while(" in line else _CALLS.findall(line)
            total += sum(self._total(c, own) for c in called if c in self.comps)
        return total

    def collective_bytes(self, comp: str) -> float:
        """The bytes one device sends in the collectives of computation `comp` (and of those it
        calls, as `_total` counts): with n devices in a group and b the bytes of the operands, an
        all-gather sends (n - 1) b, a reduce-scatter and an all-to-all (n - 1) / n b, an all-reduce
        2 (n - 1) / n b, a collective-permute b, and a ragged all-to-all (n - 1) / n of the smaller
        of its operand and its output buffer (its actual sizes are data: when each row goes to any
        device alike, a device receives as many rows as it sends, (n - 1) / n of them from other
        devices, and a buffer sized for the most it could receive is mostly not sent)."""
        return self._total(comp, "_collective")

    def _collective(self, comp: str, m: re.Match) -> float | None:
        if m.group(3) not in _COLLECTIVES:
            return None
        types = self.types(comp)
        operands = [_shape_bytes(types.get(o, "")) for o in _NAME.findall(m.group(4).split(")")[0])]
        # a ragged all-to-all's operands: the rows to send, the output buffer, the sizes
        b = min(operands[:2]) if m.group(3).startswith("ragged") else sum(operands)
        permute = m.group(3).startswith("collective-permute")  # (pairs, not groups)
        return _COLLECTIVES[m.group(3)](1 if permute else _group_size(m.group(0))) * b

    def fp8_product_flops(self, comp: str) -> float:
        """The flops of the products (dots, and convolutions as TPU writes them) of computation
        `comp` and those it calls (as `_total` counts) whose operands are both FP8: the
        FP8-activation mode's block products on TPU, which v7x's MXU runs at its FP8 rate. Each is
        2 x its output's elements x its contracted length."""
        return self._total(comp, "_fp8_product")

    def _fp8_product(self, comp: str, m: re.Match) -> float | None:
        if m.group(3) not in ("dot", "convolution"):
            return None
        types = self.types(comp)
        operands = [types.get(o, "") for o in _NAME.findall(m.group(4).split(")")[0])[:2]]
        dims = [_dims(t) for t in operands]
        if not (all(t.startswith("f8") for t in operands) and all(dims)):
            return 0.0
        return 2.0 * math.prod(_dims(m.group(2))) * _contracted(m.group(0), m.group(3), *dims)

    def reaches(self, comp: str, needle: str) -> bool:
        """Whether computation `comp`, or any computation it names (fusions, loops, branches,
        calls), holds `needle`."""
        seen, todo = set(), [comp]
        while todo:
            c = todo.pop()
            if c in seen:
                continue
            seen.add(c)
            for line in self.comps[c][1:]:
                if needle in line:
                    return True
                todo += [n for n in _NAME.findall(line) if n in self.comps]
        return False

    def trips(self, line: str, condition: str) -> int | None:
        """A while loop's trip count: the compiler's known_trip_count, else the one integer
        constant its condition compares the counter with (scans and fori_loops count from 0);
        None when the bound is not a constant (a loop over data-dependent blocks)."""
        m = _KNOWN_TRIPS.search(line)
        if m:
            return int(m.group(1))
        consts = set()
        for c in [condition] + [f for l in self.comps[condition] for f in _CALLS.findall(l)]:
            for l in self.comps.get(c, []):
                consts.update(int(x) for x in _INT_CONSTANT.findall(l))
        return consts.pop() if len(consts) == 1 else None


def _fusion_body(mod: "_Module", line: str) -> list[str]:
    """The instruction lines of the computation a fusion instruction `line` calls (none for
    another instruction)."""
    called = _CALLS.search(line)
    if " fusion(" not in line or not called or called.group(1) not in mod.comps:
        return []
    return mod.comps[called.group(1)][1:]


def _scatter_overcount(mod: "_Module", line: str) -> float:
    """For a GPU fusion whose root is an in-place scatter: the bytes XLA's HloCostAnalysis counts
    beyond the updates (it counts the whole scattered operand read and written: a cache stack of
    1.6 GB for a few rows; nothing beyond them when the updates are the larger, a scatter-add of
    many rows into few), else 0."""
    shapes, root = {}, None
    for l in _fusion_body(mod, line):
        m = _INSTRUCTION.match(l)
        if m:
            shapes[m.group(1)] = _shape_bytes(m.group(2))
            if l.lstrip().startswith("ROOT ") and m.group(3) == "scatter":
                root = m
    if root is None:
        return 0.0
    operands = _NAME.findall(root.group(4).split("), ")[0])
    return 2.0 * max(0, shapes[root.group(1)] - shapes.get(operands[-1], 0))


def _gather_overcount(mod: "_Module", line: str) -> float:
    """For a GPU fusion that gathers rows out of one of its parameters (the decode step's reads
    of its cache pools, from the stack of every layer's): the bytes XLA's HloCostAnalysis counts
    beyond the rows gathered (it counts a parameter read whole unless only sliced: a stack of
    pools for a few hundred rows), else 0."""
    shapes, users, params = {}, {}, []
    for l in _fusion_body(mod, line):
        m = _INSTRUCTION.match(l)
        if not m:
            continue
        name, op = m.group(1), m.group(3)
        shapes[name] = _shape_bytes(m.group(2))
        operands = _NAME.findall(m.group(4).split("), ")[0])
        for i, o in enumerate(operands):
            users.setdefault(o, []).append((name, op, i))
        if op == "parameter":
            params.append(name)

    def rows(name):  # the bytes the gathers reading `name` (through bitcasts) produce; None if any other use
        total = 0
        for user, op, i in users.get(name, []):
            if op == "bitcast":
                sub = rows(user)
                if sub is None:
                    return None
                total += sub
            elif op == "gather" and i == 0:
                total += shapes[user]
            else:
                return None
        return total

    over = 0.0
    for p in params:
        r = rows(p)
        if r:
            over += max(0, shapes[p] - r)
    return over


def program_cost(text: str, dynamic_trips: float, layer_weights: dict | None = None, platform: str = "tpu",
                 unchosen_bytes: float = 0.0, routed_flop_share=None) -> dict:
    """Flops and bytes accessed per device of a compiled program (its optimized HLO `text`), by
    XLA's HloCostAnalysis of each computation, combined so that every loop counts as often as
    it runs: a while body times its trip count (`dynamic_trips`, the caller's expectation, for a
    loop whose bound is data: the rounds of the routed experts' ragged exchange); the layer switch (the conditional
    whose every branch calls the sparse-attention kernel) weights each branch by the share of
    layers that take it (`layer_weights`: branch index -> share, from `branch_shares`); any
    other conditional counts its costliest branch, as XLA does. A Mosaic kernel (a custom call,
    which XLA counts as nothing) adds its declared cost (its pl.CostEstimate: on TPU in its
    backend config, on GPU in its op_name, `pallas_kernels._dispatch.declared_cost_scope`), or,
    where none is declared (the Mosaic GPU kernels), its operands' and result's bytes and no
    flops. The routed experts' grouped kernels (their calls under `moe.ROUTED_SCOPE`) declare the
    bytes of as many experts as could be chosen; `unchosen_bytes`, the caller's expectation of
    those no row chooses of one expert weight (`unchosen_expert_bytes`), comes off each such call
    once per weight it reads (`GROUPED_KERNELS`). They also declare the flops of every step
    their grid could compute, over every row of their buffer, while they compute only the steps
    of the rows that arrive: `routed_flop_share(m, n, weights)`, the caller's expectation of that
    share for a call with output `[m, n]` reading `weights` expert weights (`routed_flop_share`),
    scales each such call's flops (None:
    as declared). On GPU an in-place
    scatter fusion (the cache writes) counts its updates, not its whole operand
    (`_scatter_overcount`), and a fusion that gathers rows out of a parameter those rows, not the
    whole parameter (`_gather_overcount`; a TPU gather fusion is counted by its rows already).
    Collectives count the bytes a device sends in them (`_Module.collective_bytes`), loops and
    branches as above.
    Returns {"flops", "fp8_flops" (those of the FP8-activation kernels, which multiply FP8 on
    Hopper's tensor cores and v7x's MXU, and of XLA's own products of two FP8 operands),
    "bytes_accessed", "collective_bytes", "xla_flops", "xla_bytes_accessed" (XLA's own figures,
    loops counted once), "loops": [{"trips", "assumed"}...]}."""
    mod = _Module(text)
    loops = []

    @functools.cache
    def total(comp: str) -> np.ndarray:
        out = mod.xla(comp).copy()
        for line in mod.comps[comp]:
            if "custom-call(" in line and any(t in line for t in KERNEL_CALLS):
                declared = _DECLARED.search(line) or DECLARED_COST.search(line)
                if declared:
                    flops = float(declared.group(1))
                    out += [flops, float(declared.group(2)), 0.0, flops if any(k in line for k in FP8_KERNELS) else 0.0]
                    op_name = _OP_NAME.search(line)
                    weights = GROUPED_KERNELS.get(aot.kernel_name(op_name.group(1)) if op_name else "", 0)
                    if f"/{ROUTED_SCOPE}/" in line and weights:
                        out[1] -= weights * unchosen_bytes
                        if routed_flop_share is not None:
                            # (an output in pieces `[m, P, n/P]`: its rows whole)
                            m, *pieces = _dims(line.split(" custom-call(")[0].split(" = ", 1)[1])
                            n = math.prod(pieces)
                            out[0] -= flops * (1.0 - routed_flop_share(m, n, weights))
                else:
                    out[1] += _shape_bytes(line.split("custom_call_target=")[0])
                continue
            w = _WHILE.search(line)
            if w and " while(" in line:
                condition, body = w.groups()
                n = mod.trips(line, condition)
                loops.append({"trips": dynamic_trips if n is None else n, "assumed": n is None})
                out += (dynamic_trips if n is None else n) * total(body) - mod.xla(body)
                continue
            b = _BRANCHES.search(line) or _TRUE_FALSE.search(line)
            if b and " conditional(" in line:
                names = ([x.strip().lstrip("%") for x in b.group(1).split(",")] if b.re is _BRANCHES
                         else list(b.groups()))
                xla_max = np.max([mod.xla(n) for n in names], axis=0)
                totals = [total(n) for n in names]
                if layer_weights is not None and all(mod.reaches(n, ATTENTION_KERNEL) for n in names):
                    out += sum(layer_weights.get(i, 0.0) * t for i, t in enumerate(totals)) - xla_max
                else:
                    out += max(totals, key=lambda t: t[1]) - xla_max
                continue
            c = _CALL.search(line)
            if c:
                out += total(c.group(1)) - mod.xla(c.group(1))
            elif platform == "cuda":
                out[1] -= _scatter_overcount(mod, line) + _gather_overcount(mod, line)
        return out

    flops, nbytes, collective, fp8_flops = total(mod.entry)
    xla_flops, xla_bytes, _, _ = mod.xla(mod.entry)
    return {"flops": float(flops), "fp8_flops": float(fp8_flops), "bytes_accessed": float(nbytes),
            "collective_bytes": float(collective), "xla_flops": float(xla_flops),
            "xla_bytes_accessed": float(xla_bytes), "loops": loops}


def branch_shares(cfg: ModelConfig) -> dict[int, float]:
    """The share of layers that take each branch of the layer switch (model.LayerSchedule)."""
    from dsv4_jax.model.deepseek_v4 import LayerSchedule

    sched = LayerSchedule.of(cfg)
    return {i: float(np.mean(sched.branch == i)) for i in range(len(sched.branches))}


def local_tokens(s: Setup, tokens: int) -> int:
    """The tokens of one device's own sequences per step of `tokens` tokens per sequence."""
    return s.batch // s.shards(sharding.BATCH) * tokens


def expert_tokens(s: Setup, tokens: int) -> int:
    """The tokens whose (token, expert) pairs one device's routed experts see per step of `tokens`
    tokens per sequence: its own sequences' tokens, times the devices it exchanges tokens with
    (those of its expert axes that split the batch: moe.routed_experts_on_mesh; the ragged
    all-to-all sends it pairs from the same devices the all-gather gathers from)."""
    ep_axes = set(s.layout.axes(sharding.EXPERTS, s.mesh)) | set(s.layout.axes(sharding.EXPERT_MLP, s.mesh))
    gathered = math.prod(s.mesh.shape[a] for a in s.layout.axes(sharding.BATCH, s.mesh) if a in ep_axes)
    return local_tokens(s, tokens) * gathered


def chosen_share(cfg: ModelConfig, token_count: int) -> float:
    """The share of a layer's experts that at least one of `token_count` tokens chooses, under
    uniform routing: 1 - (1 - k/E)^G."""
    return 1 - (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** token_count


# The rounds the routed experts' ragged exchange is expected to run per layer (moe._exchanged):
# one, since a round holds EXCHANGE_CAPACITY times the rows a device receives on average.
EXCHANGE_ROUNDS = 1.0


def unchosen_expert_bytes(s: Setup, tokens: int) -> float:
    """The stored bytes of one expert weight (w1, w2 or w3: equal sizes) of one layer, held by a
    device, times how many of the experts its grouped-matmul kernel declares as read (one per
    row, at most all its own: `grouped_matmul_tpu`; its rows: the pairs of every token it
    gathers, or a round's buffer of the ragged exchange) are expected to be chosen by no row under
    uniform routing (as `min_bytes` counts the chosen ones)."""
    cfg = s.cfg
    local = cfg.n_routed_experts // s.shards(sharding.EXPERTS)
    per_expert = device_bytes(s.params["layers"]["ffn"]["w1"]) / (cfg.num_layers * local)
    token_count = expert_tokens(s, tokens)
    rows = token_count * cfg.num_experts_per_tok
    if expert_exchange_of(s.cfg, s.mesh) == "ragged_all_to_all":
        rows = exchange_rows(local_tokens(s, tokens), cfg.num_experts_per_tok, s.shards(sharding.EXPERTS))
    declared = min(local, rows)
    return max(declared - local * chosen_share(cfg, token_count), 0.0) * per_expert


def _above(mean: float, var: float, x: float) -> float:
    """P(X > x) for an integer X of `mean` and `var`, in the normal approximation."""
    if var <= 0:
        return float(mean > x)
    return 0.5 * math.erfc((x + 0.5 - mean) / math.sqrt(2 * var))


def routed_flop_share(s: Setup, tokens: int, platform: str):
    """(m, n, weights) -> the share of the declared flops of a routed-experts grouped-matmul call
    with output `[m, n]` reading `weights` expert weights (2: the fused first half, 1: w2) that
    its computing steps are expected to run, under uniform routing. The
    kernel declares a product of TM rows for every step its grid holds: a row tile of its M rows
    each, plus one for each of the min(E, M) groups that could start inside a tile
    (`grouped_matmul_tpu.max_steps`, `grouped_matmul_gpu.max_steps`), TM its own choice for the
    call's shapes. It multiplies only on the steps of the groups with rows; the rest of its
    buffer (a round of the ragged exchange holds EXCHANGE_CAPACITY times the rows a device
    receives on average; the gathered tokens' pairs of other devices' experts sort past every
    group) is zeroed. Of the G tokens whose pairs a device's E_l experts see, each sends it the
    pairs of its k choices that fall among them; the groups with rows are E_l `chosen_share`(G).
    On TPU a tile shared by two groups is a step of each: those plus one step for each tile
    boundary inside the rows received, R; on GPU each group's tiles start at its first row:
    ceil(r / TM) steps for a group of r rows. R and r are counted in the normal approximation of
    their sums over the G tokens."""
    cfg = s.cfg
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    local = E // s.shards(sharding.EXPERTS)
    G = expert_tokens(s, tokens)
    p = local / E
    # R: per token, its k distinct choices falling among the E_l (hypergeometric); r: one expert's
    received = (G * k * p, G * k * p * (1 - p) * (E - k) / max(E - 1, 1))
    one = (G * k / E, G * (k / E) * (1 - k / E))
    chosen = local * chosen_share(cfg, G)
    # each call's contracted width K, by the expert weights it reads: the first half's two (w1 and
    # w3 [.., N, K], `grouped_swiglu`, whose tiles hold both), w2's one ([.., K, N])
    widths = {}
    exchanged = expert_exchange_of(cfg, s.mesh) == "ragged_all_to_all"
    for name in ("w1", "w2"):
        w = s.params["layers"]["ffn"][name]
        values = w.values if isinstance(w, QuantizedWeight) else w
        n, kv = values.sharding.shard_shape(values.shape)[-2:]
        fmt = w.fmt if isinstance(w, QuantizedWeight) else None
        # (x reaches the kernel in the weight's compute dtype: moe._expert_rows; w2's output goes
        # back through the ragged exchange in its pieces)
        pieces = exchange_pieces(n, w.dtype) if name == "w2" and exchanged else 1
        widths[2 if name == "w1" else 1] = (2 * kv if fmt == "fp4" else kv, fmt, jnp.dtype(w.dtype).itemsize,
                                            values.dtype.itemsize, pieces)

    def share(m: int, n: int, weights: int) -> float:
        k_in, fmt, x_itemsize, w_itemsize, pieces = widths[weights]
        if platform == "tpu":
            tm = (grouped_matmul_tpu.tiles(m, n, k_in, local, fmt, x_itemsize, w_itemsize, weights)[0] if weights > 1
                  else grouped_matmul_tpu.output_tiles(m, n, k_in, local, fmt, x_itemsize, w_itemsize, pieces)[0])
            declared = grouped_matmul_tpu.max_steps(-(-m // tm), m, local)
            steps = chosen + sum(_above(*received, b * tm) for b in range(1, -(-m // tm)))
        else:
            tm = grouped_matmul_gpu.tiles(m, local, fmt).tm
            declared = grouped_matmul_gpu.max_steps(m, local, tm) - 1
            steps = chosen + local * sum(_above(*one, b * tm) for b in range(1, -(-m // tm)))
        return min(1.0, steps / declared)

    return share


# ---- the bytes a step cannot avoid --------------------------------------------------------------

def min_bytes(s: Setup, max_len: int, tokens: int) -> dict:
    """The bytes one device must read for one step of `tokens` tokens per sequence whose last
    token sits at position max_len - 1 (the cache full: the most a step reads), by part:

      weights   every parameter shard the device holds, read once in its stored format, except
                the embedding and tid2eid, of which only the chunk's tokens' rows;
      experts   the routed experts' shards the device holds that its tokens choose, once each:
                under uniform routing a layer's local expert is chosen by at least one of the G
                tokens the device runs experts for with probability 1 - (1 - k/E)^G;
      cache     what attention must read per sequence and layer: the window ring (W rows of Dh);
                ratio-4 layers: the indexer keys of every visible entry (it scores them all) and
                the top-k selected compressed rows (decode; a prefill chunk: every visible
                compressed row, the union of its queries' selections); ratio-128 layers: every
                visible compressed row. Compressor states (a step reads and writes a few rows; the
                ratio-4 state is read once per block) and every write are not counted.
    """
    cfg = s.cfg
    rows = s.batch // s.shards(sharding.BATCH)  # sequences this device attends for
    local_tokens = rows * tokens
    routed = {("layers", "ffn", w) for w in ("w1", "w2", "w3")}
    weights = experts = 0.0
    flat = jax.tree_util.tree_flatten_with_path(s.params, is_leaf=lambda x: isinstance(x, QuantizedWeight))[0]
    for path, leaf in flat:
        keys = tuple(k.key for k in path)
        held = device_bytes(leaf)
        if keys in routed:
            experts += held * chosen_share(cfg, expert_tokens(s, tokens))
        elif keys == ("embed",):
            weights += local_tokens * cfg.hidden_size * leaf.dtype.itemsize
        elif keys == ("tid2eid",):
            weights += local_tokens * cfg.num_hash_layers * cfg.num_experts_per_tok * leaf.dtype.itemsize
        else:
            weights += held
    Dh, dI, two = cfg.head_dim, cfg.index_head_dim, 2  # bf16 rings and keys
    entry = cache_spec(cfg, 1, 1, jnp.bfloat16, kv_cache_dtype=s.kv_cache_dtype)
    entry = {k.name: math.prod(entry[k.name]["pool"][0][3:]) * jnp.dtype(entry[k.name]["pool"][1]).itemsize
             for k in COMPRESSED if k.name in entry}  # bytes of one stored compressed entry
    per_row = cfg.num_layers * cfg.sliding_window * Dh * two
    for kind in COMPRESSED:  # the entries each layer reads: an indexer's top-k when decoding, and its keys
        n, p = len(cfg.layers_of_ratio(kind.ratio)), max_len // kind.ratio
        read = min(cfg.index_topk, p) if kind.indexer and tokens == 1 else p
        per_row += n * (read * entry.get(kind.name, 0) + (p * dI * two if kind.indexer else 0))
    cache = rows * per_row
    return {"total": weights + experts + cache, "weights": weights, "experts": experts, "cache": cache}


# ---- the plan ---------------------------------------------------------------------------------

def _step_figures(s: Setup, c: Compiled, need: dict, tokens_per_step: int) -> dict:
    """A compiled step's cost, its minimum and the roofline they imply on the target's device."""
    dev = aot.target(s.target).spec
    out = {"flops": None, "bytes_accessed": None, "min_bytes": need["total"], "min_bytes_parts": need}
    if c.cost is None:
        return out

    fp8 = c.cost["fp8_flops"]  # on the FP8 tensor cores, the rest at the bf16 rate
    compute_s = (c.cost["flops"] - fp8) / dev.peak_bf16_flops + fp8 / (dev.peak_fp8_flops or dev.peak_bf16_flops)

    def roofline(nbytes):
        seconds = max(nbytes / dev.hbm_bandwidth, compute_s)
        return seconds * 1e3, tokens_per_step / seconds

    ms, tps = roofline(c.cost["bytes_accessed"])
    ms_min, tps_min = roofline(need["total"])
    out.update(flops=c.cost["flops"], fp8_flops=fp8, bytes_accessed=c.cost["bytes_accessed"],
               collective_bytes=c.cost["collective_bytes"],
               bytes_ratio=c.cost["bytes_accessed"] / need["total"], roofline_ms=ms, tokens_per_s=tps,
               bound="memory" if c.cost["bytes_accessed"] / dev.hbm_bandwidth >= compute_s else "compute",
               roofline_ms_at_min_bytes=ms_min, tokens_per_s_at_min_bytes=tps_min,
               xla_cost_loops_once={"flops": c.cost["xla_flops"], "bytes_accessed": c.cost["xla_bytes_accessed"]},
               loops=_loop_summary(c.cost["loops"]))
    return out


def _loop_summary(loops: list[dict]) -> list[str]:
    counts: dict[str, int] = {}
    for lp in loops:
        key = f"{lp['trips']:g} trips" + (" (assumed: expert exchange rounds)" if lp["assumed"] else "")
        counts[key] = counts.get(key, 0) + 1
    return [f"{n} x {k}" for k, n in counts.items()]


def memory_plan(s: Setup, max_len: int, decode: Compiled, prefill: Compiled) -> dict:
    """Per-device bytes: the parameter and cache shards, the programs' needs (the larger: they do
    not run at once), and whether it all fits the device's memory."""
    params = device_bytes(s.params)
    cache = abstract_cache(s.cfg, s.batch, max_len, s.mesh, s.layout, s.kv_cache_dtype)
    logical = device_bytes(cache)
    padding = decode.cache_padding or {}  # none when the compiler refused the program
    cache = round(sum(device_bytes(leaf) * padding.get("/".join(k.key for k in path), 1.0)
                      for path, leaf in jax.tree_util.tree_flatten_with_path(cache)[0]))
    device = aot.target(s.target).spec.memory_bytes
    needs = [memory_need(c) for c in (decode, prefill)]
    out = {"parameter_bytes": params, "cache_bytes": cache, "cache_shape_bytes": logical}
    if None in needs:  # the compiler itself found a program too big for the device
        failed = [c.error for c in (decode, prefill) if c.memory is None][0]
        out.update(temp_bytes=None, other_bytes=None, total_bytes=None, memory_bytes=device, fits=False,
                   compiler=failed)
        return out
    programs = [c.memory for c in (decode, prefill)]
    big = max(range(2), key=lambda i: needs[i])
    temp = programs[big]["temp_bytes"]
    total = params + cache + needs[big]
    out.update(temp_bytes=temp, other_bytes=needs[big] - temp, total_bytes=total, memory_bytes=device,
               fits=total <= device)
    return out


def sequence_bytes(cfg: ModelConfig, seq_len: int, kv_cache_dtype: str, padding: dict | None = None) -> dict:
    """Bytes of one sequence of seq_len tokens on each device holding it (its rows' rings and
    compressor states, and its blocks of the pools, which the layouts keep whole on the devices of
    its rows): {"block_bytes", "bytes_per_sequence"}; with `padding` (`layout_padding`), each
    leaf's bytes as the compiled program lays it out, else its shape's."""
    bs = default_block_size(cfg)
    blocks = blocks_per_row(seq_len, bs)
    row = cache_spec(cfg, 1, seq_len, jnp.bfloat16, kv_cache_dtype=kv_cache_dtype)
    block = cache_spec(cfg, 1, bs, jnp.bfloat16, block_size=bs, num_blocks=1, kv_cache_dtype=kv_cache_dtype)
    parts = {"block_bytes": 0.0, "bytes_per_sequence": 0.0}
    for path, (shape, dtype) in jax.tree_util.tree_flatten_with_path(row, is_leaf=lambda x: isinstance(x, tuple))[0]:
        name = "/".join(k.key for k in path)
        factor = 1.0 if padding is None else padding.get(name, 1.0)
        if path[-1].key == "pool":  # the sequence's blocks
            nbytes = math.prod(block[path[0].key]["pool"][0]) * jnp.dtype(dtype).itemsize * factor
            parts["block_bytes"] += nbytes
            parts["bytes_per_sequence"] += blocks * nbytes
        else:
            parts["bytes_per_sequence"] += math.prod(shape) * jnp.dtype(dtype).itemsize * factor
    return {k: round(v) for k, v in parts.items()}


def cache_plan(s: Setup, seq_len: int, per_device: dict, padding: dict) -> dict:
    """The `cache` section of the plan (module doc); padding: the decode program's
    `layout_padding`."""
    mine, bf16 = sequence_bytes(s.cfg, seq_len, s.kv_cache_dtype), sequence_bytes(s.cfg, seq_len, "auto")
    laid_out = sequence_bytes(s.cfg, seq_len, s.kv_cache_dtype, padding)
    out = {"kv_cache_dtype": s.kv_cache_dtype, "seq_len": seq_len, **mine,
           "bf16_bytes_per_sequence": bf16["bytes_per_sequence"],
           "laid_out_block_bytes": laid_out["block_bytes"],
           "laid_out_bytes_per_sequence": laid_out["bytes_per_sequence"]}
    if per_device["total_bytes"] is None:
        return dict(out, free_bytes=None, sequences_per_device=None, sequences=None)
    free = per_device["memory_bytes"] - per_device["total_bytes"] + per_device["cache_bytes"]
    per = max(free, 0) // laid_out["bytes_per_sequence"]
    return dict(out, free_bytes=free, sequences_per_device=per, sequences=per * s.shards(sharding.BATCH))


def total_bytes_at(s: Setup, max_len: int, prefill_chunk: int) -> int | None:
    """The bytes a device needs at max_len: its parameter and cache shards and the larger of the
    two programs' needs (None: the compiler refused one as too big)."""
    need = 0
    for tokens in (1, min(prefill_chunk, max_len)):
        c = compile_step(s, max_len, tokens)
        if c.memory is None:
            return None
        need = max(need, memory_need(c))
    return device_bytes(s.params) + device_bytes(abstract_cache(s.cfg, s.batch, max_len, s.mesh, s.layout,
                                                                s.kv_cache_dtype)) + need


def find_max_context(s: Setup, prefill_chunk: int, known: dict[int, int | None]) -> dict:
    """The longest max_len (a multiple of CONTEXT_STEP, at most max_position_embeddings) at which
    the decode step and a prefill chunk both fit for the batch, derived from compiled programs:
    a device's bytes grow about linearly with max_len (the cache's pools, and temporaries sized
    by them), so a line through two compiled lengths predicts the longest that fits, and the
    prediction is compiled to check it (refitted through the new point, up to VERIFY times, when
    it does not fit). `known` maps lengths already compiled to their total bytes (None: refused
    by the compiler). Returns {"tokens", "verified", "compiles", "tried": {length: total bytes}}."""
    limit = aot.target(s.target).spec.memory_bytes
    top = max(CONTEXT_STEP, s.cfg.max_position_embeddings // CONTEXT_STEP * CONTEXT_STEP)
    seen = dict(known)
    compiles = 0

    def measure(length: int) -> None:
        nonlocal compiles
        if length not in seen:
            compiles += 2
            seen[length] = total_bytes_at(s, length, prefill_chunk)

    def ok(length: int) -> bool:
        return seen.get(length) is not None and seen[length] <= limit

    if device_bytes(s.params) > limit:  # the weights alone do not fit
        return {"tokens": 0, "verified": True, "compiles": 0, "tried": {}}
    first = next(iter(seen))
    for length in (4 * first, first // 2 // CONTEXT_STEP * CONTEXT_STEP, CONTEXT_STEP, 2 * CONTEXT_STEP):
        if len([n for n in seen if seen[n] is not None]) >= 2:
            break
        if CONTEXT_STEP <= length <= top:
            measure(length)
    tokens, verified = max((n for n in seen if ok(n)), default=0), False
    for _ in range(VERIFY):
        points = sorted((n, b) for n, b in seen.items() if b is not None)
        if len(points) < 2:
            break
        under = [p for p in points if p[1] <= limit]
        over = [p for p in points if p[1] > limit and (not under or p[0] > under[-1][0])]
        if under and over:  # the line through the bracket's ends
            (n0, b0), (n1, b1) = under[-1], over[0]
        else:  # the two lengths nearest the limit on the side the points lie
            (n0, b0), (n1, b1) = under[-2:] if under else over[:2]
        slope = (b1 - b0) / (n1 - n0)
        guess = top if slope <= 0 else int(n0 + (limit - b0) / slope) // CONTEXT_STEP * CONTEXT_STEP
        guess = min(max(guess, CONTEXT_STEP), top)
        if guess in seen and under and over:  # the line is not straight there: halve the bracket
            guess = (under[-1][0] + over[0][0]) // 2 // CONTEXT_STEP * CONTEXT_STEP
        if guess in seen:
            break
        measure(guess)
        if ok(guess):
            tokens, verified = max(tokens, guess), True
            if guess == top or guess + CONTEXT_STEP in seen:
                break
    return {"tokens": tokens, "verified": verified, "compiles": compiles,
            "tried": {str(n): seen[n] for n in sorted(seen)}}


def plan(model: str, target: str, layout: str | None = None, mesh_axes: dict[str, int] | None = None,
         batch: int | None = None, max_len: int = 8192, prefill_chunk: int = 512, weight_dtype: str = "native",
         search_context: bool = True, expert_exchange: str = "auto", fp8_activations: bool = False,
         kv_cache_dtype: str = "auto", seq_len: int | None = None) -> dict:
    """The plan's JSON object (see the module doc). batch None: one sequence per piece the layout
    splits sequences into."""
    if max_len < 1 or prefill_chunk < 1:
        raise PlanError(f"--max-len ({max_len}) and --prefill-chunk ({prefill_chunk}) must be positive")
    if prefill_chunk > max_len:
        raise PlanError(f"--prefill-chunk {prefill_chunk} exceeds --max-len {max_len}")
    if seq_len is not None and seq_len < 1:
        raise PlanError(f"--seq-len must be positive, got {seq_len}")
    s = setup(model, target, layout, mesh_axes, batch, weight_dtype, expert_exchange, fp8_activations,
              kv_cache_dtype)
    decode = compile_step(s, max_len, 1)
    prefill = compile_step(s, max_len, prefill_chunk)
    rows = s.batch
    dev = aot.target(target).spec
    out = {
        "model": model, "target": target, "device": dataclasses.asdict(dev),
        "mesh": dict(s.mesh.shape), "layout": s.layout.name,
        "expert_exchange": expert_exchange_of(s.cfg, s.mesh), "fp8_activations": fp8_activations,
        "batch": s.batch,
        "batch_per_device": s.batch // s.shards(sharding.BATCH), "max_len": max_len,
        "prefill_chunk": prefill_chunk, "weight_dtype": weight_dtype,
        "per_device": memory_plan(s, max_len, decode, prefill),
        "decode": _step_figures(s, decode, min_bytes(s, max_len, 1), rows),
        "prefill": _step_figures(s, prefill, min_bytes(s, max_len, prefill_chunk), rows * prefill_chunk),
    }
    out["cache"] = cache_plan(s, max_len if seq_len is None else seq_len, out["per_device"], decode.cache_padding)
    if search_context:
        pd = out["per_device"]
        search = find_max_context(s, prefill_chunk, {max_len: pd["total_bytes"]})
        out["max_context"] = search.pop("tokens")
        out["max_context_search"] = dict(search, method="a line through the total bytes of two compiled "
                                                        "lengths, its prediction compiled to check it")
    return out


# ---- the command line -----------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # bad input: one line, exit 1 (argparse's own is usage and exit 2)
        raise PlanError(message)


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="dsv4-plan", description="Compile a full-size DeepSeek-V4 for a TPU or GPU slice (no "
                                               "weights, no accelerator) and print what it needs, as JSON.")
    ap.add_argument("model", help=f"{', '.join(PRESETS)}, or a path to a config.json")
    ap.add_argument("--target", required=True, help=f"one of {', '.join(aot.TARGETS)}")
    ap.add_argument("--layout", help=f"a layout preset ({', '.join(sorted(sharding.PRESETS))}); default "
                                     f"{sharding.DEFAULT_LAYOUT}")
    ap.add_argument("--mesh", help="mesh axes, e.g. data=2,expert=4 (sizes multiply to the target's devices); "
                                   "default: every device on the expert axis")
    ap.add_argument("--batch", type=int, help="sequences (default: one per piece the layout splits them into)")
    ap.add_argument("--max-len", type=int, default=8192, help="cache length per sequence (default 8192)")
    ap.add_argument("--prefill-chunk", type=int, default=512, help="tokens per sequence in the prefill "
                                                                  "chunk compiled (default 512)")
    ap.add_argument("--weight-dtype", default="native", help="native (FP8/FP4 as stored; default) or bfloat16")
    ap.add_argument("--expert-exchange", choices=EXPERT_EXCHANGES, default="auto",
                    help="how expert parallelism moves tokens (default auto: moe.expert_exchange's rule)")
    ap.add_argument("--fp8-activations", action="store_true",
                    help="the FP8 linears with their activations quantized to FP8 (the FP8 tensor-core "
                         "kernel on CUDA; its flops at the device's FP8 peak)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="the compressed entries' storage, as dsv4-serve's: "
                                                             "auto (bf16; default) or fp8 (584-byte records)")
    ap.add_argument("--seq-len", type=int, help="sequence length the cache section counts (default --max-len)")
    ap.add_argument("--no-max-context", action="store_true", help="skip the max_context search (fewer compiles)")
    return ap


def main(argv=None) -> int:
    try:
        args = _parser().parse_args(argv)
        mesh_axes = sharding.parse_mesh(args.mesh) if args.mesh else None
        out = plan(args.model, args.target, args.layout, mesh_axes, args.batch, args.max_len, args.prefill_chunk,
                   args.weight_dtype, search_context=not args.no_max_context,
                   expert_exchange=args.expert_exchange, fp8_activations=args.fp8_activations,
                   kv_cache_dtype=args.kv_cache_dtype, seq_len=args.seq_len)
    except (PlanError, ValueError) as e:
        print(f"dsv4-plan: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 1
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
