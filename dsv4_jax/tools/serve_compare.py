"""The same load against several dsv4-serve configurations, one after the other, in one run.

    python -m dsv4_jax.tools.serve_compare --ckpt DIR --server NAME="dsv4-serve flags" [--server ...]
        [--serve-flags "flags every server gets"] [--startup-timeout S] [--out FILE]
        -- <dsv4-bench-serve flags>

For each --server, in order: start `dsv4-serve --ckpt DIR` with the common and its own flags on a
free port (a fresh process: nothing carries over from the previous server), wait until /health
answers (warm-up compiles every program first), run `dsv4-bench-serve` with the given flags (the
same prompts and arrival times for every server: they follow --seed), stop the server. Prints ONE
JSON object: each server's flags and bench report, and beside the first server's the others'
output throughput (and its change in %), mean and P90 TTFT, TPOT and ITL, and their ratios to the
first's. Used for continuous against static batching (`--scheduler static`) and for IndexCache
off against on (`--index-cache-freq 2`), as docs/serving.md shows.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

from dsv4_jax.runtime.cli_args import ArgumentParser, UsageError
from .bench_serve import BenchError

METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise UsageError(f"the server exited with status {proc.returncode} before it served")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise UsageError(f"the server did not answer /health within {timeout:.0f} s")


def run_server(ckpt: str, flags: list[str], bench_flags: list[str], startup_timeout: float, log) -> dict:
    """One server's bench report (dsv4-bench-serve's JSON)."""
    from . import bench_serve

    port = _free_port()
    cmd = [sys.executable, "-m", "dsv4_jax.serving.serve", "--ckpt", ckpt, "--port", str(port), *flags]
    log(f"starting {' '.join(cmd)}")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc, startup_timeout)
        args, specs, warmup = bench_serve.parse_args(["--base-url", url, *bench_flags])
        import asyncio

        return asyncio.run(bench_serve.benchmark(args, specs, warmup))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()


def compare(reports: dict[str, dict]) -> dict:
    """The figures the IndexCache study reports, every server beside the first."""
    names = list(reports)
    base = reports[names[0]]["all"]
    out = {}
    for name in names:
        r = reports[name]["all"]
        row = {"output_throughput": r["output_throughput"],
               "output_throughput_change_pct": 100 * (r["output_throughput"] / base["output_throughput"] - 1)}
        for m in METRICS:
            row[m] = {"mean": r[m]["mean"], "p90": r[m]["p90"],
                      "mean_ratio_to_first": r[m]["mean"] / base[m]["mean"] if base[m]["mean"] else None,
                      "p90_ratio_to_first": r[m]["p90"] / base[m]["p90"] if base[m]["p90"] else None}
        out[name] = row
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = ArgumentParser(prog="python -m dsv4_jax.tools.serve_compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--server", action="append", required=True, help='NAME="dsv4-serve flags" (repeatable)')
    ap.add_argument("--serve-flags", default="", help="flags every server gets")
    ap.add_argument("--startup-timeout", type=float, default=1800, help="seconds to wait for /health")
    ap.add_argument("--out", help="also write the JSON here")
    try:
        args = ap.parse_args(argv)
        servers = {}
        for spec in args.server:
            name, sep, flags = spec.partition("=")
            if not sep or not name or name in servers:
                raise UsageError(f'--server must be NAME="flags" with distinct names, got {spec!r}')
            servers[name] = shlex.split(args.serve_flags) + shlex.split(flags)
        if not os.path.isdir(args.ckpt):
            raise UsageError(f"checkpoint directory not found: {args.ckpt}")
        from . import bench_serve

        bench_serve.parse_args(["--base-url", "http://127.0.0.1:1", *bench_flags])  # bad flags fail now
        if args.out:
            open(args.out, "a").close()  # a bad path fails now, not after the runs
        log = lambda m: print(f"serve_compare: {m}", file=sys.stderr, flush=True)  # noqa: E731
        reports = {name: run_server(args.ckpt, flags, bench_flags, args.startup_timeout, log)
                   for name, flags in servers.items()}
    except (UsageError, BenchError, OSError) as e:
        print(f"serve_compare: error: {e}", file=sys.stderr)
        return 1
    result = {"servers": {n: {"flags": servers[n], "report": r} for n, r in reports.items()},
              "bench_flags": bench_flags, "comparison": compare(reports)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
