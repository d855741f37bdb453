"""`python -m convert.stress --size-gb 2 [--dir D] [--dtypes bfloat16,native] [--experts E] [--keep]`

Builds a synthetic DeepSeek-V4 checkpoint in the official naming and published formats (FP8 e4m3
linears with 128x128 E8M0 scales, FP4 routed experts with per-32 E8M0 scales, BF16 / F32 / I64
elsewhere) with Flash's per-layer shapes (hidden 4096, 64 heads of 512, q/o LoRA 1024, 8 output
groups, indexer 64x128, expert width 2048, hc 4) but 4 layers ([0, 0, 4, 128], the first 3
hash-routed), a 16384-token vocabulary and as many routed experts as reach --size-gb on disk
(or --experts E). Then converts it once per --dtype in a child process (`python -m convert`)
and prints one JSON object: the source size, and per dtype the output bytes on disk, wall time,
throughput, the child's peak RSS (ru_maxrss), against the largest single layer's size (source
and output) and the RSS of a child that only imports the converter (`baseline_rss_bytes`).
Everything it wrote is deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np

from dsv4_jax.checkpoint import quant
from dsv4_jax.checkpoint.export_hf import official_config
from dsv4_jax.checkpoint.names import checkpoint_layout
from dsv4_jax.checkpoint.safetensors_io import write_safetensors
from dsv4_jax.model.config import ModelConfig, Yarn
from dsv4_jax.model.params import F32, INT, is_spec_leaf, param_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_FP8 = (".attn.wq_a.", ".attn.wq_b.", ".attn.wkv.", ".attn.wo_a.", ".attn.wo_b.", ".indexer.wq_b.",
        ".shared_experts.")
_F32_NAMES = ("attn_sink", "ape", "bias")


def flash_shaped(n_experts: int, num_layers: int = 4, vocab: int = 16384) -> ModelConfig:
    ratios = (0, 0, 4, 128, 4, 128, 4, 128)[:num_layers] if num_layers <= 8 else \
        (0, 0) + tuple(4 if i % 2 == 0 else 128 for i in range(num_layers - 2))
    return ModelConfig(
        vocab_size=vocab, hidden_size=4096, num_layers=num_layers, num_heads=64, head_dim=512, rope_head_dim=64,
        q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128, compress_ratios=ratios,
        hash_layers=tuple(i < 3 for i in range(num_layers)), index_n_heads=64, index_head_dim=128,
        index_topk=512, n_routed_experts=n_experts, num_experts_per_tok=min(6, n_experts),
        moe_intermediate_size=2048, routed_scaling_factor=1.5, swiglu_limit=10.0, hc_mult=4,
        hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0,
        yarn=Yarn(factor=16.0, original_max_position_embeddings=65536))


def _stored_form(name: str, shape: tuple, cls: str) -> dict[str, tuple[tuple, str]]:
    """name -> (shape, format) of the stored tensor(s) of one checkpoint tensor."""
    if cls == INT:
        return {name: (shape, "I64")}
    last = name.rsplit(".", 1)[-1]
    if ".ffn.experts." in name:
        out, inp = shape
        return {name: ((out, inp // 2), "FP4"), name[:-len(".weight")] + ".scale": ((out, -(-inp // 32)), "E8M0")}
    if name.endswith(".weight") and any(k in name for k in _FP8):
        return {name: (shape, "FP8"), name[:-len(".weight")] + ".scale": (quant.fp8_scale_shape(shape), "E8M0")}
    if last in _F32_NAMES or last.startswith("hc_") or name.startswith("hc_") or cls == F32 and "hc" in name:
        return {name: (shape, "F32")}
    return {name: (shape, "BF16")}


_BYTES = {"I64": 8, "FP4": 1, "E8M0": 1, "FP8": 1, "F32": 4, "BF16": 2}


def tensors_by_layer(cfg: ModelConfig) -> dict[str, dict[str, tuple[tuple, str]]]:
    """Shard ("top" or "layer-N") -> stored name -> (shape, format)."""
    spec = param_spec(cfg)
    out: dict[str, dict] = {}
    for name, (path, index) in checkpoint_layout(cfg).items():
        leaf = spec
        for k in path:
            leaf = leaf[k]
        assert is_spec_leaf(leaf)
        shape, cls = leaf
        shard = f"layer-{name.split('.')[1]}" if name.startswith("layers.") else "top"
        out.setdefault(shard, {}).update(_stored_form(name, tuple(shape[len(index):]), cls))
    return out


def _nbytes(tensors: dict) -> int:
    return sum(math.prod(s) * _BYTES[f] for s, f in tensors.values())


def _make(rng, shape, fmt, n_experts):
    if fmt == "I64":
        return rng.integers(0, n_experts, shape, dtype=np.int64)
    if fmt == "FP4":
        return rng.integers(0, 256, shape, dtype=np.uint8).view(np.int8)
    if fmt == "FP8":
        b = rng.integers(0, 256, shape, dtype=np.uint8)
        b[(b & 0x7F) == 0x7F] = 0x38  # no NaN codes
        return b.view(ml_dtypes.float8_e4m3fn)
    if fmt == "E8M0":
        return rng.integers(118, 126, shape, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)
    a = rng.standard_normal(shape, dtype=np.float32) * 0.02
    return a if fmt == "F32" else a.astype(ml_dtypes.bfloat16)


def build(cfg: ModelConfig, directory: str, seed: int = 0) -> dict:
    """Writes the checkpoint (one shard per layer plus one for the rest); returns its layout."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(official_config(cfg), f, indent=2)
    rng = np.random.default_rng(seed)
    shards = tensors_by_layer(cfg)
    weight_map = {}
    for i, (shard, tensors) in enumerate(shards.items()):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(os.path.join(directory, fname),
                          {n: _make(rng, s, f, cfg.n_routed_experts) for n, (s, f) in tensors.items()})
        weight_map.update({n: fname for n in tensors})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return shards


def du(path: str) -> dict:
    apparent = blocks = files = 0
    for root, _, names in os.walk(path):
        for n in names:
            st = os.stat(os.path.join(root, n))
            apparent += st.st_size
            blocks += st.st_blocks * 512
            files += 1
    return {"bytes": apparent, "allocated_bytes": blocks, "files": files}


def run_child(args: list[str]) -> tuple[int, float, int, str]:
    """(exit status, wall seconds, peak RSS bytes, stderr) of `python args...` in ROOT."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, time.monotonic() - t0, ru.ru_maxrss * 1024, err


def output_layer_bytes(out_dir: str) -> int:
    """The largest single layer of a converted directory, from the leaves listed in its Orbax
    checkpoint's custom metadata: every per-layer leaf's slice, plus the largest per-kind (csa /
    hca) and routing (tid2eid / gate_bias) slice."""
    from dsv4_jax.model.quantized import storage_shapes

    from dsv4_jax.checkpoint.store import read_custom_metadata

    leaves = read_custom_metadata(os.path.join(out_dir, "params"))["leaves"]
    per: dict[str, int] = {}
    for key, meta in leaves.items():
        group = key.split(".")[0]
        if group not in ("layers", "csa", "hca", "tid2eid", "gate_bias"):
            continue
        shape = tuple(meta["shape"])
        if meta["kind"] in ("fp8", "fp4"):
            n = sum(math.prod(s) * d.itemsize for s, d in storage_shapes(shape, meta["kind"]).values())
        else:
            n = math.prod(shape) * np.dtype(ml_dtypes.bfloat16 if meta["dtype"] == "bfloat16" else meta["dtype"]).itemsize
        per[group] = per.get(group, 0) + n // shape[0]
    return per.get("layers", 0) + max(per.get("csa", 0), per.get("hca", 0)) + \
        max(per.get("tid2eid", 0), per.get("gate_bias", 0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m convert.stress", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="target source checkpoint size (GB, 1e9 bytes)")
    ap.add_argument("--experts", type=int, default=None, help="routed experts (default: from --size-gb)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dir", default=None, help="work directory (default: a new one under $TMPDIR)")
    ap.add_argument("--dtypes", default="bfloat16,native")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    args = ap.parse_args(argv)

    base = flash_shaped(1, args.layers)
    fixed = _nbytes({n: v for t in tensors_by_layer(base).values() for n, v in t.items() if ".experts." not in n})
    per_expert = _nbytes({n: v for t in tensors_by_layer(base).values() for n, v in t.items() if ".experts." in n})
    experts = args.experts or max(1, math.ceil((args.size_gb * 1e9 - fixed) / per_expert))
    cfg = flash_shaped(experts, args.layers)

    work = args.dir or tempfile.mkdtemp(prefix="dsv4-stress-")
    os.makedirs(work, exist_ok=True)
    src = os.path.join(work, "src")
    try:
        t0 = time.monotonic()
        shards = build(cfg, src)
        build_s = time.monotonic() - t0
        src_du = du(src)
        rc, _, base_rss, err = run_child(["-c", ("import convert.cli, dsv4_jax.checkpoint.store, dsv4_jax.checkpoint.load_hf, dsv4_jax, "
                                                 "tensorstore, jax.numpy")])
        layer_src = max(_nbytes(t) for s, t in shards.items() if s.startswith("layer-"))
        report = {
            "config": {"hidden": 4096, "layers": args.layers, "compress_ratios": list(cfg.compress_ratios),
                       "routed_experts": experts, "expert_width": 2048, "vocab": cfg.vocab_size,
                       "note": "Flash per-layer shapes; FP8 linears, FP4 experts, E8M0 scales"},
            "source_bytes": src_du["bytes"], "source_build_s": round(build_s, 1),
            "largest_layer_source_bytes": layer_src,
            "baseline_rss_bytes": base_rss,
            "machine": {"cpus": os.cpu_count()},
            "runs": {},
        }
        for dtype in args.dtypes.split(","):
            out = os.path.join(work, f"out-{dtype}")
            rc, wall, rss, err = run_child(["-m", "convert", src, out, "--dtype", dtype, "--overwrite"])
            if rc != 0:
                raise SystemExit(f"conversion --dtype {dtype} failed ({rc}): {err.strip()}")
            o = du(out)
            layer_out = output_layer_bytes(out)
            report["runs"][dtype] = {
                "out_bytes": o["bytes"], "out_allocated_bytes": o["allocated_bytes"], "out_files": o["files"],
                "wall_s": round(wall, 2),
                "throughput_read_MBps": round(src_du["bytes"] / 1e6 / wall, 1),
                "throughput_written_MBps": round(o["bytes"] / 1e6 / wall, 1),
                "peak_rss_bytes": rss,
                "largest_layer_out_bytes": layer_out,
                "peak_rss_over_largest_layer_out": round(rss / layer_out, 3),
                "peak_rss_minus_baseline_bytes": rss - base_rss,
            }
            if not args.keep:
                shutil.rmtree(out, ignore_errors=True)
        print(json.dumps(report, indent=1))
    finally:
        if not args.keep:
            shutil.rmtree(src, ignore_errors=True)
            if args.dir is None:
                shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
