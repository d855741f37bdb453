"""Chat messages to prompt text: the checkpoint's Jinja chat template, or the DeepSeek-V3.2/V4 format.

A checkpoint whose tokenizer_config.json has a `chat_template` (a Jinja string, or a list of
`{"name", "template"}` of which "default" is used) gets it, rendered in Jinja's immutable sandbox
with `messages`, `add_generation_prompt=True`, `bos_token`, `eos_token`, `tools` (the request's
OpenAI tool list, or None), `reasoning_effort` (below) and the request's `chat_template_kwargs`,
plus transformers' helpers `raise_exception(message)`, `strftime_now(format)` and a `tojson`
filter that keeps non-ASCII text. An assistant message's `tool_calls` reach a template as
`[{"id", "type": "function", "function": {"name", "arguments": dict}}]` (arguments parsed, as
transformers' templates expect), a tool result as `{"role": "tool", "content", "tool_call_id"}`.

DeepSeek-V4 checkpoints ship no template (serving.md, "Chat format"); they get the family's format,
written here (`default_prompt`) after DeepSeek-V4's own encoder (encoding_dsv4.py):
- `<｜begin▁of▁sentence｜>` once; the system (or developer) messages' text where it stands;
- the request's tools, if any: a "## Tools" section right after the leading system text (alone
  after BOS when there is none) that explains the DSML tool-call block and lists one JSON schema
  per line (`tools_section`);
- each user turn `<｜User｜>` + text; consecutive user and tool messages form one turn, their
  texts joined by a blank line, a tool result as `<tool_result>` + text + `</tool_result>`;
- each earlier assistant turn `<｜Assistant｜></think>` + reply + `<｜end▁of▁sentence｜>`, its
  tool calls (if any) after the reply and a blank line as a DSML block (`tool_calls_block`);
- last the generation prompt `<｜Assistant｜>` followed by `</think>` in the default
  non-thinking ("chat") mode, or by `<think>` with `chat_template_kwargs: {"thinking": true}`
  ("thinking" mode).
An earlier assistant message may carry its reasoning as `reasoning_content` (a string, as the
server returned it). In thinking mode DeepSeek's encoder keeps the reasoning of every assistant
turn when the request has tools, and otherwise of the assistant turns after the last user (or
tool) message: those turns open with `<think>` + reasoning + `</think>` (`<think></think>` when
the message has none). The others, and every turn in chat mode, drop it, as DeepSeek's encoder
and API do, and open with `</think>`. A template gets the field as the message's `reasoning_content`
(the name transformers' and vLLM's templates read) and decides for itself.

`reasoning_effort` is the request's field, taken as DeepSeek's API documents it: "high" and "max"
are its levels, "low" and "medium" map to "high", and OpenAI's "xhigh" to "max" (`effort_level`).
Any effort turns thinking mode on unless `chat_template_kwargs.thinking` is false. In the default
format only "max" in thinking mode changes the prompt: a line asking for maximum reasoning effort
right after BOS (`MAX_EFFORT`, in our words; DeepSeek's encoder adds its own such line there).

Message content is a string, or a list of `{"type": "text", "text": ...}` parts (joined with "\\n";
a tool result's with a blank line, as DeepSeek's encoder joins them).

The request's own text (message content and reasoning, tool calls, tools, string values of
chat_template_kwargs) is the user's, not the format's: a special-token string in it
(`<｜User｜>`, `<｜end▁of▁sentence｜>`, any string of the tokenizer's added tokens) is replaced by
a marker before rendering, and `ChatPrompt.literals` maps each marker back to its string, which
the server encodes as plain text (dsv4_jax/serving/tokenization.py), so a message cannot forge a
turn. Text a tokenizer cannot take (a lone surrogate) is refused naming its field. A template may
not be handed its own variables (`RESERVED`) through chat_template_kwargs, and any error it raises
is a ChatError.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
from datetime import datetime

from dsv4_jax.checkpoint.hf_files import ASSISTANT, BOS, END_THINK, EOS, THINK, USER
from .tokenization import surrogate_message

# DeepSeek-V4's tool-call markup (DSML): TOOL_CALLS, then per call INVOKE + name + '">' and per
# argument PARAMETER + name + '" string="true|false">' + value + END_PARAMETER, each closed in turn.
TOOL_CALLS, END_TOOL_CALLS = "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"
INVOKE, END_INVOKE = '<｜DSML｜invoke name="', "</｜DSML｜invoke>"
PARAMETER, END_PARAMETER = '<｜DSML｜parameter name="', "</｜DSML｜parameter>"
TOOL_RESULT, END_TOOL_RESULT = "<tool_result>", "</tool_result>"
ROLES = ("system", "developer", "user", "assistant", "tool")
SYSTEM_ROLES = ("system", "developer")
# The fields a message of a role may carry beyond role, content and name.
ROLE_FIELDS = {"assistant": ("tool_calls", "reasoning_content"), "tool": ("tool_call_id",)}
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function's name
# DeepSeek's API levels for each accepted `reasoning_effort` (module doc).
EFFORT_LEVELS = {"low": "high", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}
MAX_EFFORT = ("Reasoning effort: maximum. Think the problem through as thoroughly as you can: take it apart, "
              "follow every step and alternative to its end, and check the answer from more than one side "
              "before you give it.\n\n")
TOKENIZER_CONFIG = "tokenizer_config.json"
# Variables a template gets from the server, which chat_template_kwargs may not replace.
RESERVED = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "documents",
            "continue_final_message", "chat_template", "tokenize", "reasoning_effort")
MAX_DEPTH = 32  # the deepest lists and objects chat_template_kwargs, tools and tool-call arguments may nest


class ChatError(ValueError):
    """A message list or chat_template_kwargs the format cannot render; `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def normalize_messages(messages) -> list[dict]:
    """The messages as `[{"role", "content": str}]`, an assistant's calls also as `tool_calls`:
    `[{"id": str | None, "type": "function", "function": {"name", "arguments": dict}}]`, its
    reasoning as `reasoning_content` (str) and a tool result's id as `tool_call_id` (each when
    given); ChatError naming the first bad field. A message may also carry `name` (ignored) and
    other fields only when null or empty."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatError(f"{where} must be an object with 'role' and 'content'", where)
        role = m.get("role")
        if role not in ROLES:
            raise ChatError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        allowed = ("role", "content", "name", *ROLE_FIELDS.get(role, ()))
        extra = [k for k, v in m.items() if k not in allowed and v not in (None, [], "")]
        if extra:
            raise ChatError(f"{where}.{extra[0]} is not supported", f"{where}.{extra[0]}")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ChatError(f"{where}.content[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}}",
                                    f"{where}.content[{j}]")
                texts.append(part["text"])
            content = ("\n\n" if role == "tool" else "\n").join(texts)
            for j, text in enumerate(texts):
                _check_text(text, f"{where}.content[{j}].text")
        if not isinstance(content, str):
            raise ChatError(f"{where}.content must be a string or a list of text parts", f"{where}.content")
        _check_text(content, f"{where}.content")
        message = {"role": role, "content": content}
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        if role == "assistant" and m.get("reasoning_content") is not None:
            if not isinstance(m["reasoning_content"], str):
                raise ChatError(f"{where}.reasoning_content must be a string", f"{where}.reasoning_content")
            _check_text(m["reasoning_content"], f"{where}.reasoning_content")
            message["reasoning_content"] = m["reasoning_content"]
        if role == "tool" and m.get("tool_call_id") is not None:
            if not isinstance(m["tool_call_id"], str):
                raise ChatError(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
            _check_text(m["tool_call_id"], f"{where}.tool_call_id")
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's OpenAI `tool_calls` checked, each one's arguments as a dict."""
    if not isinstance(calls, list):
        raise ChatError(f"{where} must be a list of tool calls", where)
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise ChatError(f"{at} must be an object {{\"id\", \"type\": \"function\", \"function\"}}", at)
        if call.get("type", "function") != "function":
            raise ChatError(f"{at}.type must be 'function', got {call['type']!r}", f"{at}.type")
        call_id = call.get("id")
        if call_id is not None:
            if not isinstance(call_id, str):
                raise ChatError(f"{at}.id must be a string", f"{at}.id")
            _check_text(call_id, f"{at}.id")
        function = call.get("function")
        if not isinstance(function, dict):
            raise ChatError(f"{at}.function must be an object {{\"name\", \"arguments\"}}", f"{at}.function")
        name = function.get("name")
        if not (isinstance(name, str) and TOOL_NAME.fullmatch(name)):
            raise ChatError(f"{at}.function.name must be a function name of 1 to 64 letters, digits, '_' or '-', "
                            f"got {name!r}", f"{at}.function.name")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                raise ChatError(f"{at}.function.arguments is not valid JSON: it must be the JSON text of an object",
                                f"{at}.function.arguments") from None
        if not isinstance(arguments, dict):
            raise ChatError(f"{at}.function.arguments must be a JSON object (or its JSON text)",
                            f"{at}.function.arguments")
        check_value(arguments, f"{at}.function.arguments")
        # A name is written between quotes in the markup, which cannot hold a quote or a line break.
        bad = next((k for k in arguments if '"' in k or "\n" in k), None)
        if bad is not None:
            raise ChatError(f"{at}.function.arguments: the argument name {bad!r} holds a quote or a line break, "
                            "which the tool-call format cannot carry", f"{at}.function.arguments")
        out.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return out


def _check_text(text: str, where: str) -> None:
    message = surrogate_message(text, where)
    if message is not None:
        raise ChatError(message, where)


def check_value(value, where: str) -> None:
    """ChatError naming `where` when `value` (JSON data) nests deeper than MAX_DEPTH or holds
    text, a key included, that a tokenizer cannot take."""
    for text in _strings(value, where, where):
        _check_text(text, where)


def effort_level(reasoning_effort) -> str | None:
    """DeepSeek's level ("high" or "max") for a request's `reasoning_effort` (module doc); None
    for None; ChatError for another value."""
    if reasoning_effort is None:
        return None
    if reasoning_effort not in EFFORT_LEVELS:
        raise ChatError(f"reasoning_effort must be one of {', '.join(EFFORT_LEVELS)}, got {reasoning_effort!r}",
                        "reasoning_effort")
    return EFFORT_LEVELS[reasoning_effort]


@dataclasses.dataclass
class ChatPrompt:
    """A rendered prompt: `text`, in which each special-token string of the request's own text is
    a marker, and `literals`, each marker's string (to be encoded as plain text)."""

    text: str
    literals: dict[str, str]


class _Literals:
    """Replaces the special-token strings `specials` in a request's text by markers that neither
    the template nor the user's text can produce (a random nonce in private-use characters)."""

    def __init__(self, specials):
        specials = sorted({s for s in specials if s}, key=len, reverse=True)  # the longest match first
        self.pattern = re.compile("|".join(map(re.escape, specials))) if specials else None
        self.nonce = secrets.token_hex(8)
        self.literals: dict[str, str] = {}

    def _marker(self, match: re.Match) -> str:
        marker = f"\ue000{self.nonce}.{len(self.literals)}\ue001"
        self.literals[marker] = match.group()
        return marker

    def __call__(self, value):
        """`value` with its strings (also inside lists and dicts, keys included) marked."""
        if isinstance(value, str):
            return value if self.pattern is None else self.pattern.sub(self._marker, value)
        if isinstance(value, list):
            return [self(v) for v in value]
        if isinstance(value, dict):
            return {self(k): self(v) for k, v in value.items()}
        return value


def tools_section(functions: list[dict]) -> str:
    """The tools part of the system prompt: how to call a tool, then each of `functions` (OpenAI
    `function` objects) as one line of JSON of its name, description and parameters."""
    schemas = "\n".join(json.dumps({k: f[k] for k in ("name", "description", "parameters") if f.get(k) is not None},
                                   ensure_ascii=False) for f in functions)
    return ("\n\n## Tools\n\n"
            f'You can call the tools listed below to help with the request. To call tools, write a "{TOOL_CALLS}" '
            "block like this one, with one invoke per call:\n\n"
            f"{TOOL_CALLS}\n{INVOKE}$TOOL_NAME\">\n{PARAMETER}$PARAMETER_NAME\" string=\"true|false\">"
            f"$PARAMETER_VALUE{END_PARAMETER}\n...\n{END_INVOKE}\n{INVOKE}$TOOL_NAME2\">\n...\n{END_INVOKE}\n"
            f"{END_TOOL_CALLS}\n\n"
            'Write a string parameter\'s value as it is, with string="true". Write any other value (a number, '
            'a boolean, an array or an object) as JSON, with string="false".\n\n'
            "### Available Tool Schemas\n\n"
            f"{schemas}\n\n"
            "Call only these tools, by these names, with parameters exactly as their schemas define them.\n")


def tool_calls_block(calls: list[dict]) -> str:
    """The DSML block of an assistant's earlier tool calls (normalize_messages' `tool_calls`): a
    string argument as it is with string="true", any other as JSON with string="false"."""
    invokes = []
    for call in calls:
        function = call["function"]
        parameters = [f'{PARAMETER}{key}" string="{"true" if isinstance(value, str) else "false"}">'
                      f"{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}{END_PARAMETER}"
                      for key, value in function["arguments"].items()]
        invokes.append(f'{INVOKE}{function["name"]}">\n' + "\n".join(parameters) + f"\n{END_INVOKE}")
    return f"{TOOL_CALLS}\n" + "\n".join(invokes) + f"\n{END_TOOL_CALLS}"


def default_prompt(messages: list[dict], thinking: bool = False, tools: list[dict] | None = None,
                   reasoning_effort: str | None = None) -> str:
    """The DeepSeek-V3.2/V4 family's prompt (module doc) for normalized messages; `tools`: the
    OpenAI `function` objects to offer (None or empty: none); `reasoning_effort`: an
    `effort_level` ("high", "max" or None)."""
    parts = [BOS]
    if thinking and reasoning_effort == "max":
        parts.append(MAX_EFFORT)
    leading = 0
    while leading < len(messages) and messages[leading]["role"] in SYSTEM_ROLES:
        parts.append(messages[leading]["content"])
        leading += 1
    if tools:
        parts.append(tools_section(tools))
    # module doc: which earlier turns keep their reasoning
    last_user = max((i for i, m in enumerate(messages) if m["role"] in ("user", "tool")), default=-1)
    turn: list[str] = []  # the texts of the user turn being gathered (user and tool messages)
    for i, m in enumerate(messages[leading:], leading):
        if m["role"] == "user":
            turn.append(m["content"])
            continue
        if m["role"] == "tool":
            turn.append(TOOL_RESULT + m["content"] + END_TOOL_RESULT)
            continue
        if turn:
            parts.append(USER + "\n\n".join(turn))
            turn = []
        if m["role"] in SYSTEM_ROLES:
            parts.append(m["content"])
        else:
            keep = thinking and (bool(tools) or i > last_user)
            reasoning = THINK + m.get("reasoning_content", "") if keep else ""
            calls = "\n\n" + tool_calls_block(m["tool_calls"]) if m.get("tool_calls") else ""
            parts.append(ASSISTANT + reasoning + END_THINK + m["content"] + calls + EOS)
    if turn:
        parts.append(USER + "\n\n".join(turn))
    parts.append(ASSISTANT + (THINK if thinking else END_THINK))
    return "".join(parts)


@dataclasses.dataclass
class ChatFormat:
    """How a checkpoint's chat requests become prompt text: `template` (a compiled Jinja
    template) with the tokenizer's special tokens, or the default format when None."""

    template: object | None = None
    bos_token: str | None = None
    eos_token: str | None = None

    @property
    def name(self) -> str:
        return "the checkpoint's chat template" if self.template is not None else "the DeepSeek-V3.2/V4 format"

    def render(self, messages, kwargs: dict | None = None, specials=(), tools=None,
               reasoning_effort: str | None = None) -> ChatPrompt:
        """The prompt for the request's messages, the special-token strings `specials` of the
        request's own text marked (module doc). `tools`: the request's checked tools
        (tool_calls.check_tools), rendered whatever the tool choice, "none" included, as vLLM
        does; `reasoning_effort`: the request's field (module doc). ChatError for bad messages,
        kwargs or effort, or a template that fails (its `raise_exception` included)."""
        messages = normalize_messages(messages)
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict):
            raise ChatError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        _check_kwargs(kwargs)
        effort = effort_level(reasoning_effort)
        mark = _Literals(specials)
        messages, kwargs = mark(messages), mark(kwargs)
        tool_list = mark(tools.tools) if tools is not None and tools.tools else None
        if self.template is None:
            unknown = sorted(set(kwargs) - {"thinking"})
            if unknown:
                raise ChatError(f"chat_template_kwargs: the default chat format takes only 'thinking', got "
                                f"{unknown[0]!r}", "chat_template_kwargs")
            thinking = kwargs.get("thinking", effort is not None)
            if not isinstance(thinking, bool):
                raise ChatError("chat_template_kwargs.thinking must be true or false", "chat_template_kwargs")
            functions = [t["function"] for t in tool_list] if tool_list else None
            return ChatPrompt(default_prompt(messages, thinking, functions, effort), mark.literals)
        import jinja2

        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs,
                     "messages": messages, "add_generation_prompt": True, "tools": tool_list,
                     "reasoning_effort": effort}
        if effort is not None:
            variables.setdefault("thinking", True)  # an effort asks for thinking unless the kwargs say otherwise
        try:
            text = self.template.render(**variables)
        except jinja2.TemplateError as e:
            raise ChatError(f"the chat template failed: {e}", "messages") from None
        except Exception as e:  # noqa: BLE001  a template may raise anything (OverflowError for a huge range, ...)
            raise ChatError(f"the chat template failed: {type(e).__name__}: {e}", "messages") from None
        return ChatPrompt(text, mark.literals)


def _check_kwargs(kwargs: dict) -> None:
    """chat_template_kwargs may not set the template's own variables, nor hold text a tokenizer
    cannot take."""
    for key, value in kwargs.items():
        where = f"chat_template_kwargs.{key}"
        if key in RESERVED:
            raise ChatError(f"{where}: '{key}' is set by the server and may not be passed to the chat template",
                            "chat_template_kwargs")
        _check_text(key, where)
        for text in _strings(value, where, "chat_template_kwargs"):
            _check_text(text, where)


def _strings(value, where: str, param: str):
    """Every string in `value`, also inside lists and dicts (keys included); a ChatError for
    `param` when `value` nests deeper than MAX_DEPTH (the template and the marking walk it
    recursively)."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ChatError(f"{where} is nested more than {MAX_DEPTH} levels deep", param)
        if isinstance(v, str):
            yield v
        elif isinstance(v, list):
            stack += [(x, depth + 1) for x in v]
        elif isinstance(v, dict):
            stack += [(x, depth + 1) for x in (*v.keys(), *v.values())]


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def load_chat_format(ckpt: str) -> ChatFormat:
    """The chat format of checkpoint directory `ckpt` (module doc). ValueError naming the file when
    tokenizer_config.json cannot be read or its template does not compile."""
    path = os.path.join(ckpt, TOKENIZER_CONFIG)
    if not os.path.isfile(path):
        return ChatFormat()
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object")
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is None:
        return ChatFormat()
    if not isinstance(source, str):
        raise ValueError(f"{path}: chat_template must be a string or a list of named templates with a 'default'")
    return ChatFormat(_compile(source, path), _token_text(config.get("bos_token")),
                      _token_text(config.get("eos_token")))


def _compile(source: str, path: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, separators=None, sort_keys=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{path}: chat_template does not compile (line {e.lineno}: {e.message})") from None
