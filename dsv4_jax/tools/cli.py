"""`dsv4-generate --ckpt DIR (--prompt TEXT | --ids 1,2,3) [options]`

Loads a checkpoint (converted by dsv4-convert, or HF safetensors), generates, and prints the
continuation and the speed. Text prompts need the checkpoint's `tokenizer.json` (read with the
`tokenizers` package); `--ids` takes token ids (and uses the tokenizer, when it can be read, only to
print text). Generation stops at `--eos`, else at generation_config.json's eos_token_id (an id or
a list of ids), else at config.json's. Compiled programs are kept in JAX's persistent compilation
cache (`--compile-cache`, see dsv4_jax/runtime/compile_cache.py), so a second run with the same shapes
compiles nothing. `--mesh data=2,expert=4 [--layout ...]` runs the model on a device mesh
(dsv4_jax/model/sharding.py); with `--coordinator HOST:PORT --num-processes N --process-id I` (or the
JAX_* environment variables, dsv4_jax/runtime/distributed.py) every process of a multi-host run runs the
same command, and process 0 prints. Errors print one line and exit with status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _parse_ids(text: str) -> list[list[int]]:
    """'1,2,3' -> [[1, 2, 3]]; rows separated by ';' make a batch: '1,2;3,4,5'. An empty entry
    ('1,,2', '1,2,', '1;') is an error."""
    rows = []
    for row in text.split(";"):
        fields = [t.strip() for t in row.split(",")]
        try:
            if "" in fields:
                raise ValueError
            rows.append([int(t) for t in fields])
        except ValueError:
            raise ValueError(f"--ids must be comma-separated integers (rows separated by ';') with no empty "
                             f"entries, got {text!r}") from None
    return rows


def _tokenizer(ckpt: str, needed: bool):
    """The checkpoint's tokenizer.json, or None. When it is `needed` (--prompt) a missing or
    unreadable one is a ValueError; otherwise (--ids: it only turns the output into text) it is
    None, with a note on stderr when the file exists but cannot be read."""
    path = os.path.join(ckpt, "tokenizer.json")
    if not os.path.isfile(path):
        if needed:
            raise ValueError(f"--prompt needs {path}; use --ids instead")
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        if needed:
            raise ValueError(f"{path} needs the `tokenizers` package (pip install tokenizers)") from None
        return None
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a plain Exception for a malformed file
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        if needed:
            raise ValueError(f"{path}: cannot read the tokenizer ({reason})") from None
        print(f"dsv4-generate: note: {path} cannot be read ({reason}); printing token ids", file=sys.stderr)
        return None


def _decode(tok, ids: list[int]) -> str | None:
    if tok is None:
        return None
    try:
        return tok.decode(ids)
    except Exception:  # an id the tokenizer does not know: the ids are printed instead
        return None


def _eos(args, ckpt: str, config_eos: int | None) -> int | list[int] | None:
    """The stop ids: none with --no-eos, else --eos, else generation_config.json's eos_token_id
    (an id or a list of ids), else config.json's."""
    if args.no_eos:
        return None
    if args.eos is not None:
        return args.eos
    path = os.path.join(ckpt, "generation_config.json")
    if not os.path.isfile(path):
        return config_eos
    try:
        with open(path) as f:
            gen = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} cannot be read ({e}); give --eos ID or --no-eos") from None
    if not isinstance(gen, dict) or "eos_token_id" not in gen:
        return config_eos
    eos = gen["eos_token_id"]
    ok = lambda x: isinstance(x, int) and not isinstance(x, bool)  # noqa: E731
    if eos is None or ok(eos) or (isinstance(eos, list) and eos and all(map(ok, eos))):
        return eos
    raise ValueError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")


def main(argv=None) -> int:
    from dsv4_jax.runtime import distributed
    from dsv4_jax.runtime.cli_args import add_model_arguments

    ap = argparse.ArgumentParser(prog="dsv4-generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="checkpoint directory")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs tokenizer.json in --ckpt)")
    src.add_argument("--ids", help="prompt token ids, e.g. 1,2,3 (';' separates rows of a batch)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-len", type=int, default=None, help="cache size in tokens (default: a bucket that fits)")
    ap.add_argument("--eos", type=int, default=None,
                    help="stop token id (default: generation_config.json's eos_token_id, else config.json's)")
    ap.add_argument("--no-eos", action="store_true", help="do not stop at an eos token")
    add_model_arguments(ap)
    distributed.add_arguments(ap)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = ap.parse_args(argv)
    try:
        with distributed.stdout_to_stderr():  # until the report: only it goes to stdout
            report = _generate(args)
    except (ValueError, OSError, TypeError) as e:
        print(f"dsv4-generate: error: {e}", file=sys.stderr)
        return 1
    if report is None:  # a multi-process run: every process computed, process 0 prints
        return 0
    if args.json:
        print(json.dumps(report))
    else:
        for row in report["rows"]:
            print(row["text"] if row["text"] is not None else " ".join(map(str, row["ids"])))
        print(f"[{report['new_tokens']} tokens in {report['generate_s']:.2f}s: {report['tokens_per_s']:.1f} "
              f"tokens/s; load {report['load_s']:.2f}s; {report['compiled_programs']} programs compiled "
              f"({report['compile_s']:.1f}s), {report['programs_from_cache']} from the compile cache]",
              file=sys.stderr)
    return 0


def _generate(args) -> dict | None:
    """Loads the checkpoint and generates as the flags say; returns the report (None on a
    process other than 0)."""
    from dsv4_jax.runtime import compile_cache, distributed
    from dsv4_jax.runtime.cli_args import model_options

    distributed.from_arguments(args)  # before anything touches a device
    cache_dir = compile_cache.enable(args.compile_cache)  # before anything compiles
    import jax
    import jax.numpy as jnp

    import dsv4_jax

    if not os.path.isdir(args.ckpt):
        raise ValueError(f"checkpoint directory not found: {args.ckpt}")
    tok = _tokenizer(args.ckpt, needed=args.prompt is not None)
    prompts = [tok.encode(args.prompt).ids] if args.prompt is not None else _parse_ids(args.ids)
    options, mesh = model_options(args)
    with compile_cache.CompileCounter() as compiles:
        t0 = time.perf_counter()
        model = dsv4_jax.load(args.ckpt, dtype=getattr(jnp, args.dtype), mesh=mesh, layout=args.layout, **options)
        load_s = time.perf_counter() - t0
        if model.config.use_index_cache:
            print(dsv4_jax.index_cache_schedule(model.config).describe(), file=sys.stderr)
        eos = _eos(args, args.ckpt, model.config.eos_token_id)
        t0 = time.perf_counter()
        out = dsv4_jax.generate(model, prompts, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, eos_token_id=eos, seed=args.seed, max_len=args.max_len)
        gen_s = time.perf_counter() - t0
    if jax.process_index() != 0:
        return None
    n = int(out.lengths.sum())
    return {"load_s": round(load_s, 3), "generate_s": round(gen_s, 3), "new_tokens": n,
            "tokens_per_s": round(n / gen_s, 2), "eos_token_id": eos, "mesh": args.mesh,
            "processes": jax.process_count(), "compiled_programs": compiles.compiled,
            "programs_from_cache": compiles.loaded, "compile_s": round(compiles.seconds, 3),
            "compile_cache": cache_dir,
            "note": "generate_s includes the compilation of generate's programs; compile_s counts the "
                    "compile requests of load and generate (a program from the compile cache: its load time)",
            "rows": [{"prompt_ids": p, "ids": r, "text": _decode(tok, r)} for p, r in zip(prompts, out.rows())]}


if __name__ == "__main__":
    sys.exit(main())
