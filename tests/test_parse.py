"""Answer parsing: valid, near-valid, garbage, several answers, unicode, huge and negative numbers, empty."""

import pytest

from mmpg.rewards.parse import extract_answer, parse_answer, parse_time

D = 30.0  # video duration used by the table below

# (response, expected span) — parses with duration D.
VALID = [
    ("<think>hm</think><answer>12.54 to 17.83</answer>", (12.54, 17.83)),
    ("<answer>3 to 7</answer>", (3.0, 7.0)),
    ("<answer>3.0 - 7.5</answer>", (3.0, 7.5)),
    ("<answer>3-7</answer>", (3.0, 7.0)),
    ("<answer>between 4 and 9 seconds</answer>", (4.0, 9.0)),
    ("<answer>.5 to 2.25</answer>", (0.5, 2.25)),
    ("<answer>12.5s to 17.3s</answer>", (12.5, 17.3)),
    ("<answer>12.5 seconds to 17.3 seconds.</answer>", (12.5, 17.3)),
    ("<answer>The event happens from 12.5 to 17.3.</answer>", (12.5, 17.3)),
    ("<answer>0:05 to 0:12</answer>", (5.0, 12.0)),  # MM:SS
    ("<answer>00:00:05 to 00:00:12.5</answer>", (5.0, 12.5)),  # HH:MM:SS(.s)
    ("<answer>0:10 ~ 0:20</answer>", (10.0, 20.0)),
    ("<ANSWER>1 to 2</ANSWER>", (1.0, 2.0)),  # tags case-insensitive
    ("<answer>\n  1 to 2\n</answer>\n", (1.0, 2.0)),
    ("<answer>1 TO 2</answer>", (1.0, 2.0)),
    # several answers: the last complete one counts
    ("<answer>1 to 2</answer> wait <answer>5 to 8</answer>", (5.0, 8.0)),
    ("<answer>1 to 2</answer><answer>5 to", (1.0, 2.0)),  # unclosed last tag is ignored
    ("<think><answer>?</answer> no</think><answer>4 to 6</answer>", (4.0, 6.0)),
    # unicode
    ("<answer>３.５ to ７</answer>", (3.5, 7.0)),  # full-width digits (NFKC)
    ("<answer>3 \u2013 7</answer>", (3.0, 7.0)),  # en dash
    ("<answer>3\u22127</answer>", (3.0, 7.0)),  # minus sign
    ("<answer>0\uff1a05 to 0\uff1a09</answer>", (5.0, 9.0)),  # full-width colon
    ("<answer>😀 2 to 4 😀</answer>", (2.0, 4.0)),
    ("<answer>事件发生在 2 to 4</answer>", (2.0, 4.0)),
    # clamping to [0, D]
    ("<answer>-3 to 5</answer>", (0.0, 5.0)),  # negative start clamped to 0
    ("<answer>25 to 99999999999</answer>", (25.0, D)),  # huge end clamped to D
    ("<answer>0 to 30</answer>", (0.0, 30.0)),
]


@pytest.mark.parametrize("text,span", VALID)
def test_valid(text, span):
    got = parse_answer(text, D)
    assert got.ok, got.reason
    assert got.span == pytest.approx(span)
    assert got.reason is None


# (response, a word the reason must contain) — never raises, never returns a span.
INVALID = [
    ("", "empty"),
    ("   \n ", "empty"),
    (None, "empty"),
    ("12 to 17", "no <answer>"),  # no tags at all
    ("<answer>12 to 17", "no <answer>"),  # unclosed
    ("<answer></answer>", "empty <answer>"),
    ("<answer>   </answer>", "empty <answer>"),
    ("<answer>I don't know</answer>", "no 'START to END'"),
    ("<answer>12.5</answer>", "no 'START to END'"),  # one number
    ("<answer>[12.5, 17.3]</answer>", "no 'START to END'"),  # comma is not a separator
    ("<answer>1 to 2 and 3 to 4</answer>", "2 spans"),
    ("<answer>1:75 to 2:00</answer>", "not a valid time"),  # 75 seconds is not a clock field
    ("<answer>" + "9" * 310 + " to " + "9" * 311 + "</answer>", "not a valid time"),  # overflows to inf
    ("<answer>9 to 3</answer>", "after end"),  # reversed, rejected by default
    ("<answer>5 to 5</answer>", "empty span"),
    ("<answer>40 to 50</answer>", "outside"),  # wholly after D
    ("<answer>-9 to -2</answer>", "outside"),  # wholly negative
    ("<answer>" + "1 " * 600 + "</answer>", "longer than"),
    ("<answer>one to two</answer>", "no 'START to END'"),
    ("<answer>v1.2 to 3</answer>", "no 'START to END'"),  # a number glued to a word is not a time
    ("\x00\x01<answer>\x00</answer>", "no 'START to END'"),
]


@pytest.mark.parametrize("text,why", INVALID)
def test_invalid(text, why):
    got = parse_answer(text, D)
    assert not got.ok and got.span is None
    assert why in got.reason


def test_swap_reversed():
    assert parse_answer("<answer>9 to 3</answer>", D, swap_reversed=True).span == (3.0, 9.0)


def test_no_duration_clamps_only_below_zero():
    assert parse_answer("<answer>-1 to 500</answer>").span == (0.0, 500.0)


def test_answer_text_is_kept():
    got = parse_answer("<answer> from 1 to 2 </answer>", D)
    assert got.answer == "from 1 to 2"
    assert extract_answer("x") is None


@pytest.mark.parametrize("token,seconds", [("12", 12.0), ("1:05", 65.0), ("01:02:03.5", 3723.5), ("-3", -3.0),
                                           ("1:60", None), ("a", None)])
def test_parse_time(token, seconds):
    assert parse_time(token) == seconds


def test_huge_text_does_not_hang():
    text = "<think>" + "to 1 - 2 " * 100_000 + "</think><answer>1 to 2</answer>"
    assert parse_answer(text, D).span == (1.0, 2.0)
