"""Structured outputs: grammars from OpenAI / vLLM request fields, host-side matchers, and the
on-device logit mask.

The server constrains a choice's tokens to a grammar: a JSON schema (`response_format`), a regex,
a list of choices or a lark grammar (vLLM's `structured_outputs`), or a DeepSeek-V4 DSML tool-call
block (`tool_choice` "required" or a named function). The engine is llguidance: a Rust core with
a numpy bitmask API and JSON schema, regex and lark (with embedded JSON schemas) in one library,
and no torch dependency (xgrammar's Python API needs torch).

The flow, per (request, choice):
- at request time `grammar_for` / `grammar_for_tools` turn the request fields into an llguidance
  grammar string and validate it, so that a bad schema or regex is a 400 naming the field
  (`GrammarError.param`) rather than a failure mid-generation; in thinking mode (the prompt
  opened the reasoning) `after_reasoning` puts that grammar behind the reasoning (below);
- `Constraint(vocab, grammar)` holds an `llguidance.LLMatcher` on the host. While the device runs
  a step, `fill(row)` writes the allowed next tokens into one int32 row `[W]` of a packed bitmask
  `[R, W]`, W = `words(vocab_size)`; the server uploads it and the sampling program unpacks it
  (`dsv4_jax.runtime.sampling.allowed`); after each sampled token the server calls `accept(token)`. `done` says that
  only eos may follow (the server then stops the choice as it does at eos).

Thinking mode: the reasoning is free text and the grammar holds for the reply after it. The
grammar `after_reasoning` builds is any text that does not contain `</think>`, then `</think>`,
then the request's grammar (as an llguidance subgrammar, so its rules and names stay its own).
When `</think>` is one of the tokenizer's added tokens the grammar names that token (llguidance
reads every added token, special or not, as a special token rather than text); the text
`</think>` spelled by other tokens is kept out of the reasoning all the same, so the reasoning
ends where the reasoning parser (dsv4_jax/serving/reasoning.py) splits it. Eos is not allowed
before `</think>`, and nothing forces it: a reply that runs out of max_tokens while it reasons
ends with finish_reason "length" and no content, as OpenAI's reasoning models do.

Bitmask layout (llguidance's, which `llguidance.numpy` also uses): bit i of word j (bit 0 the
least significant) is token 32 j + i; 1 = allowed. Ids at or past the model's vocab_size do not
exist; ids past the tokenizer's own vocabulary (a model may have more rows than the tokenizer
has tokens) and special tokens other than eos (and `</think>` where a grammar after the
reasoning names it) are never allowed. Eos is allowed exactly where the grammar may end; after a
matcher error the mask allows only eos, so the choice ends.

JSON is compiled without free whitespace (llguidance's `whitespace_flexible: false`: `,` and
`:` with no spaces, no newlines), so the output is compact and costs fewer tokens.

A matcher is not thread-safe: the server must not run `fill` and `accept` of one Constraint at the
same time (llguidance releases the GIL while it computes a mask, so different Constraints can be
filled in parallel threads).
"""

from __future__ import annotations

import json

import numpy as np
from llguidance import LLMatcher, LLParserLimits, LLTokenizer, grammar_from

from dsv4_jax.checkpoint.hf_files import END_THINK

# JSON compiler options for every schema (module doc: compact output).
COMPACT_JSON = {"whitespace_flexible": False}

# DeepSeek-V4's tool-call markup (DSML); ｜ is U+FF5C FULLWIDTH VERTICAL LINE.
DSML = "｜DSML｜"
TOOL_CALLS_OPEN = f"<{DSML}tool_calls>\n"
TOOL_CALLS_CLOSE = f"</{DSML}tool_calls>"
INVOKE_OPEN = '<' + DSML + 'invoke name="{name}">\n'
INVOKE_CLOSE = f"</{DSML}invoke>\n"
PARAMETER_OPEN = '<' + DSML + 'parameter name="{name}" string="{string}">'
PARAMETER_CLOSE = f"</{DSML}parameter>\n"

# A raw-text (string="true") parameter value and its closing tag, as ONE lark terminal: any text
# that does not contain "</｜DSML｜", then the closing tag. As one terminal the lexer is a single
# automaton that sees where the text ends; a separate text terminal followed by the closing
# literal would be cut greedily (at "</｜DSML｜" the text lexeme could still grow) and could never
# close. The text itself may hold "<" (code, HTML), only not the closing-tag prefix.
_RAW_VALUE = (f"RAW_VALUE: (/(?s:.*)/ & ~/(?s:.*)<\\/{DSML}(?s:.*)/) "
              f"{json.dumps(PARAMETER_CLOSE, ensure_ascii=False)}")

# Text without "</think>" (module doc, thinking mode): the reasoning, as a lark terminal.
_REASONING = "/(?s:.*)/ & ~/(?s:.*)" + END_THINK.replace("/", "\\/") + "(?s:.*)/"
_REPLY = "reply"  # the name of the request's grammar behind the reasoning

# Short matcher errors (no parser state or grammar dump, which may hold the request's schema).
_LIMITS = LLParserLimits(verbose_errors=False)


class GrammarError(ValueError):
    """A structured-output request the server refuses; `param` is the OpenAI request field at
    fault ("response_format", "structured_outputs", "tools", "tool_choice"), or None when a
    validated grammar is refused by the matcher for this vocabulary (a resource limit)."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


def words(vocab_size: int) -> int:
    """W, the int32 words of one bitmask row for vocab_size tokens."""
    return (vocab_size + 31) // 32


# ---- grammars from request fields -----------------------------------------------------------

def _checked(grammar: str, param: str, what: str) -> str:
    """grammar, after llguidance compiled it without error (tokenizer-independent checks)."""
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, limits=_LIMITS)
    if is_error:
        raise GrammarError(f"{param}: invalid {what}: {messages[0].strip()}", param)
    return grammar


def _json_grammar(schema, param: str) -> str:
    if not isinstance(schema, dict):
        raise GrammarError(f"{param}: the JSON schema must be an object, got {type(schema).__name__}", param)
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, overrides=COMPACT_JSON)
    except ValueError as e:  # not serializable (a lone surrogate in a string, ...)
        raise GrammarError(f"{param}: invalid JSON schema: {e}", param) from None
    return _checked(grammar, param, "JSON schema")


def _lark(grammar_text: str, param: str, what: str) -> str:
    try:
        return _checked(LLMatcher.grammar_from_lark(grammar_text), param, what)
    except UnicodeEncodeError as e:  # a lone surrogate: not UTF-8 text
        raise GrammarError(f"{param}: invalid {what}: {e}", param) from None


def _literal(text: str) -> str:
    """A lark string literal matching exactly text (JSON escapes are lark's)."""
    return json.dumps(text, ensure_ascii=False)


def _response_format_grammar(response_format) -> str | None:
    param = "response_format"
    if not isinstance(response_format, dict):
        raise GrammarError(f"{param} must be an object", param)
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _json_grammar({"type": "object"}, param)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise GrammarError(f"{param}.json_schema must be an object", param)
        if not isinstance(spec.get("name"), str):
            raise GrammarError(f"{param}.json_schema.name must be a string", param)
        if "strict" in spec and not isinstance(spec["strict"], (bool, type(None))):
            raise GrammarError(f"{param}.json_schema.strict must be a boolean", param)
        if "schema" not in spec:
            raise GrammarError(f"{param}.json_schema.schema is required", param)
        # The schema is enforced whether strict or not: a matcher has no "best effort" mode.
        return _json_grammar(spec["schema"], param)
    raise GrammarError(f"{param}.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", param)


STRUCTURED_KEYS = ("json", "regex", "choice", "grammar")


def _structured_grammar(structured_outputs) -> str:
    param = "structured_outputs"
    if not isinstance(structured_outputs, dict):
        raise GrammarError(f"{param} must be an object", param)
    # A null field is an unset one (clients serialize every field of vLLM's model).
    given = {k: v for k, v in structured_outputs.items() if v is not None}
    unknown = sorted(set(given) - set(STRUCTURED_KEYS))
    if unknown:
        raise GrammarError(f"{param}: unsupported field(s) {', '.join(unknown)} "
                           f"(supported: {', '.join(STRUCTURED_KEYS)})", param)
    if len(given) != 1:
        raise GrammarError(f"{param} must have exactly one of {', '.join(STRUCTURED_KEYS)}", param)
    (key, value), = given.items()
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise GrammarError(f"{param}.json is not valid JSON: {e}", param) from None
        return _json_grammar(value, param)
    if key == "regex":
        if not isinstance(value, str):
            raise GrammarError(f"{param}.regex must be a string", param)
        try:
            return _checked(LLMatcher.grammar_from_regex(value), param, "regex")
        except UnicodeEncodeError as e:
            raise GrammarError(f"{param}: invalid regex: {e}", param) from None
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise GrammarError(f"{param}.choice must be a non-empty list of strings", param)
        return _lark("start: " + " | ".join(_literal(c) for c in value), param, "choice")
    if not isinstance(value, str):
        raise GrammarError(f"{param}.grammar must be a string", param)
    try:
        # "grammar" takes lark or GBNF (as vLLM's guidance backend does); GBNF is converted.
        grammar = grammar_from("grammar", value)
    except ValueError as e:  # GBNF that does not convert, or a lone surrogate
        raise GrammarError(f"{param}: invalid grammar: {e}", param) from None
    return _checked(grammar, param, "grammar")


def grammar_for(response_format=None, structured_outputs=None) -> str | None:
    """The llguidance grammar for a request's OpenAI `response_format` or vLLM `structured_outputs`
    (module doc), or None when the output is free text. Raises GrammarError naming the field."""
    if structured_outputs is not None:
        if response_format is not None and _response_format_grammar(response_format) is not None:
            raise GrammarError("give response_format or structured_outputs, not both", "structured_outputs")
        return _structured_grammar(structured_outputs)
    if response_format is None:
        return None
    return _response_format_grammar(response_format)


def after_reasoning(grammar: str, end_think: int | None) -> str:
    """`grammar` (an llguidance grammar: lark text or its JSON form) put behind a reply's
    reasoning (module doc, thinking mode). end_think: `</think>`'s token id when it is an added
    token of the tokenizer (`ServerTokenizer.end_think`), None when it is text."""
    if end_think is None:
        # One terminal: as with RAW_VALUE, a reasoning lexeme followed by a separate "</think>"
        # would be cut greedily and could never end.
        start = f"start: REASONING @{_REPLY}\nREASONING: ({_REASONING}) {_literal(END_THINK)}"
    else:
        start = f"start: REASONING <[{end_think}]> @{_REPLY}\nREASONING: {_REASONING}"
    if grammar.startswith("{"):  # llguidance's JSON form {"grammars": [the top one, ...]} (lark text cannot)
        top, *others = json.loads(grammar)["grammars"]
    else:
        top, others = {"lark_grammar": grammar}, []
    return json.dumps({"grammars": [{"lark_grammar": start}, {**top, "name": _REPLY}, *others]}, ensure_ascii=False)


# ---- tool calls -----------------------------------------------------------------------------

def _tool_functions(tools) -> dict[str, dict]:
    """name -> the function's `parameters` schema ({} when it has none), from an OpenAI tool list."""
    if not isinstance(tools, list):
        raise GrammarError("tools must be a list", "tools")
    functions = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise GrammarError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
        name, parameters = function.get("name"), function.get("parameters")
        if not isinstance(name, str) or not name:
            raise GrammarError(f"tools[{i}].function.name must be a non-empty string", "tools")
        if parameters is None:
            parameters = {}
        if not isinstance(parameters, dict):
            raise GrammarError(f"tools[{i}].function.parameters must be an object", "tools")
        functions[name] = parameters
    return functions


def _parameter_rule(name: str, schema, definitions: dict) -> str:
    """The lark body of one `<｜DSML｜parameter ...>value</｜DSML｜parameter>\\n` line."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError(f"parameter {name!r}: its schema must be an object", "tools")
    if schema.get("type") == "string":
        head = _literal(PARAMETER_OPEN.format(name=name, string="true"))
        # Raw text; a string enum / const still holds (literal alternatives). Other string
        # keywords (pattern, lengths, format) are not enforced on raw text.
        options = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
        if isinstance(options, list) and options and all(isinstance(o, str) for o in options):
            alternatives = " | ".join(_literal(o) for o in options)
            return f"{head} ({alternatives}) {_literal(PARAMETER_CLOSE)}"
        return f"{head} RAW_VALUE"
    # A JSON value; the function's $defs / definitions come along so that "#/$defs/..." resolves.
    embedded = {**definitions, **schema, "x-guidance": COMPACT_JSON}
    head = _literal(PARAMETER_OPEN.format(name=name, string="false"))
    return f"{head} %json {json.dumps(embedded)} {_literal(PARAMETER_CLOSE)}"


def grammar_for_tools(tools: list[dict], names: list[str]) -> str:
    """A grammar forcing one DSML tool-call block of one or more invokes, each calling one of
    `names` (tool_choice "required": every tool's name; a named tool_choice: that one) with the
    parameters of its schema's `properties` in schema order, the `required` ones always present and
    each other one present or absent; a "string"-typed parameter as raw text (string="true"), any
    other as compact JSON validated against its schema (string="false"). The grammar ends after
    `</｜DSML｜tool_calls>`. Raises GrammarError ("tools" for a bad tool list, "tool_choice" for a
    name that is not a tool)."""
    functions = _tool_functions(tools)
    if not names:
        raise GrammarError("no tool to call", "tool_choice")
    rules = []
    for k, name in enumerate(names):
        if name not in functions:
            raise GrammarError(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
        parameters = functions[name]
        properties = parameters.get("properties") or {}
        required = parameters.get("required") or []
        if not isinstance(properties, dict) or not isinstance(required, list):
            raise GrammarError(f"tool {name!r}: properties must be an object and required a list", "tools")
        missing = [r for r in required if r not in properties]
        if missing:
            raise GrammarError(f"tool {name!r} requires {missing} but its properties do not define them", "tools")
        definitions = {key: parameters[key] for key in ("$defs", "definitions") if key in parameters}
        items = []
        for j, (pname, pschema) in enumerate(properties.items()):
            rules.append(f"p{k}_{j}: {_parameter_rule(pname, pschema, definitions)}")
            items.append(f"p{k}_{j}" if pname in required else f"p{k}_{j}?")
        body = " ".join([_literal(INVOKE_OPEN.format(name=name)), *items, _literal(INVOKE_CLOSE)])
        rules.append(f"invoke{k}: {body}")
    invokes = " | ".join(f"invoke{k}" for k in range(len(names)))
    lark = "\n".join([f"start: {_literal(TOOL_CALLS_OPEN)} invoke+ {_literal(TOOL_CALLS_CLOSE)}",
                      f"invoke: {invokes}", *rules, _RAW_VALUE])
    return _lark(lark, "tools", "tool parameter schema")


# ---- host side: vocabulary and matchers -----------------------------------------------------

class TokenVocabulary:
    """The model's vocabulary as llguidance sees it; built once per server (about a second for a
    129k-token vocabulary) and shared by every Constraint.

    tokenizer: the checkpoint's `tokenizers.Tokenizer` (its JSON is handed to llguidance's Rust
    side; no transformers); vocab_size: the MODEL's, at least the tokenizer's (ids past the
    tokenizer's are never allowed); eos_ids: the ids that end a choice (allowed where the grammar
    may end)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        n_tokenizer = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_ids = tuple(int(i) for i in eos_ids)
        if vocab_size < n_tokenizer:
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {n_tokenizer} tokens")
        if not self.eos_ids or not all(0 <= i < n_tokenizer for i in self.eos_ids):
            raise ValueError(f"eos ids {list(self.eos_ids)} must be tokenizer ids")
        # llguidance tokenizes (forced tokens) with the tokenizer: padding / truncation would corrupt that.
        spec = json.loads(tokenizer.to_str())
        spec["padding"] = spec["truncation"] = None
        self.ll_tokenizer = LLTokenizer(json.dumps(spec), n_vocab=vocab_size, eos_token=list(self.eos_ids))
        self.vocab_size = vocab_size
        self.words = words(vocab_size)


class Constraint:
    """One (request, choice)'s grammar state on the host (module doc). Raises GrammarError (param
    None) when the matcher refuses a grammar that passed validation (a limit for this vocabulary)."""

    def __init__(self, vocab: TokenVocabulary, grammar: str):
        self.vocab = vocab
        # log_level 0: errors are read through `error`, not printed on stderr.
        self._matcher = LLMatcher(vocab.ll_tokenizer, grammar, log_level=0, limits=_LIMITS)
        if self._matcher.is_error():
            raise GrammarError(f"the grammar cannot be used: {self._matcher.get_error()}", None)

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into row, an int32 `[W]` C-contiguous array (a row of the
        bitmask `[R, W]`): bit i of word j = token 32 j + i allowed. Only eos once `done`."""
        if row.dtype != np.int32 or row.shape != (self.vocab.words,) or not row.flags.c_contiguous \
                or not row.flags.writeable:
            raise ValueError(f"need a writeable C-contiguous int32 row of {self.vocab.words} words, "
                             f"got {row.dtype} {row.shape}")
        # llguidance writes through the raw pointer; the checks above make that safe.
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept(self, token: int) -> None:
        """Advance past a sampled token. A token the last mask allowed is always accepted, so a
        refusal is the server's bug (a token sampled without the mask): RuntimeError."""
        if not self._matcher.consume_token(int(token)):
            raise RuntimeError(f"the grammar refused token {int(token)}: {self._matcher.get_error()}")

    @property
    def done(self) -> bool:
        """Whether only eos may follow (the grammar is complete and cannot go on, or a matcher error)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        """The matcher's error text, or None."""
        return self._matcher.get_error() or None
