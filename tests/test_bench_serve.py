"""dsv4-bench-serve against a scripted OpenAI-compatible SSE server (FastAPI + uvicorn in a thread,
on a free port) that streams its tokens at known delays with a known usage: the measured TTFT /
ITL / TPOT / E2EL, the stable stage, the arrival schedules, the concurrency cap, the
speculative-decoding counters, failed requests and the JSON report; bad arguments and a server
that refuses connections give one line and exit 1."""

import asyncio
import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import stderr_lines

from dsv4_jax.tools import bench_serve as bs
from dsv4_jax.tools import random_checkpoint as rc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAIL_LEN = 99  # a request with this max_tokens gets a 400


@dataclasses.dataclass
class Script:
    """What the server does: the first token after `ttft` s, one more every `itl` s, the usage
    chunk `usage_delay` s after the last token; what it saw: arrivals, concurrency."""

    ttft: float = 0.1
    itl: float = 0.05
    usage_delay: float = 0.0
    drafts_per_request: tuple = (3, 6, 4, 3, 1)  # spec-decode counters added per finished request: drafts,
    # draft tokens, accepted tokens, accepted at draft position 0, at position 1
    arrivals: list = dataclasses.field(default_factory=list)  # (perf_counter, body)
    active: int = 0
    max_active: int = 0
    counters: list = dataclasses.field(default_factory=lambda: [0, 0, 0, 0, 0])


def _app(script: Script):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "scripted-model", "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        names = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
        lines = []
        for name, value in zip(names, script.counters):
            lines += [f"# TYPE dsv4:{name} counter", f'dsv4:{name}_total{{model_name="scripted-model"}} {value}']
        lines.append("# TYPE dsv4:spec_decode_num_accepted_tokens_per_pos counter")
        lines += [f'dsv4:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} {v}'
                  for i, v in enumerate(script.counters[3:])]
        lines.append("dsv4:num_requests_running 0")
        return PlainTextResponse("\n".join(lines) + "\n")

    async def stream(request: Request, chat: bool):
        body = await request.json()
        script.arrivals.append((time.perf_counter(), body))
        n = body["max_tokens"]
        if n == FAIL_LEN:
            return JSONResponse({"error": {"message": "scripted refusal", "type": "BadRequestError",
                                           "param": None, "code": 400}}, status_code=400)
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        script.active += 1
        script.max_active = max(script.max_active, script.active)

        def chunk(i):
            choice = {"index": 0, "delta": {"content": f"t{i}"}} if chat else {"index": 0, "text": f"t{i}"}
            return f"data: {json.dumps({'id': 'x', 'choices': [choice]})}\n\n"

        async def events():
            try:
                await asyncio.sleep(script.ttft)
                for i in range(n):
                    if i:
                        await asyncio.sleep(script.itl)
                    yield chunk(i)
                await asyncio.sleep(script.usage_delay)
                usage = {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}
                yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
                script.counters = [c + d for c, d in zip(script.counters, script.drafts_per_request)]
            finally:
                script.active -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await stream(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await stream(request, chat=True)

    return app


@pytest.fixture
def server():
    """(base url, Script) of a scripted server running for one test."""
    import uvicorn

    script = Script()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(_app(script), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline, "the scripted server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", script
    srv.should_exit = True
    thread.join(10)
    sock.close()


def _run(argv, capsys) -> dict:
    code = bs.main(argv)
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


STATS = {"count", "mean", "median", "p90", "p99"}
SUMMARY = {"requests", "duration_s", "input_tokens", "output_tokens", "request_throughput", "output_throughput",
           "total_token_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"}


def test_latencies_match_the_script(server, tmp_path, capsys):
    """6 requests of 7 prompt ids and 6 tokens, 2 at a time; the server waits 0.4 s for the first
    token, 0.05 s between tokens and 0.2 s more before the usage chunk. Lower bounds are the
    server's sleeps (the client's clock starts before the server's); upper bounds leave room for
    a loaded machine (150 ms, 35 ms per gap) and still exclude the wrong definitions: E2EL to the
    end of the stream (>= 850 ms), TPOT as E2EL / tokens (>= 108 ms), TTFT to the usage chunk
    (>= 850 ms)."""
    url, script = server
    script.ttft, script.itl, script.usage_delay = 0.4, 0.05, 0.2
    out = tmp_path / "report.json"
    report = _run(["--base-url", url, "--num-requests", "6", "--max-concurrency", "2", "--input-len", "7",
                   "--output-len", "6", "--vocab-size", "100", "--warmup", "1", "--ignore-eos", "--out", str(out)],
                  capsys)
    assert json.loads(out.read_text()) == report

    assert set(report) == {"tool", "settings", "completed", "failed", "errors", "max_concurrency_reached", "all",
                           "stable", "spec_decode", "requests"}
    assert report["settings"]["model"] == "scripted-model"  # the first of /v1/models
    assert (report["completed"], report["failed"], report["errors"]) == (6, 0, [])
    assert len(script.arrivals) == 7  # the warm-up request too
    for _, body in script.arrivals:
        assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
        assert body["max_tokens"] == 6 and len(body["prompt"]) == 7 and all(0 <= t < 100 for t in body["prompt"])
        assert body["model"] == "scripted-model"
    assert script.max_active == 2 and report["max_concurrency_reached"] == 2

    for r in report["requests"]:
        assert (r["chunks"], r["output_tokens"], r["prompt_tokens"], r["error"]) == (6, 6, 7, None)
        assert 400 <= r["ttft_ms"] <= 550, r
        assert 650 <= r["e2el_ms"] <= 800, r
        assert 45 <= r["tpot_ms"] <= 85, r  # 50 ms a token; a late first chunk shortens the rest a little
        assert r["tpot_ms"] == pytest.approx((r["e2el_ms"] - r["ttft_ms"]) / 5, rel=1e-9)
        assert r["end_s"] - r["start_s"] >= 0.85  # the stream ends after the usage delay
    whole = report["all"]
    assert set(whole) == SUMMARY and all(set(whole[k]) == STATS for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"))
    assert whole["itl_ms"]["count"] == 6 * 5 and 49 <= whole["itl_ms"]["median"] <= 85
    assert whole["ttft_ms"]["count"] == 6 and 400 <= whole["ttft_ms"]["mean"] <= 550
    assert (whole["requests"], whole["input_tokens"], whole["output_tokens"]) == (6, 42, 36)
    # three rounds of two requests of at least 0.85 s each
    assert 2.55 <= whole["duration_s"] <= 3.2
    assert whole["output_throughput"] == pytest.approx(36 / whole["duration_s"])
    assert whole["total_token_throughput"] == pytest.approx(78 / whole["duration_s"])
    assert whole["request_throughput"] == pytest.approx(6 / whole["duration_s"])
    # the counters moved by 3 drafts, 6 drafted and 4 accepted tokens per timed request (not the warm-up's)
    assert report["spec_decode"] == {"metrics_prefix": "dsv4:", "spec_decode_num_drafts": 18.0,
                                     "spec_decode_num_draft_tokens": 36.0, "spec_decode_num_accepted_tokens": 24.0,
                                     "spec_decode_num_accepted_tokens_per_pos": [18.0, 6.0],
                                     "acceptance_rate": pytest.approx(24 / 36),
                                     "acceptance_length": pytest.approx(1 + 24 / 18)}


def test_stable_stage_and_arrivals_at_a_fixed_interval(server, tmp_path, capsys):
    """Arrivals every 0.6 s, at most 2 in flight; each request lasts 0.1 + 0.05 (n - 1) s for n
    tokens. Schedule (s): r0 0-1.0; r1 0.6-2.1 (concurrency first reaches 2); r2 1.2-1.9 (the
    first start after that: the stage begins); r3 arrives 1.8, waits for r2's slot, 1.9-2.7; r4
    2.4-2.55 (its end is the last drop from 2: the stage ends); r5 3.0-3.2 alone. Stable: r2, r3,
    r4. The nearest events the outcome depends on are 0.15 s apart."""
    url, script = server
    lens = [19, 29, 13, 15, 2, 5]
    prompts = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": [1, 2, 3], "output_len": n} for n in lens])
    report = _run(["--base-url", url, "--prompt-file", prompts, "--max-concurrency", "2", "--fixed-interval", "0.6",
                   "--warmup", "0"], capsys)
    req = report["requests"]
    assert [r["output_tokens"] for r in req] == lens
    starts = [r["start_s"] for r in req]
    for got, want in zip(starts, [0.0, 0.6, 1.2, 1.9, 2.4, 3.0]):
        assert want <= got <= want + 0.06, starts
    assert [r["stable"] for r in req] == [False, False, True, True, True, False]
    stable = report["stable"]
    assert stable["concurrency"] == 2 and stable["requests"] == 3
    assert stable["start_s"] == req[2]["start_s"] and stable["end_s"] == req[4]["end_s"]
    assert stable["duration_s"] == pytest.approx(stable["end_s"] - stable["start_s"])
    assert stable["output_tokens"] == 13 + 15 + 2
    assert stable["output_throughput"] == pytest.approx(30 / stable["duration_s"])
    assert stable["ttft_ms"]["count"] == 3 and report["all"]["ttft_ms"]["count"] == 6
    assert script.max_active == 2
    assert report["spec_decode"]["metrics_prefix"] == "dsv4:"


def test_concurrency_cap_all_at_once(server, capsys):
    url, script = server
    script.ttft, script.itl = 0.05, 0.02
    report = _run(["--base-url", url, "--num-requests", "10", "--max-concurrency", "3", "--input-len", "4",
                   "--output-len", "5", "--vocab-size", "50", "--warmup", "0"], capsys)
    assert script.max_active == 3 and report["max_concurrency_reached"] == 3
    intervals = [(r["start_s"], r["end_s"]) for r in report["requests"]]
    assert bs.peak_concurrency(intervals) == 3
    # the first 3 start together, every later one when one ends: stable from the 4th start on
    order = sorted(range(10), key=lambda i: intervals[i][0])
    assert [report["requests"][i]["stable"] for i in order[:3]] == [False] * 3
    assert report["stable"]["requests"] >= 5


def test_poisson_arrivals_follow_the_seeded_schedule(server, capsys):
    url, script = server
    script.ttft, script.itl = 0.02, 0.01
    report = _run(["--base-url", url, "--num-requests", "6", "--request-rate", "4", "--seed", "3",
                   "--input-len", "3", "--output-len", "2", "--vocab-size", "50", "--warmup", "0"], capsys)
    want = bs.arrival_offsets(6, 4.0, 1.0, None, 3)
    got = [r["start_s"] for r in report["requests"]]
    assert np.all(np.asarray(got) >= want) and np.all(np.asarray(got) <= want + 0.06), (got, want)
    assert report["settings"]["request_rate"] == 4.0


def test_arrival_offsets():
    assert np.array_equal(bs.arrival_offsets(4), np.zeros(4))
    assert np.array_equal(bs.arrival_offsets(4, fixed_interval=0.5), [0.0, 0.5, 1.0, 1.5])
    a = bs.arrival_offsets(20001, 4.0, 1.0, seed=11)
    assert np.array_equal(a, bs.arrival_offsets(20001, 4.0, 1.0, seed=11))
    assert not np.array_equal(a, bs.arrival_offsets(20001, 4.0, 1.0, seed=12))
    assert a[0] == 0 and np.all(np.diff(a) > 0)
    # gamma gaps of shape k and mean 1/rate: coefficient of variation 1/sqrt(k) (Poisson: 1);
    # 20,000 gaps put the sample mean within 1.5 % and the CV within 3 % (several standard errors)
    for k in (1.0, 4.0, 0.25):
        gaps = np.diff(bs.arrival_offsets(20001, 4.0, k, seed=5))
        assert gaps.mean() == pytest.approx(0.25, rel=0.015 * max(1, 1 / math.sqrt(k)))
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(k), rel=0.03 * max(1, 1 / math.sqrt(k)))


def test_stable_stage_unit():
    # cap 2: a ramp, then every start at the cap, then a lone tail request
    iv = [(0.0, 1.0), (0.5, 2.0), (1.2, 1.9), (1.9, 2.6), (2.1, 2.4), (3.0, 3.1)]
    assert bs.stable_stage(iv, 2) == (1.2, 2.4, 2)
    assert bs.stable_stage(iv, None) == (1.2, 2.4, 2)  # no cap: the peak reached
    assert bs.stable_stage(iv, 3) is None  # never reached
    assert bs.stable_stage([(0.0, 1.0), (0.0, 1.0)], 2) is None  # nothing started after reaching it


def test_spec_decode_counters_either_prefix():
    text = ("# TYPE vllm:spec_decode_num_drafts counter\n"
            'vllm:spec_decode_num_drafts_total{engine="0"} 10\nvllm:spec_decode_num_drafts_total{engine="1"} 2\n'
            'vllm:spec_decode_num_drafts_created{engine="0"} 1.7e9\n'
            "vllm:spec_decode_num_draft_tokens_total 30\nvllm:spec_decode_num_accepted_tokens_total 21\n"
            "vllm:num_requests_running 4\n")
    c = bs.spec_decode_counters(text)
    assert c == {"prefix": "vllm:", "spec_decode_num_drafts": 12.0, "spec_decode_num_draft_tokens": 30.0,
                 "spec_decode_num_accepted_tokens": 21.0, "per_position": {}}
    assert bs.spec_decode_counters("dsv4:num_requests_running 1\n") is None
    before = dict(c, spec_decode_num_drafts=2.0, spec_decode_num_draft_tokens=6.0, spec_decode_num_accepted_tokens=3.0)
    r = bs.spec_decode_report(before, c)
    assert (r["acceptance_rate"], r["acceptance_length"]) == (pytest.approx(18 / 24), pytest.approx(1 + 18 / 10))
    assert bs.spec_decode_report(None, c) is None


def test_failed_requests_are_counted_with_their_errors(server, tmp_path, capsys):
    url, _ = server
    prompts = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a b c", "output_len": n} for n in (3, FAIL_LEN, 2)])
    report = _run(["--base-url", url, "--prompt-file", prompts, "--warmup", "0"], capsys)
    assert (report["completed"], report["failed"]) == (2, 1)
    assert report["errors"] == [{"index": 1, "error": "HTTP 400: scripted refusal"}]
    assert report["requests"][1]["error"] == "HTTP 400: scripted refusal" and "ttft_ms" not in report["requests"][1]
    assert report["all"]["requests"] == 2 and report["all"]["output_tokens"] == 5

    assert bs.main(["--base-url", url, "--prompt-file", prompts, "--warmup", "2"]) == 1  # a warm-up fails
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "warm-up requests failed; first: HTTP 400: scripted refusal" in err


def test_chat_with_random_text_from_a_tokenizer(server, tmp_path, capsys):
    url, script = server
    tok = rc.build_tokenizer(512, seed=0)
    tok.save(str(tmp_path / "tokenizer.json"))
    report = _run(["--base-url", url, "--endpoint", "chat", "--tokenizer", str(tmp_path), "--num-requests", "3",
                   "--input-len", "20", "--output-len", "3", "--warmup", "0"], capsys)
    assert report["completed"] == 3 and report["all"]["tpot_ms"]["count"] == 3
    for _, body in script.arrivals:
        (message,) = body["messages"]
        assert message["role"] == "user" and isinstance(message["content"], str)
        assert abs(len(tok.encode(message["content"], add_special_tokens=False).ids) - 20) <= 2
    # token ids from the tokenizer leave out its special tokens
    specs = bs.random_prompts(50, 30, 1, text=False, tokenizer=tok, seed=1)
    ids = {t for s in specs for t in s.prompt}
    assert ids and max(ids) < 512 - 4 and min(ids) >= rc.FIRST_BYTE_ID


def test_shared_prefix_prompts():
    """--prefix-len P --num-prefixes K: request i is prefix i % K (drawn once) and its own random
    part of --input-len .. --input-len-max tokens; as text too; the warm-up cycles the prefixes."""
    specs = bs.random_prompts(12, 5, 3, text=False, vocab_size=1000, seed=2, input_len_max=9, prefix_len=40,
                              num_prefixes=3)
    prefixes = [specs[i].prompt[:40] for i in range(3)]
    assert len({tuple(p) for p in prefixes}) == 3
    for i, s in enumerate(specs):
        assert s.prompt[:40] == prefixes[i % 3] and 45 <= len(s.prompt) <= 49 and s.output_len == 3
    assert len({tuple(s.prompt[40:]) for s in specs}) == 12
    text = bs.random_prompts(4, 3, 1, text=True, seed=2, prefix_len=10, num_prefixes=2)
    assert text[0].prompt.split()[:10] == text[2].prompt.split()[:10] != text[1].prompt.split()[:10]
    args, timed, warmup = bs.parse_args(["--vocab-size", "50", "--prefix-len", "20", "--num-prefixes", "2",
                                         "--num-requests", "4", "--warmup", "2"])
    assert [s.prompt[:20] for s in warmup] == [timed[0].prompt[:20], timed[1].prompt[:20]]


BAD = [
    (["--prefix-len", "-1"], "--prefix-len must be >= 0"),
    (["--num-prefixes", "0"], "--num-prefixes must be >= 1"),
    (["--prefix-len", "4", "--prompt-file", "x.jsonl"], "--prefix-len and --prompt-file exclude each other"),
    (["--num-requests", "0"], "--num-requests must be >= 1"),
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
    (["--request-rate", "-1"], "--request-rate must be > 0 or inf"),
    (["--request-rate", "fast"], "argument --request-rate: invalid float value"),
    (["--request-rate", "2", "--fixed-interval", "1"], "exclude each other"),
    (["--burstiness", "0"], "--burstiness must be a positive number"),
    (["--fixed-interval", "-1"], "--fixed-interval must be"),
    (["--input-len", "0"], "--input-len must be >= 1"),
    (["--output-len", "0"], "--output-len must be >= 1"),
    (["--warmup", "-1"], "--warmup must be >= 0"),
    (["--endpoint", "embeddings"], "argument --endpoint: invalid choice"),
    (["--base-url", "localhost:8000"], "--base-url must start with http://"),
    (["--unknown-flag"], "unrecognized arguments: --unknown-flag"),
    ([], "random token-id prompts need --tokenizer or --vocab-size"),
    (["--tokenizer", "/nonexistent/tok"], "--tokenizer: /nonexistent/tok not found"),
    (["--prompt-file", "/nonexistent.jsonl"], "--prompt-file: cannot read /nonexistent.jsonl"),
    (["--vocab-size", "10", "--out", "/nonexistent/dir/report.json"], "its directory does not exist"),
]


@pytest.mark.parametrize("argv,message", BAD)
def test_bad_arguments_one_line_exit_1(argv, message, capsys):
    assert bs.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dsv4-bench-serve: error: ") and message in err, err


@pytest.mark.parametrize("line,message", [
    ("{not json", "not valid JSON"),
    ('{"prompt": "x", "messages": []}', "either \"prompt\" or \"messages\""),
    ('{"messages": [{"role": "user", "content": "x"}]}', "\"messages\" needs --endpoint chat"),
    ('{"prompt": [1, -2]}', "list of token ids"),
    ('{"prompt": "x", "output_len": 0}', "output_len must be a positive integer"),
])
def test_bad_prompt_files(line, message, tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    assert bs.main(["--prompt-file", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and ("p.jsonl:2" in err), err


def test_a_server_that_refuses_connections_is_one_line(tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    r = subprocess.run([sys.executable, "-m", "dsv4_jax.tools.bench_serve", "--base-url", f"http://127.0.0.1:{port}",
                        "--vocab-size", "10", "--num-requests", "2"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    lines = stderr_lines(r.stderr)
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert lines[0].startswith(f"dsv4-bench-serve: error: cannot reach the server at http://127.0.0.1:{port}/v1/models")
