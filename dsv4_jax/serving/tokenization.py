"""Text to token ids and back, for the server: checked, bounded, and off the event loop.

`ServerTokenizer` wraps the checkpoint's `tokenizers.Tokenizer`:
- `encode(texts)` runs `encode_batch`, which releases the GIL (plain `encode` holds it for the
  whole text), so the server calls it in a worker thread and the event loop keeps answering.
- `min_tokens(text)`: a lower bound on the tokens a text needs, from its length in characters,
  so that a text that cannot fit the context is refused before it is tokenized. It holds for a
  BPE vocabulary without an unknown token (byte-level, as DeepSeek's): every token is a
  vocabulary entry, and covers at most as many characters as the longest entry has (a byte-level
  entry has one character per byte, a text character at least one byte). A normalizer that may
  shrink the text (NFC / NFKC compose at most four code points into one) divides the bound; a
  tokenizer for which no bound holds gets 0 (no early refusal).
- `encode_chat(prompt)`: a rendered chat prompt (dsv4_jax/serving/chat.py) in which the request's own
  special-token strings were replaced by markers: the rest is encoded as usual (the template's
  special tokens are control tokens), each marked string as plain text, with a copy of the
  tokenizer that has no added tokens, so that a user cannot forge a turn.

`lone_surrogate` finds what the tokenizer cannot take at all: JSON may escape a lone UTF-16
surrogate ("\\ud800"), which is not a Unicode scalar value.

`TextOutput` turns a request's generated tokens into text as they arrive (incremental
detokenization with stop strings). Output text leaves special tokens out, except those a reply
asks to see: a thinking reply keeps `</think>` (`ServerTokenizer.end_think`) when the tokenizer
makes it a special token, as the reasoning split reads the marker in the text
(dsv4_jax/serving/reasoning.py).
"""

from __future__ import annotations

import json
import re

from dsv4_jax.checkpoint.hf_files import END_THINK

SHRINKING_NORMALIZERS = {"NFC": 4, "NFKC": 4}  # the most code points they compose into one
KEEPING_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend", "Sequence"}  # never fewer characters


def lone_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate in `text` (which UTF-8 cannot encode), or None."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def surrogate_message(text: str, where: str) -> str | None:
    """A message naming `where` when `text` holds a lone surrogate, else None."""
    i = lone_surrogate(text)
    if i is None:
        return None
    return (f"{where} is not valid Unicode text: it holds a lone surrogate (U+{ord(text[i]):04X}) at character "
            f"{i}; send text as UTF-8")


def _shrink_factor(normalizer: dict | None) -> int | None:
    """How many input characters a normalizer may turn into one (None: no bound known)."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for inner in normalizer.get("normalizers", []):
            f = _shrink_factor(inner)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in SHRINKING_NORMALIZERS:
        return SHRINKING_NORMALIZERS[kind]
    return 1 if kind in KEEPING_NORMALIZERS else None


def chars_per_token_bound(tokenizer) -> int | None:
    """The most text characters one token of `tokenizer` can cover, or None when no bound holds
    (module doc)."""
    spec = json.loads(tokenizer.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (model.get("unk_token") is not None and not model.get("byte_fallback")):
        return None
    factor = _shrink_factor(spec.get("normalizer"))
    if factor is None:
        return None
    return factor * max(len(s) for s in tokenizer.get_vocab(with_added_tokens=True))


def without_added_tokens(tokenizer):
    """A copy of `tokenizer` with no added tokens: it encodes their strings as plain text."""
    from tokenizers import Tokenizer

    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = []
    return Tokenizer.from_str(json.dumps(spec))


class ServerTokenizer:
    """The checkpoint's tokenizer as the server uses it (module doc)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.plain = without_added_tokens(tokenizer)
        self.chars_per_token = chars_per_token_bound(tokenizer)
        added = tokenizer.get_added_tokens_decoder()
        # Every added token's string: the chat format marks these in a request's own text.
        self.specials = tuple(t.content for t in added.values())
        self.special_ids = frozenset(i for i, t in added.items() if t.special)  # left out of output text
        # `</think>`'s id when it is an added token, else None (then it is text, one token or more).
        # llguidance reads every added token as a special token, which a grammar names by its id
        # (grammar.after_reasoning); a special one is also left out of output text, where a
        # thinking reply keeps it (TextOutput's `shown`).
        self.end_think = next((i for i, t in added.items() if t.content == END_THINK), None)

    def min_tokens(self, text: str) -> int:
        """At least this many tokens encode `text` (0 when the tokenizer allows no bound)."""
        return 0 if self.chars_per_token is None else -(-len(text) // self.chars_per_token)

    def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text (blocking; releases the GIL while it encodes)."""
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True, shown: frozenset[int] = frozenset()) -> str:
        """The text of ids; `shown`: special tokens whose text stays even when they are skipped."""
        if skip_special_tokens and not shown.isdisjoint(ids):
            ids, skip_special_tokens = [i for i in ids if i in shown or i not in self.special_ids], False
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode_chat(self, text: str, literals: dict[str, str]) -> list[int]:
        """Token ids of a rendered chat prompt (no special tokens added: the format holds its own);
        each marker of `literals` in it becomes its string encoded as plain text (blocking)."""
        if not literals:
            return self.encode([text], add_special_tokens=False)[0]
        pieces = re.split("(" + "|".join(map(re.escape, literals)) + ")", text)
        rest = self.encode(pieces[0::2], add_special_tokens=False)
        marked = [e.ids for e in self.plain.encode_batch([literals[m] for m in pieces[1::2]],
                                                         add_special_tokens=False)]
        ids = list(rest[0])
        for m, r in zip(marked, rest[1:]):
            ids += m + r
        return ids


class TextOutput:
    """One request's output text as its tokens arrive.

    Incremental detokenization: the tokens since the last boundary are decoded together with the
    ones before it (`prefix`..`read`, whose text was taken), and new text is taken only when it
    does not end in U+FFFD (a UTF-8 character split across tokens) or the request ends, so a
    character is never emitted in parts and the pieces add up to the whole output decoded at once
    (special tokens skipped, those `shown` excepted). Invalid UTF-8 (a model emitting stray bytes)
    also ends in U+FFFD; once `MAX_PENDING` tokens wait, the text up to the fourth last of them is
    taken when cutting there changes nothing and at least three characters (so three bytes) follow
    the cut (a UTF-8 decoder looks at most three bytes ahead, so later tokens cannot change the
    text before it): the text decoded per token stays short however long such a run. Stop strings:
    the text is cut before the first one and the request ends; until then the last
    len(longest stop) - 1 characters are held back, as they may begin one."""

    MAX_PENDING = 8

    def __init__(self, tokenizer, stops: list[str], shown: frozenset[int] = frozenset()):
        """shown: special token ids whose text is output all the same (module doc; then `tokenizer`
        is a ServerTokenizer)."""
        self.tokenizer, self.stops, self.shown = tokenizer, stops, shown
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read] decode to text already taken (context for the next ones)
        self.text, self.sent = "", 0
        self.hold = max(map(len, stops), default=1) - 1
        self.stopped = False  # a stop string matched

    def _decode(self, ids: list[int]) -> str:
        if self.shown:
            return self.tokenizer.decode(ids, skip_special_tokens=True, shown=self.shown)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int | None, final: bool) -> str:
        """Adds a generated token (None: a stop token, whose text is not output) and returns the
        text now ready to send; `final`: the request ends with it (everything is sent)."""
        if token is not None:
            self.ids.append(token)
        before, after = self._decode(self.ids[self.prefix: self.read]), self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self._take(after[len(before):], len(self.ids))
        elif len(self.ids) - self.read >= self.MAX_PENDING:
            cut = len(self.ids) - 4
            head, tail = self._decode(self.ids[self.prefix: cut]), self._decode(self.ids[cut:])
            if len(head) > len(before) and len(tail) >= 3 and head + tail == after:
                self._take(head[len(before):], cut)
        end = len(self.text) if final or self.stopped else max(self.sent, len(self.text) - self.hold)
        delta, self.sent = self.text[self.sent: end], end
        return delta

    def _take(self, new: str, read: int) -> None:
        """Takes `new`, the text of ids[self.read:read], and moves the boundary there."""
        start = max(0, len(self.text) - self.hold)  # the earliest a stop string ending in `new` can begin
        self.text += new
        hits = [i for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text, self.stopped = self.text[: min(hits)], True
        self.prefix, self.read = self.read, read
