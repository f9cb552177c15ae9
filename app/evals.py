"""The evaluation view's data: predictions against ground truth, worst samples first, read through `EvalReader`.

    source = EvalSource(folder)                 # an evaluation folder (mmpg eval's output, or RUN_DIR/evals/...)
    headers, rows = prediction_rows(source.predictions())
"""

from __future__ import annotations

import html
import math
import os
import threading
from pathlib import Path

from mmpg_app.answers import answer_fate
from mmpg_app.render import fmt
from mmpg_app.run_source import stat_key
from mmpg.errors import UserError
from mmpg.runs import EvalReader, PredictionRecord, list_run_evals
from mmpg.runs.evals import PREDICTIONS_JSONL


class EvalSource:
    """One evaluation folder; predictions re-read only when predictions.jsonl changed."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.reader = EvalReader(self.folder)  # UserError if it is not an evaluation folder
        self._cache: tuple[tuple, list[PredictionRecord]] | None = None
        self._lock = threading.Lock()

    def predictions(self) -> list[PredictionRecord]:
        key = stat_key(self.folder / PREDICTIONS_JSONL)
        with self._lock:
            if self._cache is not None and self._cache[0] == key:
                return self._cache[1]
        try:
            records = self.reader.predictions()
        except (TypeError, ValueError) as e:  # UserError is a ValueError: a damaged line, a newer version
            raise UserError(f"{self.folder / PREDICTIONS_JSONL}: {e}") from None
        with self._lock:
            self._cache = (key, records)
        return records

    def plots(self) -> list[Path]:
        """The folder's PNG plots, each resolved inside the folder (a symlink leading out is left out)."""
        out = []
        for p in self.reader.plots():
            try:
                out.append(self.reader.resolve(p.relative_to(self.folder)))
            except (UserError, ValueError):
                continue
        return out


def worst_first(records: list[PredictionRecord]) -> list[PredictionRecord]:
    """Lowest IoU first; among equal IoU failed samples, then unparsed answers, then by index."""
    def key(r: PredictionRecord):
        iou = r.iou if r.iou is not None and math.isfinite(r.iou) else -1.0
        return (iou, 0 if r.error else 1 if r.pred_span is None else 2, r.index)

    return sorted(records, key=key)


def status(r: PredictionRecord) -> str:
    """failed: why; or what became of the answer: ok, unparsed, out of range: RAW, clamped from RAW."""
    if r.error:
        return f"failed: {r.error}"
    return answer_fate(r.text, r.pred_span, "stop", r.duration).text()


def prediction_rows(records: list[PredictionRecord], limit: int = 2000) -> tuple[list[str], list[list]]:
    """(headers, rows) of the sample table, worst first, at most `limit` rows."""
    headers = ["index", "sample", "query", "gt_start", "gt_end", "pred_start", "pred_end", "iou", "status"]
    rows = []
    for r in worst_first(records)[:limit]:
        ps, pe = r.pred_span if r.pred_span else (None, None)
        query = r.query if len(r.query) <= 70 else r.query[:67] + "..."
        rows.append([r.index, r.sample_id, query, _round(r.gt_span[0]), _round(r.gt_span[1]), _round(ps),
                     _round(pe), _round(r.iou, 3), status(r)])
    return headers, rows


def headline_keys(metrics: dict) -> list[str]:
    """R1@m by threshold, then mIoU: the figures papers report, in metrics.json."""
    def threshold(k: str) -> float:
        try:
            return float(k[3:])
        except ValueError:
            return math.inf
    r1 = sorted((k for k in metrics if k.lower().startswith("r1@")), key=threshold)
    return r1 + [k for k in metrics if k.lower() == "miou"]


def metrics_rows(metrics: dict | None) -> list[list]:
    """[[name, value]] of metrics.json (without the version), numbers rounded; R1@m and mIoU first."""
    if not metrics:
        return []
    keys = headline_keys(metrics)
    keys += [k for k in metrics if k not in keys and k != "v"]
    return [[k, _round(metrics[k], 4) if isinstance(metrics[k], (int, float)) and not isinstance(metrics[k], bool)
             else str(metrics[k])] for k in keys]


def headline_html(metrics: dict | None) -> str:
    """R1@0.3 / 0.5 / 0.7 and mIoU as large figures at the top of the tab."""
    keys = headline_keys(metrics or {})
    cards = "".join(f'<div class="mmpg-card" data-metric="{html.escape(k)}"><div class="mmpg-card-name">'
                    f'{html.escape(k.replace("r1@", "R1@").replace("miou", "mIoU"))}</div><div class="mmpg-card-now">'
                    f"{fmt(metrics[k], 3)}</div></div>" for k in keys if isinstance(metrics[k], (int, float)))
    return f'<div class="mmpg-cards">{cards}</div>' if cards else ""


def sample_header(r: PredictionRecord) -> str:
    ps = r.pred_span
    facts = [f"<b>ground truth</b> {fmt(r.gt_span[0], 2)} – {fmt(r.gt_span[1], 2)} s",
             "<b>prediction</b> " + (f"{fmt(ps[0], 2)} – {fmt(ps[1], 2)} s" if ps else "none"),
             f"<b>IoU</b> {fmt(r.iou)}", f"<b>duration</b> {fmt(r.duration, 2)} s", f"<b>index</b> {r.index}",
             f"<b>sample</b> {html.escape(r.sample_id)}"]
    out = [f'<div class="mmpg-query">{html.escape(r.query)}</div>',
           f'<div class="mmpg-facts">{" · ".join(facts)}</div>',
           f'<div class="mmpg-video">video: <code>{html.escape(r.video)}</code></div>']
    if r.error:
        out.append(f'<div class="mmpg-note">This sample could not be evaluated: {html.escape(r.error)}</div>')
    return "\n".join(out)


def run_evals(run_dir: str | os.PathLike) -> dict[str, Path]:
    """'benchmark · step N' -> folder, for every evaluation folder inside a run directory."""
    try:
        return {f"{bench} · step {step}": folder for bench, step, folder in list_run_evals(run_dir)}
    except OSError:
        return {}


def _round(x, digits: int = 2):
    if x is None:
        return None
    x = float(x)
    return round(x, digits) if math.isfinite(x) else None
