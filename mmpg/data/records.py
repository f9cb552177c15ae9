"""The record readers of the annotation formats (`mmpg.data.formats` says what each format is).

Each `parse_*` yields (where, record) or (where, `Bad`) for every record of one file: `where` names the file and the
line, JSON key or index; a record is dict(sample_id, video, duration, query, span, clip, meta?) with the span as the
file has it (the loader checks it). Pure: no file system, no logging.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

from mmpg.data.samples import frozen
from mmpg.errors import UserError

_NUMBER = r"(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+)"
_TVG_ANSWER = re.compile(rf"^\s*{_NUMBER}\s*-\s*{_NUMBER}\s*$")  # "13.4-28.1"


class Bad(Exception):
    """A record that cannot become a sample; carries the reason (the caller knows where)."""


def _num(value: Any, what: str) -> float:
    if isinstance(value, bool) or value is None:
        raise Bad(f"{what} is {value!r}, expected a number")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise Bad(f"{what} is {value!r}, expected a number") from None
    if not math.isfinite(x):
        raise Bad(f"{what} is {value!r}, expected a finite number")
    return x


def _pair(value: Any, what: str) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise Bad(f"{what} is {value!r}, expected [start, end]")
    return _num(value[0], f"{what} start"), _num(value[1], f"{what} end")


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise Bad(f"{what} is {value!r}, expected a non-empty string")
    return value.strip()


def _query(value: Any, what: str, squash: bool = False) -> dict:
    """{"query": the text stripped (whitespace runs made one space when `squash`), "raw_query": the text as the
    file has it when that differs, else None} (`GroundingSample.raw_query`)."""
    query = _text(value, what)
    query = " ".join(query.split()) if squash else query
    return {"query": query, "raw_query": value if value != query else None}


def _meta(entry: dict, used: tuple[str, ...]) -> tuple:
    """The record's fields other than `used`, hashable (`GroundingSample.metadata`)."""
    return tuple((str(k), frozen(v)) for k, v in entry.items() if k not in used)


# Each parser yields (where, record) or (where, Bad).
# A record: dict(sample_id, video, duration, query, raw_query, span, clip, meta?), span as in the file (checked by the
# loader), raw_query the query as written when stripping changed it.

def parse_charades(path: Path, text: str) -> Iterator[tuple[str, Any]]:
    seen: Counter = Counter()
    for lineno, line in enumerate(text.splitlines(), 1):
        where = f"{path}:{lineno}"
        if not line.strip():
            continue
        head, sep, sentence = line.partition("##")
        parts = head.split()
        if not sep or len(parts) != 3:
            yield where, Bad(f"malformed line {line.strip()[:60]!r}, expected 'VIDEO_ID START END##sentence'")
            continue
        try:
            vid = parts[0]
            rec = dict(sample_id=f"{vid}#{seen[vid]}", video=vid, duration=None, clip=None,
                       **_query(sentence, "sentence"),
                       span=(_num(parts[1], "start"), _num(parts[2], "end")))
        except Bad as bad:
            yield where, bad
            continue
        seen[vid] += 1
        yield where, rec


def parse_captions(path: Path, data: Any) -> Iterator[tuple[str, Any]]:
    """ActivityNet Captions / Charades-STA JSON: {video_id: {duration, timestamps, sentences}}."""
    yield from _parse_by_video(path, data, ("timestamps", "sentences"), ("timestamp", "sentence"))


def parse_timelens(path: Path, data: Any) -> Iterator[tuple[str, Any]]:
    """TimeLens-Bench (`charades-timelens.json`, ...): {video_id: {duration, spans, queries}}. Whitespace runs in a
    query become one space, as the benchmark's loader (`parse_query`) does; a span may be [s, e] or [[s, e]]."""
    yield from _parse_by_video(path, data, ("spans", "queries"), ("span", "query"), squash=True)


def _parse_by_video(path: Path, data: Any, keys: tuple[str, str], names: tuple[str, str],
                    squash: bool = False) -> Iterator[tuple[str, Any]]:
    """{video_id: {"duration", keys[0]: [[s, e], ...], keys[1]: [text, ...]}}; ids `video_id#k`. The entry's other
    fields go to every sample's metadata."""
    stamps_key, texts_key = keys
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object {{video_id: {{duration, {stamps_key}, {texts_key}}}}}")
    for vid, entry in data.items():
        where = f"{path}[{vid!r}]"
        try:
            if not isinstance(entry, dict):
                raise Bad(f"expected an object with duration, {stamps_key}, {texts_key}")
            stamps, texts = entry.get(stamps_key), entry.get(texts_key)
            if not isinstance(stamps, list) or not isinstance(texts, list) or len(stamps) != len(texts):
                raise Bad(f"needs lists '{stamps_key}' and '{texts_key}' of equal length")
            duration = None if entry.get("duration") is None else _num(entry["duration"], "duration")
        except Bad as bad:
            yield where, bad
            continue
        meta = _meta(entry, ("duration", stamps_key, texts_key))
        for k, (stamp, text) in enumerate(zip(stamps, texts)):
            if isinstance(stamp, list) and len(stamp) == 1 and isinstance(stamp[0], list):
                stamp = stamp[0]  # [[s, e]]: one span written as a list of spans
            try:
                query = _query(text, names[1], squash)
                yield f"{where} {names[1]} {k}", dict(
                    sample_id=f"{vid}#{k}", video=vid, duration=duration, clip=None,
                    **query, span=_pair(stamp, names[0]), meta=meta)
            except Bad as bad:
                yield f"{where} {names[1]} {k}", bad


def parse_list(path: Path, data: Any, fields: str, record) -> Iterator[tuple[str, Any]]:
    """The JSON-list formats: `record(i, entry, seen)` turns one object into a record (or raises Bad); `seen`
    counts the records kept per video stem, for the `<stem>#k` ids."""
    if not isinstance(data, list):
        raise UserError(f"{path}: expected a JSON list of {{{fields}}} objects")
    seen: Counter = Counter()
    for i, entry in enumerate(data):
        where = f"{path}[{i}]"
        try:
            if not isinstance(entry, dict):
                raise Bad("expected an object")
            rec = record(i, entry, seen)
        except Bad as bad:
            yield where, bad
            continue
        seen[Path(rec["video"]).stem] += 1
        yield where, rec


def time_r1_record(i: int, entry: dict, seen: Counter) -> dict:
    video = _text(entry.get("video"), "video")
    vid = Path(video).stem
    stamp = entry.get("timestamp", entry.get("timestamps"))
    if isinstance(stamp, list) and len(stamp) == 1 and isinstance(stamp[0], list):
        stamp = stamp[0]  # [[s, e]] written as a one-element list of spans
    return dict(sample_id=str(entry.get("id", entry.get("qid", f"{vid}#{seen[vid]}"))), video=video, clip=None,
                duration=None if entry.get("duration") is None else _num(entry["duration"], "duration"),
                **_query(entry.get("sentence", entry.get("query")), "sentence"), span=_pair(stamp, "timestamp"),
                meta=_meta(entry, ("video", "duration", "timestamp", "timestamps", "sentence", "query", "id", "qid")))


def tvgbench_record(i: int, entry: dict, seen: Counter) -> dict:
    video = _text(entry.get("path"), "path")
    vid = Path(video).stem
    answer = entry.get("answer")
    match = _TVG_ANSWER.match(answer) if isinstance(answer, str) else None
    if match is None:
        raise Bad(f"answer is {answer!r}, expected 'START-END' in seconds, e.g. '13.4-28.1'")
    source = entry.get("source")
    if "id" in entry or "qid" in entry:
        sample_id = str(entry.get("id", entry.get("qid")))
    elif isinstance(source, str) and source:  # Time-R1's qid (load_tvgbench)
        sample_id = Path(source).stem.replace(".", "_").replace("-", "_") + f"_{i}"
    else:
        sample_id = f"{vid}#{seen[vid]}"
    return dict(sample_id=sample_id, video=video, clip=None,
                duration=None if entry.get("duration") is None else _num(entry["duration"], "duration"),
                **_query(entry.get("question"), "question"),
                span=(_num(match[1], "answer start"), _num(match[2], "answer end")),
                meta=_meta(entry, ("path", "question", "answer", "duration", "id", "qid")))


def parse_jsonl(path: Path, text: str) -> Iterator[tuple[str, Any]]:
    seen: Counter = Counter()
    for lineno, line in enumerate(text.splitlines(), 1):
        where = f"{path}:{lineno}"
        if not line.strip():
            continue
        try:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as e:
                raise Bad(f"not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(entry, dict):
                raise Bad("expected a JSON object per line")
            video = _text(entry.get("video"), "video")
            vid = Path(video).stem
            clip = None if entry.get("clip") is None else _pair(entry["clip"], "clip")
            if clip is not None and not 0 <= clip[0] < clip[1]:
                raise Bad(f"clip {clip[0]:g}-{clip[1]:g} needs 0 <= start < end")
            rec = dict(sample_id=str(entry.get("id", f"{vid}#{seen[vid]}")), video=video, clip=clip,
                       duration=None if entry.get("duration") is None else _num(entry["duration"], "duration"),
                       **_query(entry.get("query"), "query"), span=_pair(entry.get("span"), "span"))
        except Bad as bad:
            yield where, bad
            continue
        seen[vid] += 1
        yield where, rec
