"""Chat messages to prompt text: the checkpoint's Jinja chat template, or the DeepSeek-V3.2/V4 format.

A checkpoint whose tokenizer_config.json has a `chat_template` (a Jinja string, or a list of
`{"name", "template"}` of which "default" is used) gets it, rendered in Jinja's immutable sandbox
with `messages`, `add_generation_prompt=True`, `bos_token`, `eos_token` and the request's
`chat_template_kwargs`, plus transformers' helpers `raise_exception(message)`, `strftime_now(format)`
and a `tojson` filter that keeps non-ASCII text.

DeepSeek-V4 checkpoints ship no template (serving.md, "Chat format"); they get the family's format,
written here (`default_prompt`): `<｜begin▁of▁sentence｜>` once, a system (or developer) message's
text where it stands, each user turn `<｜User｜>` + text, each earlier assistant turn
`<｜Assistant｜></think>` + reply + `<｜end▁of▁sentence｜>`, and last the generation prompt
`<｜Assistant｜>` followed by `</think>` in the default non-thinking ("chat") mode, or by `<think>`
with `chat_template_kwargs: {"thinking": true}` ("thinking" mode).

Message content is a string, or a list of `{"type": "text", "text": ...}` parts (joined with "\\n").

The request's own text (message content, string values of chat_template_kwargs) is the user's,
not the format's: a special-token string in it (`<｜User｜>`, `<｜end▁of▁sentence｜>`, any
string of the tokenizer's added tokens) is replaced by a marker before rendering, and
`ChatPrompt.literals` maps each marker back to its string, which the server encodes as plain
text (dsv4_jax/serving/tokenization.py), so a message cannot forge a turn. Text a tokenizer cannot take
(a lone surrogate) is refused naming its field. A template may not be handed its own variables
(`RESERVED`) through chat_template_kwargs, and any error it raises is a ChatError.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
from datetime import datetime

from .tokenization import surrogate_message

BOS, EOS, USER, ASSISTANT, THINK, END_THINK = (
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>")
ROLES = ("system", "developer", "user", "assistant")
TOKENIZER_CONFIG = "tokenizer_config.json"
# Variables a template gets from the server, which chat_template_kwargs may not replace.
RESERVED = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "documents",
            "continue_final_message", "chat_template", "tokenize")
MAX_DEPTH = 32  # the deepest lists and objects chat_template_kwargs may nest


class ChatError(ValueError):
    """A message list or chat_template_kwargs the format cannot render; `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def normalize_messages(messages) -> list[dict]:
    """The messages as `[{"role", "content": str}]`; ChatError naming the first bad field. A
    message may also carry `name` (ignored) and other fields only when null or empty."""
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
        extra = [k for k, v in m.items() if k not in ("role", "content", "name") and v not in (None, [], "")]
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
            content = "\n".join(texts)
            for j, text in enumerate(texts):
                _check_text(text, f"{where}.content[{j}].text")
        if not isinstance(content, str):
            raise ChatError(f"{where}.content must be a string or a list of text parts", f"{where}.content")
        _check_text(content, f"{where}.content")
        out.append({"role": role, "content": content})
    return out


def _check_text(text: str, where: str) -> None:
    message = surrogate_message(text, where)
    if message is not None:
        raise ChatError(message, where)


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
        """`value` with its strings (also inside lists and dicts) marked."""
        if isinstance(value, str):
            return value if self.pattern is None else self.pattern.sub(self._marker, value)
        if isinstance(value, list):
            return [self(v) for v in value]
        if isinstance(value, dict):
            return {k: self(v) for k, v in value.items()}
        return value


def default_prompt(messages: list[dict], thinking: bool = False) -> str:
    """The DeepSeek-V3.2/V4 family's prompt for normalized messages (module doc)."""
    parts = [BOS]
    for m in messages:
        if m["role"] in ("system", "developer"):
            parts.append(m["content"])
        elif m["role"] == "user":
            parts.append(USER + m["content"])
        else:
            parts.append(ASSISTANT + END_THINK + m["content"] + EOS)
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

    def render(self, messages, kwargs: dict | None = None, specials=()) -> ChatPrompt:
        """The prompt for the request's messages, the special-token strings `specials` of the
        request's own text marked (module doc); ChatError for bad messages, kwargs, or a template
        that fails (its `raise_exception` included)."""
        messages = normalize_messages(messages)
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict):
            raise ChatError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        _check_kwargs(kwargs)
        mark = _Literals(specials)
        messages, kwargs = mark(messages), mark(kwargs)
        if self.template is None:
            unknown = sorted(set(kwargs) - {"thinking"})
            if unknown:
                raise ChatError(f"chat_template_kwargs: the default chat format takes only 'thinking', got "
                                f"{unknown[0]!r}", "chat_template_kwargs")
            thinking = kwargs.get("thinking", False)
            if not isinstance(thinking, bool):
                raise ChatError("chat_template_kwargs.thinking must be true or false", "chat_template_kwargs")
            return ChatPrompt(default_prompt(messages, thinking), mark.literals)
        import jinja2

        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs,
                     "messages": messages, "add_generation_prompt": True}
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
        for text in _strings(key, value, where):
            _check_text(text, where)


def _strings(key: str, value, where: str):
    """`key` and every string in `value`, also inside lists and dicts (keys included); a ChatError
    when `value` nests deeper than MAX_DEPTH (the template and the marking walk it recursively)."""
    yield key
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ChatError(f"{where} is nested more than {MAX_DEPTH} levels deep", "chat_template_kwargs")
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
