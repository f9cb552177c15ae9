"""Annotation formats for video temporal grounding, all turned into `GroundingSample`s.

- `charades`: the Charades-STA text files (`charades_sta_{train,test}.txt`), one `VIDEO_ID START END##sentence`
  per line; no durations.
- `captions` (aliases `activitynet`, `charades_json`): ActivityNet Captions JSON, also the JSON form of Charades-STA
  used by Time-R1 and others: `{video_id: {"duration", "timestamps": [[s, e], ...], "sentences": [...]}}`.
- `time_r1`: Time-R1-style lists (`train_2k5.json`):
  `[{"video", "duration", "timestamp": [s, e], "sentence", "qid"?, ...}]`.
- `tvgbench`: Time-R1's benchmark list (`tvgbench.json`): `[{"path", "question", "answer": "S-E", "duration",
  "start", "end", "source", ...}]`. The moment is `answer`, as in Time-R1's evaluation (`load_tvgbench`,
  `src/vllm_inference/data/data_loader.py`). `start` / `end` are not the moment: where set (252 of 800) they say
  where the clip file was cut from its source (end - start = duration), like TimeRFT's `video_start`; metadata only.
- `jsonl`: mmpg's generic JSONL (data/README.md), one
  `{"id"?, "video", "duration"?, "query", "span": [s, e], "clip"?: [a, b]}` per line.

Ids: formats with several sentences per video get `VIDEO#k` (k = sentence index within that video, from 0), unless
the record has its own (`id`, or Time-R1's `qid`); TVGBench ones get Time-R1's qid, `<source file stem>_<index>`
(Time-R1 counts only records whose video exists: the same ids when all are there). ActivityNet ids (`v_xxx`) are
looked up as `v_xxx.*` and then `xxx.*`, since both namings are in circulation; a relative video path that is not
found under the video folder is looked up by its bare file name there. Time-R1's `video_start` / `video_end` say
where an already cut clip file came from in its source video; its timestamps are relative to the clip file, so they
are ignored (not a window to cut). The list formats keep a record's other fields in `GroundingSample.metadata`.
Spans follow one rule in every format (`mmpg.data.samples`): an end up to max(2 s, 10 %) past the duration is
clamped (`raw_span` keeps the file's); farther out, start >= end, or a start at/past the duration is a skip.

Bad records never crash a skip-mode load: with `strict=False` each one is left out and listed in
`LoadResult.skipped` as (where, reason) and logged; with `strict=True` (default) the first one raises `UserError`
naming the file and line (or JSON key / index).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

from mmpg.data.samples import GroundingSample, LoadResult, Skip, fit_span, frozen, resolve_video, span_problem
from mmpg.errors import UserError

log = logging.getLogger("mmpg.data")

FORMATS = ("charades", "captions", "time_r1", "tvgbench", "jsonl")
_ALIASES = {"activitynet": "captions", "anet": "captions", "charades_json": "captions", "charades_txt": "charades"}
FORMAT_CHOICES = ("auto",) + FORMATS + tuple(_ALIASES)
_CHARADES_LINE = re.compile(r"^\S+\s+[-+0-9.eE]+\s+[-+0-9.eE]+\s*##")
_NUMBER = r"(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+)"
_TVG_ANSWER = re.compile(rf"^\s*{_NUMBER}\s*-\s*{_NUMBER}\s*$")  # "13.4-28.1"
_TVG_FIELDS = ("path", "question", "answer")  # a list whose first record has these is TVGBench


class _Bad(Exception):
    """A record that cannot become a sample; carries the reason (the caller knows where)."""


def _num(value: Any, what: str) -> float:
    if isinstance(value, bool) or value is None:
        raise _Bad(f"{what} is {value!r}, expected a number")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise _Bad(f"{what} is {value!r}, expected a number") from None
    if not math.isfinite(x):
        raise _Bad(f"{what} is {value!r}, expected a finite number")
    return x


def _pair(value: Any, what: str) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise _Bad(f"{what} is {value!r}, expected [start, end]")
    return _num(value[0], f"{what} start"), _num(value[1], f"{what} end")


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _Bad(f"{what} is {value!r}, expected a non-empty string")
    return value.strip()


def _meta(entry: dict, used: tuple[str, ...]) -> tuple:
    """The record's fields other than `used`, hashable (`GroundingSample.metadata`)."""
    return tuple((str(k), frozen(v)) for k, v in entry.items() if k not in used)


# Each parser yields (where, record) or (where, _Bad).
# A record: dict(sample_id, video, duration, query, span, clip, meta?), span as in the file (checked by the loader).

def _parse_charades(path: Path, text: str) -> Iterator[tuple[str, Any]]:
    seen: Counter = Counter()
    for lineno, line in enumerate(text.splitlines(), 1):
        where = f"{path}:{lineno}"
        if not line.strip():
            continue
        head, sep, sentence = line.partition("##")
        parts = head.split()
        if not sep or len(parts) != 3:
            yield where, _Bad(f"malformed line {line.strip()[:60]!r}, expected 'VIDEO_ID START END##sentence'")
            continue
        try:
            vid = parts[0]
            rec = dict(sample_id=f"{vid}#{seen[vid]}", video=vid, duration=None, clip=None,
                       query=_text(sentence, "sentence"),
                       span=(_num(parts[1], "start"), _num(parts[2], "end")))
        except _Bad as bad:
            yield where, bad
            continue
        seen[vid] += 1
        yield where, rec


def _parse_captions(path: Path, data: Any) -> Iterator[tuple[str, Any]]:
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object {{video_id: {{duration, timestamps, sentences}}}}")
    for vid, entry in data.items():
        where = f"{path}[{vid!r}]"
        try:
            if not isinstance(entry, dict):
                raise _Bad("expected an object with duration, timestamps, sentences")
            stamps, sents = entry.get("timestamps"), entry.get("sentences")
            if not isinstance(stamps, list) or not isinstance(sents, list) or len(stamps) != len(sents):
                raise _Bad("needs lists 'timestamps' and 'sentences' of equal length")
            duration = None if entry.get("duration") is None else _num(entry["duration"], "duration")
        except _Bad as bad:
            yield where, bad
            continue
        for k, (stamp, sent) in enumerate(zip(stamps, sents)):
            try:
                yield f"{where} sentence {k}", dict(
                    sample_id=f"{vid}#{k}", video=vid, duration=duration, clip=None,
                    query=_text(sent, "sentence"), span=_pair(stamp, "timestamp"))
            except _Bad as bad:
                yield f"{where} sentence {k}", bad


def _parse_list(path: Path, data: Any, fields: str, record) -> Iterator[tuple[str, Any]]:
    """The JSON-list formats: `record(i, entry, seen)` turns one object into a record (or raises _Bad); `seen`
    counts the records kept per video stem, for the `<stem>#k` ids."""
    if not isinstance(data, list):
        raise UserError(f"{path}: expected a JSON list of {{{fields}}} objects")
    seen: Counter = Counter()
    for i, entry in enumerate(data):
        where = f"{path}[{i}]"
        try:
            if not isinstance(entry, dict):
                raise _Bad("expected an object")
            rec = record(i, entry, seen)
        except _Bad as bad:
            yield where, bad
            continue
        seen[Path(rec["video"]).stem] += 1
        yield where, rec


def _time_r1_record(i: int, entry: dict, seen: Counter) -> dict:
    video = _text(entry.get("video"), "video")
    vid = Path(video).stem
    stamp = entry.get("timestamp", entry.get("timestamps"))
    if isinstance(stamp, list) and len(stamp) == 1 and isinstance(stamp[0], list):
        stamp = stamp[0]  # [[s, e]] written as a one-element list of spans
    return dict(sample_id=str(entry.get("id", entry.get("qid", f"{vid}#{seen[vid]}"))), video=video, clip=None,
                duration=None if entry.get("duration") is None else _num(entry["duration"], "duration"),
                query=_text(entry.get("sentence", entry.get("query")), "sentence"), span=_pair(stamp, "timestamp"),
                meta=_meta(entry, ("video", "duration", "timestamp", "timestamps", "sentence", "query", "id", "qid")))


def _tvgbench_record(i: int, entry: dict, seen: Counter) -> dict:
    video = _text(entry.get("path"), "path")
    vid = Path(video).stem
    answer = entry.get("answer")
    match = _TVG_ANSWER.match(answer) if isinstance(answer, str) else None
    if match is None:
        raise _Bad(f"answer is {answer!r}, expected 'START-END' in seconds, e.g. '13.4-28.1'")
    source = entry.get("source")
    if "id" in entry or "qid" in entry:
        sample_id = str(entry.get("id", entry.get("qid")))
    elif isinstance(source, str) and source:  # Time-R1's qid (load_tvgbench)
        sample_id = Path(source).stem.replace(".", "_").replace("-", "_") + f"_{i}"
    else:
        sample_id = f"{vid}#{seen[vid]}"
    return dict(sample_id=sample_id, video=video, clip=None,
                duration=None if entry.get("duration") is None else _num(entry["duration"], "duration"),
                query=_text(entry.get("question"), "question"),
                span=(_num(match[1], "answer start"), _num(match[2], "answer end")),
                meta=_meta(entry, ("path", "question", "answer", "duration", "id", "qid")))


def _parse_jsonl(path: Path, text: str) -> Iterator[tuple[str, Any]]:
    seen: Counter = Counter()
    for lineno, line in enumerate(text.splitlines(), 1):
        where = f"{path}:{lineno}"
        if not line.strip():
            continue
        try:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as e:
                raise _Bad(f"not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(entry, dict):
                raise _Bad("expected a JSON object per line")
            video = _text(entry.get("video"), "video")
            vid = Path(video).stem
            clip = None if entry.get("clip") is None else _pair(entry["clip"], "clip")
            if clip is not None and not 0 <= clip[0] < clip[1]:
                raise _Bad(f"clip {clip[0]:g}-{clip[1]:g} needs 0 <= start < end")
            rec = dict(sample_id=str(entry.get("id", f"{vid}#{seen[vid]}")), video=video, clip=clip,
                       duration=None if entry.get("duration") is None else _num(entry["duration"], "duration"),
                       query=_text(entry.get("query"), "query"), span=_pair(entry.get("span"), "span"))
        except _Bad as bad:
            yield where, bad
            continue
        seen[vid] += 1
        yield where, rec


def detect_format(path: str | Path, text: str | None = None) -> str:
    """Guess the format of an annotation file from its name and first characters."""
    path = Path(path)
    text = _read_text(path) if text is None else text
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if path.suffix.lower() == ".jsonl":
        return "jsonl"
    if _CHARADES_LINE.match(first):
        return "charades"
    if first.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            return "time_r1"  # the loader reports where the JSON breaks
        head = data[0] if isinstance(data, list) and data else None
        return "tvgbench" if isinstance(head, dict) and all(k in head for k in _TVG_FIELDS) else "time_r1"
    if first.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            return "jsonl"  # several objects, one per line
        if isinstance(data, dict) and (not data or any(isinstance(v, dict) and "timestamps" in v
                                                       for v in data.values())):
            return "captions"
        if isinstance(data, dict) and "span" in data:
            return "jsonl"  # a one-line JSONL file
    raise UserError(f"{path}: cannot tell the annotation format; pass --format with one of {', '.join(FORMATS)} "
                    "(see data/README.md)")


def _read_text(path: Path) -> str:
    """The file's text; a UTF-8 byte-order mark (Windows editors write one) is dropped, or it would become part of
    the first video id (`\\ufeffID`, then "video file not found") or make a JSON file unreadable."""
    if not path.is_file():
        raise UserError(f"annotation file {path} not found; pass the path of an existing file")
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start}); is this an annotation file?") from None


def _load_json(path: Path, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); fix the file") from None


def load_annotations(path: str | Path, video_dir: str | Path | None = None, fmt: str = "auto", strict: bool = True,
                     *, validate: bool = True, log_skips: bool = True) -> LoadResult:
    """Read an annotation file into `GroundingSample`s (video paths resolved against `video_dir`).

    validate: drop (or, strict, raise on) spans with start >= end, negative starts, starts at/past a known
        duration, or ends past it by more than `samples.end_margin(duration)`; ends past it by less are clamped,
        the file's span kept in `raw_span`. `check_dataset` turns this off to classify the problems itself (spans
        then stay as in the file). Missing durations stay None: see `fill_durations`.
    log_skips: log a warning summarising the skipped records (check-data reports them itself).
    """
    path = Path(path)
    text = _read_text(path)
    fmt = _ALIASES.get(fmt, fmt)
    if fmt == "auto":
        fmt = detect_format(path, text)
    if fmt == "charades":
        records = _parse_charades(path, text)
    elif fmt == "jsonl":
        records = _parse_jsonl(path, text)
    elif fmt == "captions":
        records = _parse_captions(path, _load_json(path, text))
    elif fmt == "time_r1":
        records = _parse_list(path, _load_json(path, text), "video, duration, timestamp, sentence", _time_r1_record)
    elif fmt == "tvgbench":
        records = _parse_list(path, _load_json(path, text), "path, question, answer, duration", _tvgbench_record)
    else:
        raise UserError(f"unknown annotation format {fmt!r}; choose one of {', '.join(FORMAT_CHOICES)}")

    result = LoadResult(samples=[])
    cache: dict[str, str] = {}
    for where, rec in records:
        raw = None
        if not isinstance(rec, _Bad) and validate:
            problem = span_problem(rec["span"], rec["duration"])
            if problem is not None:
                rec = _Bad(f"{problem[1]} in sample {rec['sample_id']}")
            else:
                rec["span"], raw = fit_span(rec["span"], rec["duration"])
        if isinstance(rec, _Bad):
            _skip(result, Skip(where, str(rec)), strict)
            continue
        result.samples.append(GroundingSample(
            sample_id=rec["sample_id"], video=_video_path(video_dir, rec["video"], fmt, cache),
            duration=rec["duration"], query=rec["query"], span=rec["span"],
            clip_start=rec["clip"][0] if rec["clip"] else None, clip_end=rec["clip"][1] if rec["clip"] else None,
            origin=where, raw_span=raw, metadata=rec.get("meta", ())))
    if result.skipped and log_skips:
        log.warning("%s: skipped %d of %d annotations (first: %s: %s)", path, len(result.skipped),
                    len(result.skipped) + len(result.samples), *result.skipped[0])
    return result


def _video_path(video_dir: str | Path | None, name: str, fmt: str, cache: dict[str, str]) -> str:
    """`resolve_video`, then two fallbacks when that file does not exist: a relative path's bare file name in
    `video_dir` (Time-R1 lists `./dataset/timer1/videos/timerft_data/x.mp4`), and ActivityNet ids without `v_`."""
    found = resolve_video(video_dir, name, cache)
    if Path(found).is_file():
        return found
    alternatives = []
    if video_dir is not None and not Path(name).is_absolute() and Path(name).name != name:
        alternatives.append(Path(name).name)
    if fmt == "captions" and name.startswith("v_"):
        alternatives.append(name[2:])
    for alt in alternatives:
        path = resolve_video(video_dir, alt, cache)
        if Path(path).is_file():
            return path
    return found


def _skip(result: LoadResult, skip: Skip, strict: bool) -> None:
    if strict:
        raise UserError(f"{skip.where}: {skip.reason}; fix it, or load with strict=False to skip bad samples")
    log.debug("skipping %s: %s", skip.where, skip.reason)
    result.skipped.append(skip)


def fill_durations(samples: list[GroundingSample], strict: bool = True) -> LoadResult:
    """Read the missing durations from the video files (decord header read, no decoding) and validate spans.

    Samples whose video is missing or unreadable, or whose span does not fit the duration, are skipped (or raise
    in strict mode); ends a little past it are clamped (`raw_span` keeps the file's), like the loader does.
    """
    from mmpg.data.video import VideoError, read_duration  # decord/torch only when needed

    result = LoadResult(samples=[])
    durations: dict[str, float | VideoError] = {}
    for sample in samples:
        if sample.duration is None:
            if sample.video not in durations:
                try:
                    durations[sample.video] = read_duration(sample.video)
                except VideoError as e:
                    durations[sample.video] = e
            d = durations[sample.video]
            if isinstance(d, VideoError):
                _skip(result, Skip(sample.where, str(d)), strict)
                continue
            problem = span_problem(sample.span, d)
            if problem is not None:
                _skip(result, Skip(sample.where, problem[1]), strict)
                continue
            span, raw = fit_span(sample.span, d)
            sample = dataclasses.replace(sample, duration=d, span=span, raw_span=sample.raw_span or raw)
        result.samples.append(sample)
    if result.skipped:
        log.warning("fill_durations: skipped %d of %d samples (first: %s: %s)", len(result.skipped), len(samples),
                    *result.skipped[0])
    return result


def write_jsonl(samples: list[GroundingSample], path: str | Path) -> None:
    """Write samples in the generic JSONL format (videos as resolved paths), e.g. after `fill_durations`.

    The span written is the file's (`raw_span or span`): reading it back clamps it again and restores `raw_span`.
    `metadata` is not written."""
    with open(path, "w", encoding="utf-8") as f:
        for s in samples:
            rec: dict[str, Any] = {"id": s.sample_id, "video": s.video, "duration": s.duration, "query": s.query,
                                   "span": list(s.raw_span or s.span)}
            if s.clip_start is not None or s.clip_end is not None:
                rec["clip"] = [s.clip_start or 0.0, s.clip_end if s.clip_end is not None else s.duration]
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
