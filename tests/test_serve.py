"""dsv4-serve against a live server: uvicorn on a free port in a thread, serving the random tiny
checkpoint (dsv4_jax.tools.random_checkpoint, converted to float32), driven with the `openai` client and
raw HTTP; plus the chat format, the detokenizer and the command line.

Greedy parity: a request's tokens must be those `dsv4_jax.generate` gives for its prompt alone
(fp32; engine and generate both cut prompts at 16-token chunks). The API returns text, so the
check is the text of generate's tokens (decoded at once, special tokens skipped) and their count
(`usage.completion_tokens`). One server for the module (2 slots, 128 tokens, 16-token chunks:
warm-up compiles 8 programs)."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from conftest import serving, stderr_lines
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

import dsv4_jax
from convert.cli import convert
from dsv4_jax.tools import bench_serve
from dsv4_jax.serving import chat, serve, tokenization
from dsv4_jax.runtime.compile_cache import CompileCounter
from dsv4_jax.runtime.request import RequestError
from dsv4_jax.tools.random_checkpoint import write_random_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLOTS, CHUNK, MAX_LEN, MAX_QUEUE = 2, 16, 128, 8
FLAGS = ["--dtype", "float32", "--slots", str(SLOTS), "--max-len", str(MAX_LEN), "--prefill-chunk", str(CHUNK),
         "--max-queue", str(MAX_QUEUE), "--compile-cache", "off"]
generate_module = sys.modules["dsv4_jax.runtime.generate"]  # the module (dsv4_jax.generate is the function)

# (name, endpoint, prompt or messages, max_tokens, sampling); all run at once in the parity test.
SAMPLED = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 1234}
REQUESTS = [
    ("text", "completions", "The quick brown fox jumps over the lazy dog", 20, {}),
    ("text-short", "completions", "hi", 12, {}),
    ("ids", "completions", list(range(300, 303)), 9, {}),
    ("ids-long", "completions", [int(x) for x in np.random.default_rng(0).integers(2, 510, 45)], 30, {}),
    ("chat", "chat", [{"role": "user", "content": "Tell me a story about a cat."}], 16, {}),
    ("chat-system", "chat", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"},
                             {"role": "assistant", "content": "Because."}, {"role": "user", "content": "OK"}], 10, {}),
    ("ids-sampled", "completions", [7, 8, 9, 10, 11, 12], 14, SAMPLED),
    ("text-2", "completions", "Once upon a time, in a land far away", 25, {}),
]
EOS_PROMPT = "eos eos eos"  # its greedy continuation's 4th token becomes a second eos id of the checkpoint


def _prompt_ids(tok: Tokenizer, kind: str, prompt) -> list[int]:
    if kind == "chat":
        return tok.encode(chat.default_prompt(chat.normalize_messages(prompt)), add_special_tokens=False).ids
    return tok.encode(prompt).ids if isinstance(prompt, str) else prompt


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The converted checkpoint, generate's tokens for every test prompt (computed on its own
    model before the server starts), and the eos id set for the eos test."""
    root = tmp_path_factory.mktemp("serve")
    write_random_checkpoint(root / "hf", "tiny")
    ckpt = root / "tiny-ckpt"
    convert(str(root / "hf"), str(ckpt), dtype="float32")
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    model = dsv4_jax.load(str(ckpt), dtype=jnp.float32)
    mp = pytest.MonkeyPatch()
    mp.setattr(generate_module, "PREFILL_CHUNK", CHUNK)
    try:
        def alone(ids, n, **sampling):
            return dsv4_jax.generate(model, [ids], n, **sampling).rows()[0]

        refs = {}
        for name, kind, prompt, n, sampling in REQUESTS:
            ids = _prompt_ids(tok, kind, prompt)
            refs[name] = (ids, alone(ids, n, **sampling))
        eos_ids = tok.encode(EOS_PROMPT).ids
        refs["eos"] = (eos_ids, alone(eos_ids, 12))
    finally:
        mp.undo()
    eos_out = refs["eos"][1]
    # A second eos id: the first token of the continuation from the 4th on that did not come before.
    eos_at = next(i for i in range(3, len(eos_out)) if eos_out[i] not in eos_out[:i] and eos_out[i] != 1)
    with open(ckpt / "generation_config.json", "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": [1, eos_out[eos_at]]}, f)
    return {"ckpt": ckpt, "tok": tok, "refs": refs, "eos_at": eos_at}


class Live:
    """The running server: its base URL, the Service behind it, and clients."""

    def __init__(self, service, port):
        self.service, self.engine = service, service.engine
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def metrics(self) -> dict:
        """{sample name with labels: value} of /metrics."""
        text = self.http.get("/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "le")
                if "le" not in s.labels:
                    out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out


@pytest.fixture(scope="module")
def live(setup):
    args = serve.parse_args(["--ckpt", str(setup["ckpt"]), *FLAGS])
    logs = []
    service = serve.load_service(args, log=logs.append)
    # decode (whole, in two halves), penalty history, the fork of n > 1 choices, the block table's update of 1 / 2
    # rows, and prefill at 1 / 2 rows x 16 tokens
    assert any(m.startswith("warm-up compiled 8 programs and ran them") for m in logs), logs
    assert any(m.startswith("warm-up: 8/8 prefill (2 rows x 16 tokens): compiled, run") for m in logs), logs
    with serving(service, args) as port:
        yield Live(service, port)
    assert not service.engine.alive()  # the lifespan stopped the engine


def _expected_text(tok, tokens) -> str:
    return tok.decode(tokens, skip_special_tokens=True)


def _ask(live: Live, kind: str, prompt, max_tokens: int, stream: bool, **extra) -> dict:
    """One request through the openai client; returns text, finish reason, usage, chunks."""
    kw = dict(model=live.service.model_name, max_tokens=max_tokens, temperature=extra.pop("temperature", 0.0),
              extra_body=extra)
    for k in ("top_p", "seed", "stop"):
        if k in extra:
            kw[k] = extra.pop(k)
    if stream:
        kw.update(stream=True, stream_options={"include_usage": True})
    if kind == "chat":
        res = live.client.chat.completions.create(messages=prompt, **kw)
    else:
        res = live.client.completions.create(prompt=prompt, **kw)
    if not stream:
        c = res.choices[0]
        return {"text": c.message.content if kind == "chat" else c.text, "finish": c.finish_reason,
                "usage": res.usage.model_dump(exclude_none=True), "chunks": None}
    text, finish, usage, chunks = "", None, None, 0
    for chunk in res:
        if chunk.choices:
            chunks += 1
            c = chunk.choices[0]
            assert finish is None, "a chunk after the one with the finish reason"
            text += (c.delta.content if kind == "chat" else c.text) or ""
            finish = c.finish_reason
        else:
            usage = chunk.usage.model_dump(exclude_none=True)
    return {"text": text, "finish": finish, "usage": usage, "chunks": chunks}


# ---- the live server ------------------------------------------------------------------------

def test_models_and_health(live, setup):
    assert [m.id for m in live.client.models.list().data] == ["tiny-ckpt"]  # the checkpoint directory's name
    assert live.client.models.retrieve("tiny-ckpt").id == "tiny-ckpt"
    with pytest.raises(openai.NotFoundError):
        live.client.models.retrieve("gpt-4")
    assert live.http.get("/health").status_code == 200


def test_concurrent_requests_equal_generate_alone(live, setup):
    """The 8 REQUESTS at once (completions and chat, text and token ids, streaming and not, one
    sampled with a seed) on 2 slots: each one's text and token count are those of generate on its
    prompt alone; nothing compiles (warm-up compiled every program)."""
    tok, refs = setup["tok"], setup["refs"]

    async def run_all():
        loop = asyncio.get_running_loop()
        return await asyncio.gather(*[
            loop.run_in_executor(None, lambda i=i, r=r: _ask(live, r[1], r[2], r[3], stream=i % 2 == 1,
                                                              ignore_eos=True, **r[4]))
            for i, r in enumerate(REQUESTS)])

    with CompileCounter() as compiles:
        results = asyncio.run(run_all())
    assert compiles.compiled == 0, compiles.programs
    for (name, *_), res in zip(REQUESTS, results):
        ids, ref = refs[name]
        assert res["text"] == _expected_text(tok, ref), name
        assert res["finish"] == "length", name
        assert res["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(ref),
                                "total_tokens": len(ids) + len(ref)}, name
        if res["chunks"] is not None:
            assert res["chunks"] == len(ref), name  # one chunk per token


def test_list_prompts_are_choices(live, setup):
    """A list of prompts gives one choice per prompt, each as it alone gives."""
    tok, refs = setup["tok"], setup["refs"]
    names = ["text", "ids", "text-short"]
    prompts = [refs[n][0] for n in names]
    res = live.client.completions.create(model="tiny-ckpt", prompt=prompts, max_tokens=9, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert [c.index for c in res.choices] == [0, 1, 2]
    for c, n in zip(res.choices, names):
        assert c.text == _expected_text(tok, refs[n][1][:9]) and c.finish_reason == "length"
    assert res.usage.prompt_tokens == sum(map(len, prompts)) and res.usage.completion_tokens == 27


def test_stop_strings_and_stop_token_ids(live, setup):
    tok, refs = setup["tok"], setup["refs"]
    ids, ref = refs["text-2"]
    full = _expected_text(tok, ref)
    # a stop string: two ASCII letters first seen at k >= 2 of the output text
    k = next(k for k in range(2, len(full) - 1)
             if re.fullmatch("[a-z]{2}", full[k:k + 2]) and full.find(full[k:k + 2]) == k)
    for stream in (False, True):
        for stop in (full[k:k + 2], [full[k:k + 2], "never-seen"]):
            res = _ask(live, "completions", ids, 25, stream, stop=stop, ignore_eos=True)
            assert res["text"] == full[:k] and res["finish"] == "stop", (stream, stop)
    # a stop token id: the output ends at it, without its text; it counts as a completion token
    j = next(j for j in range(2, len(ref)) if ref[j] not in ref[:j] and _expected_text(tok, ref[j:j + 1]))
    for stream in (False, True):
        res = _ask(live, "completions", ids, 25, stream, stop_token_ids=[ref[j]], ignore_eos=True)
        assert res["text"] == _expected_text(tok, ref[:j]) and res["finish"] == "stop"
        assert res["usage"]["completion_tokens"] == j + 1


def test_checkpoint_eos_stops_unless_ignore_eos(live, setup):
    """generation_config.json's eos ids ([1, t], t set by the fixture) stop a request by default."""
    tok, refs, at = setup["tok"], setup["refs"], setup["eos_at"]
    ids, ref = refs["eos"]
    res = _ask(live, "completions", EOS_PROMPT, 12, stream=False)
    assert res["finish"] == "stop" and res["usage"]["completion_tokens"] == at + 1
    assert res["text"] == _expected_text(tok, ref[:at])
    res = _ask(live, "completions", EOS_PROMPT, 12, stream=True, ignore_eos=True)
    assert res["finish"] == "length" and res["text"] == _expected_text(tok, ref)


BAD = [  # (endpoint, body: a dict or raw text, status, param, message pattern)
    ("completions", {"prompt": [5] * MAX_LEN}, 400, "prompt",
     rf"^This model's maximum context length is {MAX_LEN} tokens\. However, your request has {MAX_LEN} input tokens"),
    ("completions", {"prompt": [5] * 10, "max_tokens": MAX_LEN - 9}, 400, "max_tokens",
     rf"maximum context length is {MAX_LEN} tokens\. However, you requested {MAX_LEN + 1} tokens \(10 in the messages"),
    ("chat", {"messages": [{"role": "user", "content": "a" * 200}]}, 400, "messages", "maximum context length"),
    ("completions", {"prompt": [1, 512]}, 400, "prompt", r"token id 512 is outside the vocabulary \[0, 512\)"),
    ("completions", {"prompt": [[1, 2], [1, 512]]}, 400, "prompt[1]", r"^prompt\[1\]: token id 512 is outside"),
    ("completions", {"prompt": "x", "stop_token_ids": [600]}, 400, "stop_token_ids", "outside the vocabulary"),
    ("completions", {"prompt": "x", "n": 17}, 400, "n", "n must be between 1 and 16"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs",
     "needs logprobs: true"),
    ("completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", "between 0 and 20"),
    ("completions", {"prompt": "x", "temperature": -1}, 400, "temperature", ">= 0"),
    ("completions", {"prompt": "x", "top_p": 0}, 400, "top_p", r"\(0, 1\]"),
    ("completions", {"prompt": "x", "top_k": 513}, 400, "top_k", "vocabulary size 512"),
    ("completions", {"prompt": "x", "stop": 5}, 400, "stop", "stop must be"),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ("completions", {"prompt": "x", "max_tokens": "16"}, 400, "max_tokens", "valid integer"),
    ("completions", {"prompt": "x", "ignore_eos": "yes"}, 400, "ignore_eos", "valid boolean"),
    ("completions", {"prompt": [[1, 2], "x"]}, 400, "prompt", "prompt must be"),
    ("completions", {"prompt": []}, 400, "prompt", "prompt must be"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream: true"),
    ("completions", {"prompt": "x", "temprature": 0}, 400, "temprature", "Unrecognized request argument"),
    ("completions", {"max_tokens": 3}, 400, "prompt", "Missing required parameter"),
    ("completions", '{"prompt": "x",', 400, None, "not valid JSON"),
    ("completions", "[1, 2]", 400, None, "valid dictionary"),
    ("completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "The model `gpt-4` does not exist"),
    ("chat", {"messages": []}, 400, "messages", "non-empty list"),
    ("chat", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "must be one of"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content[0]",
     "text part"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"mode": 1}}, 400,
     "chat_template_kwargs", "only 'thinking'"),
]


@pytest.mark.parametrize("case", range(len(BAD)), ids=[f"{b[0]}-{b[3]}-{b[2]}" for b in BAD])
def test_bad_request(live, case):
    endpoint, body, status, param, message = BAD[case]
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    if isinstance(body, dict):
        r = live.http.post(path, json=body)
    else:
        r = live.http.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["param"] == param
    assert re.search(message, err["message"]), err["message"]


# (prompt, max_tokens, sampling, the field at fault): each refused by the shared checks of
# dsv4_jax/runtime/request.py
SAME_WORDING = [
    ([5] * 10, MAX_LEN - 9, {}, "max_tokens"),
    ([5] * MAX_LEN, 1, {}, "prompt"),
    ([1, 512], 4, {}, "prompt"),
    ([5, 6], 4, {"top_p": 0.0}, "top_p"),
    ([5, 6], 4, {"top_k": 513}, "top_k"),
    ([5, 6], 4, {"temperature": -1.0}, "temperature"),
]


@pytest.mark.parametrize("prompt, max_tokens, sampling, param", SAME_WORDING,
                         ids=[f"{c[3]}-{i}" for i, c in enumerate(SAME_WORDING)])
def test_generate_the_engine_and_the_server_refuse_in_one_wording(live, prompt, max_tokens, sampling, param):
    """A bad request gets the same message from generate (its cache as long as the server's
    slots), from Engine.submit and from the server, where it is a 400 naming the same field
    (generate's own name for max_tokens is max_new_tokens)."""
    with pytest.raises(RequestError) as by_generate:
        dsv4_jax.generate(live.engine.model, [prompt], max_tokens, max_len=MAX_LEN, **sampling)
    with pytest.raises(RequestError) as by_engine:
        live.engine.submit(prompt, max_tokens, **sampling)
    r = live.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, **sampling})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert str(by_generate.value) == str(by_engine.value) == err["message"]
    assert by_engine.value.param == err["param"] == param
    assert by_generate.value.param == {"max_tokens": "max_new_tokens"}.get(param, param)


def test_server_serves_after_bad_requests_and_openai_client_errors(live, setup):
    tok, refs = setup["tok"], setup["refs"]
    with pytest.raises(openai.BadRequestError) as e:
        live.client.completions.create(model="tiny-ckpt", prompt="x", max_tokens=1000)
    assert e.value.status_code == 400 and "maximum context length" in e.value.message
    with pytest.raises(openai.NotFoundError):
        live.client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    ids, ref = refs["ids"]
    assert _ask(live, "completions", ids, 9, stream=False, ignore_eos=True)["text"] == _expected_text(tok, ref)


def _wait_idle(engine, seconds=30):
    deadline = time.monotonic() + seconds
    while (s := engine.stats())["slots_used"] or s["waiting"]:
        assert time.monotonic() < deadline, s
        time.sleep(0.05)
    return s


def test_disconnect_mid_stream_frees_the_slot(live, setup):
    """A client that closes its stream after 3 tokens of a request for the whole context: the
    request is cancelled (engine.stats() shows the slot free) long before its max_tokens, and
    requests after it are still right."""
    tok, refs = setup["tok"], setup["refs"]
    before = _wait_idle(live.engine)
    ids = refs["ids-long"][0]
    max_tokens = MAX_LEN - len(ids)
    stream = live.client.completions.create(model="tiny-ckpt", prompt=ids, max_tokens=max_tokens,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
    for _, chunk in zip(range(3), stream):
        assert chunk.choices
    assert live.engine.stats()["slots_used"] == 1
    stream.close()
    after = _wait_idle(live.engine)
    assert after["finished_cancelled"] == before.get("finished_cancelled", 0) + 1
    assert after["generation_tokens"] - before["generation_tokens"] < max_tokens
    for name, kind in (("chat", "chat"), ("ids", "completions")):  # later requests are still right
        ids, ref = refs[name]
        prompt = next(r[2] for r in REQUESTS if r[0] == name)
        assert _ask(live, kind, prompt, len(ref), stream=True, ignore_eos=True)["text"] == _expected_text(tok, ref)


def test_disconnect_while_waiting_cancels_the_request(live, monkeypatch):
    """A non-streaming request whose client gives up while it waits (engine held) is cancelled:
    released, the engine drops it without generating a token."""
    engine, gate = live.engine, threading.Event()
    step = engine.step
    before = _wait_idle(engine)
    monkeypatch.setattr(engine, "step", lambda: gate.wait() and step())
    with pytest.raises(httpx.ReadTimeout):
        live.http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 50}, timeout=0.5)
    time.sleep(3 * serve.POLL_S)  # the server looks at its client every POLL_S
    monkeypatch.undo()
    gate.set()
    after = _wait_idle(engine)
    assert after["finished_cancelled"] == before.get("finished_cancelled", 0) + 1
    assert after["generation_tokens"] == before["generation_tokens"]


def test_full_queue_is_503(live, setup, monkeypatch):
    """With the engine held (its step waits), SLOTS requests that free slots will take and
    MAX_QUEUE more wait; the next gets a 503. Released, the waiting ones all complete."""
    engine, gate = live.engine, threading.Event()
    step = engine.step
    _wait_idle(engine)
    monkeypatch.setattr(engine, "step", lambda: gate.wait() and step())
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
    n = SLOTS + MAX_QUEUE
    results = [None] * n

    def send(i):
        results[i] = live.http.post("/v1/completions", json=body)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 30
        while engine.stats()["waiting"] < n:
            assert time.monotonic() < deadline and all(r is None for r in results), (engine.stats(), results)
            time.sleep(0.02)
        r = live.http.post("/v1/completions", json=body)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == 503 and "overloaded" in r.json()["error"]["message"]
    finally:
        monkeypatch.undo()
        gate.set()
        for t in threads:
            t.join(60)
    assert [x.status_code for x in results] == [200] * n
    assert all(x.json()["usage"]["completion_tokens"] == 2 for x in results)


def test_health_is_503_when_the_engine_thread_is_dead(live):
    live.engine.stop()
    try:
        r = live.http.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
    finally:
        live.engine.start()
    assert live.http.get("/health").status_code == 200


METRIC_NAMES = ["dsv4:num_requests_running", "dsv4:num_requests_waiting", "dsv4:num_slots", "dsv4:num_slots_used",
                "dsv4:kv_cache_usage_perc", "dsv4:prompt_tokens_total", "dsv4:generation_tokens_total",
                'dsv4:request_success_total{finished_reason="length"}', "dsv4:time_to_first_token_seconds_count",
                "dsv4:inter_token_latency_seconds_count", "dsv4:e2e_request_latency_seconds_count",
                "dsv4:request_queue_time_seconds_count", "dsv4:num_blocks", "dsv4:num_blocks_used",
                "dsv4:num_preemptions_total", "dsv4:prefix_cache_queries_total", "dsv4:prefix_cache_hits_total",
                "dsv4:prefix_cache_snapshot_hits_total"]


def test_metrics_names_and_counters(live):
    _wait_idle(live.engine)
    before = live.metrics()
    assert set(METRIC_NAMES) <= set(before), sorted(before)
    assert before["dsv4:num_slots"] == SLOTS and before["dsv4:num_requests_running"] == 0
    assert before["dsv4:num_blocks_used"] == before["dsv4:kv_cache_usage_perc"] == 0
    assert before["dsv4:num_blocks"] == live.engine.num_blocks > 0
    r = live.http.post("/v1/completions", json={"prompt": [9] * 11, "max_tokens": 7, "temperature": 0,
                                                "ignore_eos": True})
    assert r.status_code == 200
    deadline = time.monotonic() + 10  # the histograms are observed on the engine thread as the request ends
    while (after := live.metrics())["dsv4:e2e_request_latency_seconds_count"] == before[
            "dsv4:e2e_request_latency_seconds_count"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    moved = {k: after[k] - before[k] for k in METRIC_NAMES}
    assert moved["dsv4:prompt_tokens_total"] == 11 and moved["dsv4:generation_tokens_total"] == 7
    # looked up in the prefix cache; none of it found (no full block of 128 tokens before its last)
    assert moved["dsv4:prefix_cache_queries_total"] == 11 and moved["dsv4:prefix_cache_hits_total"] == 0
    assert moved["dsv4:prefix_cache_snapshot_hits_total"] == 0
    assert moved['dsv4:request_success_total{finished_reason="length"}'] == 1
    assert moved["dsv4:time_to_first_token_seconds_count"] == 1
    assert moved["dsv4:inter_token_latency_seconds_count"] == 6
    assert moved["dsv4:e2e_request_latency_seconds_count"] == 1
    assert moved["dsv4:request_queue_time_seconds_count"] == 1
    assert after["dsv4:time_to_first_token_seconds_sum"] > before["dsv4:time_to_first_token_seconds_sum"]


# ---- pieces without a server ----------------------------------------------------------------

def test_spec_decode_counters_exported_when_the_engine_has_them():
    """serve.spec_decode_metrics exports the engine's spec-decode counters under dsv4: names that
    dsv4-bench-serve reads; none without them."""
    class Stats:  # an engine's stats() as far as the metrics read it
        def __init__(self, extra):
            self.extra = extra

        def stats(self):
            return {"running": 0, "waiting": 0, "slots": 1, "slots_used": 0, "cache_usage": 0.0, "num_blocks": 1,
                    "blocks_used": 0, **self.extra}

    assert serve.spec_decode_metrics({}) == []
    text = serve.Metrics(Stats({})).render().decode()
    assert bench_serve.spec_decode_counters(text) is None
    spec = {"spec_decode_num_drafts": 10, "spec_decode_num_draft_tokens": 30, "spec_decode_num_accepted_tokens": 24}
    text = serve.Metrics(Stats(spec)).render().decode()
    assert "dsv4:spec_decode_num_accepted_tokens_total 24.0" in text
    assert bench_serve.spec_decode_counters(text) == {"prefix": "dsv4:", **{k: float(v) for k, v in spec.items()},
                                                      "per_position": {}}
    spec |= {"spec_decode_num_accepted_tokens_pos_0": 9, "spec_decode_num_accepted_tokens_pos_1": 7}
    text = serve.Metrics(Stats(spec)).render().decode()
    assert bench_serve.spec_decode_counters(text)["per_position"] == {0: 9.0, 1: 7.0}


@pytest.fixture(scope="module")
def tokenizer():
    from dsv4_jax.tools.random_checkpoint import build_tokenizer

    return build_tokenizer(512, seed=0)


def test_detokenizer_never_splits_a_character(tokenizer):
    """Byte tokens of multi-byte characters fed one at a time: no piece holds U+FFFD or a part of a
    character, and the pieces add up to the text."""
    text = "héllo wörld ✓ 😀 日本語, plain ascii too"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text) // 2  # byte-level: many characters take several tokens
    out = tokenization.TextOutput(tokenizer, [])
    pieces = [out.add(t, i == len(ids) - 1) for i, t in enumerate(ids)]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert any(p == "" for p in pieces)  # some tokens ended inside a character and waited


def test_detokenizer_pieces_add_up_to_the_whole_decode(tokenizer):
    """Random token ids (invalid UTF-8 included, special tokens skipped): the pieces add up to
    decoding all of them at once."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = [int(x) for x in rng.integers(0, 512, int(rng.integers(1, 60)))]
        out = tokenization.TextOutput(tokenizer, [])
        pieces = "".join(out.add(t, i == len(ids) - 1) for i, t in enumerate(ids))
        assert pieces == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_strings_hold_back_and_cut(tokenizer):
    ids = tokenizer.encode("say STOP now", add_special_tokens=False).ids
    out = tokenization.TextOutput(tokenizer, ["STOP", "xyz"])
    pieces = []
    for t in ids:
        pieces.append(out.add(t, False))
        if out.stopped:
            break
    assert "".join(pieces) == "say " and out.stopped
    assert all(not p.endswith("ST") for p in pieces)  # a stop string's start is never sent early
    out = tokenization.TextOutput(tokenizer, ["xyz"])  # no match: everything comes out at the end
    assert "".join(out.add(t, i == len(ids) - 1) for i, t in enumerate(ids)) == "say STOP now"


def test_default_chat_format():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
            {"role": "assistant", "content": [{"type": "text", "text": "A1"}]}, {"role": "user", "content": "U2"}]
    B, E = chat.BOS, chat.EOS
    fmt = chat.ChatFormat()
    assert fmt.render(msgs).text == f"{B}S<｜User｜>U1<｜Assistant｜></think>A1{E}<｜User｜>U2<｜Assistant｜></think>"
    assert fmt.render(msgs, {"thinking": True}).text.endswith("<｜User｜>U2<｜Assistant｜><think>")
    with pytest.raises(chat.ChatError, match=r"tool_calls\[0\]\.function must be an object"):
        fmt.render([{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}])
    assert fmt.render([{"role": "user", "content": "x", "name": "bob", "tool_calls": None}]).text.count("x") == 1


def _write_template(d, template) -> str:
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": template}, f)
    return str(d)


def test_checkpoint_chat_template_in_a_sandbox(tmp_path):
    template = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% if m.role == 'system' %}"
                "{{ raise_exception('no system') }}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}{{ tag | default('') }}{{ {'k': 'é'} | tojson }}")
    fmt = chat.load_chat_format(_write_template(tmp_path, template))
    assert fmt.template is not None
    assert fmt.render([{"role": "user", "content": "hi"}], {"tag": "!"}).text == '<s>[user]hi[assistant]!{"k": "é"}'
    with pytest.raises(chat.ChatError, match="no system"):
        fmt.render([{"role": "system", "content": "x"}])
    fmt = chat.load_chat_format(_write_template(tmp_path, "{{ ''.__class__.__mro__[1].__subclasses__() }}"))
    with pytest.raises(chat.ChatError, match="unsafe|not safely|access"):
        fmt.render([{"role": "user", "content": "x"}])
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages | length }}"}]
    assert chat.load_chat_format(_write_template(tmp_path, named)).render([{"role": "user", "content": "x"}]).text == "D1"
    with pytest.raises(ValueError, match="chat_template does not compile"):
        chat.load_chat_format(_write_template(tmp_path, "{% for %}"))


# ---- the command line -----------------------------------------------------------------------

def test_bad_flags_and_checkpoints_are_one_line(setup, tmp_path, capsys):
    taken = serve.listen_socket("127.0.0.1", 0)
    port = str(taken.getsockname()[1])
    taken.listen()
    no_tokenizer = tmp_path / "no-tok"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text("{}")
    ckpt = str(setup["ckpt"])
    cases = [
        (["--ckpt", ckpt, "--slots", "two"], "argument --max-num-seqs/--slots: invalid int value: 'two'"),
        (["--ckpt", ckpt, "--kv-cache-memory", "8 parsecs"], "argument --kv-cache-memory: '8 parsecs' is not a size"),
        (["--ckpt", ckpt, "--port", "0", "--block-size", "96", *FLAGS[:2]],
         "--block-size: block size 96 must be a positive multiple of 128"),
        (["--ckpt", ckpt, "--port", "0", "--kv-cache-memory", "1KiB", *FLAGS[:2]],
         "--kv-cache-memory: kv_cache_memory 1024 bytes holds 0 blocks of 128 tokens"),
        (["--ckpt", ckpt, "--port", "0", "--prefix-snapshots", "-1", *FLAGS[:2]],
         "--prefix-snapshots: prefix_snapshots must be >= 0, got -1"),
        ([], "the following arguments are required: --ckpt"),
        (["--ckpt", ckpt, "--port", port], f"cannot listen on 127.0.0.1:{port}"),
        (["--ckpt", str(tmp_path / "missing"), "--port", "0"], "checkpoint directory not found"),
        (["--ckpt", str(no_tokenizer), "--port", "0"], "tokenizer.json is missing"),
        (["--ckpt", ckpt, "--port", "0", "--prefill-chunk", "24", *FLAGS[:2]], "prefill_chunk must be a power of two"),
        (["--ckpt", ckpt, "--port", "0", "--layout", "dp_attention"], "--layout needs --mesh"),
    ]
    try:
        for argv, message in cases:
            assert serve.main(argv + ["--compile-cache", "off"]) == 1, argv
            err = capsys.readouterr().err
            lines = [line for line in err.splitlines() if line.startswith("dsv4-serve: error")]
            assert len(lines) == 1 and message in lines[0], err
    finally:
        taken.close()


def test_command_serves_and_stops_gracefully_on_sigterm(setup):
    """`python -m dsv4_jax.serving.serve` (no warm-up, any port): it answers, and SIGTERM ends it with
    status 0 after a graceful shutdown."""
    proc = subprocess.Popen([sys.executable, "-m", "dsv4_jax.serving.serve", "--ckpt", str(setup["ckpt"]), *FLAGS,
                             "--no-warmup", "--port", "0", "--served-model-name", "tiny"],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if m := re.search(r"serving 'tiny' on (http://\S+)", line):
                url = m.group(1)
                break
        else:
            raise AssertionError("".join(lines))
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(url + "/v1/models", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
                time.sleep(0.1)
        assert r.json()["data"][0]["id"] == "tiny" and r.json()["data"][0]["max_model_len"] == MAX_LEN
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(60) == 0, rest
        assert "Application shutdown complete" in rest and "Traceback" not in "".join(lines) + rest
        assert all(not line.startswith("dsv4-serve: error") for line in stderr_lines(rest))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
