"""The API agents use, with the openai client against a live `dsv4-serve` on the random tiny
checkpoint (fp32): tool calls, reasoning, structured outputs, logprobs, n and the sampling
controls, and none of them compiling a program after warm-up.

The random model writes no tool call or JSON of its own: what it writes under a grammar is what
the grammar lets through, so every constrained reply must parse and validate, for every seed.
The parsers themselves are tested on every split of known texts (tests/test_tool_calls.py,
tests/test_reasoning.py); here streamed and whole replies must agree, and a known tool-call text
forced through the server (a one-text `structured_outputs` choice) streams a character at a time.
"""

import concurrent.futures
import json

import jax.numpy as jnp
import jsonschema
import numpy as np
import openai
import pytest
from conftest import serving

import dsv4_jax
from convert.cli import convert
from dsv4_jax.model.deepseek_v4 import forward
from dsv4_jax.runtime.compile_cache import CompileCounter
from dsv4_jax.serving import chat, serve
from dsv4_jax.tools.random_checkpoint import write_random_checkpoint

FLAGS = ["--dtype", "float32", "--slots", "4", "--max-len", "2048", "--prefill-chunk", "32", "--compile-cache", "off"]
# The random model ends a free-text value only by chance, so the tools' parameters are bounded:
# enums, ranged integers, booleans, short arrays (a grammar bounds them; raw text it does not).
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather at a place",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"type": "string", "enum": ["C", "F"]}}, "required": ["city", "days"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {
        "exact": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
        "required": ["exact"]}}}
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                     "zip": {"type": "integer"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "scores": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 4}},
        "required": ["scores"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"], "additionalProperties": False},
}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
# An agent's history: an earlier turn's call with its reasoning, and the call's result.
AGENT_HISTORY = [*USER, {"role": "assistant", "content": None, "reasoning_content": "Paris first.", "tool_calls": [
    {"id": "c1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
THINK_BIAS = 3.0  # a logit_bias on </think> that ends the random model's reasoning after some tens of tokens


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_api")
    write_random_checkpoint(root / "hf", "tiny")
    ckpt = root / "tiny-ckpt"
    convert(str(root / "hf"), str(ckpt), dtype="float32")
    args = serve.parse_args(["--ckpt", str(ckpt), *FLAGS])
    service = serve.load_service(args, log=lambda _: None)
    with serving(service, args) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        yield service, client, ckpt


def _chat(client, stream=False, **kw):
    kw = {"model": None, "messages": USER, "max_tokens": 120, "temperature": 1.0, **kw}
    extra = kw.pop("extra_body", {})
    model = kw.pop("model")
    if not stream:
        return client.chat.completions.create(model=model or "tiny-ckpt", extra_body=extra, **kw).choices[0]
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(model=model or "tiny-ckpt", stream=True, extra_body=extra, **kw):
        for c in chunk.choices:
            d = c.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or (d.model_extra or {}).get("reasoning_content") or ""
            for t in d.tool_calls or []:
                call = calls.setdefault(t.index, {"id": t.id, "name": t.function.name, "arguments": ""})
                call["arguments"] += t.function.arguments or ""
            finish = c.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


def _calls(choice) -> list[dict]:
    return [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
            for t in choice.message.tool_calls or []]


def _valid_call(call: dict, tools: list[dict]):
    spec = next(t["function"] for t in tools if t["function"]["name"] == call["name"])
    jsonschema.validate(json.loads(call["arguments"]), spec["parameters"])


def test_tool_call_text_cut_at_every_character_gives_the_same_calls(live):
    """The model's tool-call text through the server: a `structured_outputs` choice of one known
    DSML text (content, then two calls) makes the random model write exactly that text. The test
    tokenizer spells it one byte per token, so streamed it arrives cut at every character (the
    detokenizer holds a character's bytes together); whole and streamed, for 2 seeds, the server
    parses it into the same content and `tool_calls`."""
    service, client, _ = live
    calls = [{"function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}},
             {"function": {"name": "search", "arguments": {"exact": True, "tags": ["a", "c"]}}}]
    text = "Let me look.\n\n" + chat.tool_calls_block(calls)
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    choice = {"structured_outputs": {"choice": [text]}}
    for seed in range(2):
        kw = dict(tools=[WEATHER, SEARCH], seed=seed, max_tokens=len(text.encode()) + 16)
        response = client.chat.completions.create(model="tiny-ckpt", messages=USER, temperature=1.0, **kw,
                                                  extra_body=choice)
        whole = response.choices[0]
        assert response.usage.completion_tokens == len(text.encode())  # a token a byte: every cut
        assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me look."
        assert [(c["name"], json.loads(c["arguments"])) for c in _calls(whole)] == expected
        content, _, streamed, finish = _chat(client, stream=True, extra_body=choice, **kw)
        assert finish == "tool_calls" and content == "Let me look."
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == expected


def test_required_and_named_tool_calls_are_well_formed_streamed_or_not(live):
    """tool_choice "required" (either tool) and a named function, 6 seeds each at temperature 1:
    every reply is a call of an allowed tool whose arguments validate against its schema, with
    finish_reason "tool_calls"; the same seed streamed gives the same calls."""
    service, client, _ = live
    tools = [WEATHER, SEARCH]
    with CompileCounter() as compiles:
        for choice, names in (("required", {"get_weather", "search"}),
                              ({"type": "function", "function": {"name": "search"}}, {"search"})):
            for seed in range(6):
                whole = _chat(client, tools=tools, tool_choice=choice, seed=seed, max_tokens=600)
                calls = _calls(whole)
                assert calls and whole.finish_reason == "tool_calls", whole
                for call in calls:
                    assert call["name"] in names
                    _valid_call(call, tools)
                _, _, streamed, finish = _chat(client, stream=True, tools=tools, tool_choice=choice, seed=seed,
                                               max_tokens=600)
                assert finish == "tool_calls"
                assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == \
                    [(c["name"], json.loads(c["arguments"])) for c in calls]
    assert compiles.compiled == 0, compiles.programs


def test_reasoning_is_split_the_same_streamed_or_not(live):
    """Thinking on (chat_template_kwargs and reasoning_effort): the reply's text goes to
    reasoning_content up to </think>, and streaming splits it the same way."""
    _, client, _ = live
    for extra in ({"chat_template_kwargs": {"thinking": True}}, {}):
        kw = dict(seed=5, max_tokens=40, extra_body=extra)
        if not extra:
            kw["reasoning_effort"] = "high"
        whole = _chat(client, **kw)
        reasoning = (whole.message.model_extra or {}).get("reasoning_content")
        content, streamed_reasoning, _, _ = _chat(client, stream=True, **kw)
        assert reasoning and streamed_reasoning == reasoning and content == (whole.message.content or "")
    plain = _chat(client, seed=5, max_tokens=20)
    assert (plain.message.model_extra or {}).get("reasoning_content") is None and plain.message.content


def test_structured_outputs_validate_for_every_seed(live):
    """Three schemas x 20 seeds, sent at once with unconstrained requests beside them: every
    constrained reply parses and validates; vLLM's regex and choice. (json_object allows strings
    of any length, which the random model ends only by chance: tests/test_grammar.py walks it.)"""
    _, client, _ = live

    def constrained(name, seed):
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}
        return name, _chat(client, response_format=fmt, seed=seed, max_tokens=160)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        jobs = [pool.submit(constrained, name, seed) for name in SCHEMAS for seed in range(20)]
        free = [pool.submit(_chat, client, seed=s, max_tokens=30) for s in range(4)]
        for job in jobs:
            name, choice = job.result()
            assert choice.finish_reason == "stop", choice
            assert _parses(choice.message.content), (name, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
        assert all(f.result().message.content is not None for f in free)
    rx = _chat(client, seed=2, extra_body={"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}})
    assert rx.message.content and len(rx.message.content) == 6 and rx.message.content[3] == "-"
    pick = _chat(client, seed=3, extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert pick.message.content in ("yes", "no", "maybe")


def test_constrained_replies_after_thinking(live):
    """Thinking on with a json_schema or tool_choice "required" (after a history that sends the
    reasoning of an earlier call back): the reasoning is free text up to </think> and the reply
    after it follows the grammar, streamed or not, without a compilation.
    The random model writes </think> (one token of its vocabulary) only by chance, so a
    logit_bias raises it, as a client could; biased against it, the reply reasons until
    max_tokens: finish_reason "length", all reasoning, an empty content."""
    service, client, _ = live
    end_think = service.tokenizer.end_think
    assert end_think is not None and end_think in service.tokenizer.special_ids  # the grammar names the token
    think = {"chat_template_kwargs": {"thinking": True}, "logit_bias": {str(end_think): THINK_BIAS}}
    reasonings = []
    with CompileCounter() as compiles:
        for seed in range(4):
            name = list(SCHEMAS)[seed % len(SCHEMAS)]
            fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}
            whole = _chat(client, response_format=fmt, seed=seed, max_tokens=600, extra_body=think)
            reasoning = (whole.message.model_extra or {}).get("reasoning_content")
            assert whole.finish_reason == "stop" and isinstance(reasoning, str), whole
            assert "</think>" not in reasoning + whole.message.content
            reasonings.append(reasoning)
            jsonschema.validate(json.loads(whole.message.content), SCHEMAS[name])
            content, streamed_reasoning, _, finish = _chat(client, stream=True, response_format=fmt, seed=seed,
                                                           max_tokens=600, extra_body=think)
            assert (content, streamed_reasoning, finish) == (whole.message.content, reasoning, "stop")
            call = _chat(client, messages=AGENT_HISTORY, tools=[WEATHER, SEARCH], tool_choice="required", seed=seed,
                         max_tokens=None, extra_body=think)  # the rest of the context
            assert call.finish_reason == "tool_calls" and _calls(call), call
            assert isinstance((call.message.model_extra or {}).get("reasoning_content"), str)
            for c in _calls(call):
                _valid_call(c, [WEATHER, SEARCH])
        never = {"chat_template_kwargs": {"thinking": True}, "logit_bias": {str(end_think): -100}}
        cut = _chat(client, response_format={"type": "json_object"}, seed=1, max_tokens=30, extra_body=never)
        assert cut.finish_reason == "length" and cut.message.content == ""
        assert cut.message.model_extra["reasoning_content"]
    assert any(reasonings)
    assert compiles.compiled == 0, compiles.programs


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"n": 0}, "n"), ({"top_logprobs": 3}, "top_logprobs"), ({"min_p": 2}, "min_p"),
    ({"logit_bias": {"5": 200}}, "logit_bias"), ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"messages": [*USER, {"role": "assistant", "content": "a", "reasoning_content": {"text": "r"}}]},
     "messages[1].reasoning_content"),
])
def test_bad_requests_are_400_naming_the_field(live, body, param):
    _, client, _ = live
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-ckpt", messages=USER, max_tokens=4, extra_body=body)
    assert e.value.body["param"] == param, e.value.body


def test_logprobs_are_the_models_and_n_choices_repeat_with_a_seed(live):
    """Completions with token ids, greedy: each token's logprob and the top 5 equal the
    log-softmax of the full forward's fp32 logits within 1e-5 (chat's logprobs too); n = 4 with a
    seed gives 4 answers, the same 4 twice, counted in the usage."""
    service, client, ckpt = live
    model = dsv4_jax.load(str(ckpt), dtype=jnp.float32)
    prompt = [int(x) for x in np.random.default_rng(0).integers(5, 500, 37)]
    r = client.completions.create(model="tiny-ckpt", prompt=prompt, max_tokens=12, temperature=0, logprobs=5,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    # the greedy tokens: generate's (the engine's equal them, tests/test_engine.py); their text the reply's
    tokens = dsv4_jax.generate(model, [prompt], 12).rows()[0]
    assert len(lp.token_logprobs) == r.usage.completion_tokens == len(tokens)
    assert lp.tokens == [service.tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
    seq = prompt + tokens
    logits = np.asarray(forward(model.params, jnp.asarray([seq]), model.config))[0, len(prompt) - 1:-1]
    ref = logits.astype(np.float64)
    ref = ref - ref.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    for i, (token, value, top) in enumerate(zip(seq[len(prompt):], lp.token_logprobs, lp.top_logprobs)):
        assert abs(value - ref[i, token]) < 1e-5
        best = np.sort(ref[i])[::-1][:5]  # the legacy dict keeps one entry of tokens that print alike
        assert 0 < len(top) <= 5 and abs(max(top.values()) - best[0]) < 1e-5
        assert all(np.abs(best - v).min() < 1e-5 for v in top.values())
    chat = client.chat.completions.create(model="tiny-ckpt", messages=USER, max_tokens=5, logprobs=True,
                                          top_logprobs=3, temperature=0)
    entries = chat.choices[0].logprobs.content
    assert len(entries) == chat.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in entries)
    assert all(e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in entries)

    def four():
        out = client.chat.completions.create(model="tiny-ckpt", messages=USER, max_tokens=10, n=4, seed=7,
                                             temperature=1.0, extra_body={"ignore_eos": True})
        return out, [ch.message.content for ch in sorted(out.choices, key=lambda ch: ch.index)]

    first, a = four()
    _, b = four()
    assert a == b and len(set(a)) > 1 and sorted(ch.index for ch in first.choices) == [0, 1, 2, 3]
    assert first.usage.completion_tokens == 40 and all(ch.finish_reason == "length" for ch in first.choices)


def test_sampling_controls_through_the_server(live):
    """min_p, the penalties, logit_bias and min_tokens are accepted and applied: a logit_bias of
    +100 on one token makes a greedy reply that token throughout (with no penalty), and
    min_tokens keeps eos out of the first tokens."""
    _, client, _ = live
    prompt = [5, 6, 7, 8]
    r = client.completions.create(model="tiny-ckpt", prompt=prompt, max_tokens=6, temperature=0,
                                  logit_bias={"300": 100}, logprobs=0)
    assert r.choices[0].text and len(set(r.choices[0].logprobs.tokens)) == 1
    r = client.completions.create(model="tiny-ckpt", prompt=prompt, max_tokens=8, temperature=0.8, seed=1,
                                  presence_penalty=1.5, frequency_penalty=1.0,
                                  extra_body={"repetition_penalty": 1.3, "min_p": 0.1, "min_tokens": 8})
    assert r.usage.completion_tokens == 8


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
