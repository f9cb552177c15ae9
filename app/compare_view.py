"""The compare page: two or more runs side by side. A table of each run's headline figures (smoothed reward, tIoU,
loss, latest held-out evaluation), then each headline metric as one chart with a line per run, smoothing, and any
logged metric overlaid on demand. It serves no file: everything drawn is computed from the runs' metrics.
"""

from __future__ import annotations

import gradio as gr
import pandas as pd

from mmpg_app.compare import COMPARE_PANELS, compare_rows, overlay
from mmpg_app.curves import SMOOTHING, metric_keys
from mmpg_app.curves_view import smoothing_weight
from mmpg_app.guard import guarded
from mmpg_app.render import message_html
from mmpg_app.run_source import RunSource


class CompareView:
    """Components and handlers of the compare page for `runs` ({name: RunSource}, from mmpg_app.compare.find_runs)."""

    def __init__(self, runs: dict[str, RunSource], status: gr.HTML):
        self.runs, self.status = runs, status

    def build(self) -> None:
        self.table = gr.Dataframe(label="Runs (reward, tIoU, loss: mean of the last 20 logged steps; eval: the "
                                  "latest held-out evaluation)", interactive=False, elem_id="compare-table")
        with gr.Row(equal_height=True):
            self.smoothing = gr.Radio(list(SMOOTHING), value=SMOOTHING[0], label="Smoothing (EMA weight)",
                                      elem_id="compare-smoothing", scale=2)
            self.any_key = gr.Dropdown(label="Overlay any logged metric", choices=[], elem_id="compare-any",
                                       allow_custom_value=True, scale=2)
        self.note = gr.HTML(elem_id="compare-note")
        self.plots = {}
        for i in range(0, len(COMPARE_PANELS), 2):
            with gr.Row():
                for key, title, unit in COMPARE_PANELS[i:i + 2]:
                    self.plots[key] = gr.LinePlot(x="step", y="value", color="series", title=title, height=260,
                                                  elem_id=f"compare-{key.replace('/', '-').replace('@', '')}",
                                                  show_label=False, y_title=unit, x_title="step",
                                                  color_title="run")
        self.any_plot = gr.LinePlot(x="step", y="value", color="series", height=260, elem_id="compare-any-plot",
                                    show_label=False, visible=False, color_title="run")

    def outputs(self) -> list:
        return [self.status, self.table, self.any_key, self.note, *self.plots.values()]

    def wire(self, page: gr.Blocks, refresh: gr.Button) -> None:
        s = self.status
        page.load(guarded(s)(self.on_load), [self.smoothing], self.outputs())
        refresh.click(guarded(s)(self.on_load), [self.smoothing], self.outputs())
        self.smoothing.input(guarded(s)(self.on_load), [self.smoothing], self.outputs())
        self.any_key.input(guarded(s)(self.on_any), [self.any_key, self.smoothing], [s, self.any_plot])

    def on_load(self, smoothing=SMOOTHING[0]) -> dict:
        w = smoothing_weight(smoothing)
        headers, rows = compare_rows(self.runs)
        out = {self.table: pd.DataFrame(rows, columns=headers)}
        missing = []
        for key, title, _unit in COMPARE_PANELS:
            frame = overlay(self.runs, key, w)
            out[self.plots[key]] = gr.update(value=frame, visible=not frame.empty)
            if frame.empty:
                missing.append(title)
        keys = sorted({k for src in self.runs.values() for k in metric_keys(src.metrics())})
        out[self.any_key] = gr.update(choices=keys)
        note = f"{len(self.runs)} run(s): " + ", ".join(f"{n} ({src.run_dir})" for n, src in self.runs.items())
        if missing:
            note += ". Logged by none of them: " + "; ".join(missing)
        out[self.note] = message_html(note + ".", "info")
        return out

    def on_any(self, key, smoothing=SMOOTHING[0]) -> dict:
        frame = overlay(self.runs, key, smoothing_weight(smoothing)) if key else None
        return {self.any_plot: gr.update(value=frame, visible=bool(key))}
