"""The timeline: the ground-truth span and each response's predicted span on the video's time axis, coloured by
tIoU with the truth, drawn as inline SVG (no plotting library, crisp at any size, a tooltip per bar).

    data = timeline_data(gt_span=[3.0, 9.5], duration=30.0, bars=[Bar("#0", [2.0, 8.0], 0.55, "..."), ...])
    svg = timeline_svg(data)          # a string for gr.HTML

One absolute colour scale everywhere (rollouts and evaluation): tIoU 0 is red, 0.5 yellow, 1 green, and the value
is written on each bar. A scale relative to a group's best answer would paint a group that missed the moment
entirely green; the reward (format + accuracy) is not used because its format part says nothing about the span.
"""

from __future__ import annotations

import dataclasses
import html
import math

_LOW, _MID, _HIGH = (215, 48, 39), (254, 224, 139), (26, 152, 80)  # red, yellow, green (ColorBrewer RdYlGn)
_GT_COLOUR = "#3b6fd8"
_NONE_COLOUR = "#9e9e9e"


@dataclasses.dataclass
class Bar:
    """One row of the timeline."""

    label: str  # e.g. "#3"
    span: list[float] | None  # [start_s, end_s]; None: the answer did not parse (drawn as a note)
    value: float | None  # tIoU with the truth, 0..1: colours the bar and is written on it; None or NaN: grey
    title: str = ""  # tooltip text
    note: str = ""  # written after the bar, e.g. "clamped from 4 to 10" or "truncated"


def colour(value: float | None, low: float = 0.0, high: float = 1.0) -> str:
    """'#rrggbb' for a value on the red-yellow-green scale between low and high; grey for None/NaN."""
    if value is None or not math.isfinite(value):
        return _NONE_COLOUR
    t = 0.5 if high - low < 1e-12 else min(1.0, max(0.0, (value - low) / (high - low)))
    a, b, u = (_LOW, _MID, t * 2) if t < 0.5 else (_MID, _HIGH, t * 2 - 1)
    return "#%02x%02x%02x" % tuple(round(x + (y - x) * u) for x, y in zip(a, b))


def nice_ticks(axis_max: float, target: int = 8) -> list[float]:
    """Round tick positions 0, step, 2*step, ... <= axis_max with step 1, 2 or 5 x 10^k."""
    if not math.isfinite(axis_max) or axis_max <= 0:
        return [0.0]
    raw = axis_max / target
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return [round(i * step, 6) for i in range(int(axis_max / step + 1e-9) + 1)]


def timeline_data(gt_span: list[float], duration: float, bars: list[Bar], scale: str = "tIoU") -> dict:
    """Everything the SVG needs, as plain data (tested without a browser).

    Returns {"axis_max", "ticks", "gt": [s, e], "low": 0, "high": 1, "scale" (what colours mean), "rows": [{"label",
    "x0", "x1", "colour", "value", "title", "note"}]}: x0/x1 are the span clipped to [0, axis_max] (None when the span
    is missing), note says why a row has no bar or looks odd ("unparsed", "reversed span", the bar's own note).
    """
    ends = [x for b in bars if b.span for x in b.span if math.isfinite(x)] + [x for x in gt_span if math.isfinite(x)]
    axis_max = max([duration] if duration and math.isfinite(duration) else [], default=0.0)
    axis_max = max([axis_max, *ends]) or 1.0
    low, high = 0.0, 1.0
    rows = []
    for b in bars:
        value = b.value if b.value is not None and math.isfinite(b.value) else None
        row = {"label": b.label, "x0": None, "x1": None, "colour": colour(value, low, high), "value": value,
               "title": b.title, "note": b.note}
        if b.span is None or not all(math.isfinite(x) for x in b.span):
            row["note"] = b.note or "unparsed"
        else:
            s, e = b.span
            row["note"] = "; ".join(x for x in ("reversed span" if s > e else "", b.note) if x)
            row["x0"], row["x1"] = max(0.0, min(s, e)), min(axis_max, max(s, e))
        rows.append(row)
    return {"axis_max": axis_max, "ticks": nice_ticks(axis_max), "gt": list(gt_span), "low": low, "high": high,
            "scale": scale, "rows": rows}


_FRAME_W, _FRAME_H, _FRAME_GAP = 116, 68, 6  # viewBox units (the SVG is drawn at the page's width, ~1.3 px each)
_KIND_COLOUR = {"truth": _GT_COLOUR, "pred": "#e08a00", "around": "#777777"}


def frame_slots(centres: list[float], width: float, w: float = _FRAME_W, gap: float = _FRAME_GAP) -> list[float]:
    """Left edges of frames of width w, each as near its centre as it can be without overlapping another or leaving
    [0, width] (centres sorted): pushed right where they crowd, then back from the right edge."""
    left = []
    for c in centres:
        p = max(c - w / 2, 0.0, left[-1] + w + gap if left else 0.0)
        left.append(p)
    for i in range(len(left) - 1, -1, -1):
        limit = width - w if i == len(left) - 1 else left[i + 1] - w - gap
        left[i] = min(left[i], limit)
    return left


def _frames_band(frames: list, x, width: int, top: int) -> str:
    """The event frames above the rows: each at its time (a leader line to the axis position), time written under."""
    frames = sorted(frames, key=lambda f: f[1])
    slots = frame_slots([x(t) for _, t, _ in frames], width)
    parts = []
    for (src, t, kind), left in zip(frames, slots):
        c = _KIND_COLOUR.get(kind, "#777777")
        parts.append(
            f'<g class="frame" data-t="{t:.3f}" data-kind="{html.escape(kind)}">'
            f'<image href="{html.escape(src)}" x="{left:.1f}" y="{top}" width="{_FRAME_W}" height="{_FRAME_H}" '
            f'preserveAspectRatio="xMidYMid meet"><title>{kind} frame at {t:.1f} s</title></image>'
            f'<rect x="{left:.1f}" y="{top}" width="{_FRAME_W}" height="{_FRAME_H}" fill="none" stroke="{c}" '
            f'stroke-width="2.5"/>'
            f'<text x="{left + _FRAME_W / 2:.1f}" y="{top + _FRAME_H + 13}" text-anchor="middle" fill="#222" '
            f'font-size="12" font-weight="600">{t:.1f} s</text>'
            f'<line class="frame-leader" x1="{left + _FRAME_W / 2:.1f}" y1="{top + _FRAME_H + 16}" '
            f'x2="{x(t):.1f}" y2="{top + _FRAME_H + 30}" stroke="{c}" stroke-width="1.2"/></g>')
    return "".join(parts)


def timeline_svg(data: dict, uid: str = "t", width: int = 900, label_w: int = 70, row_h: int = 20,
                 frames: list | None = None) -> str:
    """The timeline as an <svg> element (scales to its container's width); `uid` keeps element ids unique when
    several timelines are on one page. frames: [(image URL, seconds, kind)] drawn above the rows at their times,
    kind "truth" (blue border), "pred" (orange: the chosen response's span) or "around" (grey)."""
    rows = data["rows"]
    plot_w = width - label_w - 20
    band = _FRAME_H + 32 if frames else 0
    top, axis_h, legend_h = 6 + band, 26, 26
    height = top + row_h * (len(rows) + 1) + axis_h + legend_h

    def x(t: float) -> float:
        return label_w + plot_w * t / data["axis_max"]

    out = [f'<svg class="mmpg-timeline" viewBox="0 0 {width} {height}" width="100%" '
           f'xmlns="http://www.w3.org/2000/svg" font-family="sans-serif" font-size="11" role="img" '
           f'aria-label="timeline of ground truth and predicted spans">']
    if frames:
        out.append(_frames_band(frames, x, width, 4))
    body_bottom = top + row_h * (len(rows) + 1)
    gs, ge = data["gt"]
    gx0 = gx1 = None
    if all(math.isfinite(v) for v in (gs, ge)):
        gx0, gx1 = x(max(0.0, min(gs, ge))), x(min(data["axis_max"], max(gs, ge)))
        out.append(f'<rect class="gt-band" x="{gx0:.1f}" y="{top}" width="{gx1 - gx0:.1f}" '
                   f'height="{body_bottom - top}" fill="{_GT_COLOUR}" fill-opacity="0.12"/>')
    out.append(_row(0, "truth", gx0, gx1, _GT_COLOUR, f"ground truth {gs:.2f}–{ge:.2f} s",
                    "" if gx0 is not None else "no ground truth", top, row_h, label_w, "gt-bar"))
    for i, r in enumerate(rows, start=1):
        x0 = None if r["x0"] is None else x(r["x0"])
        x1 = None if r["x1"] is None else x(r["x1"])
        out.append(_row(i, r["label"], x0, x1, r["colour"], r["title"], r["note"], top, row_h, label_w, "span-bar",
                        r["value"]))
    out.append(_axis(data, x, body_bottom, label_w, plot_w))
    out.append(_legend(data, height - legend_h + 4, label_w, f"mmpg-scale-{uid}"))
    out.append("</svg>")
    return "".join(out)


def _row(i, label, x0, x1, fill, title, note, top, row_h, label_w, cls, value=None) -> str:
    y = top + i * row_h
    parts = [f'<text x="{label_w - 6}" y="{y + row_h * 0.7:.1f}" text-anchor="end" fill="#444">'
             f"{html.escape(label)}</text>"]
    if x0 is not None and x1 is not None:
        w = max(2.0, x1 - x0)  # a zero-length span stays visible
        dash = ' stroke="#333" stroke-dasharray="3,2"' if note else ""
        parts.append(f'<rect class="{cls}" x="{x0:.1f}" y="{y + 3}" width="{w:.1f}" height="{row_h - 6}" rx="2" '
                     f'fill="{fill}"{dash}><title>{html.escape(title)}</title></rect>')
    after = x1 + 4 if x1 is not None else label_w + 4
    if value is not None and x0 is not None:  # the tIoU on the bar (after it when the bar is too narrow)
        inside = x1 - x0 >= 34
        vx = (x0 + x1) / 2 if inside else after
        parts.append(f'<text class="bar-value" x="{vx:.1f}" y="{y + row_h * 0.7:.1f}" fill="#111" '
                     f'text-anchor="{"middle" if inside else "start"}" font-weight="600">{value:.2f}</text>')
        after += 0 if inside else 32
    if note:
        nx = after
        parts.append(f'<text class="note" x="{nx:.1f}" y="{y + row_h * 0.7:.1f}" fill="#777" font-style="italic">'
                     f"{html.escape(note)}<title>{html.escape(title)}</title></text>")
    return "".join(parts)


def _axis(data, x, y, label_w, plot_w) -> str:
    parts = [f'<line x1="{label_w}" y1="{y}" x2="{label_w + plot_w}" y2="{y}" stroke="#888"/>']
    for t in data["ticks"]:
        parts.append(f'<line x1="{x(t):.1f}" y1="{y}" x2="{x(t):.1f}" y2="{y + 4}" stroke="#888"/>'
                     f'<text x="{x(t):.1f}" y="{y + 15}" text-anchor="middle" fill="#555">{t:g}</text>')
    parts.append(f'<text x="{label_w + plot_w}" y="{y + 15}" text-anchor="end" fill="#555" dx="18">s</text>')
    return "".join(parts)


def _legend(data, y, label_w, gradient_id) -> str:
    low, high = data["low"], data["high"]
    stops = "".join(f'<stop offset="{o}" stop-color="{colour(low + o * (high - low), low, high)}"/>'
                    for o in (0, 0.5, 1))
    return (f'<defs><linearGradient id="{gradient_id}">{stops}</linearGradient></defs>'
            f'<text x="{label_w - 6}" y="{y + 10}" text-anchor="end" fill="#444">{html.escape(data["scale"])}</text>'
            f'<text x="{label_w}" y="{y + 10}" fill="#444">{low:.3g}</text>'
            f'<rect x="{label_w + 24}" y="{y + 1}" width="160" height="11" fill="url(#{gradient_id})"/>'
            f'<text x="{label_w + 190}" y="{y + 10}" fill="#444">{high:.3g}</text>'
            f'<rect x="{label_w + 240}" y="{y + 1}" width="22" height="11" fill="{_GT_COLOUR}"/>'
            f'<text x="{label_w + 268}" y="{y + 10}" fill="#444">ground truth</text>'
            f'<rect x="{label_w + 360}" y="{y + 1}" width="22" height="11" fill="{_NONE_COLOUR}"/>'
            f'<text x="{label_w + 388}" y="{y + 10}" fill="#444">no span</text>')
