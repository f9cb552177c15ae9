"""The Markdown texts of an evaluation: `report.md` for one checkpoint, `over_steps.md` for a run (pure functions).

Numbers are percentages with two decimals (papers print R1@m x 100); "n/a" where nothing was scored.
"""

from __future__ import annotations

import math
import re
from collections import Counter

from mmpg.data.samples import span_problem
from mmpg.eval.metrics import THRESHOLDS, empty_union, score_text

RULES = {  # threshold_rule -> (row label, comparison)
    "gt": ("tIoU > m (Time-R1)", ">"),
    "ge": ("tIoU >= m (VideoChat-R1)", ">="),
}
SUFFIX = {"gt": "", "ge": "_ge"}  # metric key suffix of each rule in metrics.json
PLOTS = (("recall_vs_threshold.png", "Recall against the IoU threshold"), ("iou_histogram.png", "IoU histogram"),
         ("start_end.png", "Predicted against true start and end"))


def pct(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.2f}"


def rule_order(first: str) -> list[str]:
    return [first] + [r for r in RULES if r != first]


def metrics_table(metrics: dict, first: str = "gt") -> list[str]:
    head = "| convention | " + " | ".join(f"R1@{m}" for m in THRESHOLDS) + " | mIoU |"
    lines = [head, "|---" * (len(THRESHOLDS) + 2) + "|"]
    for rule in rule_order(first):
        cells = [pct(metrics.get(f"r1@{m}{SUFFIX[rule]}")) for m in THRESHOLDS]
        lines.append(f"| {RULES[rule][0]} | " + " | ".join(cells) + f" | {pct(metrics.get('miou'))} |")
    return lines


def reason_kind(reason: str) -> str:
    """A reason with its numbers replaced by N, for counting reasons by kind ("span N-N s ...")."""
    return re.sub(r"(?<!\d)-?\d+(?:\.\d+)?(?:e[-+]?\d+)?", "N", reason)


def _coverage(info: dict, metrics: dict, settings: dict, preds=()) -> list[str]:
    """Whether the numbers cover the whole benchmark: queries in the file, loaded, left out (why), clamped, scored."""
    records = info.get("annotations_records")
    if records is None:  # an evaluation folder written before these counts existed
        return []
    loaded, left = info.get("benchmark_size", 0), info.get("annotations_left_out_count", 0)
    clamped, scoring = info.get("ground_truth_clamped", 0), settings.get("scoring", "mmpg")
    how = (f"scored against the file's own span (scoring {scoring})" if scoring != "mmpg"
           else "scored against the span clamped to the video (scoring mmpg)")
    lines = ["## Coverage", "", f"- queries in the annotation file: **{records}**",
             f"- loaded: **{loaded}**; left out: **{left}**"
             + "".join(f"\n  - {n} x {why}" for why, n in info.get("annotations_left_out_reasons", {}).items()),
             f"- ground truths ending past the stated duration, kept: **{clamped}**, {how}",
             *([] if scoring == "mmpg" else _kept_as_written(preds)),
             f"- evaluated: **{info.get('evaluated', loaded)}**"
             + (f" (max_samples={settings.get('max_samples')})" if settings.get("max_samples") else "")
             + f"; scored: **{int(metrics.get('count', 0))}** ({int(metrics.get('failed', 0))} failed videos, "
             + ("scored 0" if settings.get("bad_videos") == "fail" else "left out") + ")",
             *_duplicates(metrics, settings.get("threshold_rule", "gt")), ""]
    return lines


def _duplicates(metrics: dict, first: str) -> list[str]:
    """The Coverage line on records repeating a (video, query, span): which denominator the metrics above use, and
    the other one's figures (`mmpg.eval.metrics.denominator_metrics`)."""
    repeats = int(metrics.get("duplicate_records") or 0)
    if not repeats:
        return []
    once = metrics.get("duplicates") == "once"
    other = "every_record" if once else "counted_once"
    figures = "/".join(pct(metrics.get(f"{other}/r1@{m}{SUFFIX[first]}")) for m in THRESHOLDS)
    return [f"- records repeating an earlier one's (video, query, span): **{repeats}**; the metrics above count "
            + ("each such key once, as TimeLens's compute_metrics.py does (duplicates=once)" if once
               else "every record (duplicates=count)")
            + f"; counting {'every record' if once else 'each key once, as TimeLens does'} instead: "
            f"{int(metrics.get(f'{other}/count') or 0)} scored, R1@{'/'.join(str(m) for m in THRESHOLDS)} "
            f"{figures} % ({RULES[first][0]}), mIoU {pct(metrics.get(f'{other}/miou'))} %"]


def truth_kind(span, duration) -> str | None:
    """Why no moment could be trained on a ground truth (`mmpg.data.samples.span_problem`, in words), or None."""
    duration = duration if duration is not None and duration == duration else None  # NaN: not known
    problem = span_problem(tuple(span), duration)
    if problem is None:
        return None
    if problem[0] == "start_ge_end":
        return "zero-length" if span[0] == span[1] else "reversed (start > end)"
    if span[0] < 0:
        return "starting before 0"
    if duration is not None and span[0] >= duration:
        return "starting at or past the duration"
    return "ending more than max(2 s, 10 %) past the duration"


def _kept_as_written(records) -> list[str]:
    """Coverage lines under a paper's scoring: the evaluated ground truths training would skip, kept as the
    papers' loaders keep them, and the answers whose union with the truth is empty (their code divides by 0)."""
    kinds = Counter(k for k in (truth_kind(r.gt_span, r.duration) for r in records) if k)
    empty = sum(r.pred_span is not None and empty_union(r.pred_span, r.gt_span) for r in records)
    lines = [f"- ground truths no moment could be trained on, kept as written (the paper's loader keeps every "
             f"record): **{sum(kinds.values())}**" + "".join(f"\n  - {n} x {k}" for k, n in kinds.most_common())
             + ("; scored as its code scores them: a zero-length truth gives tIoU 0 to any answer of positive "
                "length, a reversed one 0 to every answer, one ending past the video is scored unclamped"
                if kinds else "")]
    if empty:
        lines.append(f"- answers with an empty union with their ground truth (a zero-length answer on the same "
                     f"zero-length truth): **{empty}**, scored 0; Time-R1's compute_IoU gives NaN there (its mIoU "
                     "becomes NaN), VideoChat-R1's leaves the sample out, TimeLens's compute_metrics.py stops")
    return lines


def _decoding(metrics: dict, share_videos) -> list[str]:
    """What the decoding cost: videos, their passes through the vision tower (one each when a batch's queries of a
    video share it) and prefilled prompt tokens, for the samples the call that finished the folder decoded."""
    if "perf/videos" not in metrics:  # written before these counts existed
        return []
    n = int(metrics.get("perf/samples_decoded") or 0)
    how = {True: ", a video's queries batched together (share_videos)", False: ", fixed batches (share_videos=false)"}
    count = {k: int(metrics.get(f"perf/{k}") or 0) for k in ("videos", "vision_calls", "prefix_tokens")}
    return ["## Decoding", "", f"- {n} samples decoded by the last run{how.get(share_videos, '')}",
            f"- videos {count['videos']}, vision-tower videos encoded {count['vision_calls']}, prefill tokens "
            f"{count['prefix_tokens']}", ""]


def _problems(metrics: dict, records, settings: dict) -> list[str]:
    n, total = int(metrics.get("count", 0)), int(metrics.get("total", 0))
    k = int(metrics.get("unparseable_count", 0))
    repeats = int(metrics.get("duplicate_records") or 0) if metrics.get("duplicates") == "once" else 0
    lines = [f"Scored samples: **{n}** of {total} evaluated"
             + (f" and counted ({repeats} repeated records counted once)." if repeats else "."), "",
             f"Unparseable answers (scored IoU 0): **{k}** of {n} ({pct(metrics.get('unparseable'))} %)."]
    reasons = Counter()
    for r in records:
        if r.error is None and r.pred_span is None:
            why = score_text(r.text, tuple(r.gt_span), r.duration, settings.get("scoring", "mmpg"),
                             settings.get("swap_reversed", False)).reason
            reasons[reason_kind(why or "?")] += 1
    lines += [f"- {count} x {why}" for why, count in reasons.most_common(5)]
    failed = [r for r in records if r.error is not None]
    how = ("scored as failures (IoU 0, in the denominators; bad_videos=fail)" if settings.get("bad_videos") == "fail"
           else "left out of the metrics (bad_videos=skip)")
    lines += ["", f"Failed samples (video missing, unreadable or corrupt): **{len(failed)}** of {total}, {how}."]
    lines += [f"- `{r.sample_id}` (index {r.index}): {r.error}" for r in failed[:10]]
    if len(failed) > 10:
        lines.append(f"- ... and {len(failed) - 10} more (predictions.jsonl has them all, with `error` set)")
    return lines


def _settings_rows(info: dict) -> list[str]:
    s = dict(info.get("settings", {}))
    template = s.pop("template_text", None)
    rows = ["| setting | value |", "|---|---|",
            f"| checkpoint | `{info.get('checkpoint')}` |", f"| protocol | {info.get('protocol')} |"]
    rows += [f"| {k} | {'null' if v is None else v} |" for k, v in s.items() if not isinstance(v, dict)]
    rows += [f"| {k}.{kk} | {vv} |" for k, v in s.items() if isinstance(v, dict) for kk, vv in v.items()]
    if template:
        rows += ["", "Prompt (system, then user; {placeholders} filled per sample):", "", "```text",
                 f"[system] {template.get('system') or '(the chat template default)'}", template.get("user", ""),
                 "```"]
    return rows


def _fast_paths(fast: dict) -> list[str]:
    """What each fast path of the evaluating process chose (`mmpg.choices`): same answers, other speed."""
    if not fast:
        return []
    rows = ["", "## Fast paths", "", "| path | chosen | why |", "|---|---|---|"]
    return rows + [f"| {k} | {v.get('value')} | {v.get('why') or ''} |" for k, v in fast.items()]


def _zoom(metrics: dict) -> list[str]:
    """The zoom protocol's section (template=zoom), nothing otherwise."""
    if "zoom/calls_mean" not in metrics:
        return []
    counts = sorted(int(k.split("@")[1]) for k in metrics if k.startswith("zoom/count@"))
    lines = ["", "## Zoom protocol", "",
             f"Zooms per sample {metrics['zoom/calls_mean']:.2f} (samples that zoomed: "
             f"{pct(metrics['zoom/used_share'])} %), error turns per sample {metrics['zoom/errors_mean']:.2f}, clip "
             f"frames per sample {metrics['zoom/clip_frames_mean']:.1f} (beside the overview's).", "",
             "| zooms | samples | mIoU (%) |", "|---|---|---|"]
    lines += [f"| {k} | {int(metrics[f'zoom/count@{k}'])} | {pct(metrics[f'zoom/miou@{k}'])} |" for k in counts]
    return lines + [""]


def eval_report(info: dict, metrics: dict, records, protocol_summary: str = "") -> str:
    """report.md: what was evaluated, the metrics under both conventions (the protocol's first), unparseable and
    failed samples, every setting that changes the numbers, the plots."""
    settings = info.get("settings", {})
    first = settings.get("threshold_rule", "gt")
    loaded = info.get("benchmark_size")
    left_out = info.get("annotations_left_out", [])
    lines = [f"# Evaluation: {info.get('benchmark')}", "",
             f"- checkpoint: `{info.get('checkpoint')}`" + (f" (step {info['step']})" if info.get("step") is not None
                                                           else ""),
             f"- protocol: **{info.get('protocol')}**" + (f" — {protocol_summary}" if protocol_summary else ""),
             f"- annotations: `{info.get('annotations')}` ({loaded} samples"
             + (f", evaluated the first {settings.get('max_samples')}" if settings.get("max_samples") else "") + ")",
             f"- videos: `{info.get('videos')}`", "", "## Metrics (%)", ""]
    lines += metrics_table(metrics, first)
    lines += ["", f"R1@m counts a sample when its tIoU {RULES[first][1]} m under the protocol's convention (first "
              "row); the other row is the other convention. mIoU does not depend on it.", ""]
    lines += _coverage(info, metrics, settings, records)
    lines += _decoding(metrics, info.get("runtime", {}).get("share_videos"))
    lines += _zoom(metrics)
    lines += _problems(metrics, records, settings)
    if left_out:
        count = info.get("annotations_left_out_count", len(left_out))
        lines += ["", f"Annotation records left out when loading (not evaluated): **{count}**"]
        lines += [f"- {where}: {why}" for where, why in left_out[:5]]
    lines += ["", "## Settings that change the numbers", ""] + _settings_rows(info)
    lines += _fast_paths(info.get("fast_paths") or {})
    lines += ["", "## Plots", ""] + [f"![{title}](plots/{name})" for name, title in PLOTS]
    return "\n".join(lines) + "\n"


def over_steps_report(benchmark: str, run_dir: str, rows: list[tuple[int, dict]], first: str = "gt") -> str:
    """over_steps.md: one row per evaluated checkpoint (step, metrics), R1 under the protocol's convention."""
    suffix = SUFFIX[first]
    lines = [f"# {benchmark} over training steps", "", f"Run: `{run_dir}`. R1@m counts tIoU {RULES[first][1]} m "
             f"({RULES[first][0]}); each step's report.md has both conventions. Values in %.", "",
             "| step | " + " | ".join(f"R1@{m}" for m in THRESHOLDS) + " | mIoU | unparseable | failed | samples |",
             "|---" * (len(THRESHOLDS) + 6) + "|"]
    for step, m in rows:
        cells = [pct(m.get(f"r1@{t}{suffix}")) for t in THRESHOLDS]
        lines.append(f"| {step} | " + " | ".join(cells) + f" | {pct(m.get('miou'))} | {pct(m.get('unparseable'))} "
                     f"| {int(m.get('failed') or 0)} | {int(m.get('count') or 0)} |")
    return "\n".join(lines) + "\n"
