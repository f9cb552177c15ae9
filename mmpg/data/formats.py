"""Annotation formats for video temporal grounding, all turned into `GroundingSample`s by `load_annotations`, which
detects the format: `charades` (Charades-STA text), `captions` (ActivityNet Captions and Charades-STA JSON; aliases
`activitynet`, `charades_json`), `time_r1` (TimeRFT lists), `tvgbench` (Time-R1's benchmark; the moment is `answer`,
as in Time-R1's `load_tvgbench`, while `start` / `end` only say where the clip was cut from its source), `timelens`
(TimeLens-Bench, read as TencentARC/TimeLens's `timelens_data.py` reads it) and `jsonl` (mmpg's own). Each format's
fields, and where to get each file: data/README.md.

Ids: `VIDEO#k` (k the sentence index within the video, from 0) unless the record has its own (`id`, Time-R1's
`qid`); TVGBench's are Time-R1's `<source file stem>_<index>` (Time-R1 counts only records whose video exists: the
same ids when all are there). A video is looked up by id with the usual extensions (ActivityNet's `v_xxx` also as
`xxx`), a relative path not found also by its bare file name. Time-R1's
`video_start` / `video_end` describe an already cut clip, whose timestamps are relative to the clip file: not a
window to cut. A list format keeps a record's other fields in `GroundingSample.metadata`.
Spans follow one rule in every format (`mmpg.data.samples`): an end up to max(2 s, 10 %) past the duration is
clamped (`raw_span` keeps the file's); farther out, start >= end or a start at/past the duration is a skip, except
with `keep_all=True` (evaluation under a paper's scoring, whose loaders keep every record), which keeps them as
written; a record without a readable span is always left out.
Bad records: with `strict=True` (default) the first one raises `UserError` naming the file and line (or JSON key /
index); with `strict=False` each is left out, listed in `LoadResult.skipped` as (where, reason) and logged.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Any

from mmpg.data.records import (Bad, parse_captions, parse_charades, parse_jsonl, parse_list, parse_timelens,
                                time_r1_record, tvgbench_record)
from mmpg.data.samples import GroundingSample, LoadResult, Skip, fit_span, resolve_video, span_problem
from mmpg.errors import UserError

log = logging.getLogger("mmpg.data")

FORMATS = ("charades", "captions", "time_r1", "tvgbench", "timelens", "jsonl")
_ALIASES = {"activitynet": "captions", "anet": "captions", "charades_json": "captions", "charades_txt": "charades",
            "timelens_bench": "timelens"}
FORMAT_CHOICES = ("auto",) + FORMATS + tuple(_ALIASES)
_CHARADES_LINE = re.compile(r"^\S+\s+[-+0-9.eE]+\s+[-+0-9.eE]+\s*##")
_TVG_FIELDS = ("path", "question", "answer")  # a list whose first record has these is TVGBench


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
        if isinstance(data, dict) and data and all(isinstance(v, dict) and "spans" in v and "queries" in v
                                                   for v in list(data.values())[:1]):
            return "timelens"
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
                     *, validate: bool = True, log_skips: bool = True, keep_all: bool = False) -> LoadResult:
    """Read an annotation file into `GroundingSample`s (video paths resolved against `video_dir`).

    validate: drop (or, strict, raise on) spans with start >= end, negative starts, starts at/past a known
        duration, or ends past it by more than `samples.end_margin(duration)`; ends past it by less are clamped,
        the file's span kept in `raw_span`. `check_dataset` turns this off to classify the problems itself (spans
        then stay as in the file). Missing durations stay None: see `fill_durations`.
    log_skips: log a warning summarising the skipped records (check-data reports them itself).
    keep_all: evaluation under a paper's scoring: a span `validate` would drop is kept as the file has it, and every
        sample is marked `as_written` (the dataset then keeps such spans too once it reads a duration). Training
        never loads this way, so it still skips them, counted.
    """
    path = Path(path)
    text = _read_text(path)
    fmt = _ALIASES.get(fmt, fmt)
    if fmt == "auto":
        fmt = detect_format(path, text)
    if fmt == "charades":
        records = parse_charades(path, text)
    elif fmt == "jsonl":
        records = parse_jsonl(path, text)
    elif fmt == "captions":
        records = parse_captions(path, _load_json(path, text))
    elif fmt == "time_r1":
        records = parse_list(path, _load_json(path, text), "video, duration, timestamp, sentence", time_r1_record)
    elif fmt == "tvgbench":
        records = parse_list(path, _load_json(path, text), "path, question, answer, duration", tvgbench_record)
    elif fmt == "timelens":
        records = parse_timelens(path, _load_json(path, text))
    else:
        raise UserError(f"unknown annotation format {fmt!r}; choose one of {', '.join(FORMAT_CHOICES)}")

    result = LoadResult(samples=[])
    cache: dict[str, str] = {}
    for where, rec in records:
        raw = None
        if not isinstance(rec, Bad) and validate:
            problem = span_problem(rec["span"], rec["duration"])
            if problem is None:
                rec["span"], raw = fit_span(rec["span"], rec["duration"])
            elif not keep_all:  # kept: the span stays as in the file
                rec = Bad(f"{problem[1]} in sample {rec['sample_id']}")
        if isinstance(rec, Bad):
            _skip(result, Skip(where, str(rec)), strict)
            continue
        result.samples.append(GroundingSample(
            sample_id=rec["sample_id"], video=_video_path(video_dir, rec["video"], fmt, cache),
            duration=rec["duration"], query=rec["query"], span=rec["span"],
            clip_start=rec["clip"][0] if rec["clip"] else None, clip_end=rec["clip"][1] if rec["clip"] else None,
            origin=where, raw_span=raw, metadata=rec.get("meta", ()), as_written=keep_all,
            raw_query=rec.get("raw_query")))
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
    in strict mode), unless loaded `as_written` (then only the video counts); ends a little past it are clamped
    (`raw_span` keeps the file's), like the loader does.
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
            if problem is not None and not sample.as_written:
                _skip(result, Skip(sample.where, problem[1]), strict)
                continue
            span, raw = fit_span(sample.span, d) if problem is None else (sample.span, None)
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
