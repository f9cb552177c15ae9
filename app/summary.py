"""The run summary at the top of the page: is the run learning? Computed from metrics.jsonl and the held-out
evaluations, without Gradio.

For each headline metric (GRPO: reward, tIoU, parse rate, share of zero-advantage groups; SFT: the loss), with W
the window (20 steps, or half the steps logged when fewer than 2W):

    now    = mean of the last W logged values
    change = now - mean of the W values before them          (a trend over steps, not one noisy step)
    line   = exponential moving average, alpha = 2 / (W + 1), drawn small beside the numbers

A change is coloured by whether it is good for that metric (the zero-advantage share and the loss should fall).
The evaluation row sets the latest held-out evaluation (mIoU, R1@0.5, R1@0.7) beside the first one, the run's
starting point: eval.jsonl (training's held-out evaluation) first, else the run's evaluation folders. The page's
title carries the trainer's logprob-drift alarm (`drift_note`).

    html = summary_html(metrics, evals, kind="grpo")
"""

from __future__ import annotations

import html
import math

from mmpg_app.render import fmt
from mmpg.errors import UserError
from mmpg.runs import EvalReader, list_run_evals, metric_series

WINDOW = 20
# (metric, name, what it is, +1 when higher is better / -1 when lower is)
GRPO_HEADLINES = [
    ("reward/mean", "reward", "overall reward per response (format + accuracy)", +1),
    ("reward/iou", "tIoU", "mean tIoU of the sampled spans with the truth", +1),
    ("reward/parsed", "parse rate", "share of responses whose answer gave a span", +1),
    ("data/zero_adv_groups", "zero-advantage groups", "share of groups whose rewards were all equal: no signal", -1),
]
SFT_HEADLINES = [("sft/loss", "loss", "supervised cross-entropy per target token", -1)]
EVAL_KEYS = [("miou", "mIoU"), ("r1@0.5", "R1@0.5"), ("r1@0.7", "R1@0.7")]
SPARK_POINTS = 150


def ema(values: list[float], alpha: float) -> list[float]:
    """Exponential moving average: s_0 = v_0, s_t = alpha v_t + (1 - alpha) s_{t-1}."""
    out: list[float] = []
    for v in values:
        out.append(v if not out else alpha * v + (1 - alpha) * out[-1])
    return out


def trend(records: list[dict], key: str, window: int = WINDOW) -> dict | None:
    """{"now", "change" (None with one point), "window", "steps", "smooth"} of a logged metric; None if absent."""
    steps, values = metric_series(records, key)
    pairs = [(s, float(v)) for s, v in zip(steps, values)
             if isinstance(v, (int, float)) and math.isfinite(float(v))]
    if not pairs:
        return None
    vals = [v for _, v in pairs]
    w = max(1, min(window, len(vals) // 2))
    now = sum(vals[-w:]) / w
    before = vals[-2 * w:-w]
    change = now - sum(before) / len(before) if len(vals) >= 2 and before else None
    return {"now": now, "change": change, "window": w, "steps": [s for s, _ in pairs], "raw": vals,
            "smooth": ema(vals, 2.0 / (window + 1))}


def eval_points(eval_lines: list[dict], folder_metrics: list[tuple[int, dict]]) -> list[tuple[int, dict]]:
    """[(step, {"miou", "r1@0.5", "r1@0.7"})] by step: eval.jsonl's lines ("eval/miou", ...), else the evaluation
    folders' metrics.json."""
    out = []
    for line in eval_lines:
        m = {k: line.get(f"eval/{k}", line.get(k)) for k, _ in EVAL_KEYS}
        if any(isinstance(v, (int, float)) for v in m.values()):
            out.append((int(line.get("step", 0)), m))
    if not out:
        out = [(step, {k: m.get(k) for k, _ in EVAL_KEYS}) for step, m in folder_metrics]
    return sorted(out, key=lambda t: t[0])


def run_eval_points(src) -> list[tuple[int, dict]]:
    """eval_points of a RunSource: its eval.jsonl, else the metrics.json of its evaluation folders."""
    folders = []
    if not src.eval_metrics():
        for _bench, step, folder in list_run_evals(src.run_dir):
            try:
                folders.append((step, EvalReader(folder).metrics() or {}))
            except (UserError, OSError, ValueError):
                continue
    return eval_points(src.eval_metrics(), folders)


def spark_svg(steps: list[int], values: list[float], raw: list[float] | None = None, width: int = 180,
              height: int = 40) -> str:
    """A small line of `values` (the raw values faint behind it) over `steps`, the step range under it and the value
    range on its left."""
    if len(values) < 2:
        return ""
    every = values + (raw or [])
    lo, hi = min(every), max(every)
    span_s = (steps[-1] - steps[0]) or 1
    span_v = (hi - lo) or 1.0
    left = 42  # room for a label such as 0.0625

    def line(vals: list[float], style: str) -> str:
        pts = " ".join(f"{left + (width - left - 2) * (s - steps[0]) / span_s:.1f},"
                       f"{3 + (height - 17) * (1 - (v - lo) / span_v):.1f}" for s, v in zip(steps, vals))
        return f'<polyline points="{pts}" fill="none" {style}/>'

    return (f'<svg class="spark" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
            f'xmlns="http://www.w3.org/2000/svg" font-size="10" font-family="sans-serif">'
            + (line(raw, 'stroke="#b9c6dd" stroke-width="1"') if raw else "")
            + line(values, 'stroke="#3b6fd8" stroke-width="1.8"')
            + f'<text x="{left - 3}" y="10" fill="#666" text-anchor="end">{_short_number(hi)}</text>'
            f'<text x="{left - 3}" y="{height - 14}" fill="#666" text-anchor="end">{_short_number(lo)}</text>'
            f'<text x="{left}" y="{height - 2}" fill="#666">step {steps[0]}</text>'
            f'<text x="{width - 2}" y="{height - 2}" fill="#666" text-anchor="end">{steps[-1]}</text></svg>')


def _short_number(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"


def _card(name: str, what: str, t: dict, better: int, big: bool = False) -> str:
    change = ""
    if t["change"] is not None:
        good = t["change"] * better > 0
        flat = abs(t["change"]) < 1e-9
        kind = "flat" if flat else ("up" if good else "down")
        arrow = "→" if flat else ("▲" if t["change"] > 0 else "▼")
        change = (f'<span class="mmpg-change mmpg-{kind}" title="mean of the last {t["window"]} step(s) against '
                  f'the {t["window"]} before">{arrow} {t["change"]:+.3g}</span>')
    k = max(1, -(-len(t["steps"]) // SPARK_POINTS))  # every k-th point and the last: a few hundred pixels need
    keep = list(range(0, len(t["steps"]), k))         # no more
    keep += [len(t["steps"]) - 1] if keep[-1] != len(t["steps"]) - 1 else []
    spark = spark_svg(*([t[x][i] for i in keep] for x in ("steps", "smooth", "raw")), 460 if big else 180,
                      130 if big else 48)
    return (f'<div class="mmpg-card" data-metric="{html.escape(name)}" title="{html.escape(what)}">'
            f'<div class="mmpg-card-name">{html.escape(name)}</div>'
            f'<div class="mmpg-card-now">{_short_number(t["now"])}</div><div>{change}</div>{spark}</div>')


def _eval_card(points: list[tuple[int, dict]]) -> str:
    if not points:
        return ('<div class="mmpg-card" data-metric="evaluation"><div class="mmpg-card-name">held-out evaluation'
                '</div><div class="mmpg-sub">none yet (eval.every_n_steps with data.val, or mmpg eval on a '
                "checkpoint)</div></div>")
    (s0, first), (s1, last) = points[0], points[-1]
    rows = []
    for k, label in EVAL_KEYS:
        a, b = first.get(k), last.get(k)
        if not isinstance(b, (int, float)):
            continue
        start = f"{a:.3f}" if isinstance(a, (int, float)) and len(points) > 1 else ""
        delta = b - a if isinstance(a, (int, float)) and len(points) > 1 else None
        cls = "flat" if delta is None or abs(delta) < 1e-9 else ("up" if delta > 0 else "down")
        rows.append(f"<tr><td>{label}</td><td><b>{b:.3f}</b></td><td>{start}</td><td class='mmpg-{cls}'>"
                    f"{'' if delta is None else f'{delta:+.3f}'}</td></tr>")
    head = f"<tr><th></th><th>step {s1}</th><th>{f'step {s0}' if len(points) > 1 else ''}</th><th>change</th></tr>"
    return (f'<div class="mmpg-card" data-metric="evaluation"><div class="mmpg-card-name">held-out evaluation '
            f'<span class="mmpg-sub">latest beside the first of {len(points)}</span></div>'
            f'<table class="mmpg-evals">{head}{"".join(rows)}</table></div>')


def summary_html(metrics: list[dict], eval_lines: list[dict], folder_metrics: list[tuple[int, dict]] | None = None,
                 kind: str | None = None, window: int = WINDOW, more: str = "", rollouts: str = "") -> str:
    """The summary row: one card per headline metric the run logged, and the evaluation card (eval_lines: eval.jsonl;
    folder_metrics: [(step, metrics.json)] of the evaluation folders, used when eval_lines has none); `more`: cards
    after them (the memory card, app/plan_card.py); `rollouts`: a card shown after the evaluation for a GRPO run
    only (synchronous or how stale, app/staleness.py)."""
    sft = kind == "sft" or (kind is None and trend(metrics, "sft/loss") is not None
                            and trend(metrics, "reward/mean") is None)
    heads = SFT_HEADLINES if sft else GRPO_HEADLINES
    cards = [_card(name, what, t, better, big=sft) for key, name, what, better in heads
             if (t := trend(metrics, key, window)) is not None]
    if not cards:
        cards.append('<div class="mmpg-card"><div class="mmpg-sub">no training metrics logged yet</div></div>')
    cards.append(_eval_card(eval_points(eval_lines, folder_metrics or [])) + ("" if sft else rollouts) + more)
    title = "SFT run: is the loss falling?" if sft else "GRPO run: is it learning?"
    return (f'<div class="mmpg-summary"><div class="mmpg-summary-title">{title} '
            f'<span class="mmpg-sub">(each figure: the mean of the last {window} steps; ▲▼ its change against the '
            f'{window} before, green when good; the line: smoothed; every curve in Curves)</span></div>'
            f'<div class="mmpg-cards">{"".join(cards)}</div></div>')


def drift_note(metrics: list[dict]) -> str:
    """The warning line for the steps the trainer flagged with alarm/logprob_drift (empty when none)."""
    flagged = [m for m in metrics if m.get("alarm/logprob_drift")]
    if not flagged:
        return ""
    last = flagged[-1]
    return (f"logprob drift: {len(flagged)} step(s) flagged, the last at step {last.get('step')} "
            f"(actor/logprob_gap_max {fmt(last.get('actor/logprob_gap_max'), 3)} for several steps in a row): the "
            "rollout engine samples from another distribution than the training forward scores; see train.log")
