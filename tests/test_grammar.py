"""Structured outputs (dsv4_jax.serving.grammar): random walks through the grammars' token masks
on the random checkpoint's byte-level BPE must end in text that parses and validates; bad request
fields are GrammarErrors naming the field; the JAX mask matches a numpy reference.

A walk samples each token by Gumbel-max over random logits masked as the sampling program masks them (`sampling.allowed`) (so the
device-side mask is in every step), with a bias on the tokens that close things (quotes,
brackets, eos, "<" and the next byte of a DSML closing tag in progress) that grows with the steps
in a row of free text (more than WIDE tokens allowed) and is 0 at structural choices (an optional
field or not, another tool call or not): free text wanders a while and then ends, structure is
chosen uniformly, so every walk terminates well inside its step cap.
The model's vocabulary (750) is larger than the tokenizer's (700) and not a multiple of 32, so
each mask also checks the ids past the tokenizer and the tail of the last word."""

import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from tokenizers import Tokenizer

from dsv4_jax.checkpoint.hf_files import END_THINK
from dsv4_jax.runtime.sampling import allowed
from dsv4_jax.serving import grammar
from dsv4_jax.serving.grammar import Constraint, GrammarError, TokenVocabulary
from dsv4_jax.serving.reasoning import ReasoningParser
from dsv4_jax.tools.random_checkpoint import EOS_ID, build_tokenizer, byte_chars

TOKENIZER_SIZE, VOCAB = 700, 750
SEEDS = range(20)
MAX_STEPS = 3000
WIDE, RATE = 16, 1 / 8  # the walk's bias (module doc)

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                     "properties": {"name": {"type": "string"},
                                    "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                    "address": {"type": "object", "required": ["city"],
                                                "properties": {"city": {"type": "string"}}}}},
            "meta": {"type": "object"},
        },
        "required": ["user", "meta"],
    },
    "arrays": {
        "type": "array", "minItems": 1, "maxItems": 4,
        "items": {"type": "object", "additionalProperties": False, "required": ["id", "tags"],
                  "properties": {"id": {"type": "integer"},
                                 "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                                 "scores": {"type": "array", "items": {"type": "number"}}}},
    },
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "size": {"type": "string", "enum": ["S", "M", "L"]},
                       "level": {"enum": [1, 2, "three", None]},
                       "flag": {"type": "boolean"}},
        "required": ["color", "size", "level", "flag"],
        "additionalProperties": False,
    },
    "optional": {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"type": "integer"}, "c": {"type": "boolean"},
                       "d": {"type": "array", "items": {"type": "number"}}},
        "required": ["a", "c"],
        "additionalProperties": False,
    },
}

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object",
        "properties": {"query": {"type": "string"},
                       "filters": {"type": "object", "additionalProperties": False,
                                   "properties": {"lang": {"type": "string"}, "year": {"type": "integer"}}},
                       "limit": {"$ref": "#/$defs/limit"}},
        "required": ["query", "filters"],
        "$defs": {"limit": {"type": "integer", "minimum": 1, "maximum": 10}}}}},
    {"type": "function", "function": {"name": "now"}},
]



@jax.jit
def _apply(logits, bitmask):
    """The logits with what the bitmask does not allow at -inf, as the sampling program masks them."""
    return jnp.where(allowed(bitmask, logits.shape[-1]), logits, -jnp.inf)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TOKENIZER_SIZE, seed=0)


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return TokenVocabulary(tokenizer, VOCAB, [EOS_ID])


def unpack(row: np.ndarray, n: int) -> np.ndarray:
    """The bool mask [n] of a bitmask row [W] (bit i of word j = token 32 j + i)."""
    return np.unpackbits(row.astype("<i4").view(np.uint8), bitorder="little")[:n].astype(bool)


BYTE_OF = {c: b for b, c in enumerate(byte_chars())}  # byte-level BPE: token text character -> byte


def byte_tokens(tokenizer, data: bytes) -> list[int]:
    """The single-byte token of each byte (byte-level BPE: every byte is a token)."""
    chars = byte_chars()
    return [tokenizer.token_to_id(chars[b]) for b in data]


def walk(constraint: Constraint, tokenizer, seed: int, prefer, named=()) -> str:
    """Sample tokens through constraint's masks until eos (module doc); prefer(data) -> the ids to
    bias toward after the bytes data; named: the special tokens the grammar names (which it may
    allow). Returns the decoded text (eos excluded, special tokens' text included)."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((1, grammar.words(VOCAB)), np.int32)
    specials = [i for i, t in tokenizer.get_added_tokens_decoder().items()
                if t.special and i != EOS_ID and i not in named]
    tokens: list[int] = []
    data = b""
    free = 0  # steps in a row with a wide choice (free text), which the bias grows with
    for step in range(MAX_STEPS):
        constraint.fill(mask[0])
        allowed = unpack(mask[0], 32 * mask.shape[1])
        assert not allowed[TOKENIZER_SIZE:].any(), "an id past the tokenizer (or past vocab_size) allowed"
        assert not allowed[specials].any(), "a special token other than eos allowed"
        assert allowed.any()
        free = free + 1 if allowed.sum() > WIDE else 0
        bias = np.zeros(VOCAB, np.float32)
        bias[sorted(prefer(data) | {EOS_ID})] = free * RATE
        logits = rng.gumbel(size=(1, VOCAB)).astype(np.float32) + bias
        token = int(np.argmax(np.asarray(_apply(logits, mask))[0]))
        assert allowed[token]
        if token == EOS_ID:
            assert constraint.error is None
            return tokenizer.decode(tokens, skip_special_tokens=False)
        constraint.accept(token)
        tokens.append(token)
        data += bytes(BYTE_OF[c] for c in tokenizer.id_to_token(token))
    raise AssertionError(f"no eos in {MAX_STEPS} steps: {tokenizer.decode(tokens)[-200:]!r}")


def json_prefer(tokenizer):
    closers = set(byte_tokens(tokenizer, b'"}]'))
    return lambda data: closers


# ---- JSON, regex, choice --------------------------------------------------------------------

@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema_walks_validate(name, tokenizer, vocab):
    schema = SCHEMAS[name]
    g = grammar.grammar_for(response_format={"type": "json_schema",
                                             "json_schema": {"name": name, "schema": schema, "strict": True}})
    outputs = set()
    for seed in SEEDS:
        c = Constraint(vocab, g)
        text = walk(c, tokenizer, seed, json_prefer(tokenizer))
        assert c.done
        jsonschema.validate(json.loads(text), schema)
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", text)), "whitespace outside strings"
        outputs.add(text)
    assert len(outputs) > 1


def test_structured_json_string_and_json_object(tokenizer, vocab):
    for g, schema in [
        (grammar.grammar_for(response_format={"type": "json_object"}), {"type": "object"}),
        (grammar.grammar_for(structured_outputs={"json": json.dumps(SCHEMAS["optional"])}), SCHEMAS["optional"]),
    ]:
        for seed in SEEDS:
            text = walk(Constraint(vocab, g), tokenizer, seed, json_prefer(tokenizer))
            jsonschema.validate(json.loads(text), schema)


def test_regex_and_choice(tokenizer, vocab):
    pattern = r"[a-z]{2,6}-[0-9]{1,3}(\.[a-z]+)?"
    g = grammar.grammar_for(structured_outputs={"regex": pattern})
    for seed in SEEDS:
        assert re.fullmatch(pattern, walk(Constraint(vocab, g), tokenizer, seed, lambda data: set()))
    choices = ["yes", "no", "maybe so", "nö <｜DSML｜>"]
    g = grammar.grammar_for(structured_outputs={"choice": choices, "regex": None})
    seen = {walk(Constraint(vocab, g), tokenizer, seed, lambda data: set()) for seed in SEEDS}
    assert seen <= set(choices) and len(seen) > 1


def test_lark_grammar(tokenizer, vocab):
    g = grammar.grammar_for(structured_outputs={"grammar": 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/'})
    for seed in SEEDS:
        assert re.fullmatch(r"\(\d{1,3}(,\d{1,3})*\)", walk(Constraint(vocab, g), tokenizer, seed,
                                                            lambda data: set(byte_tokens(tokenizer, b")"))))


# ---- tool calls -----------------------------------------------------------------------------

_OPEN_PARAM = '<｜DSML｜parameter name="([^"]*)" string="(true|false)">'
_INVOKE = f'<｜DSML｜invoke name="[^"]*">\n(?:{_OPEN_PARAM}.*?</｜DSML｜parameter>\n)*</｜DSML｜invoke>\n'
_BLOCK = re.compile(f"<｜DSML｜tool_calls>\n(?:{_INVOKE})+</｜DSML｜tool_calls>", re.S)
_INVOKE_PARTS = re.compile('<｜DSML｜invoke name="([^"]*)">\n(.*?)</｜DSML｜invoke>\n', re.S)
_PARAM_PARTS = re.compile(f"{_OPEN_PARAM}(.*?)</｜DSML｜parameter>\n", re.S)


def tool_prefer(tokenizer):
    """The next byte of a parameter's closing tag once begun, else closers and "<" (raw text ends
    at the closing tag)."""
    closers = set(byte_tokens(tokenizer, b'"}]<'))
    tag = grammar.PARAMETER_CLOSE.encode()

    def prefer(data):
        for k in range(len(tag) - 1, 0, -1):
            if data.endswith(tag[:k]):
                return set(byte_tokens(tokenizer, tag[k:k + 1]))
        return closers
    return prefer


def check_tool_calls(text: str, names: list[str]) -> list[str]:
    """Parse a DSML block, check every invoke against TOOLS; the names called, in order."""
    assert _BLOCK.fullmatch(text), text
    functions = {t["function"]["name"]: t["function"].get("parameters", {}) for t in TOOLS}
    called = []
    for name, body in _INVOKE_PARTS.findall(text):
        assert name in names
        schema = functions[name]
        properties = list(schema.get("properties", {}))
        params = _PARAM_PARTS.findall(body)
        assert "".join(m.group(0) for m in _PARAM_PARTS.finditer(body)) == body
        given = [p for p, _, _ in params]
        assert given == [p for p in properties if p in given], "parameters out of schema order"
        assert set(schema.get("required", [])) <= set(given)
        for pname, string, value in params:
            pschema = {**schema.get("properties")[pname], "$defs": schema.get("$defs", {})}
            assert (string == "true") == (pschema.get("type") == "string")
            if string == "true":
                assert "</｜DSML｜" not in value
            else:
                value = json.loads(value)
            jsonschema.validate(value, pschema)
        called.append(name)
    return called


@pytest.mark.parametrize("names", [["get_weather", "search", "now"], ["search"]])
def test_tool_grammar_walks(names, tokenizer, vocab):
    g = grammar.grammar_for_tools(TOOLS, names)
    called = []
    for seed in SEEDS:
        c = Constraint(vocab, g)
        text = walk(c, tokenizer, seed, tool_prefer(tokenizer))
        assert c.done
        called += check_tool_calls(text, names)
    assert set(called) == set(names)


def test_tool_raw_text_may_hold_angle_brackets(tokenizer, vocab):
    """A string parameter's raw text can hold "<", "</x>", "<｜DSML｜", only not "</｜DSML｜"."""
    g = grammar.grammar_for_tools(TOOLS, ["get_weather"])
    head = ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
            '<｜DSML｜parameter name="city" string="true">')
    tail = '</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    for city, ok in [("a < b </x> <｜DSML｜ ok\n", True), ("", True), ("x</｜DSML｜y", False)]:
        c = Constraint(vocab, g)
        ids = tokenizer.encode(head + city + tail, add_special_tokens=False).ids
        accepted = 0
        mask = np.zeros(grammar.words(VOCAB), np.int32)
        for token in ids:
            c.fill(mask)
            if not unpack(mask, VOCAB)[token]:
                break
            c.accept(token)
            accepted += 1
        assert (accepted == len(ids) and c.done) == ok, city


# ---- thinking: the grammar after the reasoning --------------------------------------------------

def plain_think_tokenizer(tokenizer):
    """tokenizer with `</think>` an ordinary vocabulary entry rather than an added token: text to
    llguidance (its token or its bytes), as in a tokenizer that does not add it."""
    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != END_THINK]
    return Tokenizer.from_str(json.dumps(spec))


@pytest.fixture(scope="module", params=["added", "text"])
def thinking(request, tokenizer):
    """(tokenizer, vocabulary, `</think>`'s id as after_reasoning takes it): the test tokenizer
    (where `</think>` is an added, special token), or the same with `</think>` as text."""
    if request.param == "added":
        return tokenizer, TokenVocabulary(tokenizer, VOCAB, [EOS_ID]), tokenizer.token_to_id(END_THINK)
    plain = plain_think_tokenizer(tokenizer)
    assert plain.token_to_id(END_THINK) == tokenizer.token_to_id(END_THINK)
    return plain, TokenVocabulary(plain, VOCAB, [EOS_ID]), None


def think_prefer(tokenizer, after):
    """Toward `</think>`'s token while the reasoning lasts, then `after`'s preference."""
    end, closed = {tokenizer.token_to_id(END_THINK)}, END_THINK.encode()
    return lambda data: after(data[data.index(closed) + len(closed):]) if closed in data else end


def split(text: str) -> tuple[str, str]:
    """(reasoning, content) as the server's reasoning parser splits a thinking reply's text."""
    parser = ReasoningParser(True)
    parts = [parser.feed(text), parser.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


def test_thinking_walks_reason_then_follow_the_schema(thinking):
    """Every walk is reasoning without `</think>`, `</think>`, then JSON that validates; the
    reasoning parser splits it there; the walks reason for a while, and differ."""
    tok, vocab, end_think = thinking
    schema = SCHEMAS["nested"]
    g = grammar.after_reasoning(grammar.grammar_for(
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}), end_think)
    named = () if end_think is None else (end_think,)
    reasonings = set()
    for seed in SEEDS:
        c = Constraint(vocab, g)
        text = walk(c, tok, seed, think_prefer(tok, json_prefer(tok)), named)
        assert c.done
        reasoning, content = split(text)
        assert text == reasoning + END_THINK + content
        jsonschema.validate(json.loads(content), schema)
        reasonings.add(reasoning)
    assert len(reasonings) > 1 and max(map(len, reasonings)) > 20


def test_thinking_walks_then_call_a_tool(thinking):
    tok, vocab, end_think = thinking
    g = grammar.after_reasoning(grammar.grammar_for_tools(TOOLS, ["get_weather", "now"]), end_think)
    named = () if end_think is None else (end_think,)
    for seed in range(6):
        text = walk(Constraint(vocab, g), tok, seed, think_prefer(tok, tool_prefer(tok)), named)
        reasoning, content = split(text)
        assert text == reasoning + END_THINK + content
        check_tool_calls(content, ["get_weather", "now"])


def allowed_after(vocab, constraint, tokens) -> np.ndarray:
    """The bool mask [VOCAB] after accepting tokens."""
    mask = np.zeros(grammar.words(VOCAB), np.int32)
    for token in tokens:
        constraint.fill(mask)
        assert unpack(mask, VOCAB)[token], token
        constraint.accept(token)
    constraint.fill(mask)
    return unpack(mask, VOCAB)


def test_the_reasoning_ends_only_at_think_end(thinking):
    """No eos while the reasoning lasts (a reply cannot end before `</think>`); the text
    `</think>` spelled in bytes is refused inside the reasoning when the marker is an added
    token, and ends it when the marker is text; after it the regex holds, and `</think>` is no
    longer allowed."""
    tok, vocab, end_think = thinking
    g = grammar.after_reasoning(grammar.grammar_for(structured_outputs={"regex": "[a-z]{2}"}), end_think)
    c = Constraint(vocab, g)
    reasoning = tok.encode("Let me think: the answer {is} </think", add_special_tokens=False).ids
    mask = allowed_after(vocab, c, reasoning)
    assert not mask[EOS_ID] and mask[tok.token_to_id(END_THINK)]
    spelled = byte_tokens(tok, b">")
    if end_think is not None:
        assert not mask[spelled].any()
        mask = allowed_after(vocab, c, [end_think])
    else:
        mask = allowed_after(vocab, c, spelled)
    assert not mask[EOS_ID] and not mask[tok.token_to_id(END_THINK)]
    assert mask[byte_tokens(tok, b"q")].all() and not mask[byte_tokens(tok, b"Q<")].any()
    assert allowed_after(vocab, c, byte_tokens(tok, b"ok"))[EOS_ID] and c.done


# ---- errors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, param, fragment", [
    ({"response_format": {"type": "xml"}}, "response_format", "type"),
    ({"response_format": "json"}, "response_format", "object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format", "name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "foo"),
    ({"structured_outputs": {"json": {"type": "string", "pattern": "a(b"}}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "JSON"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty"),
    ({"structured_outputs": {"ebnf": "x"}}, "structured_outputs", "ebnf"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs", "foo"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs", "both"),
])
def test_bad_requests(kwargs, param, fragment):
    with pytest.raises(GrammarError, match=re.escape(fragment)) as e:
        grammar.grammar_for(**kwargs)
    assert e.value.param == param


def test_no_grammar():
    assert grammar.grammar_for() is None
    assert grammar.grammar_for(response_format={"type": "text"}) is None
    assert grammar.grammar_for(response_format={"type": "text"}, structured_outputs={"regex": "a"}) is not None


@pytest.mark.parametrize("tools, names, param", [
    (TOOLS, ["missing"], "tool_choice"),
    (TOOLS, [], "tool_choice"),
    ([{"type": "function"}], ["x"], "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "foo"}}}}}], ["f"], "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {}, "required": ["a"]}}}], ["f"], "tools"),
])
def test_bad_tools(tools, names, param):
    with pytest.raises(GrammarError) as e:
        grammar.grammar_for_tools(tools, names)
    assert e.value.param == param


def test_constraint_misuse(tokenizer, vocab):
    c = Constraint(vocab, grammar.grammar_for(structured_outputs={"choice": ["ab"]}))
    with pytest.raises(ValueError):
        c.fill(np.zeros(grammar.words(VOCAB) - 1, np.int32))
    with pytest.raises(ValueError):
        c.fill(np.zeros(grammar.words(VOCAB), np.int64))
    with pytest.raises(RuntimeError):
        c.accept(tokenizer.token_to_id("z"))
    assert c.error and c.done
    mask = np.zeros(grammar.words(VOCAB), np.int32)
    c.fill(mask)  # after an error only eos, so the choice ends
    assert np.flatnonzero(unpack(mask, VOCAB)).tolist() == [EOS_ID]
    with pytest.raises(ValueError):
        TokenVocabulary(tokenizer, TOKENIZER_SIZE - 1, [EOS_ID])


# ---- the bitmask on device ---------------------------------------------------------------------

@pytest.mark.parametrize("V", [64, 70, 750])
def test_the_sampling_programs_bitmask_matches_numpy(V):
    rng = np.random.default_rng(V)
    R, W = 4, grammar.words(V) + (V == 70)  # a spare word is allowed
    bitmask = rng.integers(-2**31, 2**31, size=(R, W), dtype=np.int64).astype(np.int32)
    bitmask[0] = -1
    bitmask[1] = 0
    logits = rng.standard_normal((R, V)).astype(np.float32)
    allowed = np.stack([unpack(row, V) for row in bitmask])
    want = np.where(allowed, logits, -np.inf)
    got = np.asarray(_apply(jnp.asarray(logits), jnp.asarray(bitmask)))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[0], logits[0])
