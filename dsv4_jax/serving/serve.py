"""`dsv4-serve --ckpt DIR [options]`: an OpenAI-compatible HTTP server over the serving engine.

FastAPI on uvicorn. The engine (dsv4_jax/runtime/engine.py, continuous batching over cache slots) runs in
its own thread (`Engine.start`); a request's tokens come back through its `on_token` callback on
that thread, which hands them to the request's asyncio queue with `loop.call_soon_threadsafe`.
The checkpoint's programs are all compiled (or loaded from the compilation cache) and run once
before the port opens (`warmup`, a line of progress per program; unless --no-warmup), so no
request pays a compilation or a program's slow first run. Text is tokenized in worker threads
(dsv4_jax/serving/tokenization.py) and a text whose length alone proves it too long for the context is
refused before it is tokenized, so a large prompt does not stall the other clients.

Endpoints: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/completions` (prompt: text, a list
of texts, token ids or a list of token-id lists; one choice per prompt), `POST
/v1/chat/completions` (the chat format of dsv4_jax/serving/chat.py), `GET /health` (200; 503 once the
engine thread has stopped), `GET /metrics` (Prometheus text format, `dsv4:` names, see `Metrics`).
Streaming (`"stream": true`) sends server-sent events, one chunk per generated token, ending with
`data: [DONE]`; with `stream_options: {"include_usage": true}` a last chunk before it holds
`choices: []` and the usage.

Request fields honoured: `model` (optional; another name than --served-model-name is a 404),
`prompt` / `messages`, `max_tokens` (completions default 16; chat: `max_completion_tokens`, else
`max_tokens`, else the rest of the context), `temperature` (default 1.0; 0 = greedy), `top_p`,
`top_k` (0 or -1 = off), `min_p`, `presence_penalty`, `frequency_penalty`, `repetition_penalty`,
`logit_bias`, `min_tokens` (dsv4_jax/runtime/sampling.py: applied on the device, per row), `seed`
(default: a random one; choice i of a request draws with seed + i), `n` (choices per prompt, up to
MAX_N; one prefill: the later choices are forked from the first one's prefilled prompt),
`stop` (a string or a list: matched on the output text, which is cut before the first match),
`stop_token_ids`, `ignore_eos` (else the checkpoint's eos ids, from generation_config.json or
config.json, stop a request), `speculative_tokens` (with --speculative-tokens K: drafts a round for
this request, 0 .. K; default K), `logprobs` (completions: N alternatives; chat: true, with
`top_logprobs` N): the model's own log-probabilities (log-softmax of its logits, before penalties,
bias, temperature and cut-offs, as vLLM's default), `structured_outputs` (vLLM's: `json`, `regex`,
`choice` or `grammar`), `stream`, `stream_options.include_usage`, and for chat
`chat_template_kwargs`, `tools` and `tool_choice` (DeepSeek's DSML tool calls, parsed into
`tool_calls`; "required" and a named function are enforced by a grammar), `reasoning_effort` and
thinking mode (the reasoning comes back as `reasoning_content`), `response_format` (json_object,
json_schema). A constrained reply (dsv4_jax/serving/grammar.py, llguidance) gets its allowed tokens
from a matcher on the host before each step and applies them in the sampling program; in thinking
mode the reasoning is free text up to `</think>` and the grammar holds for the reply after it.
Earlier assistant messages may carry their `reasoning_content` (dsv4_jax/serving/chat.py).
Accepted and ignored: `user`, `metadata`, `store`, `service_tier`, `prompt_cache_key`,
`safety_identifier`, `parallel_tool_calls`, `stream_options.include_obfuscation`. Accepted only at
the value that asks for nothing (null, or the value in `NEUTRAL`), else a 400 naming the field:
`best_of`, `echo`, `suffix`, `functions`, `function_call`, `modalities`, `audio`, `prediction`,
`web_search_options`, `verbosity`. Any other field is a 400 ("Unrecognized request argument").

With --deterministic a request's tokens do not depend on what is batched with it or on how its
prompt is cut (the engine's deterministic mode: prompts go in a token a step).

Errors are OpenAI's JSON `{"error": {"message", "type", "param", "code"}}` with the HTTP status as
`code` (dsv4_jax/serving/http.py): 400 for a bad request (malformed JSON, a field of the wrong type
or value, text with a lone surrogate, a token id outside the vocabulary, a prompt longer than the
context or max_tokens past it, in OpenAI's wording), 401 without the --api-key (`/v1/*` only),
404 for another model name, 408 for a body slower than --timeout-read, 413 for a body over
--max-request-bytes, 500 for a bug of ours (logged; the connection stays open, as it does after
every error), 503 when --max-queue requests already wait with no free slot for them, or a
request the shutdown cut off. A client that disconnects has its requests cancelled, which frees
their slots: a stream's at once (the ASGI stack cancels its task), any request's within half a
second (`POLL_S`). SIGINT / SIGTERM shut down gracefully: the port closes, idle and half-sent
connections close, requests in flight get --timeout-graceful-shutdown seconds to finish (then
they are cut off), the engine stops, and the process exits 0. Bad flags or a bad checkpoint
print one line and exit 1.
"""

from __future__ import annotations

import asyncio
from argparse import BooleanOptionalAction
import contextlib
import dataclasses
import json
import os
import random
import signal
import socket
import sys
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsv4_jax.model.cache import KV_CACHE_DTYPES
from dsv4_jax.runtime.cli_args import ArgumentParser, UsageError, byte_size
from dsv4_jax.runtime.engine import Engine, EngineConfigError, QueueFull, StaticEngine
from dsv4_jax.runtime.request import RequestError, SamplingParams, check_prompt, input_too_long, prompt_field
from dsv4_jax.runtime.speculative import SPEC_DECODE_COUNTERS
from .chat import THINK, ChatError, ChatFormat, load_chat_format
from .grammar import Constraint, GrammarError, TokenVocabulary, after_reasoning, grammar_for, grammar_for_tools
from .reasoning import ReasoningParser
from .tool_calls import ToolCallParser, ToolSpec, check_tools, collect
from .http import APIError, Gate, error_response, protocol
from .tokenization import ServerTokenizer, TextOutput, surrogate_message

PROG = "dsv4-serve"
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
POLL_S = 0.5  # how often a waiting request checks its client and the engine thread
LATENCY_BUCKETS = tuple(0.001 * 2 ** k for k in range(22))  # 1 ms .. 35 min, doubling
NEUTRAL = {  # OpenAI fields we do not implement, accepted (besides null) only at these values
    "best_of": (1,), "echo": (False,), "suffix": ("",), "functions": ([],), "function_call": ("none",),
    "modalities": (["text"],), "audio": (), "prediction": (), "web_search_options": (), "verbosity": (),
}
MAX_N = 16  # choices a request may ask for
MAX_REQUEST_BYTES = 16 << 20  # --max-request-bytes default: a 1M-token prompt as text or as ids fits
READ_TIMEOUT_S = 30.0  # --timeout-read default
GRACEFUL_SHUTDOWN_S = 30.0  # --timeout-graceful-shutdown default
API_KEY_ENV = "DSV4_API_KEY"
REQUIRED = {"/v1/completions": "prompt", "/v1/chat/completions": "messages"}  # for an empty body's message


class ClientGone(Exception):
    """The HTTP client disconnected while its request ran."""


# ---- request bodies -------------------------------------------------------------------------

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    include_obfuscation: Any = None  # ignored


class _Common(BaseModel):
    """Fields both endpoints take (module doc); strict types, unknown fields rejected."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Any = None  # a string or a list of strings (checked in `_stops`)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    speculative_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    structured_outputs: Any = None  # vLLM's: {"json" | "regex" | "choice" | "grammar": ...} (serving/grammar.py)


class CompletionRequest(_Common):
    prompt: Any  # text, texts, token ids or lists of them (checked in `_completion_prompts`)
    logprobs: int | None = None  # top alternatives per token, 0 .. MAX_TOP_LOGPROBS
    best_of: Any = None
    echo: Any = None
    suffix: Any = None


class ChatRequest(_Common):
    messages: Any  # checked by chat.normalize_messages
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: Any = None
    tools: Any = None  # checked by tool_calls.check_tools
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: str | None = None
    web_search_options: Any = None
    verbosity: Any = None


def _check_neutral(body: _Common) -> None:
    for name in body.model_fields_set & NEUTRAL.keys():
        value = getattr(body, name)
        if value is not None and not any(type(value) is type(v) and value == v for v in NEUTRAL[name]):
            allowed = " or ".join(json.dumps(v) for v in (None, *NEUTRAL[name]))
            raise APIError(400, f"'{name}' is not supported by this server (accepted: {allowed}), got "
                                f"{json.dumps(value)}", name)


# ---- metrics --------------------------------------------------------------------------------

SPEC_DECODE_HELP = {
    "spec_decode_num_drafts": "Speculative decoding: draft proposals (verify steps) so far.",
    "spec_decode_num_draft_tokens": "Speculative decoding: draft tokens proposed so far.",
    "spec_decode_num_accepted_tokens": "Speculative decoding: draft tokens accepted so far.",
}


def spec_decode_metrics(stats: dict) -> list:
    """Counters `dsv4:spec_decode_num_drafts`, `dsv4:spec_decode_num_draft_tokens`,
    `dsv4:spec_decode_num_accepted_tokens` (exposed with `_total`) for those of these names the
    engine's stats() has; none when it has none (no speculative decoding)."""
    from prometheus_client.core import CounterMetricFamily

    out = [CounterMetricFamily(f"dsv4:{name}", SPEC_DECODE_HELP[name], value=stats[name])
           for name in SPEC_DECODE_COUNTERS if name in stats]
    per_position = sorted((int(k.rsplit("_", 1)[1]), v) for k, v in stats.items()
                          if k.startswith("spec_decode_num_accepted_tokens_pos_"))
    if per_position:
        family = CounterMetricFamily("dsv4:spec_decode_num_accepted_tokens_per_pos", "Speculative decoding: "
                                     "draft tokens accepted so far, by their position in the draft.",
                                     labels=["position"])
        for i, v in per_position:
            family.add_metric([str(i)], v)
        out.append(family)
    return out


class _EngineCollector:
    """engine.stats() read at each scrape: gauges of requests and slots, token counters."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.engine.stats()
        yield GaugeMetricFamily("dsv4:num_requests_running", "Requests in a slot (prefilling or decoding).",
                                value=s["running"])
        yield GaugeMetricFamily("dsv4:num_requests_waiting", "Requests waiting for a slot.", value=s["waiting"])
        yield GaugeMetricFamily("dsv4:num_slots", "Cache slots (sequences decoded together).", value=s["slots"])
        yield GaugeMetricFamily("dsv4:num_slots_used", "Cache slots holding a request.", value=s["slots_used"])
        yield GaugeMetricFamily("dsv4:kv_cache_usage_perc", "Cache use: blocks of the paged pools in use over "
                                "all of them (1 = full).", value=s["cache_usage"])
        yield GaugeMetricFamily("dsv4:num_blocks", "Blocks of the paged cache pools.", value=s["num_blocks"])
        yield GaugeMetricFamily("dsv4:num_blocks_used", "Blocks of the paged cache pools held by requests.",
                                value=s["blocks_used"])
        yield CounterMetricFamily("dsv4:num_preemptions", "Requests preempted (blocks ran out; they are "
                                  "prefilled again later).", value=s.get("preemptions", 0))
        if "prefix_cache_queries" in s:
            yield CounterMetricFamily("dsv4:prefix_cache_queries", "Prefix cache: prompt tokens of admitted "
                                      "requests looked up.", value=s["prefix_cache_queries"])
            yield CounterMetricFamily("dsv4:prefix_cache_hits", "Prefix cache: prompt tokens found (their "
                                      "compressed entries read from cached blocks).", value=s["prefix_cache_hits"])
        if "prefix_cache_snapshot_hits" in s:
            yield CounterMetricFamily("dsv4:prefix_cache_snapshot_hits", "Prefix cache: requests started from a "
                                      "row state saved at the end of a cached block, with no recompute before it.",
                                      value=s["prefix_cache_snapshot_hits"])
        yield CounterMetricFamily("dsv4:prompt_tokens", "Prompt tokens prefilled.", value=s.get("prompt_tokens", 0))
        yield CounterMetricFamily("dsv4:generation_tokens", "Tokens generated.", value=s.get("generation_tokens", 0))
        finished = CounterMetricFamily("dsv4:request_success", "Requests the engine finished, by reason "
                                       "(cancelled: a stop string or a client that left).", labels=["finished_reason"])
        for reason in ("stop", "length", "cancelled"):
            finished.add_metric([reason], s.get(f"finished_{reason}", 0))
        yield finished
        yield from spec_decode_metrics(s)


class Metrics:
    """The server's Prometheus registry: the engine's state (`_EngineCollector`) and histograms of
    time to first token, inter-token latency, end-to-end latency and queue time (seconds, from the
    engine's timestamps), observed when a request ends."""

    def __init__(self, engine: Engine):
        from prometheus_client import CollectorRegistry, Histogram

        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))

        def histogram(name, doc):
            return Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=self.registry)

        self.ttft = histogram("dsv4:time_to_first_token_seconds", "Arrival to first token.")
        self.itl = histogram("dsv4:inter_token_latency_seconds", "Between consecutive tokens of a request.")
        self.e2e = histogram("dsv4:e2e_request_latency_seconds", "Arrival to the end of the request.")
        self.queue = histogram("dsv4:request_queue_time_seconds", "Arrival to admission into a slot.")

    def observe(self, req, end: float) -> None:
        """A finished engine request (called on the engine thread)."""
        if req.admitted is not None:
            self.queue.observe(req.admitted - req.arrival)
        if req.token_times:
            self.ttft.observe(req.token_times[0] - req.arrival)
            for a, b in zip(req.token_times, req.token_times[1:]):
                self.itl.observe(b - a)
            self.e2e.observe(end - req.arrival)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# ---- the service ----------------------------------------------------------------------------

@dataclasses.dataclass
class Service:
    """What the handlers share: the engine, the tokenizer, the chat format, names and ids."""

    engine: Engine
    tokenizer: ServerTokenizer
    chat: ChatFormat
    model_name: str
    eos_ids: tuple[int, ...]
    metrics: Metrics
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    vocabulary: TokenVocabulary | None = None  # for constrained replies (grammar.py); None without eos ids

    @property
    def vocab_size(self) -> int:
        return self.engine.cfg.vocab_size


def _bad_request(e: RequestError) -> APIError:
    """A request the runtime's checks refused (dsv4_jax/runtime/request.py): a 400 in their
    wording, naming their field."""
    return APIError(400, str(e), e.param)


@dataclasses.dataclass
class Sampling:
    """A request's sampling, checked, its stop strings (matched here, on the output text) and the
    choices it asks for per prompt (`n`)."""

    params: SamplingParams
    stops: list[str]
    n: int = 1


def _sampling(body: _Common, service: Service) -> Sampling:
    """The request's sampling with OpenAI's defaults (temperature 1, a random seed; top_k -1, as
    vLLM takes it, or absent: off) and the checkpoint's eos ids among the stop ids unless
    ignore_eos, checked as the engine checks it."""
    ids = tuple(body.stop_token_ids or ())
    if not body.ignore_eos:
        ids += tuple(i for i in service.eos_ids if i not in ids)
    k = service.engine.k
    logprobs = _logprobs(body)
    # No stop ids go as None: the runtime refuses an empty list, as a list that lost its ids.
    try:
        params = SamplingParams.checked(
            service.vocab_size, 1.0 if body.temperature is None else body.temperature,
            0 if body.top_k in (None, -1) else body.top_k, 1.0 if body.top_p is None else body.top_p,
            random.getrandbits(32) if body.seed is None else body.seed, ids or None,
            k if body.speculative_tokens is None else body.speculative_tokens, max_speculative_tokens=k,
            min_p=body.min_p or 0.0, presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=body.logit_bias, min_tokens=body.min_tokens or 0, logprobs=logprobs)
    except RequestError as e:
        raise _bad_request(e) from None
    n = 1 if body.n is None else body.n
    if not 1 <= n <= MAX_N:
        raise APIError(400, f"n must be between 1 and {MAX_N}, got {n}", "n")
    return Sampling(params, _stops(body.stop), n)


def _logprobs(body: _Common) -> int | None:
    """The top alternatives a request wants with each token's log-probability, None for none:
    completions' `logprobs: N`, chat's `logprobs: true` with `top_logprobs: N` (default 0)."""
    if isinstance(body, CompletionRequest):
        return body.logprobs
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def _stops(stop) -> list[str]:
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError(400, "stop must be a non-empty string or a list of non-empty strings", "stop")
    for i, text in enumerate(stops):
        _check_text(text, "stop" if isinstance(stop, str) else f"stop[{i}]")
    return stops


def _check_text(text: str, param: str) -> None:
    message = surrogate_message(text, param)
    if message is not None:
        raise APIError(400, message, param)


def _check_length(text: str, service: Service, param: str) -> None:
    """Refuses a text that its length in characters already proves too long for the context,
    before it is tokenized."""
    n, limit = service.tokenizer.min_tokens(text), service.engine.max_len
    if n >= limit:
        raise _bad_request(input_too_long(limit, n, param, characters=len(text)))


async def _completion_prompts(prompt, service: Service) -> list[list[int]]:
    """`prompt` as token-id lists: text (encoded with the tokenizer's special tokens, e.g. bos,
    in a worker thread), a list of texts, token ids, or a list of token-id lists."""
    def is_id(x):
        return isinstance(x, int) and not isinstance(x, bool)

    if isinstance(prompt, str):
        prompt = [prompt]
    elif isinstance(prompt, list) and prompt and all(map(is_id, prompt)):
        return [prompt]
    if not (isinstance(prompt, list) and prompt and (
            all(isinstance(p, str) for p in prompt)
            or all(isinstance(p, list) and p and all(map(is_id, p)) for p in prompt))):
        raise APIError(400, "prompt must be a string, a list of strings, a non-empty list of token ids or a list of "
                            "non-empty token-id lists", "prompt")
    if not isinstance(prompt[0], str):
        return prompt
    for i, text in enumerate(prompt):
        param = prompt_field(i, len(prompt))
        _check_text(text, param)
        _check_length(text, service, param)
    return await asyncio.to_thread(service.tokenizer.encode, prompt)


@dataclasses.dataclass
class ChatSetup:
    """What a chat request adds to its choices' outputs: whether the prompt opened the reasoning
    (thinking mode: the reply's text up to `</think>` is reasoning_content) and its tools (the
    reply's content read for tool calls)."""

    thinking: bool = False
    tools: ToolSpec | None = None


class ChoiceOutput:
    """One choice's generated tokens as what the API sends: its text (TextOutput: incremental
    detokenization, stop strings), for a chat request split into reasoning and content
    (ReasoningParser) and the content read for tool calls (ToolCallParser), and its tokens'
    log-probabilities."""

    def __init__(self, service: Service, stops: list[str], chat: ChatSetup | None, call_ids: str):
        self.tokenizer = service.tokenizer
        # A thinking reply's `</think>` stays in its text, even as a special token, for the reasoning split.
        end_think = service.tokenizer.end_think
        shown = frozenset({end_think}) if chat is not None and chat.thinking and end_think is not None else frozenset()
        self.text = TextOutput(service.tokenizer, stops, shown)
        self.chat = chat
        self.reasoning = ReasoningParser(chat.thinking) if chat is not None else None
        self.tools = ToolCallParser(chat.tools, call_ids) if chat is not None else None
        self.called = False  # a tool call was sent
        self.tokens = 0

    @property
    def stopped(self) -> bool:
        return self.text.stopped

    def add(self, token: int | None, final: bool) -> dict:
        """The delta a generated token (None: a stop token, no text) makes: {"text"} for a
        completion; for a chat reply whichever of "reasoning_content", "content" (a str) and
        "tool_calls" (parser events) it has."""
        self.tokens += 1
        text = self.text.add(token, final or self.text.stopped)
        if self.chat is None:
            return {"text": text}
        reasoning, content = self.reasoning.feed(text)
        if final or self.text.stopped:
            more = self.reasoning.finish()
            reasoning, content = reasoning + more[0], content + more[1]
        events = self.tools.feed(content) + (self.tools.finish() if final or self.text.stopped else [])
        calls = [e for e in events if isinstance(e, dict)]
        self.called |= bool(calls)
        delta = {"reasoning_content": reasoning, "content": "".join(e for e in events if isinstance(e, str)),
                 "tool_calls": calls}
        return {k: v for k, v in delta.items() if v}

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)


class Generation:
    """One API request's choices running in the engine, as events (choice, delta, the token's
    log-probabilities or None, finish reason or None), one per generated token; the last one of
    each choice has its finish reason.

    A request of P prompts and n choices runs P x n engine requests, choice p * n + j drawing with
    seed + p * n + j; the choices after a prompt's first share its prefill: they are forked from
    its slot once its prompt is prefilled (Engine's `after`). The engine thread's
    callback puts (choice, token, log-probabilities, engine finish reason) on an asyncio queue with
    `call_soon_threadsafe`; the handler's task turns tokens into text (`ChoiceOutput`)."""

    def __init__(self, service: Service, http: Request, prompts: list[list[int]], max_tokens: list[int],
                 sampling: Sampling, param: str, chat: ChatSetup | None = None, grammar: str | None = None):
        """param: the request's field the prompts come from ("prompt" or "messages"), for errors;
        chat: a chat request's setup; grammar: what each choice's text must follow
        (dsv4_jax/serving/grammar.py)."""
        self.service, self.http = service, http
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.prompt_tokens = sum(map(len, prompts))
        n = sampling.n
        rid = uuid.uuid4().hex
        self.outputs = [ChoiceOutput(service, sampling.stops, chat, f"{rid}/{i}") for i in range(len(prompts) * n)]
        self.finish: list[str | None] = [None] * len(self.outputs)
        engine = service.engine
        try:
            for i, (p, m) in enumerate(zip(prompts, max_tokens)):  # every prompt, before any runs
                check_prompt(p, m, service.vocab_size, engine.max_len, field=prompt_field(i, len(prompts), param))
        except RequestError as e:
            raise _bad_request(e) from None
        s = sampling.params
        self.requests = []
        try:
            for i in range(len(self.outputs)):
                p, m = prompts[i // n], max_tokens[i // n]
                self.requests.append(engine.submit(
                    p, m, seed=s.seed + i, on_token=lambda req, token, i=i: self._on_token(i, req, token),
                    after=self.requests[i - i % n] if i % n else None,
                    constraint=None if grammar is None else Constraint(service.vocabulary, grammar),
                    **_engine_sampling(s)))
        except QueueFull as e:
            self.cancel()
            raise APIError(503, f"The server is overloaded: {e}; retry later") from None
        except RequestError as e:  # a seed + i past 64 bits: the rest was checked above
            self.cancel()
            raise _bad_request(e) from None

    def _on_token(self, index: int, req, token: int | None) -> None:
        """Runs on the engine thread."""
        if token is None:
            self.service.metrics.observe(req, time.monotonic())
            return
        lp = req.logprobs[-1] if req.sampling.logprobs is not None else None
        with contextlib.suppress(RuntimeError):  # the event loop closed: nobody is listening any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, token, lp, req.finish_reason))

    async def events(self):
        """Yields (choice, delta, log-probabilities or None, finish reason or None) until every
        choice has finished. Raises ClientGone when the client leaves, APIError(500) when the
        engine thread stops."""
        getter, checked = None, self.loop.time()
        try:
            while None in self.finish:
                getter = getter or asyncio.ensure_future(self.queue.get())
                done, _ = await asyncio.wait({getter}, timeout=POLL_S)
                if self.loop.time() - checked >= POLL_S:  # also while tokens flow (a non-streaming request)
                    checked = self.loop.time()
                    if await self.http.is_disconnected():
                        raise ClientGone()
                    if not self.service.engine.alive():
                        raise APIError(500, "the engine stopped; see the server's log")
                if not done:
                    continue
                (i, token, lp, reason), getter = getter.result(), None
                if self.finish[i] is not None:  # tokens after a stop string, until the cancel lands
                    continue
                out = self.outputs[i]
                # A stop id has no text; a request ended by its grammar ends on a token of its text.
                stop_id = reason == "stop" and token in self.requests[i].sampling.stop_token_ids
                delta = out.add(None if stop_id else token, reason is not None)
                if out.stopped:
                    self.service.engine.cancel(self.requests[i])
                    reason = "stop"
                if reason == "stop" and out.called:
                    reason = "tool_calls"
                self.finish[i] = reason
                yield i, delta, None if lp is None else (token, lp), reason
        finally:
            if getter is not None:
                getter.cancel()
            self.cancel()

    def cancel(self) -> None:
        """Cancels the requests still in the engine (their slots free at the next step)."""
        for r in self.requests:
            if not r.done:
                self.service.engine.cancel(r)

    def usage(self) -> dict:
        n = sum(out.tokens for out in self.outputs)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}


def _engine_sampling(s: SamplingParams) -> dict:
    """A checked SamplingParams as Engine.submit's keywords (less the seed, set per choice)."""
    return dict(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                stop_token_ids=s.stop_token_ids or None,  # (): None, see _sampling
                speculative_tokens=s.speculative_tokens, presence_penalty=s.presence_penalty,
                frequency_penalty=s.frequency_penalty, repetition_penalty=s.repetition_penalty,
                logit_bias=dict(s.logit_bias) or None, min_tokens=s.min_tokens, logprobs=s.logprobs)


def _check_model(body: _Common, service: Service) -> None:
    if body.model is not None and body.model != service.model_name:
        raise APIError(404, f"The model `{body.model}` does not exist.", "model")


def _checked_sampling(body: _Common, service: Service) -> Sampling:
    """The checks every completion request gets (model, fields at their neutral values, stream
    options), then its sampling settings."""
    _check_model(body, service)
    _check_neutral(body)
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", "stream_options")
    return _sampling(body, service)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _chat_logprobs(out: ChoiceOutput, token: int, lp) -> dict:
    """A token's entry of a chat choice's `logprobs.content` (OpenAI's shape)."""
    def entry(t: int, logprob: float) -> dict:
        text = out.token_text(t)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "surrogatepass"))}

    return {**entry(token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs)]}


class _CompletionLogprobs:
    """A completion choice's `logprobs` (OpenAI's legacy shape: tokens, token_logprobs,
    top_logprobs as {token: logprob}, text_offset), built token by token."""

    def __init__(self):
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        self.offset = 0

    def add(self, out: ChoiceOutput, token: int, lp) -> dict:
        """Adds a token; returns the part for this token alone (a stream's chunk)."""
        text = out.token_text(token)
        top = {}
        for t, v in zip(lp.top_ids, lp.top_logprobs):  # tokens that print alike: the likeliest keeps the key
            top.setdefault(out.token_text(t), v)
        part = {"tokens": [text], "token_logprobs": [lp.logprob], "text_offset": [self.offset], "top_logprobs": [top]}
        self.offset += len(text)
        for key, value in part.items():
            getattr(self, key).extend(value)
        return part

    def whole(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}


async def _respond(gen: Generation, body: _Common, kind: str, model: str) -> Response:
    """The response to a completion (kind "text_completion") or chat ("chat.completion") request:
    a stream of server-sent events, or one JSON object once every choice has finished."""
    chat = kind == "chat.completion"
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": kind + (".chunk" if chat and body.stream else ""), "created": int(time.time()), "model": model}
    legacy = [_CompletionLogprobs() for _ in gen.outputs]

    def logprobs(i, token_lp):
        if token_lp is None:
            return None
        out = gen.outputs[i]
        return {"content": [_chat_logprobs(out, *token_lp)]} if chat else legacy[i].add(out, *token_lp)

    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        started = [False] * len(gen.outputs)

        def choice(i, delta, token_lp, reason):
            if not chat:
                return {"index": i, "text": delta["text"], "logprobs": logprobs(i, token_lp), "finish_reason": reason}
            d = {"content": "", **delta} if "reasoning_content" not in delta and "tool_calls" not in delta else delta
            if not started[i]:  # the role goes with the first token (a chunk with choices times TTFT)
                d, started[i] = {"role": "assistant", **d}, True
            return {"index": i, "delta": d, "logprobs": logprobs(i, token_lp), "finish_reason": reason}

        async def stream():
            try:
                async for i, delta, token_lp, reason in gen.events():
                    yield _sse({**head, "choices": [choice(i, delta, token_lp, reason)],
                                **({"usage": None} if usage else {})})
            except ClientGone:
                return
            except APIError as e:
                yield _sse(e.body())
            else:
                if usage:
                    yield _sse({**head, "choices": [], "usage": gen.usage()})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    texts, reasoning = [""] * len(gen.outputs), [""] * len(gen.outputs)
    calls = [[] for _ in gen.outputs]
    entries = [[] for _ in gen.outputs]
    try:
        async for i, delta, token_lp, _ in gen.events():
            texts[i] += delta.get("text", "") + delta.get("content", "")
            reasoning[i] += delta.get("reasoning_content", "")
            calls[i] += delta.get("tool_calls", [])
            if token_lp is not None:
                entries[i].append(logprobs(i, token_lp))
    except ClientGone:
        return Response(status_code=499)  # nobody reads it
    wanted = gen.requests[0].sampling.logprobs is not None
    if chat:
        choices = []
        for i, t in enumerate(texts):
            _, tool_calls = collect(calls[i])
            message = {"role": "assistant", "content": t if t or not tool_calls else None}
            if gen.outputs[i].chat.thinking:
                message["reasoning_content"] = reasoning[i]
            if tool_calls:
                message["tool_calls"] = tool_calls
            lp = {"content": [e["content"][0] for e in entries[i]]} if wanted else None
            choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": gen.finish[i]})
    else:
        choices = [{"index": i, "text": t, "logprobs": legacy[i].whole() if wanted else None,
                    "finish_reason": gen.finish[i]} for i, t in enumerate(texts)]
    return JSONResponse({**head, "choices": choices, "usage": gen.usage()})


# ---- the API's documented responses (/openapi.json) ------------------------------------------

class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """Every error's body."""
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None
    finish_reason: str


class CompletionResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatMessage(BaseModel):
    role: str
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[dict] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: dict | None
    finish_reason: str


class ChatCompletionResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: str
    data: list[ModelCard]


ERROR_STATUSES = {
    400: "A malformed or invalid request (the field is named in `param`)",
    401: "The server has an API key (--api-key) and the request did not send it as `Authorization: Bearer KEY`",
    404: "Another model name than the served one",
    408: "The request body did not arrive within --timeout-read seconds",
    413: "The request body is larger than --max-request-bytes",
    500: "An internal error (logged by the server)",
    503: "The waiting queue is full, the engine stopped, or the server shut down before the request finished",
}
SSE = {"text/event-stream": {"schema": {"type": "string"},
                             "description": "With `stream: true`: one `data: {chunk}` event per token, then "
                                            "`data: [DONE]`"}}


def _responses(*statuses: int, stream: bool = False) -> dict:
    out = {s: {"model": ErrorResponse, "description": ERROR_STATUSES[s]} for s in statuses}
    if stream:
        out[200] = {"content": SSE}
    return out


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema without the 422 it adds to every route with parameters: the server
    answers every invalid request with a 400 in the error shape."""
    from fastapi.openapi.utils import get_openapi

    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema["paths"].values():
            for operation in path.values():
                operation["responses"].pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def create_app(service: Service, *, api_key: str | None = None, max_request_bytes: int = MAX_REQUEST_BYTES,
               read_timeout: float = READ_TIMEOUT_S) -> FastAPI:
    """The ASGI app behind `Gate` (dsv4_jax/serving/http.py: API key, body limit and deadline,
    internal errors); its lifespan starts the engine thread and stops it at shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.engine.start()
        try:
            yield
        finally:
            service.engine.stop()

    app = FastAPI(title=PROG, lifespan=lifespan)
    app.openapi = lambda: _openapi(app)
    app.add_middleware(Gate, api_key=api_key, max_body=max_request_bytes, read_timeout=read_timeout)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if err["type"] == "json_invalid":
            message, param = f"The request body is not valid JSON ({err.get('ctx', {}).get('error', err['msg'])})", None
        elif err["type"] == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {param}"
        elif err["type"] == "string_unicode":  # a lone surrogate where pydantic reads text (a field's name)
            message = (f"'{param}' is" if param else "A field name in the request body is") + (
                " not valid Unicode text (it holds a lone surrogate); send text as UTF-8")
        elif param is None and (err["type"] == "missing" or err.get("input", 0) is None):  # no body, or null
            param = REQUIRED.get(request.url.path)
            message = f"The request body is empty: send a JSON object with at least '{param}'"
        elif err["type"] == "missing":
            message = f"Missing required parameter: '{param}'"
        else:
            message = f"Invalid value for '{param}': {err['msg']}" if param else err["msg"]
        return error_response(APIError(400, message, param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        return error_response(APIError(e.status_code, str(e.detail)), e.headers)  # 405 keeps its Allow

    def model_card() -> dict:
        return {"id": service.model_name, "object": "model", "created": service.created, "owned_by": "dsv4-jax",
                "max_model_len": service.engine.max_len}

    @app.get("/health", responses=_responses(503))
    async def health() -> dict:
        if not service.engine.alive():
            raise APIError(503, "the engine thread is not running")
        return {}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text format (`dsv4:` names)"}})
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, responses=_responses(401))
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_responses(401, 404))
    async def model(model_id: str):
        if model_id != service.model_name:
            raise APIError(404, f"The model `{model_id}` does not exist.", "model")
        return model_card()

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses=_responses(400, 401, 404, 408, 413, 500, 503, stream=True))
    async def completions(body: CompletionRequest, http: Request):
        sampling = _checked_sampling(body, service)
        grammar = _grammar(body, None, service)
        prompts = await _completion_prompts(body.prompt, service)
        m = DEFAULT_COMPLETION_TOKENS if body.max_tokens is None else body.max_tokens
        gen = Generation(service, http, prompts, [m] * len(prompts), sampling, "prompt", grammar=grammar)
        return await _respond(gen, body, "text_completion", service.model_name)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses=_responses(400, 401, 404, 408, 413, 500, 503, stream=True))
    async def chat_completions(body: ChatRequest, http: Request):
        sampling = _checked_sampling(body, service)
        try:
            tools = check_tools(body.tools, body.tool_choice)
        except ChatError as e:
            raise APIError(400, str(e), e.param) from None
        prompt, setup = await _chat_prompt(body, tools, service)
        grammar = _grammar(body, tools, service)
        if grammar is not None and setup.thinking:  # the reasoning is free; the grammar holds after it
            grammar = after_reasoning(grammar, service.tokenizer.end_think)
        m = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if m is None:
            m = max(service.engine.max_len - len(prompt), 1)
        gen = Generation(service, http, [prompt], [m], sampling, "messages", chat=setup, grammar=grammar)
        return await _respond(gen, body, "chat.completion", service.model_name)

    return app


async def _chat_prompt(body: ChatRequest, tools: ToolSpec, service: Service) -> tuple[list[int], ChatSetup]:
    """The request's messages rendered (dsv4_jax/serving/chat.py, with its tools and reasoning
    effort) and encoded, both in a worker thread; the special-token strings of the request's own
    text become plain text. Also the reply's setup: thinking mode when the prompt ends by opening
    the reasoning."""
    tokenizer = service.tokenizer
    try:
        prompt = await asyncio.to_thread(service.chat.render, body.messages, body.chat_template_kwargs,
                                         tokenizer.specials, tools, body.reasoning_effort)
    except ChatError as e:
        raise APIError(400, str(e), e.param) from None
    _check_length(prompt.text, service, "messages")
    ids = await asyncio.to_thread(tokenizer.encode_chat, prompt.text, prompt.literals)
    return ids, ChatSetup(prompt.text.rstrip().endswith(THINK), tools)


def _grammar(body: _Common, tools: ToolSpec | None, service: Service) -> str | None:
    """The grammar a request's replies must follow (dsv4_jax/serving/grammar.py), None for none:
    a chat request's tool_choice required / a named function (a call of its tools), else its
    response_format, or either endpoint's structured_outputs; 400 naming the field when the
    library refuses it."""
    forced = None if tools is None else tools.forced_names()
    fields = (("tool_choice", forced), ("response_format", getattr(body, "response_format", None)),
              ("structured_outputs", body.structured_outputs))
    asked = [name for name, value in fields if value is not None and value != {"type": "text"}]
    if len(asked) > 1:
        raise APIError(400, f"{asked[0]} and {asked[1]} both constrain the reply: send one", asked[1])
    try:
        grammar = (grammar_for_tools(tools.tools, forced) if forced is not None
                   else grammar_for(getattr(body, "response_format", None), body.structured_outputs))
    except GrammarError as e:
        raise APIError(400, str(e), e.param) from None
    if grammar is not None and service.vocabulary is None:
        raise APIError(400, "constrained replies need the checkpoint's eos token id (none is known)", asked[0])
    return grammar


# ---- command line ---------------------------------------------------------------------------

def parse_args(argv=None):
    from dsv4_jax.runtime.cli_args import add_model_arguments

    ap = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="checkpoint directory (dsv4-convert output, or HF safetensors), "
                                                  "with tokenizer.json")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    ap.add_argument("--served-model-name", help="the model's name in the API (default: the checkpoint "
                                                "directory's name)")
    ap.add_argument("--max-num-seqs", "--slots", dest="slots", type=int, default=8,
                    help="sequences decoded together (cache slots; default 8)")
    ap.add_argument("--max-len", type=int, default=4096, help="tokens a sequence may hold: prompt + output "
                                                              "(default 4096)")
    ap.add_argument("--block-size", type=int, default=None,
                    help="tokens per block of the paged cache pools, a multiple of every compress ratio "
                         "(default: the largest ratio, 128 for DeepSeek-V4)")
    ap.add_argument("--kv-cache-memory", type=byte_size, default=None,
                    help="bytes for the paged cache pools, e.g. 8GiB (default: 90%% of the device's free memory "
                         "less the slots' rings and states; on a CPU, max-num-seqs sequences of max-len tokens)")
    ap.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                    help="the compressed entries' storage: auto (the compute dtype) or fp8 (DeepSeek's 584-byte "
                         "record: e4m3 with a power-of-two scale per 64 values, bf16 RoPE part; default auto)")
    ap.add_argument("--enable-prefix-caching", action=BooleanOptionalAction, default=True,
                    help="reuse the cache blocks of prompt prefixes seen before (default: on; "
                         "--no-enable-prefix-caching turns it off)")
    ap.add_argument("--prefix-snapshots", type=int, default=None,
                    help="row states prefix caching keeps, each at the end of a cached block, so that a request "
                         "reusing that prefix starts there instead of recomputing the window before it "
                         "(default: 2 x max-num-seqs; 0: always recompute)")
    ap.add_argument("--max-queue", type=int, default=1024, help="requests that may wait for a slot; more get "
                                                                "503 (default 1024)")
    ap.add_argument("--prefill-chunk", type=int, default=512, help="largest prompt chunk prefilled in one step, "
                                                                   "a power of two >= 16 (default 512)")
    ap.add_argument("--max-tokens-per-step", type=int, default=None,
                    help="token budget of an engine step: prefill chunks plus one per decoding slot "
                         "(default: prefill chunk + slots)")
    add_model_arguments(ap)
    ap.add_argument("--scheduler", choices=("continuous", "static"), default="continuous",
                    help="continuous batching (the engine; default), or static batches through generate (the "
                         "baseline it is measured against: a batch runs to its end before the next starts)")
    ap.add_argument("--deterministic", action="store_true",
                    help="a request's tokens do not depend on what else is batched or on how its prompt is cut "
                         "(prompts go in one token a step through the decode program; slower prefill)")
    ap.add_argument("--speculative-tokens", type=int, default=0,
                    help="speculative decoding with the checkpoint's MTP block: K drafts a round (1-8; default 0: off)")
    ap.add_argument("--no-warmup", action="store_true", help="open the port without compiling first (the first "
                                                             "requests then compile)")
    ap.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                    help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, else none)")
    ap.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                    help=f"largest request body; larger ones get 413 (default {MAX_REQUEST_BYTES})")
    ap.add_argument("--timeout-read", type=float, default=READ_TIMEOUT_S,
                    help="seconds a client has to send a request's headers (from connecting or from its previous "
                         "response) and then its body; slower ones are cut off (default %(default)g)")
    ap.add_argument("--timeout-graceful-shutdown", type=float, default=GRACEFUL_SHUTDOWN_S,
                    help="on SIGINT / SIGTERM, seconds the requests in flight have to finish before they are "
                         "cancelled (default %(default)g)")
    args = ap.parse_args(argv)
    for flag, value in (("--max-request-bytes", args.max_request_bytes), ("--timeout-read", args.timeout_read),
                        ("--timeout-graceful-shutdown", args.timeout_graceful_shutdown)):
        if not value > 0:
            raise UsageError(f"{flag} must be positive, got {value:g}")
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("--api-key must not be empty")
    return args


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), not yet listening: a taken port fails here, before the
    model loads, and clients are refused until uvicorn listens (after warm-up)."""
    if not 0 <= port < 65536:
        raise OSError(f"--port must be in [0, 65536), got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise OSError(f"--host {host}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None
    return sock


def _tokenizer(ckpt: str):
    from tokenizers import Tokenizer

    path = os.path.join(ckpt, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing: the server needs the checkpoint's tokenizer")
    try:
        return ServerTokenizer(Tokenizer.from_file(path))
    except Exception as e:  # noqa: BLE001  the tokenizers package raises plain Exceptions
        raise ValueError(f"{path}: cannot read the tokenizer ({str(e).splitlines()[0] if str(e) else e!r})") from None


def load_service(args, log=None) -> Service:
    """Loads the checkpoint, builds the engine and (unless --no-warmup) compiles and runs its programs.
    ValueError / OSError for a bad flag or checkpoint."""
    from dsv4_jax.runtime import compile_cache
    from dsv4_jax.runtime.cli_args import model_options

    log = log or (lambda msg: print(f"{PROG}: {msg}", file=sys.stderr, flush=True))
    compile_cache.enable(args.compile_cache)  # before anything compiles
    import jax.numpy as jnp

    import dsv4_jax
    from dsv4_jax.checkpoint.hf_files import generation_eos_ids

    if not os.path.isdir(args.ckpt):
        raise ValueError(f"checkpoint directory not found: {args.ckpt}")
    tokenizer = _tokenizer(args.ckpt)
    chat = load_chat_format(args.ckpt)
    options, mesh = model_options(args)
    t0 = time.perf_counter()
    model = dsv4_jax.load(args.ckpt, dtype=getattr(jnp, args.dtype), mesh=mesh, layout=args.layout,
                          mtp=args.speculative_tokens > 0, **options)
    cfg = model.config
    if cfg.use_index_cache:
        log(dsv4_jax.index_cache_schedule(cfg).describe())
    eos = generation_eos_ids(args.ckpt, cfg.vocab_size) or (
        () if cfg.eos_token_id is None else (cfg.eos_token_id,))
    if args.scheduler == "static" and args.deterministic:
        raise ValueError("--scheduler static runs generate's batches: drop --deterministic")
    if args.scheduler == "static" and args.speculative_tokens:
        raise ValueError("--scheduler static runs no speculation: drop --speculative-tokens")
    try:
        engine = (Engine if args.scheduler == "continuous" else StaticEngine)(
            model, slots=args.slots, max_len=args.max_len, prefill_chunk=args.prefill_chunk,
            max_tokens_per_step=args.max_tokens_per_step, max_queue=args.max_queue,
            speculative_tokens=args.speculative_tokens, block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=args.enable_prefix_caching,
            kv_cache_dtype=args.kv_cache_dtype, deterministic=args.deterministic,
            prefix_snapshots=args.prefix_snapshots)
    except EngineConfigError as e:
        raise ValueError(f"--{e.param.replace('_', '-')}: {e}") from None
    name = args.served_model_name or os.path.basename(os.path.normpath(os.path.abspath(args.ckpt)))
    log(f"loaded {args.ckpt} in {time.perf_counter() - t0:.1f}s ({args.dtype}; {engine.slots} slots of "
        f"{engine.max_len} tokens; eos ids {list(eos)}; chat: {chat.name})")
    if tokenizer.chars_per_token is None:
        log("text prompts are not length-checked before they are tokenized (no bound on characters per token "
            "holds for this tokenizer); --max-request-bytes limits them")
    if not args.no_warmup:
        warmup(engine, log)
    vocabulary = TokenVocabulary(tokenizer.tokenizer, cfg.vocab_size, eos) if eos else None
    return Service(engine, tokenizer, chat, name, tuple(eos), Metrics(engine), vocabulary=vocabulary)


def warmup(engine: Engine, log) -> None:
    """Runs the engine's warm-up (every program compiled, or loaded from the compilation cache,
    and run once), logging a line per program and at the end how many were compiled and how
    many loaded."""
    from dsv4_jax.runtime.compile_cache import CompileCounter

    t0 = time.perf_counter()
    compiled = loaded = 0
    log("warm-up: compiling and running every program before the port opens (--no-warmup skips it)")
    with CompileCounter() as counter:
        seen = (0, 0)

        def progress(i: int, total: int, name: str) -> None:
            nonlocal seen, compiled, loaded
            new = (counter.compiled - seen[0], counter.loaded - seen[1])
            seen = (counter.compiled, counter.loaded)
            how = "compiled" if new[0] else "loaded from the compilation cache" if new[1] else "already compiled"
            compiled, loaded = compiled + bool(new[0]), loaded + bool(not new[0] and new[1])
            log(f"warm-up: {i}/{total} {name}: {how}, run ({time.perf_counter() - t0:.1f}s)")

        n = engine.warmup(progress=progress)
    seconds = f"{time.perf_counter() - t0:.1f}s"
    if compiled and loaded:
        log(f"warm-up compiled {compiled} programs and loaded {loaded} from the compilation cache, and ran them "
            f"in {seconds}")
    elif loaded:
        log(f"warm-up loaded {n} programs from the compilation cache and ran them in {seconds}")
    elif compiled:
        log(f"warm-up compiled {n} programs and ran them in {seconds}")
    else:
        log(f"warm-up ran {n} programs, compiled already, in {seconds}")


def uvicorn_config(service: Service, args, log_level: str = "info"):
    """uvicorn's configuration for the app: the h11 protocol with the header deadline and the
    graceful shutdown of dsv4_jax/serving/http.py, the flags' limits."""
    import uvicorn

    app = create_app(service, api_key=args.api_key, max_request_bytes=args.max_request_bytes,
                     read_timeout=args.timeout_read)
    return uvicorn.Config(app, http=protocol(args.timeout_read), log_level=log_level,
                          timeout_graceful_shutdown=args.timeout_graceful_shutdown)


def main(argv=None) -> int:
    import uvicorn

    try:
        args = parse_args(argv)
        sock = listen_socket(args.host, args.port)
    except (UsageError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    try:
        service = load_service(args)
    except (ValueError, OSError, TypeError) as e:
        sock.close()
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        sock.close()
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    server = uvicorn.Server(uvicorn_config(service, args, log_level="info"))
    # uvicorn shuts down gracefully on SIGINT / SIGTERM once it runs, then raises the signal again
    # for the handler it found. This one also makes a signal that comes before uvicorn takes over
    # a graceful shutdown, and after it a no-op, so that a graceful shutdown exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    host, port = sock.getsockname()[:2]
    print(f"{PROG}: serving {service.model_name!r} on http://{host}:{port}"
          f"{' (API key required)' if args.api_key else ''}", file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
