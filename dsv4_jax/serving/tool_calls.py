"""OpenAI tool calling for DeepSeek-V4: the request's tools checked, and the calls read back out of
the model's text.

`check_tools(tools, tool_choice)` checks a chat request's `tools` and `tool_choice` and returns a
`ToolSpec`: the tools, which chat.ChatFormat.render puts in the prompt (chat.tools_section), and
the choice: "auto", "none" (the tools are still in the prompt, as vLLM does, but the model's text
is not parsed for calls), "required" (some call must be made) or a named function (a call of it
must be made). `ToolSpec.forced_names()` and `ToolSpec.schemas()` are what a decoding grammar
needs to enforce a required call.

`ToolCallParser` reads DeepSeek-V4's tool-call blocks (DSML, chat.py's constants) out of the
reply's content as it streams:

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="location" string="true">Beijing</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

`feed(delta)` and `finish()` return events: a `str` is content (for `delta.content`), a `dict` a
tool-call delta in OpenAI's streaming shape. Call i's first delta, sent once its `invoke` tag is
complete, is `{"index": i, "id": "call_<24 hex>", "type": "function", "function": {"name",
"arguments": ""}}`; the next ones are `{"index": i, "function": {"arguments": fragment}}`, one per
complete parameter and one closing the object, so that the fragments of a call add up to the JSON
text of its arguments object: a string="true" value as a JSON string, a string="false" value
parsed as JSON and written again (compactly), or, when it does not parse (or is NaN or an
infinity, which JSON cannot hold), as a JSON string of its raw text.

Text outside a block is content. Text that may be the start of `<｜DSML｜tool_calls>` is held back
until it is known not to be, so no fragment of the marker reaches the content; the whitespace
right before a block (DeepSeek's format puts a blank line there) is dropped with it. A block that
breaks the format (an unexpected tag or text, a duplicate parameter, a bad `string` flag) or is
cut off when the reply ends goes to the content as it was written, from the whitespace before its
marker to the break, and the text after the break is read again as content. The calls sent before
the break stay sent, and a call open at the break gets its arguments object closed, so every call
sent holds valid JSON of its complete parameters.

Every decision waits for exactly the text it needs and no more, so the events add up to the same
content and calls however the text is cut: `parse(text)`, the non-streaming reply, is feeding the
whole text at once. Call ids come from `secrets`, or, given `seed` (a string unique to the reply,
say the request id and choice index), from its hash, so a replay gets the same ids. A call's name
is sent as the model wrote it, even one that is not among the tools (a grammar keeps a required
call to them). The parser sees only the reply's content: calls inside the reasoning are not
parsed (dsv4_jax/serving/reasoning.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import secrets

from .chat import (END_INVOKE, END_PARAMETER, END_TOOL_CALLS, INVOKE, PARAMETER, TOOL_CALLS, TOOL_NAME, ChatError,
                   check_value)
from .reasoning import partial_marker_length

TOOL_CHOICES = ("auto", "none", "required")
NO_PARAMETERS = {"type": "object", "properties": {}}  # the schema of a tool that declares none


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    """A request's checked tools: `tools`, its OpenAI list (`[{"type": "function", "function":
    {"name", "description"?, "parameters"?, "strict"?}}]`, empty for none), and `choice`: "auto",
    "none", "required", or "function" with `function` the name of the one tool to call."""

    tools: list[dict]
    choice: str
    function: str | None = None

    @property
    def parses(self) -> bool:
        """Whether the reply is read for tool calls (there are tools, and the choice is not "none")."""
        return bool(self.tools) and self.choice != "none"

    def forced_names(self) -> list[str] | None:
        """The names a call must use when one is required ("required": every tool's, a named
        function: its own), None when the model may answer without a call."""
        if self.choice == "required":
            return [t["function"]["name"] for t in self.tools]
        if self.choice == "function":
            return [self.function]
        return None

    def schemas(self) -> dict[str, dict]:
        """Each tool's name -> the JSON schema of its arguments (an empty object schema when it
        declares no parameters)."""
        schemas = {t["function"]["name"]: t["function"].get("parameters") for t in self.tools}
        return {name: NO_PARAMETERS if schema is None else schema for name, schema in schemas.items()}


def check_tools(tools, tool_choice) -> ToolSpec:
    """The request's `tools` and `tool_choice` checked (module doc); ChatError naming the bad
    field. No tools (null or []) is allowed with no choice, "auto" or "none"."""
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise ChatError("'tools' must be a list of tools {\"type\": \"function\", \"function\": {...}}", "tools")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ChatError(f"{where} must be an object {{\"type\": \"function\", \"function\": {{...}}}}", where)
        if tool.get("type") != "function":
            raise ChatError(f"{where}.type must be 'function', got {tool.get('type')!r}", f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ChatError(f"{where}.function must be an object {{\"name\", \"description\", \"parameters\"}}",
                            f"{where}.function")
        name = function.get("name")
        if not (isinstance(name, str) and TOOL_NAME.fullmatch(name)):
            raise ChatError(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
                            f"{where}.function.name")
        if name in names:
            raise ChatError(f"{where}.function.name: two tools are named {name!r}", f"{where}.function.name")
        names.add(name)
        # null stands for an absent field, as some clients send it
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise ChatError(f"{where}.function.description must be a string", f"{where}.function.description")
        parameters = function.get("parameters", NO_PARAMETERS)
        # The format passes arguments as named parameters: their schema must be an object's.
        if parameters is not None and not (isinstance(parameters, dict) and parameters.get("type") in (None, "object")):
            raise ChatError(f"{where}.function.parameters must be a JSON schema of an object "
                            "({\"type\": \"object\", \"properties\": {...}})", f"{where}.function.parameters")
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise ChatError(f"{where}.function.strict must be true or false", f"{where}.function.strict")
        check_value(tool, where)
    if tool_choice is None:
        return ToolSpec(tools, "auto" if tools else "none")
    if tool_choice in TOOL_CHOICES:
        if tool_choice == "required" and not tools:
            raise ChatError("tool_choice 'required' needs tools: send them in 'tools'", "tool_choice")
        return ToolSpec(tools, tool_choice)
    if not (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
            and isinstance(tool_choice.get("function"), dict)):
        raise ChatError("tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", "
                        "\"function\": {\"name\": ...}}", "tool_choice")
    name = tool_choice["function"].get("name")
    if not tools:
        raise ChatError(f"tool_choice names the function {name!r}, but the request has no tools: send them in "
                        "'tools'", "tool_choice")
    if name not in names:
        raise ChatError(f"tool_choice names the function {name!r}, which is not among the tools", "tool_choice")
    return ToolSpec(tools, "function", name)


# The parser's states: which text it expects next.
CONTENT, CALLS, PARAMETERS, VALUE = "content", "calls", "parameters", "value"
FIELD = object()  # in a tag's parts: an attribute's value, up to the next '"'
INVOKE_TAG = (INVOKE, FIELD, '">')
PARAMETER_TAG = (PARAMETER, FIELD, '" string="', FIELD, '">')


def _match(text: str, parts: tuple) -> tuple[int, list[str]] | bool | None:
    """Whether `text` begins with the tag `parts` (literals and FIELDs): (its length, its field
    values), None when the text so far may still become it, False when it cannot. A field holds
    no '"' and no line break."""
    pos, fields = 0, []
    for part in parts:
        if part is FIELD:
            end = text.find('"', pos)
            newline = text.find("\n", pos)
            if end < 0:
                return False if newline >= 0 else None
            if 0 <= newline < end:
                return False
            fields.append(text[pos:end])
            pos = end
        else:
            piece = text[pos: pos + len(part)]
            if not part.startswith(piece):
                return False
            if len(piece) < len(part):
                return None
            pos += len(part)
    return pos, fields


def _json_value(raw: str) -> str:
    """A string="false" value as JSON text: parsed and written again, or its raw text as a JSON
    string when it is not JSON (or is NaN or an infinity, which JSON text cannot hold)."""
    def finite(number: str) -> float:
        value = float(number)
        if not math.isfinite(value):
            raise ValueError(number)
        return value

    def reject(constant: str):
        raise ValueError(constant)

    try:
        value = json.loads(raw, parse_float=finite, parse_constant=reject)
    except (ValueError, RecursionError):
        return json.dumps(raw, ensure_ascii=False)
    return json.dumps(value, ensure_ascii=False)


def collect(events: list[str | dict]) -> tuple[str, list[dict]]:
    """Parser events gathered into a whole reply: (content, tool calls as OpenAI's message
    `tool_calls`: `[{"id", "type": "function", "function": {"name", "arguments"}}]`)."""
    content, calls = [], []
    for event in events:
        if isinstance(event, str):
            content.append(event)
        elif "id" in event:
            calls.append({"id": event["id"], "type": "function", "function": dict(event["function"])})
        else:
            calls[event["index"]]["function"]["arguments"] += event["function"]["arguments"]
    return "".join(content), calls


class ToolCallParser:
    """One reply's content read for tool calls as it streams (module doc). `spec`: the request's
    tools (None, no tools or tool_choice "none": everything is content); `seed`: makes the call
    ids a function of it."""

    def __init__(self, spec: ToolSpec | None, seed: str | None = None):
        self.active = spec is not None and spec.parses
        self.seed = seed
        self.state = CONTENT
        self.text = ""  # received and not yet taken
        self.block = ""  # the open block's text taken so far (the content, should the block break)
        self.calls = 0  # calls started
        self.call_open = False  # the last call's arguments object is not closed
        self.parameter: tuple[str, bool] | None = None  # the open parameter: (name, string="true")
        self.names: set[str] = set()  # the open call's parameter names
        self.scan = 0  # where in `text` END_PARAMETER may start (the value before it was searched)

    def feed(self, delta: str) -> list[str | dict]:
        """The events (content `str`s and tool-call delta `dict`s) the reply's next text completes."""
        if not self.active:
            return [delta] if delta else []
        self.text += delta
        events = []
        self._advance(events)
        return _joined(events)

    def finish(self) -> list[str | dict]:
        """The events left when the reply ends: a block still open is cut off (module doc), and
        text held back is content."""
        if not self.active:
            return []
        events = []
        while self.state != CONTENT:
            self._break(events)
            self._advance(events)
        events.append(self.text)
        self.text = ""
        return _joined(events)

    def parse(self, text: str) -> tuple[str, list[dict]]:
        """A whole reply's (content, tool calls) (`collect`), the same as streaming it gives."""
        return collect(self.feed(text) + self.finish())

    def _call_id(self, index: int) -> str:
        if self.seed is None:
            return "call_" + secrets.token_hex(12)
        return "call_" + hashlib.sha256(f"{self.seed}\0{index}".encode()).hexdigest()[:24]

    def _arguments(self, events: list, fragment: str) -> None:
        events.append({"index": self.calls - 1, "function": {"arguments": fragment}})

    def _take(self, n: int) -> str:
        """Moves the next n characters of text into the open block's text."""
        taken, self.text = self.text[:n], self.text[n:]
        self.block += taken
        return taken

    def _close_call(self, events: list) -> None:
        self._arguments(events, "}" if self.names else "{}")
        self.call_open, self.names = False, set()

    def _break(self, events: list) -> None:
        """Gives up the open block where the text stands: its text so far becomes content."""
        if self.call_open:
            self._close_call(events)
        events.append(self.block)
        self.block, self.state, self.parameter, self.scan = "", CONTENT, None, 0

    def _advance(self, events: list) -> None:
        """Takes as much of the text as can be decided now."""
        while True:
            if self.state == CONTENT:
                at = self.text.find(TOOL_CALLS)
                if at < 0:
                    held = len(self.text) - partial_marker_length(self.text, TOOL_CALLS)
                    kept = len(self.text[:held].rstrip())  # whitespace that may precede a block waits too
                    events.append(self.text[:kept])
                    self.text = self.text[kept:]
                    return
                before = self.text[:at]
                content = before.rstrip()
                events.append(content)
                self.text = self.text[len(content):]
                self._take(at - len(content) + len(TOOL_CALLS))
                self.state = CALLS
            elif self.state == VALUE:
                at = self.text.find(END_PARAMETER, self.scan)
                if at < 0:
                    self.scan = max(0, len(self.text) - len(END_PARAMETER) + 1)
                    return
                name, is_string = self.parameter
                value = self._take(at)
                self._take(len(END_PARAMETER))
                text = json.dumps(value, ensure_ascii=False) if is_string else _json_value(value)
                self._arguments(events, ("{" if not self.names else ", ") + json.dumps(name, ensure_ascii=False)
                                + ": " + text)
                self.names.add(name)
                self.state, self.parameter, self.scan = PARAMETERS, None, 0
            else:
                self._take(len(self.text) - len(self.text.lstrip()))
                if not self.text:
                    return
                if self.state == CALLS:
                    opening, closing = _match(self.text, INVOKE_TAG), _match(self.text, (END_TOOL_CALLS,))
                else:
                    opening, closing = _match(self.text, PARAMETER_TAG), _match(self.text, (END_INVOKE,))
                if closing:
                    self._take(closing[0])
                    if self.state == CALLS:
                        self.block, self.state = "", CONTENT
                    else:
                        self._close_call(events)
                        self.state = CALLS
                elif opening and self._open(opening[1], events):
                    self._take(opening[0])
                elif opening is None or closing is None:
                    return  # the text so far may still become one of the tags
                else:  # neither tag, or an opening tag that breaks the format
                    self._break(events)

    def _open(self, fields: list[str], events: list) -> bool:
        """Opens the call or parameter whose tag has `fields`; False when the tag breaks the format
        (an empty name, a `string` flag not "true" or "false", a parameter named twice)."""
        if self.state == CALLS:
            if not fields[0]:
                return False
            events.append({"index": self.calls, "id": self._call_id(self.calls), "type": "function",
                           "function": {"name": fields[0], "arguments": ""}})
            self.calls += 1
            self.call_open, self.state = True, PARAMETERS
            return True
        name, flag = fields
        if not name or flag not in ("true", "false") or name in self.names:
            return False
        self.parameter, self.state = (name, flag == "true"), VALUE
        return True


def _joined(events: list[str | dict]) -> list[str | dict]:
    """`events` with adjacent content merged and empty content dropped."""
    out = []
    for event in events:
        if isinstance(event, str):
            if not event:
                continue
            if out and isinstance(out[-1], str):
                out[-1] += event
                continue
        out.append(event)
    return out
