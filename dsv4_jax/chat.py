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
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import datetime

BOS, EOS, USER, ASSISTANT, THINK, END_THINK = (
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>")
ROLES = ("system", "developer", "user", "assistant")
TOKENIZER_CONFIG = "tokenizer_config.json"


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
        if not isinstance(content, str):
            raise ChatError(f"{where}.content must be a string or a list of text parts", f"{where}.content")
        out.append({"role": role, "content": content})
    return out


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

    def render(self, messages, kwargs: dict | None = None) -> str:
        """Prompt text for the request's messages; ChatError for bad messages, kwargs, or a
        template that fails (its `raise_exception` included)."""
        messages = normalize_messages(messages)
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict):
            raise ChatError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        if self.template is None:
            unknown = sorted(set(kwargs) - {"thinking"})
            if unknown:
                raise ChatError(f"chat_template_kwargs: the default chat format takes only 'thinking', got "
                                f"{unknown[0]!r}", "chat_template_kwargs")
            thinking = kwargs.get("thinking", False)
            if not isinstance(thinking, bool):
                raise ChatError("chat_template_kwargs.thinking must be true or false", "chat_template_kwargs")
            return default_prompt(messages, thinking)
        import jinja2

        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs,
                     "messages": messages, "add_generation_prompt": True}
        try:
            return self.template.render(**variables)
        except jinja2.TemplateError as e:
            raise ChatError(f"the chat template failed: {e}", "messages") from None


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
