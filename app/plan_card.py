"""The run summary's memory card: the run's own plan (`mmpg plan`'s memory model on the run's config.yaml, device
and device count) beside its measured `perf/peak_memory_mb`, and what that figure is on the run's device
(`mmpg.plan.run.measure_of`: on a GPU the tensors; on a CPU the memory above the process's baseline before the
model, held against the plan's stated CPU error). A CPU run that logged the whole process's ru_maxrss (as mmpg once
did) is shown with no ratio, as not comparable.

The plan depends only on config.yaml and run.json, so it is made once per version of those two files (their size
and modification time); a refresh re-reads only the measured figure. Planning imports no model code, and `prefetch`
starts it in a thread when the page is built, so the page's first open does not wait for it. A run whose config
cannot be planned (a model path that no longer exists and is no preset, a config of an older mmpg) gets one line
saying why.

    html = plan_card_html(run_dir, info, metrics)
"""

from __future__ import annotations

import html
import threading
from pathlib import Path

from mmpg.plan.run import inspect_plan, measured_peak, verdict
from mmpg.runs import RunReader
from mmpg.runs.layout import CONFIG_YAML, RUN_JSON

TOP_PARTS = 3  # the largest parts named on the card; every part in its tooltip
_CACHE: dict[tuple, dict | str] = {}
_LOCK = threading.Lock()  # one planning at a time: the page's first open waits for a prefetch in flight


def _mb(x: float) -> str:
    return f"{x / 1024:.2f} GB" if x >= 1024 else f"{x:.0f} MB"


def _plan_key(run_dir: Path) -> tuple:
    """What the plan is made from: the run directory and the size and modification time of config.yaml, run.json."""
    out = [str(run_dir.resolve())]
    for name in (CONFIG_YAML, RUN_JSON):
        try:
            st = (run_dir / name).stat()
            out += [st.st_size, st.st_mtime_ns]
        except OSError:
            out += [None, None]
    return tuple(out)


def run_plan_cached(run_dir: Path, info: dict, metrics: list[dict]) -> dict | str:
    """inspect_plan's dict, or the one line why the run cannot be planned; once per version of config.yaml and
    run.json (an SFT plan also reads the target length from the metrics of its first planning)."""
    key = _plan_key(run_dir)
    with _LOCK:
        if key not in _CACHE:
            try:
                _CACHE[key] = inspect_plan(str(run_dir), info, metrics)
            except Exception as e:  # noqa: BLE001 - any config problem is one line on the card, never an error page
                _CACHE[key] = str(e).splitlines()[0] if str(e) else type(e).__name__
        return _CACHE[key]


def prefetch(run_dir: Path) -> None:
    """Plan the run in a background thread (its own reader: the page's RunSource is not shared across threads)."""
    def work() -> None:
        try:
            reader = RunReader(run_dir)
            run_plan_cached(Path(run_dir), reader.info(), reader.metrics())
        except Exception:  # noqa: BLE001 - a run not written yet or damaged: the page's own read reports it
            pass

    threading.Thread(target=work, name="mmpg-plan-prefetch", daemon=True).start()


def plan_card_html(run_dir: Path, info: dict, metrics: list[dict]) -> str:
    """The card: planned per-device peak with its largest parts, the measured peak, their ratio and its meaning."""
    p = run_plan_cached(Path(run_dir), info, metrics)
    head = '<div class="mmpg-card mmpg-plan" data-metric="memory"><div class="mmpg-card-name">memory per device</div>'
    if isinstance(p, str):
        return head + f'<div class="mmpg-sub mmpg-plan-why">no plan: {html.escape(p)}</div></div>'
    planned = p["peak_bytes"] / 2 ** 20
    measured, steps = measured_peak(metrics, p["measured_since"])  # the newest lines, not the plan's cached copy
    where = f"{p['devices']} × {'CPU' if p['device'] == 'cpu' else 'GPU'}"
    parts = ", ".join(f"{k} {_mb(v / 2 ** 20)}" for k, v in list(p["parts"].items())[:TOP_PARTS])
    every = "; ".join(f"{k} {_mb(v / 2 ** 20)}" for k, v in p["parts"].items())
    rows = [f'<tr><td>planned</td><td><b class="mmpg-planned">{_mb(planned)}</b></td>'
            f'<td class="mmpg-sub" title="{html.escape(every)}">{html.escape(parts)} ({p["peak_phase"]})</td></tr>']
    if measured is None:
        rows.append('<tr><td>measured</td><td>—</td><td class="mmpg-sub">no perf/peak_memory_mb logged yet'
                    '</td></tr>')
    else:
        ratio = (verdict(measured, planned, p["device"], p["error_band"]) if p["comparable"]
                 else "not comparable with the plan")
        rows.append(f'<tr><td>measured</td><td><b class="mmpg-measured">{_mb(measured)}</b></td>'
                    f'<td class="mmpg-sub">{html.escape(ratio)}; largest of {steps} step(s)</td></tr>')
    notes = [f"measured is {p['measured_means']}"] + ([p["note"]] if p["note"] else [])
    if p["kind"] == "sft":
        notes.append("SFT planned as an update of one target per prompt (an estimate)")
    return (head + f'<div class="mmpg-sub">mmpg plan on {where}</div><table class="mmpg-evals">{"".join(rows)}'
            f'</table><div class="mmpg-sub mmpg-plan-note">{html.escape("; ".join(notes))}</div></div>')
