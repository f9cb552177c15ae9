"""Parse a predicted moment out of model text. Never raises on model text: a failure is a reason string.

Rules, in order:
1. Take the content of the last complete `<answer>...</answer>` (tags case-insensitive).
2. Normalise unicode (NFKC: full-width digits and colons become ASCII; dashes and the minus sign become `-`).
3. Find exactly one span `A SEP B`, SEP in `to`, `-`, `and`, `~`; A and B are seconds (`12`, `12.5`, `.5`),
   `MM:SS(.s)` or `HH:MM:SS(.s)`, optionally followed by `s` / `sec` / `seconds`. A leading `-` makes a negative
   number. Text around the span is allowed ("from 3.2 to 7 seconds").
4. start > end: rejected (default) or swapped; start == end: rejected (an empty moment).
5. Clamp to [0, duration] (to [0, inf) without a duration); a span that lies wholly outside is rejected.
"""

from __future__ import annotations

import math
import re
import unicodedata
from typing import NamedTuple

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
_TIME = r"-?(?:\d+(?::\d+){1,2}(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
_UNIT = r"(?:\s*(?:seconds?|secs?|s)\b)?"
_SPAN = re.compile(rf"(?<![\w.:])({_TIME}){_UNIT}\s*(?:to|-|and|~)\s*({_TIME}){_UNIT}(?![\w:]|\.\d)", re.IGNORECASE)
_DASHES = dict.fromkeys(map(ord, "\u2010\u2011\u2012\u2013\u2014\u2015\u2212\ufe63"), "-")
MAX_ANSWER_CHARS = 1000  # an answer longer than this is not a span; don't run regexes over megabytes


class ParsedAnswer(NamedTuple):
    """`span` (start, end) in seconds when parsing worked, else None and `reason` says why."""

    span: tuple[float, float] | None
    reason: str | None = None
    answer: str | None = None  # the text inside the last <answer> tags, if any

    @property
    def ok(self) -> bool:
        return self.span is not None


def extract_answer(text: str) -> str | None:
    """Content of the last complete <answer>...</answer>, stripped; None if there is none."""
    found = _ANSWER.findall(text) if isinstance(text, str) else []
    return found[-1].strip() if found else None


def parse_time(token: str) -> float | None:
    """Seconds in `12.5`, `1:05`, `01:02:03.5`, `-3`; None if a clock field is out of range or not finite."""
    sign = -1.0 if token.startswith("-") else 1.0
    parts = token.lstrip("-").split(":")
    try:
        fields = [float(p) for p in parts]
    except ValueError:
        return None
    if any(f >= 60 for f in fields[1:]):  # 1:75 is not a clock time
        return None
    value = 0.0
    for f in fields:
        value = value * 60 + f
    return sign * value if math.isfinite(value) else None


def parse_answer(text: str, duration: float | None = None, *, swap_reversed: bool = False) -> ParsedAnswer:
    """The predicted span in `text` (see the module docstring for the rules)."""
    if not isinstance(text, str) or not text.strip():
        return ParsedAnswer(None, "empty response")
    answer = extract_answer(text)
    if answer is None:
        return ParsedAnswer(None, "no <answer>...</answer> in the response")
    if not answer:
        return ParsedAnswer(None, "empty <answer>", answer)
    if len(answer) > MAX_ANSWER_CHARS:
        return ParsedAnswer(None, f"answer longer than {MAX_ANSWER_CHARS} characters", answer[:MAX_ANSWER_CHARS])
    normal = unicodedata.normalize("NFKC", answer).translate(_DASHES)
    matches = list(_SPAN.finditer(normal))
    if not matches:
        return ParsedAnswer(None, "no 'START to END' span in the answer", answer)
    if len(matches) > 1:
        return ParsedAnswer(None, f"{len(matches)} spans in the answer, expected one", answer)
    start, end = parse_time(matches[0].group(1)), parse_time(matches[0].group(2))
    if start is None or end is None:
        return ParsedAnswer(None, f"not a valid time in {matches[0].group(0)!r}", answer)
    if start > end:
        if not swap_reversed:
            return ParsedAnswer(None, f"start {start:g} is after end {end:g}", answer)
        start, end = end, start
    if start == end:
        return ParsedAnswer(None, f"empty span {start:g} to {end:g}", answer)
    hi = math.inf if duration is None else float(duration)
    if end <= 0 or start >= hi:
        return ParsedAnswer(None, f"span {start:g} to {end:g} lies outside the video [0, {hi:g}]", answer)
    return ParsedAnswer((max(start, 0.0), min(end, hi)), None, answer)
