"""A chat reply's generated text split, as it streams, into reasoning and content.

In thinking mode the prompt ends with `<think>` (dsv4_jax/serving/chat.py), so the model's text up
to its `</think>` is reasoning (the response's `reasoning_content`) and the text after it the
reply's content; a reply that ends without `</think>` was all reasoning. In the default chat mode
the prompt already closed the reasoning (`</think>`): everything is content. The marker reaches
this parser as text even where the tokenizer makes it a special token (output text otherwise
leaves those out: dsv4_jax/serving/tokenization.py, TextOutput's `shown`); a constrained reply's
grammar ends its reasoning at the same marker (dsv4_jax/serving/grammar.py, `after_reasoning`).

The text arrives in pieces that may cut `</think>` anywhere, so the end of the reasoning that could
still be the start of the marker is held back until the next piece settles it: the marker never
reaches either part, and the parts come out the same however the text is cut.

Only the content goes on to the tool-call parser (dsv4_jax/serving/tool_calls.py): DeepSeek's
format writes tool calls after the reasoning, and markup inside the reasoning is the model
thinking aloud, not a call.
"""

from __future__ import annotations

from .chat import END_THINK


def partial_marker_length(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is the beginning of `marker` (shorter than
    the whole marker): the text that must wait, as more text may complete the marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReasoningParser:
    """One reply's split into reasoning and content (module doc); `thinking`: the prompt opened
    the reasoning (thinking mode)."""

    def __init__(self, thinking: bool):
        self.in_reasoning = thinking
        self.held = ""  # the reasoning's end that may be the start of `</think>`

    def feed(self, delta: str) -> tuple[str, str]:
        """The next piece of generated text as (reasoning, content) ready to send."""
        if not self.in_reasoning:
            return "", delta
        text = self.held + delta
        at = text.find(END_THINK)
        if at >= 0:
            self.in_reasoning, self.held = False, ""
            return text[:at], text[at + len(END_THINK):]
        cut = len(text) - partial_marker_length(text, END_THINK)
        self.held = text[cut:]
        return text[:cut], ""

    def finish(self) -> tuple[str, str]:
        """What is left when the reply ends: a held end that did not become `</think>` is reasoning."""
        held, self.held = self.held, ""
        return held, ""
