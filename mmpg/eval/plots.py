"""PNG plots of an evaluation (matplotlib, Agg backend), each written atomically (rendered to memory, then a temp
file renamed into place).

    recall_vs_threshold.png   R1@m for m in 0..1 under both conventions, the reported thresholds marked
    iou_histogram.png         tIoU of every scored sample (unparseable and failed ones sit at 0, counted in the title)
    start_end.png             predicted against true start and end seconds (parsed answers only)
    over_steps.png            R1@0.3/0.5/0.7 and mIoU against the training step (a run's evaluations)
"""

from __future__ import annotations

import io
import math
from pathlib import Path

from mmpg.eval.metrics import THRESHOLDS, recall, recall_curve
from mmpg.eval.markdown import RULES, SUFFIX
from mmpg.runs.files import atomic_write_bytes


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)  # no display; never opens a window
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    plt = _pyplot()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue())


def recall_plot(path: Path, ious: list[float], first: str = "gt", title: str = "") -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for rule in [first] + [r for r in RULES if r != first]:
        xs, ys = recall_curve(ious, rule)
        ax.plot(xs, [100 * y for y in ys], label=RULES[rule][0], linestyle="-" if rule == first else "--")
    for m in THRESHOLDS:
        ax.axvline(m, color="0.8", linewidth=0.8, zorder=0)
        value = recall(ious, m, first)
        if not math.isnan(value):  # the reported figure, under the protocol's convention
            ax.plot([m], [100 * value], "o", color="black", markersize=4)
            ax.annotate(f"{100 * value:.1f}", (m, 100 * value), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
    ax.set(xlabel="IoU threshold m", ylabel="R1@m (%)", xlim=(0, 1), ylim=(0, 100),
           title=title or f"Recall against the IoU threshold ({len(ious)} samples)")
    ax.legend(loc="upper right", fontsize=8)
    return _save(fig, path)


def iou_histogram(path: Path, ious: list[float], zero_answers: int, title: str = "") -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    ax.hist(ious, bins=20, range=(0, 1), color="tab:blue", edgecolor="white")
    ax.set(xlabel="tIoU", ylabel="samples", xlim=(0, 1),
           title=title or f"IoU of {len(ious)} samples ({zero_answers} unparseable or failed at 0)")
    return _save(fig, path)


def start_end_plot(path: Path, pairs: list[tuple[tuple[float, float], tuple[float, float]]]) -> Path:
    """pairs: (predicted span, true span) of the parsed answers."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 5))
    if pairs:
        ax.scatter([t[0] for _, t in pairs], [p[0] for p, _ in pairs], s=12, label="start", alpha=0.7)
        ax.scatter([t[1] for _, t in pairs], [p[1] for p, _ in pairs], s=12, label="end", alpha=0.7, marker="x")
        hi = max(max(p[1], t[1]) for p, t in pairs) * 1.05 or 1.0
        ax.plot([0, hi], [0, hi], color="0.6", linewidth=0.8, zorder=0)
        ax.set(xlim=(0, hi), ylim=(0, hi))
        ax.legend(loc="upper left", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no parsed answers", ha="center", va="center", transform=ax.transAxes)
    ax.set(xlabel="true (s)", ylabel="predicted (s)", title=f"Predicted against true times ({len(pairs)} answers)")
    return _save(fig, path)


def over_steps_plot(path: Path, rows: list[tuple[int, dict]], first: str = "gt", title: str = "") -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    steps = [s for s, _ in rows]
    for key, label in [(f"r1@{m}{SUFFIX[first]}", f"R1@{m}") for m in THRESHOLDS] + [("miou", "mIoU")]:
        ys = [100 * m[key] if m.get(key) is not None and not math.isnan(m[key]) else math.nan for _, m in rows]
        ax.plot(steps, ys, marker="o", label=label, linestyle="--" if key == "miou" else "-")
    ax.set(xlabel="training step", ylabel="%", ylim=(0, 100),
           title=title or f"Metrics over training steps (R1: {RULES[first][0]})")
    ax.legend(fontsize=8)
    return _save(fig, path)
