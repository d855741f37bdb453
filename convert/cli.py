"""`dsv4-convert HF_DIR OUT_DIR [--dtype bfloat16|float32|native] [--layers N] [--overwrite]`

Reads an HF DeepSeek-V4 checkpoint (official or transformers naming; float, FP8 block-scaled or
FP4 expert weights) and writes OUT_DIR with

* `config.json`: {"dsv4_jax": ModelConfig.to_dict(), "converted_from", "layers_converted", "dtype",
  "mtp_tensors", and with --dtype native "quantized": {leaf: "fp8"|"fp4"}} (readable by
  `dsv4_jax.ModelConfig.from_hf(OUT_DIR)`);
* `params/`: the parameter tree as an Orbax PyTree checkpoint (zarr3 arrays written slice by
  slice with tensorstore, convert/store.py; restorable with plain Orbax): with bfloat16/float32,
  "weight" leaves dequantized exactly to that dtype, fp32 and int leaves as `dsv4_jax.param_spec`
  says; with native, the FP8/FP4 leaves of `dsv4_jax.params.NATIVE_QUANT`
  that the checkpoint stores quantized stay quantized (values + scales) and every other float
  leaf keeps bfloat16 where the checkpoint's values fit it exactly, float32 otherwise; a quantized
  leaf is the subtree {"values", "scale"};
* `mtp/`: the `mtp.*` tensors, when present, as another Orbax checkpoint (tree nested by the
  names' dotted parts, so each array's directory is the tensor's name).

The conversion streams: headers are checked first, then one tensor (with its scale) at a time is
read, converted and written into its slice of the on-disk array, so memory stays around one
tensor plus the writer's bounded in-flight buffer (256 MiB), whatever the checkpoint's size.

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

import numpy as np

from .store import array_name

PARAMS_DIR = "params"
MTP_DIR = "mtp"
DTYPES = ("bfloat16", "float32", "native")


class ConvertError(Exception):
    pass


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


class _Progress:
    """`[####....] done/total tensors  read/total bytes  rate MB/s  ETA` on a TTY; silent otherwise."""

    def __init__(self, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.monotonic()
        self.last = 0.0

    def __call__(self, done: int, total: int, nbytes: int, total_bytes: int | None = None) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done != total and now - self.last < 0.1:
            return
        self.last = now
        width = 30
        frac = nbytes / total_bytes if total_bytes else done / max(total, 1)
        filled = int(width * min(frac, 1.0))
        elapsed = max(now - self.t0, 1e-6)
        rate = nbytes / 1e6 / elapsed
        line = f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} tensors"
        if total_bytes:
            line += f"  {_fmt_bytes(nbytes)}/{_fmt_bytes(total_bytes)}"
        line += f"  {rate:7.1f} MB/s"
        if total_bytes and 0 < nbytes < total_bytes:
            line += f"  ETA {int(elapsed * (total_bytes - nbytes) / nbytes)}s"
        self.stream.write(line + "  ")
        if done == total:
            self.stream.write("\n")
        self.stream.flush()


def storage_layout(plan, dtype: str) -> dict[tuple, tuple[str, object]]:
    """Leaf path -> (kind, stored dtype): kind "float"/"int" with a numpy dtype, or "fp8"/"fp4"
    (dtype None) for a leaf kept quantized (--dtype native only)."""
    import ml_dtypes
    import numpy as np

    from dsv4_jax.params import INT, NATIVE_QUANT, leaf_dtype, map_spec

    out = {}

    def decide(path, leaf):
        _, cls = leaf
        if cls == INT:
            out[path] = ("int", np.dtype(np.int32))
        elif dtype != "native":
            d = leaf_dtype(cls, dtype)
            out[path] = ("float", np.dtype(ml_dtypes.bfloat16) if d.name == "bfloat16" else np.dtype(d))
        else:
            kinds = plan.sources.get(path, set())
            fmts = {k.split(":")[0] for k in kinds}
            if path in NATIVE_QUANT and len(fmts) == 1 and next(iter(fmts)) in ("fp8", "fp4"):
                out[path] = (next(iter(fmts)), None)
            elif kinds and kinds <= {"BF16", "fp8", "fp4"}:  # bf16 holds these exactly (E8M0 scales)
                out[path] = ("float", np.dtype(ml_dtypes.bfloat16))
            else:
                out[path] = ("float", np.dtype(np.float32))

    map_spec(decide, plan.spec)
    return out


def _write_params(plan, layout: dict, params_dir: str, mtp_dir: str, progress, *, native: bool,
                  mtp_dtype) -> tuple[int, int]:
    """Streams every tensor into the two Orbax checkpoints; returns (mtp tensor count, bytes written)."""
    from dsv4_jax.params import map_spec

    from .load_hf import iter_sources
    from .store import CheckpointWriter

    writer = CheckpointWriter(params_dir)
    map_spec(lambda path, leaf: writer.create(path, layout[path][0], leaf[0], dtype=layout[path][1],
                                              lead=_lead(path)), plan.spec)
    mtp_writer = CheckpointWriter(mtp_dir) if plan.mtp_names else None
    n_mtp = 0
    for name, path, index, src in iter_sources(plan, progress):
        if path is None:  # mtp: raw tensors as stored; quantized ones kept (native) or dequantized
            n_mtp += 1
            mpath = tuple(name.split("."))  # nested by the name's parts: directories keep the name
            if src.fmt != "raw" and native:
                mtp_writer.create(mpath, src.fmt, _logical_shape(src), lead=0)
                mtp_writer.write(mpath + ("values",), (), src.data.view(np.uint8) if src.fmt == "fp4" else src.data)
                mtp_writer.write(mpath + ("scale",), (), src.scale)
            else:
                arr = src.data if src.fmt == "raw" else src.dense(mtp_dtype)
                mtp_writer.create(mpath, "int" if arr.dtype.kind in "iub" else "float", arr.shape, dtype=arr.dtype)
                mtp_writer.write(mpath, (), arr)
            continue
        kind, dt = layout[path]
        if kind in ("fp8", "fp4"):
            writer.write(path + ("values",), index, src.data.view(np.uint8) if kind == "fp4" else src.data)
            writer.write(path + ("scale",), index, src.scale)
        else:
            writer.write(path, index, src.dense(dt))
    writer.close()
    if mtp_writer is not None:
        mtp_writer.close()
    return n_mtp, writer.bytes_written + (mtp_writer.bytes_written if mtp_writer else 0)


def _lead(path) -> int:
    """Leading stacked axes of a leaf: layers (and experts) / per-kind stacks; 0 at the top."""
    if path[0] in ("layers", "csa", "hca", "tid2eid", "gate_bias"):
        return 2 if path[:2] == ("layers", "ffn") and path[2] in ("w1", "w2", "w3") else 1
    return 0


def _logical_shape(src) -> tuple:
    s = tuple(src.data.shape)
    return s[:-1] + (2 * s[-1],) if src.fmt == "fp4" else s


def convert(hf_dir: str, out_dir: str, *, dtype: str = "bfloat16", layers: int | None = None,
            overwrite: bool = False, progress=None) -> str:
    """Converts hf_dir into out_dir (see module doc). Raises on error, leaving no out_dir behind
    (an existing out_dir replaced with --overwrite is only removed once the new one is complete).
    Streams: one tensor (and its scale) is read, converted and written at a time."""
    import ml_dtypes

    from dsv4_jax.config import ModelConfig

    from .load_hf import plan_checkpoint

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
    plan = plan_checkpoint(hf_dir, cfg, skip_layers_from=layers)  # every header check, before any write
    layout = storage_layout(plan, dtype)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        n_mtp, _ = _write_params(plan, layout, os.path.join(tmp, PARAMS_DIR), os.path.join(tmp, MTP_DIR), progress,
                                 native=dtype == "native",
                                 mtp_dtype=np.float32 if dtype == "float32" else ml_dtypes.bfloat16)
        meta = {"dsv4_jax": cfg.to_dict(), "converted_from": os.path.abspath(hf_dir),
                "layers_converted": cfg.num_layers, "dtype": dtype, "mtp_tensors": n_mtp}
        if dtype == "native":
            meta["quantized"] = {array_name(p): k for p, (k, _) in layout.items() if k in ("fp8", "fp4")}
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
    ap.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                    help="dtype of the weight leaves; native keeps FP8/FP4 weights quantized")
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
    except Exception as e:  # noqa: BLE001  anything else: still one clear line, no partial output
        print(f"dsv4-convert: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if sys.stderr.isatty():
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
