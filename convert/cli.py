"""`dsv4-convert HF_DIR OUT_DIR [--dtype bfloat16|float32|native] [--layers N] [--overwrite]`

Reads an HF DeepSeek-V4 checkpoint (official or transformers naming; float, FP8 block-scaled or
FP4 expert weights) and writes OUT_DIR with

* `config.json`: {"dsv4_jax": ModelConfig.to_dict(), "converted_from", "layers_converted", "dtype",
  "mtp_tensors", "copied_files", and with --dtype native "quantized": {leaf: "fp8"|"fp4"}}
  (readable by `dsv4_jax.ModelConfig.from_hf(OUT_DIR)`);
* `params/`: the parameter tree as an Orbax PyTree checkpoint (zarr3 arrays written slice by
  slice with tensorstore, dsv4_jax/checkpoint/store.py; restorable with plain Orbax): with bfloat16/float32,
  "weight" leaves dequantized exactly to that dtype, fp32 and int leaves as `dsv4_jax.param_spec`
  says; with native, the FP8/FP4 leaves of `dsv4_jax.model.params.NATIVE_QUANT`
  that the checkpoint stores quantized stay quantized (values + scales) and every other float
  leaf keeps bfloat16 where the checkpoint's values fit it exactly, float32 otherwise; a quantized
  leaf is the subtree {"values", "scale"};
* `mtp/`: the MTP block, when the checkpoint has its `mtp.*` tensors, as another Orbax checkpoint
  of the block's parameter tree (`dsv4_jax.model.mtp.mtp_param_spec`: `nnx.state(model.mtp)`,
  routed experts stacked), its leaves stored as params/'s (with native, the FP8/FP4 leaves of
  `mtp.NATIVE_QUANT` kept quantized, named "mtp.<path>" in "quantized");
* `tokenizer.json`, `tokenizer_config.json`, `generation_config.json`: copied from HF_DIR, those
  it has (listed in "copied_files"; each checked first, dsv4_jax/checkpoint/hf_files.py).

The conversion streams: headers are checked first, then one tensor (with its scale) at a time is
read, converted and written into its slice of the on-disk array, so memory stays around one
tensor plus the writer's bounded in-flight buffer (256 MiB), whatever the checkpoint's size.

OUT_DIR may not be HF_DIR, lie inside it or contain it; an existing non-empty OUT_DIR is only
replaced with --overwrite, and only if it is a previous conversion (`check_out_dir`). Everything
is written into a temporary directory next to OUT_DIR and renamed at the end; OUT_DIR gets the
mode the umask gives (one it replaces keeps its mode). On any error the temporary directory is
removed, one message naming the file or tensor goes to stderr and the exit status is 1. On
success stderr gets one warning line per tensor holding NaN or infinite values (they are
written as they are) and one summary line `dsv4-convert: wrote OUT_DIR (N tensors, SIZE, DTYPE,
T s)`; a TTY also gets a progress bar.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import shutil
import stat
import sys
import time

import numpy as np

from dsv4_jax.checkpoint import hf_files
from dsv4_jax.checkpoint.store import array_name

PARAMS_DIR = "params"
MTP_DIR = "mtp"
DTYPES = ("bfloat16", "float32", "native")
OUTPUT_ENTRIES = ("config.json", PARAMS_DIR, MTP_DIR, *hf_files.FILES)  # all a conversion writes


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

    from dsv4_jax.model import mtp
    from dsv4_jax.model.params import INT, NATIVE_QUANT, leaf_dtype, map_spec

    formats = {**NATIVE_QUANT, **{(MTP_DIR,) + p: f for p, f in mtp.NATIVE_QUANT.items()}}
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
            if path in formats and len(fmts) == 1 and next(iter(fmts)) in ("fp8", "fp4"):
                out[path] = (next(iter(fmts)), None)
            elif kinds and kinds <= {"BF16", "fp8", "fp4"}:  # bf16 holds these exactly (E8M0 scales)
                out[path] = ("float", np.dtype(ml_dtypes.bfloat16))
            else:
                out[path] = ("float", np.dtype(np.float32))

    map_spec(decide, plan.spec)
    return out


def nonfinite_counts(arr: np.ndarray, block: int = 1 << 22) -> tuple[int, int]:
    """(NaN count, infinite count) of an array (0, 0 for integers), `block` elements at a time so
    the masks stay small next to the tensor."""
    if arr.dtype.kind in "iub":
        return 0, 0
    flat = arr.reshape(-1)
    nan = inf = 0
    for i in range(0, flat.size, block):
        part = flat[i:i + block]
        bad = np.count_nonzero(~np.isfinite(part))
        if bad:
            n = np.count_nonzero(np.isnan(part))
            nan, inf = nan + n, inf + bad - n
    return nan, inf


def _write_params(plan, layout: dict, params_dir: str, mtp_dir: str,
                  progress) -> tuple[int, int, dict[str, tuple[int, int]]]:
    """Streams every tensor into the two Orbax checkpoints; returns (mtp tensor count, bytes
    written, {tensor name: (NaN, infinite) counts} of the tensors holding any, as written: the
    dense values, or a quantized leaf's stored values and scales)."""
    from dsv4_jax.checkpoint.store import CheckpointWriter

    writer = CheckpointWriter(params_dir)
    mtp_writer = CheckpointWriter(mtp_dir) if plan.has_mtp else None
    nonfinite: dict[str, tuple[int, int]] = {}
    try:
        n_mtp = _write_tensors(plan, layout, writer, mtp_writer, nonfinite, progress)
        writer.close()
        if mtp_writer is not None:
            mtp_writer.close()
    except BaseException:  # writes still in flight would land in the directory after it is removed
        for w in (writer, mtp_writer):
            if w is not None:
                w.abort()
        raise
    return n_mtp, writer.bytes_written + (mtp_writer.bytes_written if mtp_writer else 0), nonfinite


def _write_tensors(plan, layout: dict, writer, mtp_writer, nonfinite: dict, progress) -> int:
    """The body of `_write_params`: creates the arrays, then writes each tensor as it is read,
    counting its NaN and infinite values into `nonfinite`; returns the mtp tensor count."""
    from dsv4_jax.model.params import map_spec

    from dsv4_jax.checkpoint.load_hf import iter_sources

    def write(w, name: str, path: tuple, index: tuple, arr: np.ndarray) -> None:
        nan, inf = nonfinite_counts(arr)
        if nan or inf:
            n0, i0 = nonfinite.get(name, (0, 0))
            nonfinite[name] = (n0 + nan, i0 + inf)
        w.write(path, index, arr)

    def place(path):  # the checkpoint a leaf goes to, and its path there
        return (mtp_writer, path[1:]) if path[0] == MTP_DIR else (writer, path)

    def create(path, leaf):
        w, local = place(path)
        w.create(local, layout[path][0], leaf[0], dtype=layout[path][1], lead=_lead(path))

    map_spec(create, plan.spec)
    n_mtp = 0
    for name, path, index, src in iter_sources(plan, progress):
        (kind, dt), (w, local) = layout[path], place(path)
        n_mtp += w is mtp_writer
        if kind in ("fp8", "fp4"):
            write(w, name, local + ("values",), index, _stored_values(src))
            write(w, name, local + ("scale",), index, src.scale)
        else:
            write(w, name, local, index, src.dense(dt))
    return n_mtp


def _lead(path) -> int:
    """Leading stacked axes of a leaf: layers (and experts) / per-kind stacks; the MTP block's
    experts; 0 at the top."""
    if path[:2] == (MTP_DIR, "ffn"):
        return int(path[2] in ("w1", "w2", "w3"))
    if path[0] in ("layers", "csa", "hca", "tid2eid", "gate_bias"):
        return 2 if path[:2] == ("layers", "ffn") and path[2] in ("w1", "w2", "w3") else 1
    return 0


def _stored_values(src) -> np.ndarray:
    """A quantized Source's values as stored: FP4's packed bytes as uint8, FP8's e4m3 as they are."""
    return src.data.view(np.uint8) if src.fmt == "fp4" else src.data


@dataclasses.dataclass
class Conversion:
    """What `convert` wrote: out_dir (symlinks resolved); the checkpoint tensors converted (a
    quantized weight and its scale count once); the array bytes written under params/ and mtp/;
    the HF files copied (hf_files.FILES found in hf_dir); and the tensors holding NaN or infinite
    values as written, name -> (NaN count, infinite count)."""

    out_dir: str
    dtype: str
    tensors: int
    bytes_written: int
    seconds: float
    copied: list[str]
    nonfinite: dict[str, tuple[int, int]]

    def summary(self) -> str:
        return (f"wrote {self.out_dir} ({self.tensors} tensors, {_fmt_bytes(self.bytes_written)}, {self.dtype}, "
                f"{self.seconds:.1f} s)")


def _ancestors(path: str):
    """(directory, os.stat) for path, symlinks and '..' resolved, and each directory above it,
    skipping those that do not exist."""
    p = os.path.realpath(path)
    while True:
        try:
            st = os.stat(p)
        except OSError:
            st = None
        if st is not None:
            yield p, st
        up = os.path.dirname(p)
        if up == p:
            return
        p = up


def check_out_dir(hf_dir: str, out_dir: str, overwrite: bool) -> None:
    """Raises ConvertError unless writing out_dir leaves hf_dir and the user's files alone.
    out_dir must not be hf_dir, be inside it or contain it, compared as the file system sees
    them (device and inode, so a symlink, '..' or a second mount of the same directory is
    caught). An existing non-empty out_dir is replaced only with `overwrite`, and only when it
    is a previous dsv4-convert output (`dsv4_jax.checkpoint.loading.is_converted`: config.json with a
    "dsv4_jax" entry, and params/) holding nothing else than what a conversion writes."""
    from dsv4_jax.checkpoint.loading import is_converted

    hf_stat = os.stat(hf_dir)
    real_out = os.path.realpath(out_dir)
    for d, st in _ancestors(out_dir):
        if os.path.samestat(st, hf_stat):
            if d == real_out:
                raise ConvertError(f"OUT_DIR {out_dir} is HF_DIR {hf_dir} (the same directory): "
                                   f"write the conversion to another directory")
            raise ConvertError(f"OUT_DIR {out_dir} is inside HF_DIR {hf_dir}: "
                               f"write the conversion outside the checkpoint directory")
    if not os.path.exists(out_dir):
        return
    if not os.path.isdir(out_dir):
        raise ConvertError(f"{out_dir} exists and is not a directory")
    out_stat = os.stat(out_dir)
    if any(os.path.samestat(st, out_stat) for _, st in _ancestors(hf_dir)):
        raise ConvertError(f"OUT_DIR {out_dir} contains HF_DIR {hf_dir}: "
                           f"write the conversion to a directory that does not hold the checkpoint")
    entries = os.listdir(out_dir)
    if not entries:
        return
    if not overwrite:
        raise ConvertError(f"{out_dir} exists and is not empty (pass --overwrite to replace a previous conversion)")
    if not is_converted(out_dir):
        raise ConvertError(f"{out_dir} is not a dsv4-convert output (no config.json with \"dsv4_jax\" and "
                           f"{PARAMS_DIR}/); --overwrite only replaces a previous conversion")
    foreign = sorted(set(entries) - set(OUTPUT_ENTRIES))
    if foreign:
        raise ConvertError(f"{out_dir} holds files a conversion does not write ({', '.join(foreign)}); "
                           f"--overwrite would delete them: move them or choose another OUT_DIR")


def _sibling(out_dir: str, tag: str) -> str:
    """An unused name next to out_dir, hidden, for the directory being written or the one replaced."""
    return os.path.join(os.path.dirname(out_dir), f".{os.path.basename(out_dir)}.{tag}-{secrets.token_hex(6)}")


def _make_work_dir(out_dir: str) -> tuple[list[str], str]:
    """Creates out_dir's missing parents and, next to out_dir, the directory the conversion is
    written into; returns (the parents created, outermost first; that directory). os.mkdir
    gives the mode the umask gives, as out_dir made directly would have (tempfile.mkdtemp's
    would be 0700). An error names out_dir, never the temporary name."""
    missing = []
    p = os.path.dirname(out_dir)
    while not os.path.isdir(p):
        if os.path.lexists(p):
            raise ConvertError(f"cannot create {out_dir}: {p} is not a directory")
        missing.append(p)
        p = os.path.dirname(p)
    created = []
    try:
        for d in reversed(missing):
            os.mkdir(d)
            created.append(d)
        work = _sibling(out_dir, "tmp")
        os.mkdir(work)
    except OSError as e:
        _remove_dirs(created)
        where = f" (creating {e.filename})" if e.filename in missing else ""
        raise ConvertError(f"cannot create {out_dir}: {e.strerror or e}{where}") from None
    return created, work


def _remove_dirs(created: list[str]) -> None:
    for d in reversed(created):
        try:
            os.rmdir(d)
        except OSError:
            pass


def convert(hf_dir: str, out_dir: str, *, dtype: str = "bfloat16", layers: int | None = None,
            overwrite: bool = False, progress=None) -> Conversion:
    """Converts hf_dir into out_dir (see module doc). Every check comes before anything is
    written: `check_out_dir`, the config, every tensor header, the tokenizer / generation files.
    Raises on error, leaving neither out_dir nor the parents it created behind (an existing
    out_dir replaced with `overwrite` is only removed once the new one is complete). Streams:
    one tensor (and its scale) is read, converted and written at a time."""
    from dsv4_jax.model.config import ModelConfig

    from dsv4_jax.checkpoint.load_hf import plan_checkpoint

    t0 = time.monotonic()
    if dtype not in DTYPES:
        raise ConvertError(f"--dtype must be one of {DTYPES}, got {dtype!r}")
    if not os.path.isdir(hf_dir):
        raise ConvertError(f"{hf_dir}: not a directory")
    check_out_dir(hf_dir, out_dir, overwrite)
    out_dir = os.path.realpath(out_dir)  # a symlinked OUT_DIR: its target is replaced, not the link
    cfg = ModelConfig.from_hf(hf_dir)
    if layers is not None:
        if not 1 <= layers <= cfg.num_layers:
            raise ConvertError(f"--layers must be in [1, {cfg.num_layers}], got {layers}")
        cfg = cfg.replace(num_layers=layers, compress_ratios=cfg.compress_ratios[:layers],
                          hash_layers=cfg.hash_layers[:layers])
    plan = plan_checkpoint(hf_dir, cfg, skip_layers_from=layers)  # every header check, before any write
    layout = storage_layout(plan, dtype)
    copied = hf_files.check_files(hf_dir, cfg.vocab_size)
    replaced_mode = stat.S_IMODE(os.stat(out_dir).st_mode) if os.path.isdir(out_dir) else None
    created, tmp = _make_work_dir(out_dir)
    try:
        n_mtp, nbytes, nonfinite = _write_params(
            plan, layout, os.path.join(tmp, PARAMS_DIR), os.path.join(tmp, MTP_DIR), progress)
        hf_files.copy_files(hf_dir, tmp, copied)
        meta = {"dsv4_jax": cfg.to_dict(), "converted_from": os.path.abspath(hf_dir),
                "layers_converted": cfg.num_layers, "dtype": dtype, "mtp_tensors": n_mtp, "copied_files": copied}
        if dtype == "native":
            meta["quantized"] = {array_name(p): k for p, (k, _) in layout.items() if k in ("fp8", "fp4")}
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(meta, f, indent=2)
        if replaced_mode is not None:
            os.chmod(tmp, replaced_mode)
            old = _sibling(out_dir, "old")
            os.rename(out_dir, old)
            try:
                os.rename(tmp, out_dir)
            except OSError:
                os.rename(old, out_dir)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_dirs(created)
        raise
    return Conversion(out_dir, dtype, len(plan.todo), nbytes, time.monotonic() - t0, copied, nonfinite)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dsv4-convert", description=__doc__.split("\n\n")[0])
    ap.add_argument("hf_dir", help="HF checkpoint directory (config.json + safetensors)")
    ap.add_argument("out_dir", help="output directory (Orbax checkpoint + config.json)")
    ap.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                    help="dtype of the weight leaves; native keeps FP8/FP4 weights quantized")
    ap.add_argument("--layers", type=int, default=None, help="convert only the first N main layers")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace OUT_DIR if it is a previous conversion (nothing else is ever replaced)")
    args = ap.parse_args(argv)
    from dsv4_jax.model.config import ConfigError

    from dsv4_jax.checkpoint.safetensors_io import CheckpointError

    try:
        done = convert(args.hf_dir, args.out_dir, dtype=args.dtype, layers=args.layers,
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
    for name, (nan, inf) in done.nonfinite.items():
        print(f"dsv4-convert: warning: tensor {name!r} has {nan} NaN and {inf} infinite values (written as they are)",
              file=sys.stderr)
    print(f"dsv4-convert: {done.summary()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
