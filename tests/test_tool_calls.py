"""Tool calling (dsv4_jax/serving/tool_calls.py, dsv4_jax/serving/chat.py): the request's tools
checked, rendered into DeepSeek-V4's prompt with earlier calls and their results, and the model's
DSML blocks parsed back into OpenAI tool calls, the same whether the text streams in any pieces or
comes whole."""

import json
import os
import random

import pytest
from conftest import text_splits

from dsv4_jax.serving import chat
from dsv4_jax.serving.tool_calls import ToolCallParser, ToolSpec, check_tools, collect

B, E = chat.BOS, chat.EOS
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city, días incluidos",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["location"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
SPEC = check_tools([WEATHER, NOW], "auto")


def block(*invokes: str) -> str:
    return "<｜DSML｜tool_calls>\n" + "\n".join(invokes) + "\n</｜DSML｜tool_calls>"


def invoke(name: str, *parameters: tuple[str, str, str]) -> str:
    """An invoke of `name` with (parameter name, "true"/"false", raw value) parameters."""
    lines = [f'<｜DSML｜parameter name="{k}" string="{flag}">{v}</｜DSML｜parameter>' for k, flag, v in parameters]
    return f'<｜DSML｜invoke name="{name}">\n' + "\n".join(lines) + "\n</｜DSML｜invoke>"


TRICKY = 'line one\nline "two" <b> & \\ ü 日本 😀 </｜DSML｜parameterX <｜DSML｜tool_calls>'
NESTED = {"a": [1, 2.5, {"b": None, "c": [True, False]}], "d": {"e": "x\ny"}, "f": -3e-5}
BROKEN = block(invoke("get_weather", ("location", "maybe", "Paris")))
SAME = None  # in CASES: the content is the whole text
# (model text, expected content or SAME, expected calls as (name, arguments))
CASES = [
    ("Let me check.\n\n" + block(invoke("get_weather", ("location", "true", "Beijing"), ("days", "false", "3"))),
     "Let me check.", [("get_weather", {"location": "Beijing", "days": 3})]),
    ("\n\n" + block(invoke("get_weather", ("location", "true", "Paris")), invoke("now")),
     "", [("get_weather", {"location": "Paris"}), ("now", {})]),
    (block(invoke("get_weather", ("location", "true", TRICKY), ("n", "false", "42"), ("x", "false", " -1.5e3 "),
                  ("ok", "false", "true"), ("none", "false", "null"), ("nested", "false", json.dumps(NESTED)),
                  ("list", "false", '[1, "two", {"three": [3]}]'), ("raw", "false", "not json {"),
                  ("huge", "false", "1e999"), ("nan", "false", "NaN"), ("empty", "true", ""))),
     "", [("get_weather", {"location": TRICKY, "n": 42, "x": -1500.0, "ok": True, "none": None, "nested": NESTED,
                           "list": [1, "two", {"three": [3]}], "raw": "not json {", "huge": "1e999", "nan": "NaN",
                           "empty": ""})]),
    ('<｜DSML｜tool_calls><｜DSML｜invoke name="now"></｜DSML｜invoke></｜DSML｜tool_calls>', "",
     [("now", {})]),  # no whitespace between the tags
    ("Before.\n" + block(invoke("now")) + "\nAfter the call: <｜DSML｜ is text.",
     "Before.\nAfter the call: <｜DSML｜ is text.", [("now", {})]),
    ("a <｜DS b", SAME, []),
    ("ends with a partial marker <｜DSML｜tool_c", SAME, []),
    ("spaces kept   \n", SAME, []),
    ("x" + block(invoke("now")) + " y " + block(invoke("get_weather", ("location", "true", "Oslo"))) + "z",
     "x yz", [("now", {}), ("get_weather", {"location": "Oslo"})]),  # the space before a block goes with it
    # a bad string flag breaks the block: it stays text; the call opened before the break is sent, empty
    ("Hm.\n\n" + BROKEN, SAME, [("get_weather", {})]),
    # cut off mid-parameter: the text is content, the call holds its complete parameters
    ("\n" + block(invoke("get_weather", ("location", "true", "Rome"), ("days", "false", "2")))[:-40], SAME,
     [("get_weather", {"location": "Rome"})]),
    # a parameter named twice, an unknown tag, an empty name: the block is text again and the rest is read anew
    (block(invoke("now", ("a", "true", "1"), ("a", "true", "2"))), SAME, [("now", {"a": "1"})]),
    ("<｜DSML｜tool_calls>\n<｜DSML｜think>" + block(invoke("now")), "<｜DSML｜tool_calls>\n<｜DSML｜think>",
     [("now", {})]),
    (block('<｜DSML｜invoke name="">\n</｜DSML｜invoke>'), SAME, []),
    ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bad\nname">', SAME, []),
]


def _run(pieces: list[str], spec=SPEC) -> tuple[list, tuple[str, list[dict]]]:
    parser = ToolCallParser(spec, seed="req-1/0")
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    return events, collect(events)


def _calls(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_every_split_parses_the_same(case):
    text, content, calls = CASES[case]
    content = text if content is SAME else content
    whole = ToolCallParser(SPEC, seed="req-1/0").parse(text)
    assert whole[0] == content
    assert _calls(whole[1]) == calls
    seeded = ToolCallParser(SPEC, seed="req-1/0")
    assert [c["id"] for c in whole[1]] == [seeded._call_id(i) for i in range(len(calls))]
    for pieces in text_splits(text):
        events, result = _run(pieces)
        assert result == whole, pieces
        for event in events:  # OpenAI's streaming shapes: a call's header first, then argument fragments
            assert isinstance(event, str) and event or set(event) in ({"index", "function"},
                                                                      {"index", "id", "type", "function"})


FUZZ_PIECES = ["words ", " ", "\n", "\n\n", "<", "</", "｜", '"', ">", "<｜DSML｜", "<｜DSML｜tool_c", "1", "é",
               '{"k": [1, "</"]}', chat.TOOL_CALLS, chat.END_TOOL_CALLS, '<｜DSML｜invoke name="now">',
               '<｜DSML｜invoke name="get_weather">', chat.END_INVOKE, '<｜DSML｜parameter name="a" string="true">',
               '<｜DSML｜parameter name="b" string="false">', '<｜DSML｜parameter name="a" string="no">',
               chat.END_PARAMETER]


def _fuzz_text(rng: random.Random) -> str:
    """Markup pieces and text strung at random, or well-formed blocks with one random piece put
    in, or cut short."""
    if rng.random() < 0.5:
        return "".join(rng.choice(FUZZ_PIECES) for _ in range(rng.randint(1, 30)))
    values = [("true", "x"), ("true", "multi\nline <b>"), ("false", "[1, {}]"), ("false", "oops"), ("true", "")]
    text = rng.choice(["", "Sure.", "Sure.\n\n"]) + "".join(
        block(*[invoke(rng.choice(["now", "get_weather"]), *[(f"p{k}", *rng.choice(values))
                                                              for k in range(rng.randint(0, 3))])
                for _ in range(rng.randint(1, 3))]) + rng.choice(["", " then ", "\n"])
        for _ in range(rng.randint(1, 2)))
    at = rng.randrange(len(text) + 1)
    return text[:at] + rng.choice(FUZZ_PIECES) + text[at:] if rng.random() < 0.5 else text[:at]


def test_random_markup_parses_the_same_in_any_pieces():
    """Random texts of markup and text, many of them broken somewhere: any chunking gives the same
    reply, and every call sent holds a JSON object."""
    rng = random.Random(0)
    calls = 0
    for _ in range(600):
        text = _fuzz_text(rng)
        whole = ToolCallParser(SPEC, seed="f").parse(text)
        assert all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in whole[1])
        calls += len(whole[1])
        for pieces in (list(text), *[_random_pieces(text, rng) for _ in range(3)]):
            parser = ToolCallParser(SPEC, seed="f")
            assert collect([e for p in pieces for e in parser.feed(p)] + parser.finish()) == whole, pieces
    assert calls > 300  # the texts hold calls, not only broken markup


def _random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_streamed_deltas_have_openai_shape():
    text = "Sure.\n\n" + block(invoke("get_weather", ("location", "true", "Beijing"), ("days", "false", "3")),
                               invoke("now"))
    events = ToolCallParser(SPEC, seed="s").feed(text)
    ids = [ToolCallParser(SPEC, seed="s")._call_id(i) for i in range(2)]
    assert events == [
        "Sure.",
        {"index": 0, "id": ids[0], "type": "function", "function": {"name": "get_weather", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"location": "Beijing"'}},
        {"index": 0, "function": {"arguments": ', "days": 3'}},
        {"index": 0, "function": {"arguments": "}"}},
        {"index": 1, "id": ids[1], "type": "function", "function": {"name": "now", "arguments": ""}},
        {"index": 1, "function": {"arguments": "{}"}},
    ]
    assert ids[0].startswith("call_") and len(ids[0]) == 29 and ids[0] != ids[1]
    unseeded = [ToolCallParser(SPEC)._call_id(0) for _ in range(2)]
    assert unseeded[0] != unseeded[1] and all(len(i) == 29 for i in unseeded)


def test_held_text_waits_only_for_what_may_be_a_block():
    parser = ToolCallParser(SPEC)
    assert parser.feed("Hello ") == ["Hello"]  # trailing whitespace may come before a block
    assert parser.feed("world<") == [" world"]
    assert parser.feed("｜DSML｜") == []
    assert parser.feed("x") == ["<｜DSML｜x"]
    assert parser.feed("\n\n") == [] and parser.finish() == ["\n\n"]


def test_parser_is_off_without_tools_or_with_choice_none():
    text = "a " + block(invoke("now"))
    for spec in (None, check_tools(None, None), check_tools([NOW], "none")):
        parser = ToolCallParser(spec)
        assert parser.feed(text) == [text] and parser.finish() == []
        assert ToolCallParser(spec).parse(text) == (text, [])


# ---- the request's tools ---------------------------------------------------------------------

def test_tool_choice_and_what_a_grammar_needs():
    assert check_tools(None, None) == ToolSpec([], "none") and not check_tools([], "auto").parses
    spec = check_tools([WEATHER, NOW], None)
    assert spec.choice == "auto" and spec.parses and spec.forced_names() is None
    assert check_tools([WEATHER, NOW], "none").forced_names() is None and not check_tools([NOW], "none").parses
    assert check_tools([WEATHER, NOW], "required").forced_names() == ["get_weather", "now"]
    named = check_tools([WEATHER, NOW], {"type": "function", "function": {"name": "now"}})
    assert named.forced_names() == ["now"] and named.choice == "function"
    assert spec.schemas() == {"get_weather": WEATHER["function"]["parameters"],
                              "now": {"type": "object", "properties": {}}}
    nullable = {"type": "function", "function": {"name": "n", "description": None, "parameters": None, "strict": None}}
    assert check_tools([nullable], None).schemas() == {"n": {"type": "object", "properties": {}}}


BAD_TOOLS = [  # (tools, tool_choice, param, message)
    ({"type": "function"}, None, "tools", "must be a list"),
    (["x"], None, "tools[0]", "must be an object"),
    ([{"type": "retrieval", "function": {"name": "x"}}], None, "tools[0].type", "must be 'function'"),
    ([{"type": "function"}], None, "tools[0].function", "must be an object"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "tools[0].function.name", "1 to 64"),
    ([{"type": "function", "function": {"name": "x" * 65}}], None, "tools[0].function.name", "1 to 64"),
    ([NOW, NOW], None, "tools[1].function.name", "two tools are named 'now'"),
    ([{"type": "function", "function": {"name": "x", "description": 3}}], None, "tools[0].function.description",
     "must be a string"),
    ([{"type": "function", "function": {"name": "x", "parameters": {"type": "array"}}}], None,
     "tools[0].function.parameters", "JSON schema of an object"),
    ([{"type": "function", "function": {"name": "x", "parameters": "{}"}}], None, "tools[0].function.parameters",
     "JSON schema of an object"),
    ([{"type": "function", "function": {"name": "x", "strict": "yes"}}], None, "tools[0].function.strict",
     "true or false"),
    ([{"type": "function", "function": {"name": "x", "description": "\ud800"}}], None, "tools[0]", "lone surrogate"),
    ([{"type": "function", "function": {"name": "x", "parameters": {"type": "object", "p": [[[[[[[[[[[[[[[[[[[[[[[[[[[[
        [[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}}}], None, "tools[0]", "nested more than 32"),
    (None, "required", "tool_choice", "'required' needs tools"),
    ([NOW], "sometimes", "tool_choice", "must be 'auto', 'none', 'required'"),
    ([NOW], {"type": "function", "function": "now"}, "tool_choice", "must be 'auto'"),
    ([NOW], {"type": "function", "function": {"name": "later"}}, "tool_choice", "'later', which is not among"),
    ([], {"type": "function", "function": {"name": "now"}}, "tool_choice", "has no tools"),
]


@pytest.mark.parametrize("case", range(len(BAD_TOOLS)), ids=[c[2] for c in BAD_TOOLS])
def test_bad_tools_name_the_field(case):
    tools, choice, param, message = BAD_TOOLS[case]
    with pytest.raises(chat.ChatError, match=message) as e:
        check_tools(tools, choice)
    assert e.value.param == param


# ---- tools and calls in the prompt ----------------------------------------------------------

TOOLS_HEAD = (
    "\n\n## Tools\n\nYou can call the tools listed below to help with the request. To call tools, write a "
    "\"<｜DSML｜tool_calls>\" block like this one, with one invoke per call:\n\n<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME\">\n<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">"
    "$PARAMETER_VALUE</｜DSML｜parameter>\n...\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"$TOOL_NAME2\">\n...\n"
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n\nWrite a string parameter's value as it is, with string=\"true\". "
    "Write any other value (a number, a boolean, an array or an object) as JSON, with string=\"false\".\n\n"
    "### Available Tool Schemas\n\n")
SCHEMAS = (json.dumps(WEATHER["function"], ensure_ascii=False) + "\n" + '{"name": "now"}\n\nCall only these tools, '
           "by these names, with parameters exactly as their schemas define them.\n")


def test_tools_go_after_the_system_text():
    fmt, user = chat.ChatFormat(), [{"role": "user", "content": "Weather?"}]
    text = fmt.render([{"role": "system", "content": "Be brief."}, *user], tools=SPEC).text
    assert text == f"{B}Be brief.{TOOLS_HEAD}{SCHEMAS}<｜User｜>Weather?<｜Assistant｜></think>"
    assert "días" in text  # the schema line keeps non-ASCII text
    assert fmt.render(user, tools=SPEC).text == f"{B}{TOOLS_HEAD}{SCHEMAS}<｜User｜>Weather?<｜Assistant｜></think>"
    assert fmt.render(user, tools=check_tools([WEATHER, NOW], "none")).text == fmt.render(user, tools=SPEC).text
    assert fmt.render(user, tools=check_tools([], None)).text == fmt.render(user).text == \
        f"{B}<｜User｜>Weather?<｜Assistant｜></think>"


CONVERSATION = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "Weather in Beijing and the time?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": '{"location": "Beijing", "days": 3}'}},
        {"id": "c2", "type": "function", "function": {"name": "now", "arguments": {}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "12:00"}, {"type": "text",
                                                                                         "text": "UTC"}]},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c3", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"location": "北京", "opts": {"u": [1, true]}}'}}]},
    {"role": "tool", "tool_call_id": "c3", "content": "cloudy"},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "Sunny, then cloudy."},
    {"role": "user", "content": "Bye"},
]
HISTORY = (
    "<｜User｜>Weather in Beijing and the time?<｜Assistant｜></think>Checking.\n\n<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"get_weather\">\n"
    "<｜DSML｜parameter name=\"location\" string=\"true\">Beijing</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"now\">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + E +
    "<｜User｜><tool_result>sunny</tool_result>\n\n<tool_result>12:00\n\nUTC</tool_result><｜Assistant｜></think>"
    "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
    "<｜DSML｜parameter name=\"location\" string=\"true\">北京</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"opts\" string=\"false\">{\"u\": [1, true]}</｜DSML｜parameter>\n"
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + E +
    "<｜User｜><tool_result>cloudy</tool_result>\n\nThanks<｜Assistant｜></think>Sunny, then cloudy." + E +
    "<｜User｜>Bye<｜Assistant｜>")


def test_history_of_calls_and_results():
    fmt = chat.ChatFormat()
    assert fmt.render(CONVERSATION).text == f"{B}S{HISTORY}</think>"
    assert fmt.render(CONVERSATION, tools=SPEC).text == f"{B}S{TOOLS_HEAD}{SCHEMAS}{HISTORY}</think>"
    # thinking with tools: DeepSeek's encoder keeps earlier turns' (here empty) reasoning
    thinking = fmt.render(CONVERSATION, {"thinking": True}, tools=SPEC).text
    assert thinking == f"{B}S{TOOLS_HEAD}{SCHEMAS}" + HISTORY.replace(
        "<｜Assistant｜></think>", "<｜Assistant｜><think></think>") + "<think>"
    assert fmt.render(CONVERSATION, {"thinking": True}).text == f"{B}S{HISTORY}<think>"


def _with_reasoning(conversation, texts):
    """conversation with each assistant message given the next of texts as reasoning_content."""
    texts = iter(texts)
    return [{**m, "reasoning_content": next(texts)} if m["role"] == "assistant" else m for m in conversation]


def test_history_reasoning_is_kept_as_deepseeks_encoder_keeps_it():
    """Earlier turns' reasoning_content: with thinking and tools each turn opens with <think> +
    its reasoning + </think>; with thinking and no tools only the turns after the last user
    message do; without thinking it is dropped, as DeepSeek's encoder drops it."""
    fmt = chat.ChatFormat()
    messages = _with_reasoning(CONVERSATION, ["Need weather and time.", "", "All done."])
    thinking = fmt.render(messages, {"thinking": True}, tools=SPEC).text
    kept = HISTORY
    for reply, reasoning in (("Checking.", "Need weather and time."), ("\n\n", ""), ("Sunny", "All done.")):
        kept = kept.replace(f"{chat.ASSISTANT}</think>{reply}", f"{chat.ASSISTANT}<think>{reasoning}</think>{reply}", 1)
    assert thinking == f"{B}S{TOOLS_HEAD}{SCHEMAS}{kept}<think>"
    assert fmt.render(messages, {"thinking": True}).text == f"{B}S{HISTORY}<think>"
    assert fmt.render(messages, tools=SPEC).text == f"{B}S{TOOLS_HEAD}{SCHEMAS}{HISTORY}</think>"
    assert fmt.render(messages).text == fmt.render(CONVERSATION).text
    # without tools, the assistant turns after the last user message keep theirs (here the last,
    # with no user message after it)
    tail = messages[:-1]
    assert fmt.render(tail, {"thinking": True}).text == fmt.render(CONVERSATION[:-1], {"thinking": True}).text.replace(
        f"{chat.ASSISTANT}<think></think>Sunny", f"{chat.ASSISTANT}<think>All done.</think>Sunny")
    assert fmt.render(CONVERSATION[:-1], {"thinking": True}).text.count("<think></think>") == 1
    assert fmt.render(tail).text == fmt.render(CONVERSATION[:-1]).text
    # null is an absent reasoning; a user's or tool's null or empty one is ignored as other empty fields are
    absent = _with_reasoning(CONVERSATION, [None] * 3) + [{"role": "user", "content": "x", "reasoning_content": ""}]
    assert fmt.render(absent, {"thinking": True}, tools=SPEC).text == \
        fmt.render(CONVERSATION + [{"role": "user", "content": "x"}], {"thinking": True}, tools=SPEC).text


def test_special_tokens_in_reasoning_are_marked():
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "a", "reasoning_content": "x<｜end▁of▁sentence｜><｜User｜>y"},
                {"role": "user", "content": "r"}]
    prompt = chat.ChatFormat().render(messages, {"thinking": True}, specials=[chat.USER, chat.EOS], tools=SPEC)
    assert prompt.text.count(chat.USER) == 2 and prompt.text.count(chat.EOS) == 1  # the format's own only
    assert sorted(prompt.literals.values()) == [chat.USER, chat.EOS]
    restored = prompt.text
    for marker, literal in prompt.literals.items():
        restored = restored.replace(marker, literal)
    assert f"<｜Assistant｜><think>x{chat.EOS}{chat.USER}y</think>a{chat.EOS}" in restored


def test_a_parsed_reply_renders_back_as_it_was_written():
    """A call the parser reads from DeepSeek's format, sent back in the history, renders as the
    model wrote it."""
    reply = "On it.\n\n" + block(invoke("get_weather", ("location", "true", "Oslo"), ("days", "false", "2")),
                                 invoke("now"))
    content, calls = ToolCallParser(SPEC).parse(reply)
    text = chat.ChatFormat().render([{"role": "user", "content": "q"},
                                     {"role": "assistant", "content": content, "tool_calls": calls}]).text
    assert f"<｜Assistant｜></think>{reply}{E}" in text


def test_special_tokens_in_tools_and_calls_are_marked():
    tools = check_tools([{"type": "function", "function": {"name": "f", "description": "x<｜User｜>y"}}], None)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"<｜User｜>": "<｜User｜>"}'}}]}]
    prompt = chat.ChatFormat().render(messages, specials=[chat.USER], tools=tools)
    assert prompt.text.count(chat.USER) == 1 and len(prompt.literals) == 3  # the format's own turn only
    restored = prompt.text
    for marker, literal in prompt.literals.items():
        restored = restored.replace(marker, literal)
    assert '"description": "x<｜User｜>y"' in restored
    assert '<｜DSML｜parameter name="<｜User｜>" string="true"><｜User｜></｜DSML｜parameter>' in restored


def _template(directory, template: str) -> str:
    """directory, with a tokenizer_config.json holding chat template `template`."""
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": template}, f)
    return str(directory)


def test_a_template_gets_tools_and_calls(tmp_path):
    template = ("{% for t in tools or [] %}{{ t.function.name }},{% endfor %}|{% for m in messages %}[{{ m.role }}]"
                "{% for c in m.tool_calls or [] %}{{ c.id }}:{{ c.function.name }}{{ c.function.arguments | tojson }}"
                "{% endfor %}{{ m.tool_call_id or '' }}{% endfor %}|{{ reasoning_effort }}|{{ thinking }}")
    fmt = chat.load_chat_format(_template(tmp_path, template))
    messages = CONVERSATION[1:4]
    assert fmt.render(messages, tools=SPEC).text == (
        'get_weather,now,|[user][assistant]c1:get_weather{"location": "Beijing", "days": 3}c2:now{}[tool]c1|None|')
    reasoning = chat.load_chat_format(_template(tmp_path,
                                                "{% for m in messages %}[{{ m.reasoning_content }}]{% endfor %}"))
    assert reasoning.render(_with_reasoning(messages, ["why"])).text == "[][why][]"
    assert fmt.render(messages, reasoning_effort="xhigh").text.endswith("|max|True")
    assert fmt.render(messages, {"thinking": False}, reasoning_effort="low").text.endswith("|high|False")
    for key in ("tools", "reasoning_effort"):
        with pytest.raises(chat.ChatError, match=f"'{key}' is set by the server"):
            fmt.render(messages, {key: []})


def test_reasoning_effort():
    fmt, user = chat.ChatFormat(), [{"role": "user", "content": "q"}]
    head = f"{B}{chat.MAX_EFFORT}<｜User｜>q<｜Assistant｜><think>"
    assert chat.MAX_EFFORT.startswith("Reasoning effort: maximum.") and chat.MAX_EFFORT.endswith("\n\n")
    for effort in ("max", "xhigh"):
        assert fmt.render(user, reasoning_effort=effort).text == head
    for effort in ("low", "medium", "high"):  # DeepSeek's "high": thinking on, nothing added
        assert fmt.render(user, reasoning_effort=effort).text == f"{B}<｜User｜>q<｜Assistant｜><think>"
    not_thinking = fmt.render(user, {"thinking": False}, reasoning_effort="max").text
    assert not_thinking == f"{B}<｜User｜>q<｜Assistant｜></think>"
    system = [{"role": "system", "content": "S"}, *user]
    assert fmt.render(system, reasoning_effort="max", tools=SPEC).text.startswith(f"{B}{chat.MAX_EFFORT}S\n\n## Tools")
    for bad in ("extreme", 3, "MAX"):
        with pytest.raises(chat.ChatError, match="reasoning_effort must be one of low, medium, high, xhigh, max") as e:
            fmt.render(user, reasoning_effort=bad)
        assert e.value.param == "reasoning_effort"


def _call(arguments='{"a": 1}', **function):
    return {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments, **function}}


BAD_MESSAGES = [  # (messages, param, message)
    ([{"role": "user", "content": "x", "tool_calls": [_call()]}], "messages[0].tool_calls", "not supported"),
    ([{"role": "user", "content": "x", "tool_call_id": "c"}], "messages[0].tool_call_id", "not supported"),
    ([{"role": "assistant", "tool_calls": {"id": "c"}}], "messages[0].tool_calls", "must be a list"),
    ([{"role": "assistant", "tool_calls": ["c"]}], "messages[0].tool_calls[0]", "must be an object"),
    ([{"role": "assistant", "tool_calls": [{"id": "1"}]}], "messages[0].tool_calls[0].function", "must be an object"),
    ([{"role": "assistant", "tool_calls": [{**_call(), "type": "code"}]}], "messages[0].tool_calls[0].type",
     "must be 'function'"),
    ([{"role": "assistant", "tool_calls": [{**_call(), "id": 7}]}], "messages[0].tool_calls[0].id",
     "must be a string"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [_call(), _call("{'a': 1}")]}],
     "messages[1].tool_calls[1].function.arguments", "not valid JSON"),
    ([{"role": "assistant", "tool_calls": [_call("[1, 2]")]}], "messages[0].tool_calls[0].function.arguments",
     "must be a JSON object"),
    ([{"role": "assistant", "tool_calls": [_call(None)]}], "messages[0].tool_calls[0].function.arguments",
     "must be a JSON object"),
    ([{"role": "assistant", "tool_calls": [_call('{"a\\"b": 1}')]}], "messages[0].tool_calls[0].function.arguments",
     "holds a quote or a line break"),
    ([{"role": "assistant", "tool_calls": [_call('{"a": "\\ud800"}')]}],
     "messages[0].tool_calls[0].function.arguments", "lone surrogate"),
    ([{"role": "assistant", "tool_calls": [_call("[" * 5000 + "]" * 5000)]}],
     "messages[0].tool_calls[0].function.arguments", "not valid JSON"),
    ([{"role": "assistant", "tool_calls": [_call(name="a b")]}], "messages[0].tool_calls[0].function.name",
     "function name of 1 to 64"),
    ([{"role": "tool", "tool_call_id": "c"}], "messages[0].content", "must be a string or a list of text parts"),
    ([{"role": "tool", "content": "r", "tool_call_id": 3}], "messages[0].tool_call_id", "must be a string"),
    ([{"role": "user", "content": "x", "reasoning_content": "r"}], "messages[0].reasoning_content", "not supported"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "a", "reasoning_content": ["r"]}],
     "messages[1].reasoning_content", "must be a string"),
    ([{"role": "assistant", "content": "a", "reasoning_content": 7}], "messages[0].reasoning_content",
     "must be a string"),
    ([{"role": "assistant", "content": "a", "reasoning_content": "\ud800"}], "messages[0].reasoning_content",
     "lone surrogate"),
]


@pytest.mark.parametrize("case", range(len(BAD_MESSAGES)), ids=[c[1] for c in BAD_MESSAGES])
def test_bad_calls_and_results_name_the_field(case):
    messages, param, message = BAD_MESSAGES[case]
    with pytest.raises(chat.ChatError, match=message) as e:
        chat.ChatFormat().render(messages)
    assert e.value.param == param
