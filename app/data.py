"""What the inspector shows, computed without Gradio: group summaries and filters, table rows, response text parts.

Everything is read through `mmpg.runs` (`RunReader`, `metric_series`, `list_run_evals`). Parsed step files are
cached here, keyed by (path, mtime, size): a run that is still writing adds new files, a resumed run rewrites some,
and either shows up at the next read.

    source = RunSource("runs/my_run")        # never raises; `source.problem()` says what is missing
    source.steps()                           # [int], listed afresh
    groups = source.groups(12)               # [GroupRecord]; cached by the file's stat
    rows = response_rows(groups[0])          # (headers, rows) of the response table
"""

from __future__ import annotations

import dataclasses
import html
import math
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path

from mmpg.errors import UserError
from mmpg.rewards.grounding import temporal_iou
from mmpg.rewards.parse import parse_answer
from mmpg.runs import EVAL_JSONL, METRICS_JSONL, GroupRecord, ResponseRecord, RunReader
from mmpg.runs.layout import rollout_path

FILTERS = (
    "all groups",
    "all rewards equal (zero advantage)",
    "unparseable answers",
    "truncated responses",
    "lowest mean reward",
    "highest mean reward",
    "out-of-range answers",
)
SCOPES = ("this step", "all steps")


# --------------------------------------------------------------------------------------------------- the source
class RunSource:
    """A run directory as the app sees it: a `RunReader` made when the folder becomes a run directory, and caches.

    Holds at most `max_steps` parsed step files (a step of 16 groups x 8 long responses is about 1 MB of text) and a
    summary of every step seen (a few numbers per group, for filters over the whole run).
    """

    def __init__(self, run_dir: str | os.PathLike, max_steps: int = 16):
        self.run_dir = Path(run_dir)
        self._reader: RunReader | None = None
        self._groups: OrderedDict[int, tuple[tuple, list[GroupRecord]]] = OrderedDict()
        self._summaries: dict[int, tuple[tuple, list[GroupSummary]]] = {}
        self._metrics: tuple[tuple, list[dict]] | None = None
        self._max_steps = max_steps
        self._lock = threading.Lock()  # Gradio runs handlers in threads

    def reader(self) -> RunReader:
        """The RunReader; UserError (saying what is missing) while the folder is not a run directory."""
        if self._reader is None:
            self._reader = RunReader(self.run_dir)
        return self._reader

    def problem(self) -> str | None:
        """Why nothing can be shown (empty folder, newer layout, ...), or None."""
        try:
            self.reader()
        except UserError as e:
            return str(e)
        return None

    def steps(self) -> list[int]:
        return self.reader().steps()

    def metrics(self) -> list[dict]:
        """metrics.jsonl records, re-read only when the file changed."""
        key = _stat(self.run_dir / METRICS_JSONL)
        with self._lock:
            if self._metrics is not None and self._metrics[0] == key:
                return self._metrics[1]
        records = self.reader().metrics()
        with self._lock:
            self._metrics = (key, records)
        return records

    def metrics_key(self) -> tuple:
        """Changes whenever metrics.jsonl or eval.jsonl changes."""
        return _stat(self.run_dir / METRICS_JSONL) + _stat(self.run_dir / EVAL_JSONL)

    def eval_metrics(self) -> list[dict]:
        return self.reader().eval_metrics()

    def groups(self, step: int) -> list[GroupRecord]:
        """The GroupRecords of one step (UserError if the step has no rollouts or its file is damaged)."""
        key = _stat(rollout_path(self.run_dir, step))
        with self._lock:
            hit = self._groups.get(step)
            if hit is not None and hit[0] == key:
                self._groups.move_to_end(step)
                return hit[1]
        groups = self.reader().rollouts(step)
        with self._lock:
            self._groups[step] = (key, groups)
            self._groups.move_to_end(step)
            while len(self._groups) > self._max_steps:
                self._groups.popitem(last=False)
            self._summaries[step] = (key, [summarize(step, i, g) for i, g in enumerate(groups)])
        return groups

    def summaries(self, step: int) -> list[GroupSummary]:
        key = _stat(rollout_path(self.run_dir, step))
        with self._lock:
            hit = self._summaries.get(step)
            if hit is not None and hit[0] == key:
                return hit[1]
        self.groups(step)
        return self._summaries[step][1]

    def all_summaries(self, progress=None) -> tuple[list[GroupSummary], list[str]]:
        """Summaries of every step (slow the first time on a long run: every step file is parsed once, about 4 ms a
        step of 16 groups), and one message per step that could not be read. progress(done, total) is called as
        it goes."""
        out, problems = [], []
        steps = self.steps()
        for i, step in enumerate(steps):
            if progress is not None and i % 25 == 0:
                progress(i, len(steps))
            try:
                out.extend(self.summaries(step))
            except UserError as e:
                problems.append(str(e))
        return out, problems


def _stat(path: Path) -> tuple:
    try:
        st = path.stat()
    except OSError:
        return ()
    return (st.st_mtime_ns, st.st_size, st.st_ino)


# ----------------------------------------------------------------------------------------- summaries, filters
@dataclasses.dataclass(frozen=True)
class GroupSummary:
    """The few facts of a group that filters and the group picker need."""

    step: int
    position: int  # line of the group in its step file, 0-based (what the picker selects)
    group_index: int
    sample_id: str
    size: int  # G
    mean_reward: float  # mean "overall" reward; NaN if none is finite
    all_equal: bool  # every response has the same overall reward: zero advantage, no learning signal
    unparsed: int  # responses without a span (unparsed, out of range or truncated)
    truncated: int  # responses that hit max_new_tokens
    out_of_range: int = 0  # answers outside the video: rejected ("out of range") or cut to it ("clamped")

    @property
    def key(self) -> str:
        """The group picker's value: 'step:position'."""
        return f"{self.step}:{self.position}"

    def label(self, with_step: bool) -> str:
        parts = [f"step {self.step}"] if with_step else []
        parts.append(f"group {self.group_index}")
        parts.append(f"mean reward {_fmt(self.mean_reward)}")
        if self.all_equal:
            parts.append("all equal")
        if self.unparsed:
            parts.append(f"{self.unparsed} unparsed")
        if self.out_of_range:
            parts.append(f"{self.out_of_range} out of range")
        if self.truncated:
            parts.append(f"{self.truncated} truncated")
        return " · ".join(parts)


def summarize(step: int, position: int, group: GroupRecord) -> GroupSummary:
    overall = [r.rewards.get("overall", math.nan) for r in group.responses]
    finite = [x for x in overall if math.isfinite(x)]
    return GroupSummary(
        step=step,
        position=position,
        group_index=group.group_index,
        sample_id=group.sample_id,
        size=len(group.responses),
        mean_reward=sum(finite) / len(finite) if finite else math.nan,
        all_equal=len(finite) == len(overall) and (max(finite, default=0.0) - min(finite, default=0.0)) <= 1e-9,
        unparsed=sum(r.parsed_span is None for r in group.responses),
        truncated=sum(r.finish_reason == "length" for r in group.responses),
        out_of_range=sum(_may_be_outside(r, group.duration) and verdict(r, group.duration).label in (
            "out of range", "clamped") for r in group.responses),
    )


def filter_groups(summaries: list[GroupSummary], name: str, limit: int = 200) -> list[GroupSummary]:
    """The groups a filter keeps, in the order the picker lists them (at most `limit`): newest step first, so the
    recent failures of a long run are the ones listed.

    'lowest' / 'highest mean reward' keep every group, sorted (groups without a finite reward last).
    """
    if name not in FILTERS:
        raise UserError(f"unknown filter {name!r}; one of: {', '.join(FILTERS)}")
    keep = {
        FILTERS[1]: lambda s: s.all_equal,
        FILTERS[2]: lambda s: s.unparsed > 0,
        FILTERS[3]: lambda s: s.truncated > 0,
        FILTERS[6]: lambda s: s.out_of_range > 0,
    }.get(name, lambda s: True)
    out = sorted((s for s in summaries if keep(s)), key=lambda s: (-s.step, s.position))
    if name in (FILTERS[4], FILTERS[5]):
        sign = 1.0 if name == FILTERS[4] else -1.0
        out.sort(key=lambda s: (not math.isfinite(s.mean_reward), sign * s.mean_reward
                                if math.isfinite(s.mean_reward) else 0.0, -s.step, s.position))
    return out[:limit]


def parse_group_key(key: str | None) -> tuple[int, int]:
    """'12:3' -> (12, 3); UserError for anything else (values come from the browser)."""
    m = re.fullmatch(r"(\d{1,9}):(\d{1,6})", str(key or ""))
    if not m:
        raise UserError(f"{key!r} is not a group (expected 'step:position')")
    return int(m.group(1)), int(m.group(2))


def count_matches(summaries: list[GroupSummary], name: str) -> int:
    """How many groups the filter keeps, with no limit."""
    return len(filter_groups(summaries, name, limit=len(summaries) + 1))


# ------------------------------------------------------------------------------------------ what went wrong
@dataclasses.dataclass(frozen=True)
class Verdict:
    """What became of a response's answer. label: "ok", "truncated" (hit max_new_tokens), "unparsed" (no span
    read), "out of range" (a span wholly outside the video: rejected, though its format may still score) or
    "clamped" (a span partly outside, cut to the video). raw: the answer as written, where it matters."""

    label: str
    raw: str | None = None
    why: str = ""

    @property
    def failed(self) -> bool:
        return self.label != "ok"

    def text(self) -> str:
        """One short cell: 'ok', 'truncated', 'unparsed', 'out of range: 24 to 30', 'clamped from 16 to 24'."""
        if self.label == "out of range" and self.raw:
            return f"out of range: {self.raw}"
        if self.label == "clamped" and self.raw:
            return f"clamped from {self.raw}"
        return self.label


def verdict(r: ResponseRecord, duration: float) -> Verdict:
    """Name the failure of one response by reading its answer again without the video's bounds."""
    return answer_verdict(r.text, r.parsed_span, r.finish_reason, duration)


def answer_verdict(text: str, span: list[float] | None, finish: str, duration: float) -> Verdict:
    """`verdict` of an answer `text` whose scored span is `span` (None: no span) in a video of `duration` s."""
    if finish == "length":
        return Verdict("truncated", why="hit max_new_tokens before the answer closed")
    raw = parse_answer(text, None)  # the span as written, before it is checked against [0, duration]
    short = raw.answer[:60] if raw.answer else None
    outside = raw.reason is not None and "outside the video" in raw.reason  # ends at or before 0
    known = math.isfinite(duration)
    if span is None:
        if outside or (raw.ok and known and raw.span[0] >= duration):
            return Verdict("out of range", short, f"{short!r} lies outside the {_fmt(duration, 1)} s video")
        return Verdict("unparsed", short, raw.reason or "no span was read")
    if raw.ok and (raw.span[0] < 0 or (known and raw.span[1] > duration)):
        return Verdict("clamped", short, f"{short!r} was cut to the {_fmt(duration, 1)} s video")
    return Verdict("ok")


def _may_be_outside(r: ResponseRecord, duration: float) -> bool:
    """False when the answer cannot have been outside the video (saves parsing every answer of a long run again):
    a clamped span ends at 0 or at the duration; a rejected one has no span."""
    if r.finish_reason == "length":
        return False
    return r.parsed_span is None or r.parsed_span[0] <= 0.0 or r.parsed_span[1] >= duration


def span_iou(r: ResponseRecord, gt: list[float]) -> float | None:
    """The tIoU of a response's span with the truth (its logged "iou" when there is one); None without a span."""
    if r.parsed_span is None:
        return None
    logged = r.rewards.get("iou")
    if logged is not None and math.isfinite(logged):
        return logged
    return temporal_iou(tuple(r.parsed_span), tuple(gt))


REWARD_HELP = ("<b>Reading the rewards.</b> overall = format + accuracy (weights in the run's config, 1 each by "
               "default). format: 1 when the response is &lt;think&gt;…&lt;/think&gt;&lt;answer&gt;…&lt;/answer&gt;, "
               "whatever the span. iou: the plain tIoU |pred ∩ truth| / |pred ∪ truth|; it colours the bars (red 0, "
               "yellow 0.5, green 1, the same scale as Evaluation) and is written on them. iou_v2 = tIoU × (1 − "
               "|Δstart|/d) × (1 − |Δend|/d) (Time-R1): also pays for boundary distance; accuracy is iou_v2 unless "
               "the config sets reward.accuracy: iou. An answer outside the video gets no span (out of range) or "
               "is cut to it (clamped); both are named in the table.")


# ----------------------------------------------------------------------------------------------- table rows
def reward_keys(group: GroupRecord) -> list[str]:
    """Reward component names of a group: 'overall' first, then the others sorted."""
    keys = {k for r in group.responses for k in r.rewards}
    return (["overall"] if "overall" in keys else []) + sorted(keys - {"overall"})


def response_rows(group: GroupRecord) -> tuple[list[str], list[list]]:
    """(headers, rows) of the response table: one row per response, in sampling order.

    Columns: #, start_s, end_s (None when unparsed), answer (ok or the failure, the raw answer beside a clamped
    span), each reward component, advantage, length, finish.
    """
    keys = reward_keys(group)
    headers = ["#", "start_s", "end_s", "answer", *keys, "advantage", "length", "finish"]
    rows = []
    for i, r in enumerate(group.responses):
        start, end = (r.parsed_span if r.parsed_span else (None, None))
        rows.append([i, _num(start, 2), _num(end, 2), verdict(r, group.duration).text(),
                     *[_num(r.rewards.get(k), 3) for k in keys], _num(r.advantage, 3), r.length, r.finish_reason])
    return headers, rows


def group_header(group: GroupRecord, summary: GroupSummary | None = None) -> str:
    """HTML: the query, duration, ground truth, sample and video of a group."""
    gt = group.gt_span
    facts = [f"<b>ground truth</b> {_fmt(gt[0], 2)} – {_fmt(gt[1], 2)} s",
             f"<b>duration</b> {_fmt(group.duration, 2)} s", f"<b>step</b> {group.step}",
             f"<b>group</b> {group.group_index}", f"<b>sample</b> {_h(group.sample_id)}"]
    if summary is not None:
        facts += [f"<b>responses</b> {summary.size}", f"<b>mean reward</b> {_fmt(summary.mean_reward)}"]
    out = [f'<div class="mmpg-query">{_h(group.query)}</div>', f'<div class="mmpg-facts">{" · ".join(facts)}</div>',
           f'<div class="mmpg-video">video: <code>{_h(group.video)}</code></div>']
    if summary is not None and summary.all_equal:
        out.append('<div class="mmpg-note">All rewards of this group are equal: zero advantage, no learning signal.'
                   "</div>")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------- response text
_TAG = re.compile(r"<(think|answer)>(.*?)(?:</\1>|$)", re.S)


def split_response(text: str) -> list[tuple[str, str]]:
    """[(kind, text)] with kind 'think', 'answer' or 'text', in order. A tag left open (a truncated response) runs
    to the end of the text."""
    parts, pos = [], 0
    for m in _TAG.finditer(text):
        if m.start() > pos and text[pos:m.start()].strip():
            parts.append(("text", text[pos:m.start()]))
        parts.append((m.group(1), m.group(2)))
        pos = m.end()
    if text[pos:].strip() or not parts:
        parts.append(("text", text[pos:]))
    return parts


def drift_note(metrics: list[dict]) -> str:
    """The warning line for the steps the trainer flagged with alarm/logprob_drift (empty when none)."""
    flagged = [m for m in metrics if m.get("alarm/logprob_drift")]
    if not flagged:
        return ""
    last = flagged[-1]
    return (f"logprob drift: {len(flagged)} step(s) flagged, the last at step {last.get('step')} "
            f"(actor/logprob_gap_max {_fmt(last.get('actor/logprob_gap_max'), 3)} for several steps in a row): the "
            "rollout engine samples from another distribution than the training forward scores; see train.log")


# ------------------------------------------------------------------------------------------------- helpers
def _num(x, digits: int):
    """A table cell: rounded float, or None for missing / non-finite values (shown empty, sorted last)."""
    if x is None:
        return None
    x = float(x)
    return round(x, digits) if math.isfinite(x) else None


def _fmt(x, digits: int = 3) -> str:
    return "—" if x is None or not math.isfinite(float(x)) else f"{float(x):.{digits}f}"


def _h(text) -> str:
    return html.escape(str(text))
