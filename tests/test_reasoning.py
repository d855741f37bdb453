"""The split of a chat reply into reasoning and content (dsv4_jax/serving/reasoning.py): the same
however the text is cut, and `</think>` never reaches either part."""


import pytest
from conftest import text_splits

from dsv4_jax.serving.reasoning import ReasoningParser, partial_marker_length

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
