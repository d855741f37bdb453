"""`dsv4-convert HF_DIR OUT_DIR [--dtype bfloat16|float32] [--layers N] [--overwrite]`

Reads an HF DeepSeek-V4 checkpoint (official or transformers naming; float, FP8 block-scaled or
FP4 expert weights, dequantized exactly) and writes OUT_DIR with

* `config.json`: {"dsv4_jax": ModelConfig.to_dict(), "converted_from", "layers_converted", "dtype"}
  (readable by `dsv4_jax.ModelConfig.from_hf(OUT_DIR)`);
* `params/`: an Orbax checkpoint of the parameter tree ("weight" leaves in --dtype, fp32 and int
  leaves as `dsv4_jax.param_spec` says);
* `mtp/`: an Orbax checkpoint of the `mtp.*` tensors (nested by the dotted name), when present.

Everything is written into a temporary directory next to OUT_DIR and renamed at the end; on any
error the temporary directory is removed, one message naming the file or tensor goes to stderr
and the exit status is non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

PARAMS_DIR = "params"
MTP_DIR = "mtp"
DTYPES = ("bfloat16", "float32")


class ConvertError(Exception):
    pass


class _Progress:
    def __init__(self, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.monotonic()
        self.last = 0.0

    def __call__(self, done: int, total: int, nbytes: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done != total and now - self.last < 0.1:
            return
        self.last = now
        width = 30
        filled = int(width * done / max(total, 1))
        rate = nbytes / 1e6 / max(now - self.t0, 1e-6)
        self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} tensors  {rate:7.1f} MB/s")
        if done == total:
            self.stream.write("\n")
        self.stream.flush()


def _nest(flat: dict) -> dict:
    """{'mtp.0.enorm.weight': a} -> {'mtp': {'0': {'enorm': {'weight': a}}}}."""
    out: dict = {}
    for name, arr in flat.items():
        parts = name.split(".")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConvertError(f"tensor {name!r} clashes with another mtp tensor name")
        if parts[-1] in node:
            raise ConvertError(f"tensor {name!r} clashes with another mtp tensor name")
        node[parts[-1]] = arr
    return out


def flatten_names(tree: dict, prefix: str = "") -> dict:
    """Inverse of `_nest`."""
    out = {}
    for k, v in tree.items():
        name = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            out.update(flatten_names(v, name))
        else:
            out[name] = v
    return out


def _save_tree(path: str, tree: dict) -> None:
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.abspath(path), tree)
        ckptr.wait_until_finished()


def convert(hf_dir: str, out_dir: str, *, dtype: str = "bfloat16", layers: int | None = None,
            overwrite: bool = False, progress=None) -> str:
    """Converts hf_dir into out_dir (see module doc). Raises on error, leaving no out_dir behind
    (an existing out_dir replaced with --overwrite is only removed once the new one is complete)."""
    import jax.numpy as jnp

    from dsv4_jax.config import ModelConfig

    from .load_hf import read_hf_checkpoint

    if dtype not in DTYPES:
        raise ConvertError(f"--dtype must be one of {DTYPES}, got {dtype!r}")
    if not os.path.isdir(hf_dir):
        raise ConvertError(f"{hf_dir}: not a directory")
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise ConvertError(f"{out_dir} exists and is not a directory")
        if os.listdir(out_dir) and not overwrite:
            raise ConvertError(f"{out_dir} exists and is not empty (pass --overwrite to replace it)")
    cfg = ModelConfig.from_hf(hf_dir)
    if layers is not None:
        if not 1 <= layers <= cfg.num_layers:
            raise ConvertError(f"--layers must be in [1, {cfg.num_layers}], got {layers}")
        cfg = cfg.replace(num_layers=layers, compress_ratios=cfg.compress_ratios[:layers],
                          hash_layers=cfg.hash_layers[:layers])
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        params, mtp = read_hf_checkpoint(hf_dir, cfg, getattr(jnp, dtype),
                                         skip_layers_from=layers, progress=progress)
        _save_tree(os.path.join(tmp, PARAMS_DIR), params)
        del params
        if mtp:
            _save_tree(os.path.join(tmp, MTP_DIR), _nest(mtp))
        meta = {"dsv4_jax": cfg.to_dict(), "converted_from": os.path.abspath(hf_dir),
                "layers_converted": cfg.num_layers, "dtype": dtype, "mtp_tensors": len(mtp)}
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(meta, f, indent=2)
        if os.path.exists(out_dir):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
            os.rmdir(old)
            os.rename(out_dir, old)
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dsv4-convert", description=__doc__.split("\n\n")[0])
    ap.add_argument("hf_dir", help="HF checkpoint directory (config.json + safetensors)")
    ap.add_argument("out_dir", help="output directory (Orbax checkpoint + config.json)")
    ap.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="dtype of the weight leaves")
    ap.add_argument("--layers", type=int, default=None, help="convert only the first N main layers")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    args = ap.parse_args(argv)
    from dsv4_jax.config import ConfigError

    from .safetensors_io import CheckpointError

    try:
        out = convert(args.hf_dir, args.out_dir, dtype=args.dtype, layers=args.layers,
                      overwrite=args.overwrite, progress=_Progress())
    except (ConvertError, CheckpointError, ConfigError, OSError) as e:
        print(f"dsv4-convert: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("dsv4-convert: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # anything else: still one clear line, no partial output
        print(f"dsv4-convert: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if sys.stderr.isatty():
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
