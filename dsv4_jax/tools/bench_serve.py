"""`dsv4-bench-serve`: a load generator for a running OpenAI-compatible server (ours or any).

    dsv4-bench-serve [--base-url URL] [--model NAME] [--endpoint completions|chat]
                     [--input-len N [--input-len-max M] [--prefix-len P --num-prefixes K] --output-len N
                      | --prompt-file FILE.jsonl]
                     [--num-requests N]
                     [--max-concurrency C] [--request-rate inf|R [--burstiness B] | --fixed-interval S]
                     [--warmup N] [--seed S] [--ignore-eos] [--out FILE]

Every request streams (`stream: true`, `stream_options: {include_usage: true}`). Per request, as
serving.md defines them: TTFT = time from sending to the first chunk with choices; E2EL = time to
the last chunk with choices; ITL = the gaps between consecutive chunks with choices; TPOT = (E2EL -
TTFT) / (output tokens - 1), output tokens from the stream's `usage.completion_tokens` (a request
whose stream carries no usage fails). Arrivals: all at once (`--request-rate inf`, the default),
Poisson at R requests/s with gamma-distributed gaps of shape `--burstiness` (1 = Poisson), or every
S seconds (`--fixed-interval`); `--max-concurrency` caps the requests in flight (a request that
arrives at the cap waits, and is timed from when it is sent). `--warmup N` requests run first,
untimed.

Prompts: random ones of `--input-len` tokens, or a JSONL `--prompt-file` (one object per line:
`{"prompt": "text" or [token ids], "output_len": N}` or `{"messages": [...], "output_len": N}`;
output_len defaults to --output-len). Random prompts for /v1/completions are token ids (the
server must take token-id prompts, as vLLM's and ours do), drawn from the non-special ids of
`--tokenizer` (a tokenizer.json, or a directory holding one) or from [0, --vocab-size); for
/v1/chat/completions, or with --random-text, they are text: --input-len random tokens of
--tokenizer decoded (about that many tokens again), or --input-len random lowercase words.
Shared prefixes (as vLLM's prefix-repetition and SGLang's generated-shared-prefix workloads):
with `--prefix-len P`, `--num-prefixes K` random prompts of P tokens are drawn once, and request i
is prefix i % K followed by its own random prompt (the --input-len part); the warm-up requests
cycle through the prefixes too, so `--warmup K` has every prefix cached before the timed run.

Prints ONE JSON object (also written to --out): the settings; completed and failed counts with the
first errors; for the whole run and for the stable stage, requests, duration, token counts,
request / output-token / total-token throughput and the mean, median, P90 and P99 of TTFT, TPOT,
ITL and E2EL in milliseconds; the speculative-decoding acceptance read from the server's /metrics
before and after the timed run (counters `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`,
`..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos` by position, or the same under
`dsv4:`): acceptance rate = accepted / draft tokens,
acceptance length = 1 + accepted / drafts; and one record per request.

The stable stage (AISBench's): the client-side concurrency (requests sent and not finished)
first reaches its maximum (--max-concurrency, or the highest it reached without one); the stage
runs from the first request sent after that moment to the last moment the concurrency left its
maximum. The requests sent inside it are the stable ones, and its length is the duration its
throughputs divide by. None when no request was sent while the concurrency held its maximum.

Bad arguments, a server that cannot be reached or a failing warm-up print one line and exit 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import sys
import time

import numpy as np

from dsv4_jax.runtime.cli_args import ArgumentParser, UsageError
from dsv4_jax.runtime.speculative import SPEC_DECODE_COUNTERS, acceptance

PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"  # labelled by position
METRIC_PREFIXES = ("dsv4:", "vllm:")
MAX_ERRORS = 5  # errors kept in the report


class BenchError(Exception):
    """A problem that stops the benchmark; the message says what and where."""


@dataclasses.dataclass
class RequestSpec:
    """One request's input: text, token ids, or chat messages; and its max_tokens."""

    prompt: str | list[int] | list[dict]
    output_len: int


@dataclasses.dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from the run's start."""

    index: int
    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # chunks with choices
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2el(self) -> float:
        return self.chunk_times[-1] - self.start

    @property
    def itl(self) -> list[float]:
        return list(np.diff(self.chunk_times))

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens or 0
        return (self.e2el - self.ttft) / (n - 1) if n > 1 else None


# ---- arrivals and prompts -------------------------------------------------------------------

def arrival_offsets(n: int, request_rate: float = math.inf, burstiness: float = 1.0,
                    fixed_interval: float | None = None, seed: int = 0) -> np.ndarray:
    """Seconds from the run's start at which each of n requests arrives: all at 0 (rate inf), i *
    fixed_interval, or the first at 0 and then gamma gaps of shape burstiness and mean 1 / rate
    (Poisson arrivals at burstiness 1; below 1 burstier, above 1 more regular). [n] float64."""
    if fixed_interval is not None:
        return np.arange(n, dtype=np.float64) * fixed_interval
    if math.isinf(request_rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (request_rate * burstiness), size=max(n - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])


def _load_tokenizer(path: str):
    from tokenizers import Tokenizer

    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise BenchError(f"--tokenizer: {path} not found")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001  the tokenizers package raises plain Exceptions
        raise BenchError(f"--tokenizer: {path} is not a valid tokenizer.json ({str(e).splitlines()[0]})") from None


def random_prompts(n: int, input_len: int, output_len: int, *, text: bool, tokenizer=None,
                   vocab_size: int | None = None, seed: int = 0, input_len_max: int | None = None,
                   prefix_len: int = 0, num_prefixes: int = 1) -> list[RequestSpec]:
    """n random prompts of input_len tokens (with input_len_max, of lengths drawn uniformly from
    input_len .. input_len_max), prompt i after prefix i % num_prefixes of `num_prefixes` random
    prompts of prefix_len tokens (none when prefix_len is 0). Token ids: from the tokenizer's
    non-special ids, or
    [0, vocab_size). Text with a tokenizer: its tokens that decode to printable text on their
    own, drawn until the text encodes to at least input_len tokens, cut there (the cut text may
    encode one or two tokens apart, where merges cross the cut); without one, input_len random
    lowercase words."""
    rng = np.random.default_rng(seed)
    if tokenizer is not None:
        special = set(tokenizer.get_added_tokens_decoder())
        pool = [i for i in range(tokenizer.get_vocab_size()) if i not in special]
        if text:
            pool = [i for i in pool if (s := tokenizer.decode([i])) and s.isprintable() and "\ufffd" not in s]
        if not pool:
            raise BenchError("--tokenizer has no token to build random prompts from")
        pool = np.array(pool)
    elif vocab_size is not None:
        pool = np.arange(vocab_size)
    elif not text:
        raise BenchError("random token-id prompts need --tokenizer or --vocab-size (or use --random-text)")
    if prefix_len:
        prefixes = [p.prompt for p in random_prompts(num_prefixes, prefix_len, output_len, text=text,
                                                     tokenizer=tokenizer, vocab_size=vocab_size, seed=seed + 1)]
        own = random_prompts(n, input_len, output_len, text=text, tokenizer=tokenizer, vocab_size=vocab_size,
                             seed=seed, input_len_max=input_len_max)
        join = (lambda a, b: a + " " + b) if text else (lambda a, b: a + b)  # noqa: E731
        return [RequestSpec(join(prefixes[i % num_prefixes], r.prompt), output_len) for i, r in enumerate(own)]
    specs = []
    lengths = rng.integers(input_len, input_len_max + 1, n) if input_len_max else [input_len] * n
    for input_len in map(int, lengths):
        if tokenizer is None and text:
            prompt: str | list[int] = " ".join("".join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(2, 8)))
                                               for _ in range(input_len))
        elif text:
            ids: list[int] = []
            while len(ids) < input_len:
                more = tokenizer.decode([int(i) for i in rng.choice(pool, input_len)])
                ids = tokenizer.encode(tokenizer.decode(ids) + more, add_special_tokens=False).ids
            prompt = tokenizer.decode(ids[:input_len])
        else:
            prompt = [int(i) for i in rng.choice(pool, input_len)]
        specs.append(RequestSpec(prompt, output_len))
    return specs


def load_prompt_file(path: str, endpoint: str, default_output_len: int) -> list[RequestSpec]:
    """The JSONL prompt file's requests (format: module doc); a bad line is an error naming it."""
    specs = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        raise BenchError(f"--prompt-file: cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise BenchError(f"--prompt-file: {path} is not UTF-8 text") from None
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--prompt-file {path}:{no}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise BenchError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or ("prompt" in obj) == ("messages" in obj):
            raise BenchError(f"{where}: expected an object with either \"prompt\" or \"messages\"")
        out = obj.get("output_len", default_output_len)
        if isinstance(out, bool) or not isinstance(out, int) or out < 1:
            raise BenchError(f"{where}: output_len must be a positive integer, got {out!r}")
        prompt = obj.get("prompt", obj.get("messages"))
        if "messages" in obj:
            if endpoint != "chat":
                raise BenchError(f"{where}: \"messages\" needs --endpoint chat")
            if not isinstance(prompt, list) or not prompt or not all(isinstance(m, dict) for m in prompt):
                raise BenchError(f"{where}: \"messages\" must be a non-empty list of objects")
        elif isinstance(prompt, list):
            if endpoint == "chat":
                raise BenchError(f"{where}: token-id prompts need --endpoint completions")
            if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
                raise BenchError(f"{where}: \"prompt\" must be text or a non-empty list of token ids")
        elif not isinstance(prompt, str) or not prompt:
            raise BenchError(f"{where}: \"prompt\" must be text or a non-empty list of token ids")
        specs.append(RequestSpec(prompt, out))
    if not specs:
        raise BenchError(f"--prompt-file: {path} holds no requests")
    return specs


def request_body(spec: RequestSpec, endpoint: str, model: str, ignore_eos: bool,
                 temperature: float | None) -> dict:
    body: dict = {"model": model, "max_tokens": spec.output_len, "stream": True,
                  "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        messages = spec.prompt if isinstance(spec.prompt, list) else [{"role": "user", "content": spec.prompt}]
        body["messages"] = messages
    else:
        body["prompt"] = spec.prompt
    if ignore_eos:
        body["ignore_eos"] = True
    if temperature is not None:
        body["temperature"] = temperature
    return body


# ---- one request ----------------------------------------------------------------------------

def _error_text(status: int, raw: bytes) -> str:
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = raw.decode("utf-8", "replace").strip()[:200]
    return f"HTTP {status}: {message}"


async def send_request(client, url: str, body: dict, result: RequestResult, clock) -> None:
    """Streams one request, filling result (times from clock()); failures go to result.error."""
    import httpx

    result.start = clock()
    usage = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                result.error = _error_text(resp.status_code, await resp.aread())
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                now = clock()
                chunk = json.loads(data)
                if chunk.get("error"):
                    err = chunk["error"]
                    result.error = f"error in stream: {err.get('message', err) if isinstance(err, dict) else err}"
                    return
                if chunk.get("choices"):
                    result.chunk_times.append(now)
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return
    except (ValueError, AttributeError) as e:
        result.error = f"malformed stream chunk: {e}"
        return
    finally:
        result.end = clock()
    if not isinstance(usage, dict) or not isinstance(usage.get("completion_tokens"), int):
        result.error = "the stream carried no usage.completion_tokens (stream_options.include_usage ignored?)"
    elif not result.chunk_times:
        result.error = "the stream carried no chunk with choices"
    else:
        result.output_tokens = usage["completion_tokens"]
        result.prompt_tokens = usage.get("prompt_tokens")


async def run_requests(client, url: str, bodies: list[dict], offsets: np.ndarray,
                       max_concurrency: int | None) -> tuple[list[RequestResult], float]:
    """Sends bodies[i] at offsets[i] (or when a concurrency slot frees); returns the results
    (times from the run's start) and the run's duration (start to the last request's end)."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    results = [RequestResult(i) for i in range(len(bodies))]

    async def one(i: int) -> None:
        delay = offsets[i] - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        async with gate:
            await send_request(client, url, bodies[i], results[i], clock)

    await asyncio.gather(*(one(i) for i in range(len(bodies))))
    return results, max((r.end for r in results), default=0.0)


# ---- aggregates -----------------------------------------------------------------------------

def stats_ms(values) -> dict:
    """mean, median, P90, P99 of seconds, in milliseconds (None without samples)."""
    x = np.asarray([v for v in values if v is not None], np.float64) * 1e3
    if x.size == 0:
        return {"count": 0, "mean": None, "median": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {"count": int(x.size), "mean": float(x.mean()), "median": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(results: list[RequestResult], duration: float) -> dict:
    """Throughputs over duration and latency statistics of the completed requests among results."""
    done = [r for r in results if r.ok]
    inputs = sum(r.prompt_tokens or 0 for r in done)
    outputs = sum(r.output_tokens for r in done)
    return {
        "requests": len(done), "duration_s": duration, "input_tokens": inputs, "output_tokens": outputs,
        "request_throughput": len(done) / duration if duration > 0 else None,
        "output_throughput": outputs / duration if duration > 0 else None,
        "total_token_throughput": (inputs + outputs) / duration if duration > 0 else None,
        "ttft_ms": stats_ms(r.ttft for r in done), "tpot_ms": stats_ms(r.tpot for r in done),
        "itl_ms": stats_ms(g for r in done for g in r.itl), "e2el_ms": stats_ms(r.e2el for r in done),
    }


def _events(intervals: list[tuple[float, float]]) -> list[tuple[float, int]]:
    """(time, +1 at a start / -1 at an end), in time order, an end first on a tie."""
    return sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])


def peak_concurrency(intervals: list[tuple[float, float]]) -> int:
    """The most [start, end) intervals open at once."""
    level = peak = 0
    for _, step in _events(intervals):
        level += step
        peak = max(peak, level)
    return peak


def stable_stage(intervals: list[tuple[float, float]], max_concurrency: int | None) -> tuple[float, float, int] | None:
    """(t_start, t_end, concurrency) of the stable stage (module doc) of requests in flight over
    [start, end) intervals, or None when no request was sent while the concurrency held its maximum."""
    target = max_concurrency or peak_concurrency(intervals)
    level, reached, t_start, t_end = 0, False, None, None
    for t, step in _events(intervals):
        before, level = level, level + step
        if step == 1 and reached and t_start is None:
            t_start = t
        if step == 1 and level == target:
            reached = True
        if step == -1 and before == target:
            t_end = t
    if t_start is None or t_end is None or t_end <= t_start:
        return None
    return t_start, t_end, target


# ---- the server's metrics -------------------------------------------------------------------

def spec_decode_counters(text: str) -> dict | None:
    """The spec-decode counters (summed over label sets) in a Prometheus text exposition, under
    the first prefix of METRIC_PREFIXES that has them; None when it has none."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name.endswith("_created"):
                continue
            name = name.removesuffix("_total")
            for prefix in METRIC_PREFIXES:
                counter = name.removeprefix(prefix)
                if not name.startswith(prefix) or counter not in SPEC_DECODE_COUNTERS + (PER_POSITION,):
                    continue
                entry = found.setdefault(prefix, {**dict.fromkeys(SPEC_DECODE_COUNTERS, 0.0), "per_position": {}})
                if counter == PER_POSITION:
                    i = int(sample.labels.get("position", 0))
                    entry["per_position"][i] = entry["per_position"].get(i, 0.0) + sample.value
                else:
                    entry[counter] += sample.value
    for prefix in METRIC_PREFIXES:
        if prefix in found:
            return {"prefix": prefix, **found[prefix]}
    return None


def spec_decode_report(before: dict | None, after: dict | None) -> dict | None:
    """Acceptance over the timed run from the counters before and after it."""
    if before is None or after is None:
        return None
    delta = {k: after[k] - before.get(k, 0.0) for k in SPEC_DECODE_COUNTERS}
    positions = sorted(after.get("per_position", {}))
    per_position = [after["per_position"][i] - before.get("per_position", {}).get(i, 0.0) for i in positions]
    return {"metrics_prefix": after["prefix"], **delta, PER_POSITION: per_position,
            **acceptance(*(delta[k] for k in SPEC_DECODE_COUNTERS))}


async def _scrape(client, root: str) -> dict | None:
    import httpx

    try:
        resp = await client.get(root + "/metrics")
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    try:
        return spec_decode_counters(resp.text)
    except ValueError:  # not the Prometheus text format
        return None


# ---- the run --------------------------------------------------------------------------------

def _urls(base_url: str) -> tuple[str, str]:
    """(server root, API root ending in /v1) from --base-url given with or without /v1."""
    root = base_url.rstrip("/")
    root = root.removesuffix("/v1")
    return root, root + "/v1"


async def _first_model(client, api: str, model: str | None) -> str:
    import httpx

    try:
        resp = await client.get(api + "/models")
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach the server at {api}/models: {type(e).__name__}: {e}") from None
    if model is not None:
        return model
    if resp.status_code != 200:
        raise BenchError(f"GET {api}/models: {_error_text(resp.status_code, resp.content)} (pass --model)")
    try:
        return resp.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchError(f"GET {api}/models listed no model (pass --model)") from None


def _record(r: RequestResult, stable: bool) -> dict:
    out = {"index": r.index, "start_s": r.start, "end_s": r.end, "stable": stable, "error": r.error}
    if r.ok:
        out.update(ttft_ms=r.ttft * 1e3, tpot_ms=None if r.tpot is None else r.tpot * 1e3, e2el_ms=r.e2el * 1e3,
                   chunks=len(r.chunk_times), prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens)
    return out


async def benchmark(args, specs: list[RequestSpec], warmup: list[RequestSpec]) -> dict:
    import httpx

    root, api = _urls(args.base_url)
    url = api + ("/chat/completions" if args.endpoint == "chat" else "/completions")
    timeout = httpx.Timeout(args.timeout, connect=min(args.timeout, 30.0))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model = await _first_model(client, api, args.model)

        def bodies(batch):
            return [request_body(s, args.endpoint, model, args.ignore_eos, args.temperature) for s in batch]

        if warmup:
            done, _ = await run_requests(client, url, bodies(warmup), np.zeros(len(warmup)), args.max_concurrency)
            bad = [r for r in done if not r.ok]
            if bad:
                raise BenchError(f"{len(bad)} of {len(warmup)} warm-up requests failed; first: {bad[0].error}")
        before = await _scrape(client, root)
        offsets = arrival_offsets(len(specs), args.request_rate, args.burstiness, args.fixed_interval, args.seed)
        results, duration = await run_requests(client, url, bodies(specs), offsets, args.max_concurrency)
        after = await _scrape(client, root)

    stage = stable_stage([(r.start, r.end) for r in results], args.max_concurrency)
    stable_ids = {r.index for r in results if stage and stage[0] <= r.start <= stage[1]}
    failed = [r for r in results if not r.ok]
    report = {
        "tool": "dsv4-bench-serve",
        "settings": {"base_url": args.base_url, "model": model, "endpoint": args.endpoint,
                     "num_requests": len(specs), "max_concurrency": args.max_concurrency,
                     "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
                     "burstiness": args.burstiness, "fixed_interval": args.fixed_interval, "warmup": len(warmup),
                     "seed": args.seed, "ignore_eos": args.ignore_eos, "temperature": args.temperature,
                     "prompt_file": args.prompt_file,
                     "input_len": None if args.prompt_file else args.input_len,
                     "prefix_len": args.prefix_len, "num_prefixes": args.num_prefixes,
                     "output_len": None if args.prompt_file else args.output_len},
        "completed": len(results) - len(failed), "failed": len(failed),
        "errors": [{"index": r.index, "error": r.error} for r in sorted(failed, key=lambda r: r.end)[:MAX_ERRORS]],
        "max_concurrency_reached": peak_concurrency([(r.start, r.end) for r in results]),
        "all": summarize(results, duration),
        "stable": None,
        "spec_decode": spec_decode_report(before, after),
        "requests": [_record(r, r.index in stable_ids) for r in results],
    }
    if stage is not None:
        t_start, t_end, level = stage
        report["stable"] = {"start_s": t_start, "end_s": t_end, "concurrency": level,
                            **summarize([r for r in results if r.index in stable_ids], t_end - t_start)}
    return report


# ---- command line ---------------------------------------------------------------------------

def parse_args(argv) -> tuple:
    ap = ArgumentParser(prog="dsv4-bench-serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (with or without /v1)")
    ap.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    ap.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    ap.add_argument("--input-len", type=int, default=128, help="random prompts' length in tokens")
    ap.add_argument("--input-len-max", type=int, help="random prompts' lengths drawn uniformly from --input-len "
                                                      "to this")
    ap.add_argument("--prefix-len", type=int, default=0, help="random prompts after a shared prefix of this many "
                                                               "tokens (default 0: none)")
    ap.add_argument("--num-prefixes", type=int, default=1, help="shared prefixes, request i after prefix i %% N "
                                                                "(default 1)")
    ap.add_argument("--output-len", type=int, default=128, help="max_tokens of every request")
    ap.add_argument("--prompt-file", help="JSONL requests instead of random prompts")
    ap.add_argument("--tokenizer", help="tokenizer.json (or a directory holding one) for random prompts")
    ap.add_argument("--vocab-size", type=int, help="random token ids in [0, N) when there is no --tokenizer")
    ap.add_argument("--random-text", action="store_true", help="random prompts as text, also for completions")
    ap.add_argument("--num-requests", type=int, help="requests timed (default: 100, or the prompt file's count)")
    ap.add_argument("--max-concurrency", type=int, help="most requests in flight (default: no cap)")
    ap.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, or inf (all at once)")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    ap.add_argument("--fixed-interval", type=float, help="seconds between arrivals (instead of --request-rate)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed requests before the run (default 1)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts and the arrival gaps")
    ap.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (generate all output tokens)")
    ap.add_argument("--temperature", type=float, help="send this temperature (default: the server's)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds without a byte before a request fails")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)

    checks = [(args.input_len >= 1, f"--input-len must be >= 1, got {args.input_len}"),
              (args.output_len >= 1, f"--output-len must be >= 1, got {args.output_len}"),
              (args.prefix_len >= 0, f"--prefix-len must be >= 0, got {args.prefix_len}"),
              (args.num_prefixes >= 1, f"--num-prefixes must be >= 1, got {args.num_prefixes}"),
              (not (args.prefix_len and args.prompt_file), "--prefix-len and --prompt-file exclude each other"),
              (args.input_len_max is None or args.input_len_max >= args.input_len,
               f"--input-len-max must be >= --input-len, got {args.input_len_max}"),
              (args.num_requests is None or args.num_requests >= 1,
               f"--num-requests must be >= 1, got {args.num_requests}"),
              (args.max_concurrency is None or args.max_concurrency >= 1,
               f"--max-concurrency must be >= 1, got {args.max_concurrency}"),
              (args.request_rate > 0, f"--request-rate must be > 0 or inf, got {args.request_rate}"),
              (math.isfinite(args.burstiness) and args.burstiness > 0,
               f"--burstiness must be a positive number, got {args.burstiness}"),
              (args.fixed_interval is None or (math.isfinite(args.fixed_interval) and args.fixed_interval >= 0),
               f"--fixed-interval must be a number of seconds >= 0, got {args.fixed_interval}"),
              (args.fixed_interval is None or math.isinf(args.request_rate),
               "--fixed-interval and --request-rate exclude each other"),
              (args.warmup >= 0, f"--warmup must be >= 0, got {args.warmup}"),
              (args.vocab_size is None or args.vocab_size >= 1, f"--vocab-size must be >= 1, got {args.vocab_size}"),
              (args.timeout > 0, f"--timeout must be > 0, got {args.timeout}"),
              (args.base_url.startswith(("http://", "https://")),
               f"--base-url must start with http:// or https://, got {args.base_url!r}"),
              (args.out is None or os.access(os.path.dirname(os.path.abspath(args.out)), os.W_OK),
               f"--out {args.out}: its directory does not exist or cannot be written")]
    for ok, message in checks:
        if not ok:
            raise UsageError(message)

    if args.prompt_file:
        pool = load_prompt_file(args.prompt_file, args.endpoint, args.output_len)
        n = args.num_requests or len(pool)
        specs = [pool[i % len(pool)] for i in range(n + args.warmup)]
    else:
        tok = _load_tokenizer(args.tokenizer) if args.tokenizer else None
        n = args.num_requests or 100
        specs = random_prompts(n + args.warmup, args.input_len, args.output_len,
                               text=args.endpoint == "chat" or args.random_text, tokenizer=tok,
                               vocab_size=args.vocab_size, seed=args.seed, input_len_max=args.input_len_max,
                               prefix_len=args.prefix_len, num_prefixes=args.num_prefixes)
    return args, specs[:n], specs[n:]  # the warm-up requests come after: they do not shift the timed ones


def main(argv=None) -> int:
    try:
        args, specs, warmup = parse_args(argv)
        report = asyncio.run(benchmark(args, specs, warmup))
    except (UsageError, BenchError) as e:
        print(f"dsv4-bench-serve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("dsv4-bench-serve: interrupted", file=sys.stderr)
        return 130
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        try:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        except OSError as e:
            print(f"dsv4-bench-serve: error: cannot write --out {args.out}: {e.strerror or e}", file=sys.stderr)
            return 1
    if report["completed"] == 0:
        print(f"dsv4-bench-serve: error: all {report['failed']} requests failed; first: {report['errors'][0]['error']}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
