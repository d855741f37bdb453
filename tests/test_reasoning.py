"""The split of a chat reply into reasoning and content (dsv4_jax/serving/reasoning.py): the same
however the text is cut, and `</think>` never reaches either part."""


import pytest
from conftest import text_splits

from dsv4_jax.checkpoint.hf_files import END_THINK, USER
from dsv4_jax.serving.reasoning import ReasoningParser, partial_marker_length
from dsv4_jax.serving.tokenization import ServerTokenizer, TextOutput
from dsv4_jax.tools.random_checkpoint import build_tokenizer

# (thinking, generated text, expected reasoning, expected content)
CASES = [
    (True, "Let me think.</think>The answer is 4.", "Let me think.", "The answer is 4."),
    (True, "</think>direct", "", "direct"),
    (True, "a</think>b</think>c", "a", "b</think>c"),  # only the first closes the reasoning
    (True, "x <</thi</think>y", "x <</thi", "y"),
    (True, "cut off while thinking </thin", "cut off while thinking </thin", ""),
    (True, "no marker at all", "no marker at all", ""),
    (True, "日本</think>😀", "日本", "😀"),
    (False, "plain </think> answer", "", "plain </think> answer"),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_every_split_gives_the_same_parts(case):
    thinking, text, reasoning, content = CASES[case]
    for pieces in text_splits(text):
        parser = ReasoningParser(thinking)
        parts = [parser.feed(p) for p in pieces] + [parser.finish()]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (reasoning, content), pieces


def test_a_possible_marker_is_held_back_until_settled():
    parser = ReasoningParser(True)
    assert parser.feed("step </") == ("step ", "")
    assert parser.feed("thi") == ("", "")
    assert parser.feed("s is not it") == ("</this is not it", "")
    assert parser.feed("</think") == ("", "")
    assert parser.feed(">done") == ("", "done")
    assert parser.feed(" more") == ("", " more") and parser.finish() == ("", "")


def test_partial_marker_length():
    assert partial_marker_length("abc</th", "</think>") == 4
    assert partial_marker_length("abc<", "</think>") == 1
    assert partial_marker_length("abc</think>", "</think>") == 0  # a whole marker is found, not held
    assert partial_marker_length("", "</think>") == 0


def test_a_special_think_end_reaches_the_parser():
    """The test tokenizer makes </think> a special token: a thinking reply's text keeps it (and
    only it), piece by piece as at once, so the parser splits there."""
    tok = ServerTokenizer(build_tokenizer(512, seed=0))
    assert tok.end_think in tok.special_ids
    user = tok.encode([USER], add_special_tokens=False)[0]
    ids = sum(tok.encode(["Hmm, 日本", "done"], add_special_tokens=False), [])
    cut = len(tok.encode(["Hmm, 日本"], add_special_tokens=False)[0])
    ids = ids[:cut - 1] + user + ids[cut - 1:cut] + [tok.end_think] + ids[cut:]
    shown = frozenset({tok.end_think})
    out = TextOutput(tok, [], shown)
    text = "".join(out.add(t, i == len(ids) - 1) for i, t in enumerate(ids))
    assert text == tok.decode(ids, shown=shown) == f"Hmm, 日本{END_THINK}done"
    assert tok.decode(ids) == "Hmm, 日本done"  # without `shown` every special token is left out
    parser = ReasoningParser(True)
    assert parser.feed(text) == ("Hmm, 日本", "done")
