"""The Curves tab: every panel of app/curves.py with its unit and description, smoothing and log scale, the
panels hidden for having nothing or only zeros named in one note, and any logged metric on demand.

Curves are drawn when their tab is first opened (keeps the first page load light), then kept current by the run
view's refresh (which calls `curves` with the options kept in the page's state).
"""

from __future__ import annotations

import html

import gradio as gr

from mmpg_app.curves import EVAL_PANEL, PANELS, SMOOTHING, curve_frames, folded, long_frame, metric_keys
from mmpg_app.guard import guarded
from mmpg_app.render import message_html
from mmpg.errors import UserError


def smoothing_weight(smoothing) -> float:
    """The EMA weight of a Smoothing choice ('off' or a number in [0, 1))."""
    if smoothing in (None, "", SMOOTHING[0]):
        return 0.0
    try:
        w = float(smoothing)
    except (TypeError, ValueError):
        raise UserError(f"{smoothing!r} is not a smoothing weight; one of {', '.join(SMOOTHING)}") from None
    if not 0.0 <= w < 1.0:
        raise UserError(f"smoothing weight {w} is outside [0, 1)")
    return w


class CurvesView:
    """Components and handlers of the Curves tab; `seen` is the page's state (options and what was drawn)."""

    def __init__(self, source, status: gr.HTML, seen: gr.State):
        self.src, self.status, self.seen = source, status, seen

    def build(self) -> None:
        with gr.Tab("Curves", id="curves") as self.tab:
            with gr.Row(equal_height=True):
                self.smoothing = gr.Radio(list(SMOOTHING), value=SMOOTHING[0], label="Smoothing (EMA weight)",
                                          elem_id="smoothing", scale=2)
                self.log = gr.Checkbox(label="log scale (log10 of the values)", value=False, elem_id="log-scale",
                                       scale=1)
            self.curves_note = gr.HTML(elem_id="curves-note")
            self.plots, self.boxes = {}, {}
            panels = [*PANELS, EVAL_PANEL]
            for i in range(0, len(panels), 2):
                with gr.Row():
                    for p in panels[i:i + 2]:
                        with gr.Column() as self.boxes[p.id]:  # hidden when it has nothing to draw
                            gr.HTML(f'<div class="mmpg-caption"><b>{html.escape(p.title)}</b>: '
                                    f"{html.escape(p.what)}</div>", elem_id=f"caption-{p.id}")
                            self.plots[p.id] = gr.LinePlot(
                                x="step", y="value", color="series", title=p.title, height=260,
                                elem_id=f"curve-{p.id}", label=p.title, show_label=False, y_title=p.unit,
                                x_title="step", color_title="series")
            self.any_key = gr.Dropdown(label="Any logged metric", choices=[], elem_id="any-metric",
                                       allow_custom_value=True)  # choices change under it (see widgets.picker)
            self.any_plot = gr.LinePlot(x="step", y="value", color="series", height=260, elem_id="curve-any",
                                        show_label=False, visible=False)

    def outputs(self) -> list:
        return [*self.plots.values(), *self.boxes.values(), self.any_key, self.curves_note]

    def wire(self) -> None:
        s = self.status
        self.any_key.input(guarded(s)(self.on_any), [self.any_key, self.smoothing, self.log], [s, self.any_plot])
        for c in (self.smoothing, self.log):
            c.input(guarded(s)(self.on_options), [self.smoothing, self.log, self.seen], [s, *self.outputs(), self.seen])
        self.tab.select(guarded(s)(self.on_tab), [self.seen], [s, *self.outputs(), self.seen])

    def on_tab(self, seen) -> dict:
        """Curves are drawn when their tab is first opened (keeps the first page load light), then kept current."""
        seen = dict(seen or {})
        if self.src.problem():
            return {self.curves_note: message_html("nothing logged yet", "note")}
        seen["curves"], seen["metrics"] = True, self.src.metrics_key()
        return {**self.curves(seen.get("smoothing", 0.0), seen.get("log", False)), self.seen: seen}

    def on_any(self, key, smoothing=SMOOTHING[0], log=False) -> dict:
        frame = long_frame(self.src.metrics(), [key] if key else [], smoothing=smoothing_weight(smoothing),
                           log=bool(log))
        return {self.any_plot: gr.update(value=frame, visible=bool(key))}

    def on_options(self, smoothing, log, seen) -> dict:
        """Smoothing or log scale changed: redraw the curves with them (kept for later refreshes)."""
        seen = {**(seen or {}), "smoothing": smoothing_weight(smoothing), "log": bool(log)}
        if self.src.problem():
            return {self.seen: seen}
        return {**self.curves(seen["smoothing"], seen["log"]), self.seen: seen}

    def curves(self, smoothing: float = 0.0, log: bool = False) -> dict:
        """Every panel; those with nothing logged or only zeros hidden and named in the note."""
        metrics, evals = self.src.metrics(), self.src.eval_metrics()
        frames = curve_frames(metrics, evals, smoothing, log)
        empty, zero = folded(metrics, evals)
        hidden = set(empty) | {title for title, _ in zero}
        out = {}
        for p in [*PANELS, EVAL_PANEL]:
            out[self.plots[p.id]] = gr.update(value=frames[p.id], y_title=f"log10 {p.unit}" if log else p.unit)
            out[self.boxes[p.id]] = gr.update(visible=p.title not in hidden)
        out[self.any_key] = gr.update(choices=metric_keys(metrics))
        note = f"{len(metrics)} step(s) in metrics.jsonl, {len(evals)} evaluation(s) in eval.jsonl."
        if zero:
            note += " Always 0, not drawn: " + "; ".join(f"{t} ({', '.join(k)})" for t, k in zero) + "."
        if empty:
            note += " Not logged by this run: " + "; ".join(empty) + "."
        out[self.curves_note] = message_html(note, "info")
        return out

