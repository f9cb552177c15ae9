"""The learning demo's report: the evaluations beside the trivial baselines, the GRPO reward curve, where to look.

Written to RESULTS/summary.md (what the terminal shows), RESULTS/summary.json (the numbers, for tests and for
comparing seeds) and RESULTS/reward.png (reward and tIoU per GRPO step), each atomically.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from pathlib import Path

from mmpg.eval.baselines import trivial_baselines
from mmpg.runs import RunReader, atomic_write_json, atomic_write_text

COLUMNS = (("mIoU", "miou"), ("R1@0.3", "r1@0.3"), ("R1@0.5", "r1@0.5"), ("R1@0.7", "r1@0.7"),
           ("no answer", "unparseable"))
SPARKS = "▁▂▃▄▅▆▇█"


class Clock:
    """Seconds per stage name (a stage may be timed several times; the times add up)."""

    def __init__(self):
        self.start, self.seconds = time.perf_counter(), {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def total(self) -> float:
        return time.perf_counter() - self.start


def baselines(train, test) -> dict[str, tuple[str, dict]]:
    names = {"whole video": "whole_video", "mean train span": "mean_train_span"}
    return {names[name]: (f"baseline: {name}", m) for name, m in trivial_baselines(train, test).items()}


class Rows:
    """The table's rows in order: key -> (label, metrics); `folders` maps a model row to its evaluation folder."""

    def __init__(self, first: dict[str, tuple[str, dict]]):
        self.rows, self.folders = dict(first), {}

    def add(self, key: str, label: str, result) -> None:
        self.rows[key], self.folders[key] = (label, result.metrics), Path(result.folder)

    def line(self, key: str) -> str:
        m = self.rows[key][1]
        return ", ".join(f"{label} {_pct(m.get(k))}" for label, k in COLUMNS)

    def table(self) -> list[str]:
        width = max(len(label) for label, _ in self.rows.values())
        head = f"| {'':<{width}} | " + " | ".join(f"{label:>9}" for label, _ in COLUMNS) + " |"
        rule = f"|{'-' * (width + 2)}|" + "|".join("-" * 10 + ":" for _ in COLUMNS) + "|"
        body = [f"| {label:<{width}} | " + " | ".join(f"{_pct(m.get(k)):>9}" for _, k in COLUMNS) + " |"
                for label, m in self.rows.values()]
        return [head, rule, *body]

    def to_json(self) -> dict:
        return {key: dict(m, label=label) for key, (label, m) in self.rows.items()}


def _pct(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}"


def reward_curve(metrics: list[dict], blocks: int = 10) -> list[tuple[int, int, float, float]]:
    """The GRPO run's steps cut into at most `blocks` equal runs of steps: (first step, last step, mean reward,
    mean tIoU) for each."""
    rows = [m for m in metrics if "reward/mean" in m]
    if not rows:
        return []
    size = max(1, math.ceil(len(rows) / blocks))
    out = []
    for i in range(0, len(rows), size):
        part = rows[i:i + size]
        out.append((part[0]["step"], part[-1]["step"], sum(m["reward/mean"] for m in part) / len(part),
                    sum(m.get("reward/iou", 0.0) for m in part) / len(part)))
    return out


def sparkline(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:
        return SPARKS[0] * len(values)
    return "".join(SPARKS[min(len(SPARKS) - 1, int((v - lo) / (hi - lo) * len(SPARKS)))] for v in values)


def reward_trend(metrics: list[dict]) -> dict[str, float]:
    """Mean training reward over the first and the last third of the GRPO steps."""
    rewards = [m["reward/mean"] for m in metrics if "reward/mean" in m]
    third = max(1, len(rewards) // 3)
    return {"first_third": sum(rewards[:third]) / third, "last_third": sum(rewards[-third:]) / third,
            "steps": float(len(rewards))}


def reward_plot(path: Path, metrics: list[dict]) -> Path | None:
    """reward/mean and reward/iou per GRPO step with a moving average; None when the run logged no reward."""
    from mmpg.eval.plots import _pyplot, _save

    plt = _pyplot()
    rows = [m for m in metrics if "reward/mean" in m]
    if not rows:
        return None
    steps = [m["step"] for m in rows]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for key, label in (("reward/mean", "reward (format + tIoU·distance)"), ("reward/iou", "tIoU of the samples")):
        values = [m.get(key, float("nan")) for m in rows]
        k = max(1, len(values) // 10)
        smooth = [sum(values[max(0, i - k + 1):i + 1]) / len(values[max(0, i - k + 1):i + 1])
                  for i in range(len(values))]
        line, = ax.plot(steps, values, alpha=0.3)
        ax.plot(steps, smooth, color=line.get_color(), label=f"{label}, mean of {k}")
    ax.set_xlabel("GRPO step")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    ax.set_title("mmpg demo: training reward")
    return _save(fig, path)


@dataclasses.dataclass
class DemoReport:
    """The demo's results: written by `write` to summary.md, summary.json and reward.png, printed as `text`."""

    preset: object
    seed: int
    paths: object
    rows: Rows
    clock: Clock
    sft_run: Path
    grpo_run: Path
    exactness: float

    def __post_init__(self):
        self.metrics = RunReader(self.grpo_run).metrics()
        self.curve = reward_curve(self.metrics)
        self.trend = reward_trend(self.metrics)
        self.png = None

    def write(self) -> None:
        results = Path(self.paths.results)
        results.mkdir(parents=True, exist_ok=True)
        self.png = reward_plot(results / "reward.png", self.metrics)
        atomic_write_text(results / "summary.md", self.text() + "\n")
        atomic_write_json(results / "summary.json", {
            "v": 1, "preset": dataclasses.asdict(self.preset), "seed": self.seed, "rows": self.rows.to_json(),
            "eval_folders": {k: str(v) for k, v in self.rows.folders.items()}, "reward_trend": self.trend,
            "reward_curve": self.curve, "seconds": dict(self.clock.seconds, total=self.clock.total()),
            "sft_run": str(self.sft_run), "grpo_run": str(self.grpo_run), "exactness_max_abs_diff": self.exactness})

    def text(self) -> str:
        p, results = self.preset, Path(self.paths.results)
        lines = ["", f"mmpg demo results ({p.name}, seed {self.seed}): greedy answers on the "
                 f"{int(next(iter(self.rows.rows.values()))[1]['count'])} held-out test videos; % of queries, "
                 "R1@m counts tIoU > m", "", *self.rows.table(), ""]
        if self.curve:
            values = [r[2] for r in self.curve]
            lines.append(f"GRPO training reward, mean per {self.curve[0][1] - self.curve[0][0] + 1} steps: "
                         f"{sparkline(values)}  " + " ".join(f"{v:.3f}" for v in values))
            lines.append(f"  first third of the steps {self.trend['first_third']:.3f} -> last third "
                         f"{self.trend['last_third']:.3f}" + (f"; plot: {self.png}" if self.png else ""))
        secs = self.clock.seconds
        lines += ["", "time: " + ", ".join(f"{k} {v:.0f} s" for k, v in secs.items())
                  + f"; total {self.clock.total() / 60:.1f} min", "", "look next:",
                  f"  mmpg inspect {self.grpo_run}      # the GRPO run: sampled groups, rewards, curves, its eval",
                  f"  mmpg inspect {self.sft_run}"]
        for key, folder in self.rows.folders.items():
            lines.append(f"  {folder / 'report.md'}   ({self.rows.rows[key][0]})")
        lines.append(f"  {results / 'summary.md'}")
        return "\n".join(lines)
