"""An argparse parser whose usage errors raise instead of exiting with status 2 and the usage text,
so a CLI can report every bad input the same way: one line on stderr and status 1."""

from __future__ import annotations

import argparse


class UsageError(ValueError):
    """A command line that does not parse; the message says what is wrong."""


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse calls this for every parse error
        raise UsageError(message)


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def byte_size(text: str) -> int:
    """A byte count as flags take it: `8GiB`, `512MiB`, `1.5GB`, `4096` (argparse type: a bad one
    is a usage error naming the flag)."""
    import re

    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = m and m.group(2).upper()
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 8GiB, 512MiB, 2GB or a number of bytes)")
    return int(float(m.group(1)) * _UNITS[unit])


def add_model_arguments(parser) -> None:
    """The flags every CLI that loads a model takes: compute dtype, attention implementation,
    IndexCache, the compilation cache and the device mesh."""
    from . import compile_cache
    from dsv4_jax.model import sharding
    from dsv4_jax.model.config import EXPERT_EXCHANGES

    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--attention-impl", choices=("auto", "pallas", "ref"), default="auto")
    parser.add_argument("--expert-exchange", choices=EXPERT_EXCHANGES, default="auto",
                        help="how expert parallelism on --mesh moves tokens (TPU/GPU; default auto: "
                             "dsv4_jax.model.moe.expert_exchange's rule)")
    parser.add_argument("--fp8-activations", action="store_true",
                        help="quantize the FP8 linears' activations to e4m3 per 128 as DeepSeek's reference "
                             "inference does (FP8 tensor cores on CUDA; a --dtype native checkpoint)")
    parser.add_argument("--index-cache-freq", type=int, default=None,
                        help="IndexCache: ratio-4 layers of rank r reuse the last top-k when r %% F != 0")
    parser.add_argument("--index-cache-pattern", default=None, help="IndexCache: one F/S per ratio-4 layer")
    parser.add_argument("--index-cache-skip-compressor", action="store_true",
                        help="IndexCache: reusing layers also skip their indexer's compressor")
    compile_cache.add_flag(parser)
    sharding.add_arguments(parser)


def model_options(args) -> tuple[dict, object]:
    """`load`'s run-time options and the device mesh (or None) from add_model_arguments' flags."""
    from dsv4_jax.model import sharding

    options = {"attention_impl": args.attention_impl, "expert_exchange": args.expert_exchange,
               "fp8_activations": args.fp8_activations}
    if args.index_cache_freq is not None or args.index_cache_pattern is not None:
        options.update(use_index_cache=True, index_topk_freq=args.index_cache_freq,
                       index_topk_pattern=args.index_cache_pattern,
                       index_cache_skip_compressor=args.index_cache_skip_compressor)
    if args.layout is not None and args.mesh is None:
        raise ValueError("--layout needs --mesh")
    mesh = sharding.make_mesh(sharding.parse_mesh(args.mesh)) if args.mesh else None
    return options, mesh
