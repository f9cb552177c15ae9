"""The rollout groups as the Rollouts tab lists and shows them, computed without Gradio: a summary of each group
(what the filters and the group picker need), the filters, the response table and the group's header.

    summaries = source.summaries(12)                     # [GroupSummary] of step 12 (app/run_source.py)
    kept = filter_groups(summaries, "unparseable answers")
    headers, rows = response_rows(source.groups(12)[kept[0].position])

A group is picked by the key 'step:position' (its line in the step's file), the only value the browser sends back.
"""

from __future__ import annotations

import dataclasses
import html
import math
import re

from mmpg_app.answers import left_the_video, response_fate
from mmpg_app.render import fmt
from mmpg.errors import UserError
from mmpg.runs import GroupRecord

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
        parts.append(f"mean reward {fmt(self.mean_reward)}")
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
        out_of_range=sum(left_the_video(r, group.duration) for r in group.responses),
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


REWARD_HELP = ("<b>Reading the rewards.</b> overall = format + accuracy (weights in the run's config, 1 each by "
               "default). format: 1 when the response is "
               "&lt;think&gt;…&lt;/think&gt;&lt;answer&gt;…&lt;/answer&gt;, whatever the span. iou: the plain "
               "tIoU |pred ∩ truth| / |pred ∪ truth|; it colours the bars (red 0, yellow 0.5, green 1, the same "
               "scale as Evaluation) and is written on them. iou_v2 = tIoU × (1 − |Δstart|/d) × (1 − |Δend|/d) "
               "(Time-R1): also pays for boundary distance; accuracy is iou_v2 unless the config sets "
               "reward.accuracy: iou. An answer outside the video gets no span (out of range) or is cut to it "
               "(clamped); both are named in the table.")


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
        rows.append([i, _cell_value(start, 2), _cell_value(end, 2), response_fate(r, group.duration).text(),
                     *[_cell_value(r.rewards.get(k), 3) for k in keys], _cell_value(r.advantage, 3), r.length,
                     r.finish_reason])
    return headers, rows


def group_header(group: GroupRecord, summary: GroupSummary | None = None) -> str:
    """HTML: the query, duration, ground truth, sample and video of a group."""
    gt = group.gt_span
    facts = [f"<b>ground truth</b> {fmt(gt[0], 2)} – {fmt(gt[1], 2)} s",
             f"<b>duration</b> {fmt(group.duration, 2)} s", f"<b>step</b> {group.step}",
             f"<b>group</b> {group.group_index}", f"<b>sample</b> {html.escape(str(group.sample_id))}"]
    if summary is not None:
        facts += [f"<b>responses</b> {summary.size}", f"<b>mean reward</b> {fmt(summary.mean_reward)}"]
    out = [f'<div class="mmpg-query">{html.escape(str(group.query))}</div>',
           f'<div class="mmpg-facts">{" · ".join(facts)}</div>',
           f'<div class="mmpg-video">video: <code>{html.escape(str(group.video))}</code></div>']
    if summary is not None and summary.all_equal:
        out.append('<div class="mmpg-note">All rewards of this group are equal: zero advantage, no learning signal.'
                   "</div>")
    return "\n".join(out)


def _cell_value(x, digits: int):
    """A table cell: rounded float, or None for missing / non-finite values (shown empty, sorted last)."""
    if x is None:
        return None
    x = float(x)
    return round(x, digits) if math.isfinite(x) else None
