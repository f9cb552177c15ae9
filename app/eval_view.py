"""The Evaluation tab: an evaluation folder's metrics, its samples worst first, and one sample at a time with its
frames, timeline (ground truth against the prediction, coloured by IoU) and answer text.

Opened on an evaluation folder, the tab shows that folder; opened on a run directory, it lists the run's
evaluation folders (RUN_DIR/evals/<benchmark>/step_*). The picker's values are labels looked up in that list,
never paths taken from the browser.
"""

from __future__ import annotations

import html
import urllib.parse
from pathlib import Path

import gradio as gr
import pandas as pd

from mmpg_app.evals import EvalSource, headline_html, metrics_rows, prediction_rows, sample_header, worst_first
from mmpg_app.frames import decoded_items, event_frames, frame_src, strip_html
from mmpg_app.guard import guarded
from mmpg_app.render import fmt, message_html, text_parts_html, turns_html
from mmpg_app.timeline import Bar, timeline_data, timeline_svg
from mmpg_app.widgets import SORT_HINT, as_int, picker
from mmpg.errors import UserError


def plots_html(paths: list[Path]) -> str:
    """The folder's plots as <img> tags (paths already resolved inside the evaluation folder)."""
    if not paths:
        return ""
    return '<div class="mmpg-plots">' + "".join(
        f'<img src="gradio_api/file={urllib.parse.quote(str(p))}" alt="{html.escape(p.stem)}" '
        f'title="{html.escape(p.name)}">' for p in paths) + "</div>"


class EvalView:
    """`folders()` returns {label: folder}: the one folder the app was opened on, or a run's evaluation folders."""

    def __init__(self, folders, status: gr.HTML):
        self.folders, self.status = folders, status
        self._sources: dict[Path, EvalSource] = {}

    def build(self) -> None:
        with gr.Tab("Evaluation", id="evals") as self.tab:
            self.pick = picker("Evaluation folder", "eval-pick")
            self.headline = gr.HTML(elem_id="eval-headline")
            self.info = gr.HTML(elem_id="eval-info")
            with gr.Column(visible=False) as self.body:
                with gr.Row():
                    self.metrics = gr.Dataframe(headers=["metric", "value"], label="metrics.json", interactive=False,
                                                elem_id="eval-metrics", max_height=300, scale=1)
                    self.plots = gr.HTML(elem_id="eval-plots")
                self.table = gr.Dataframe(label=SORT_HINT.format(what="Samples, worst first: click a row to see it"),
                                          interactive=False,
                                          elem_id="eval-samples", max_height=360)
                self.sample = picker("Sample", "eval-sample")
                self.header = gr.HTML(elem_id="eval-header")
                self.gallery = gr.HTML(elem_id="eval-frames")
                self.frames_note = gr.HTML(elem_id="eval-frames-note")
                self.timeline = gr.HTML(elem_id="eval-timeline")
                self.text = gr.HTML(elem_id="eval-text")
        self.sample_view = [self.header, self.gallery, self.frames_note, self.timeline, self.text]

    def outputs(self) -> list:
        return [self.status, self.pick, self.headline, self.info, self.body, self.metrics, self.plots, self.table,
                self.sample,
                *self.sample_view]

    def wire(self, lazy: bool) -> None:
        """lazy: fill the tab when it is first opened (a run directory's page), not at page load."""
        s = self.status
        if lazy:
            self.tab.select(guarded(s)(self.on_open), [self.pick], self.outputs())
        self.pick.input(guarded(s)(self.on_pick), [self.pick], self.outputs())
        self.table.select(guarded(s)(self.on_select), [self.pick], [s, self.sample, *self.sample_view], queue=False)
        self.sample.input(guarded(s)(self.on_sample), [self.pick, self.sample], [s, *self.sample_view], queue=False)

    # ----------------------------------------------------------------------------------------------- handlers
    def on_open(self, current) -> dict:
        """The tab was opened: list the evaluation folders, unless one is already on show."""
        return {} if current and current in self.folders() else self.on_load()

    def on_refresh(self, current) -> dict:
        """The Refresh button: re-list the folders; reload the one on show (its predictions may have grown)."""
        labels = list(self.folders())
        if current is None:
            return {self.pick: gr.update(choices=labels)}
        return {**self.on_pick(current), self.pick: gr.update(choices=labels)} if current in labels else self.on_load()

    def on_load(self) -> dict:
        labels = list(self.folders())
        if not labels:
            return {self.pick: gr.update(choices=[], value=None), self.body: gr.update(visible=False),
                    self.headline: "",
                    self.info: message_html("No evaluation folders in this run yet (RUN_DIR/evals/<benchmark>/"
                                            "step_*; mmpg eval writes them).", "info")}
        out = self.on_pick(labels[-1])
        out[self.pick] = gr.update(choices=labels, value=labels[-1])
        return out

    def on_pick(self, label) -> dict:
        src = self.source(label)
        records = src.predictions()
        headers, rows = prediction_rows(records)
        info = src.reader.info()
        facts = [f"<b>{k}</b> {html.escape(str(info[k]))}" for k in ("checkpoint", "protocol", "step", "created")
                 if info.get(k) is not None]
        facts.append(f"<b>predictions</b> {len(records)}")
        metrics = src.reader.metrics()
        plots = src.plots()
        out = {
            self.headline: headline_html(metrics),
            self.info: f'<div class="mmpg-facts">{" · ".join(facts)}</div>'
                       + ("" if metrics else message_html("metrics.json not written yet: the evaluation has not "
                                                          "finished", "note")),
            self.metrics: pd.DataFrame(metrics_rows(metrics), columns=["metric", "value"]),
            self.plots: plots_html(plots),
            self.table: pd.DataFrame(rows, columns=headers),
            self.body: gr.update(visible=True),
        }
        worst = worst_first(records)
        choices = [(f"#{r.index} · IoU {fmt(r.iou)} · {r.query[:50]}", r.index) for r in worst[:2000]]
        out[self.sample] = gr.update(choices=choices, value=choices[0][1] if choices else None)
        out.update(self.sample_out(src, worst[0].index) if worst else
                   {self.header: message_html("no predictions written yet", "note")})
        return out

    def on_select(self, label, evt: gr.SelectData) -> dict:
        row = evt.row_value or []
        if not row:
            raise UserError("select a row of the sample table")
        index = int(row[0])
        return {self.sample: index, **self.sample_out(self.source(label), index)}

    def on_sample(self, label, index) -> dict:
        index = as_int(index, "a sample index")
        if index is None:
            raise UserError("pick a sample")
        return self.sample_out(self.source(label), index)

    # ----------------------------------------------------------------------------------------------- pieces
    def source(self, label) -> EvalSource:
        folders = self.folders()
        if label not in folders:
            raise UserError(f"{label!r} is not one of this run's evaluation folders")
        folder = folders[label]
        if folder not in self._sources:
            self._sources[folder] = EvalSource(folder)
        return self._sources[folder]

    @staticmethod
    def event(record) -> list:
        """The frames inside and around the truth and the prediction, decoded when the video is there."""
        if record.error:
            return []
        frames, _ = event_frames(None, None, record.video, record.gt_span, record.pred_span, record.duration)
        return [(frame_src(x), t, kind) for x, t, kind in frames]

    def sample_out(self, src: EvalSource, index: int) -> dict:
        record = next((r for r in src.predictions() if r.index == index), None)
        if record is None:
            raise UserError(f"no prediction with index {index} in {src.folder}")
        items, note = decoded_items(record.video) if not record.error else ([], "")
        bar = Bar("pred", record.pred_span, record.iou,
                  ("prediction " + (f"{record.pred_span[0]:.2f}–{record.pred_span[1]:.2f} s"
                                    if record.pred_span else "unparsed") + f", IoU {fmt(record.iou)}"))
        return {
            self.header: sample_header(record),
            self.gallery: strip_html(items),
            self.frames_note: message_html(note, "info" if items else "note"),
            self.timeline: timeline_svg(timeline_data(record.gt_span, record.duration, [bar] + zoom_rows(record),
                                                      scale="IoU"), uid="eval", frames=self.event(record)),
            self.text: (turns_html(record.turns) if record.turns else text_parts_html(record.text) if record.text
                        else message_html("no answer text", "info")),
        }


def zoom_rows(record) -> list[Bar]:
    """The zoom protocol's windows of one prediction (template=zoom) as grey timeline rows, in turn order."""
    windows = [t["zoom"] for t in (record.turns or []) if "zoom" in t]
    return [Bar(f"z{k}", [a, b], None, f"zoom {k} on {a:.2f}–{b:.2f} s", "zoom") for k, (a, b) in enumerate(windows, 1)]
