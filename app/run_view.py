"""The run tabs of the inspector: Rollouts (step and group pickers, filters, frames, timeline, response table and
text) and Curves (training metrics over steps, app/curves_view.py), and the run summary above them (with the
run's memory plan beside its measured peak, app/plan_card.py). Every handler returns {component: value} and goes
through `guarded`, so a problem shows as a message, never as an error page.

New steps appear while a run writes: a timer (and the Refresh button) re-lists the steps and re-reads the metrics,
re-rendering only what changed; "follow the newest step" jumps to each new step as it lands.
"""

from __future__ import annotations

import datetime

import gradio as gr
import pandas as pd

from mmpg_app.answers import response_fate, span_iou
from mmpg_app.curves_view import CurvesView
from mmpg_app.frames import event_frames, event_strip, frame_items, frame_src, strip_html
from mmpg_app.groups import (
    FILTERS, REWARD_HELP, SCOPES, count_matches, filter_groups, group_header, parse_group_key, response_rows,
)
from mmpg_app.guard import guarded
from mmpg_app.plan_card import plan_card_html, prefetch
from mmpg_app.render import fmt, message_html, response_html
from mmpg_app.run_source import RunSource
from mmpg_app.staleness import asynchronous, configured_staleness, group_staleness_html, rollouts_card_html
from mmpg_app.summary import drift_note, run_eval_points, summary_html
from mmpg_app.timeline import Bar, timeline_data, timeline_svg
from mmpg_app.widgets import SORT_HINT, as_int, empty_table, highlighted, picker
from mmpg.errors import UserError


class RunView:
    """Components and handlers of the run tabs. `build` goes inside the page's `gr.Tabs`, `wire` after it."""

    def __init__(self, source: RunSource, status: gr.HTML, title: gr.Markdown, seen: gr.State):
        self.src, self.status, self.title, self.seen = source, status, title, seen
        self.tabs: gr.Tabs | None = None  # the page's tabs, when the page lets the view switch them

    # ------------------------------------------------------------------------------------------------- layout
    def build_summary(self) -> None:
        """The run summary (goes above the tabs); its memory plan starts in the background."""
        self.summary = gr.HTML(elem_id="summary")
        prefetch(self.src.run_dir)

    def build(self) -> None:
        with gr.Tab("Rollouts", id="rollouts"):
            with gr.Row(equal_height=True):
                self.step = picker("Step (type to search)", "step", scale=1)
                with gr.Column(scale=0, min_width=90):
                    self.prev = gr.Button("◀ previous", elem_id="step-prev", size="sm")
                    self.next = gr.Button("next ▶", elem_id="step-next", size="sm")
                self.filter = gr.Dropdown(list(FILTERS), value=FILTERS[0], label="Filter", elem_id="filter", scale=2)
                self.scope = gr.Radio(list(SCOPES), value=SCOPES[0], label="Filter over", elem_id="scope", scale=1)
                self.group = picker("Group", "group", scale=3)
            self.picked = gr.HTML(elem_id="picked")
            self.header = gr.HTML(elem_id="group-header")
            self.timeline = gr.HTML(elem_id="timeline")
            with gr.Row(equal_height=True):
                self.frames_note = gr.HTML(elem_id="frames-note")
                self.more = gr.Button("More frames of the event", elem_id="more-frames", size="sm", scale=0,
                                      min_width=200)
            self.event_strip = gr.HTML(elem_id="event-strip")
            gr.HTML(f'<div class="mmpg-info">{REWARD_HELP}</div>', elem_id="reward-help")
            self.table = gr.Dataframe(value=empty_table(),
                                      label=SORT_HINT.format(what="Responses: click a row to read it"),
                                      interactive=False, elem_id="responses", max_height=420)
            self.response = picker("Response", "response")
            self.text = gr.HTML(elem_id="response-text")
            gr.HTML('<div class="mmpg-info">The whole video, evenly spaced (hover a frame to enlarge it):</div>')
            self.gallery = gr.HTML(elem_id="frames")
        self.cv = CurvesView(self.src, self.status, self.seen)
        self.cv.build()
        self.plots = self.cv.plots
        self.view = [self.header, self.gallery, self.frames_note, self.timeline, self.event_strip, self.table,
                     self.response, self.text]

    def outputs(self) -> list:
        """Everything `on_refresh` may update (the page's load event uses the same list)."""
        return [self.status, self.title, self.summary, self.step, self.group, self.picked, *self.view,
                *self.cv.outputs(), *([self.tabs] if self.tabs is not None else []), self.seen]

    def inputs(self) -> list:
        return [self.step, self.filter, self.scope, self.group, self.seen]

    def wire(self, refresh: gr.Button, follow: gr.Checkbox, timer: gr.Timer) -> None:
        s = self.status
        picks = [self.step, self.filter, self.scope]
        for c in picks:  # progress shows on the group list (reading every step file for "all steps" takes seconds)
            c.input(guarded(s)(self.on_pick), picks, [s, self.step, self.group, self.picked, *self.view],
                    show_progress="full", show_progress_on=[self.picked])
        pick_out = [s, self.group, self.picked, *self.view]
        self.prev.click(guarded(s)(self.on_prev), picks, [self.step, *pick_out], show_progress="hidden")
        self.next.click(guarded(s)(self.on_next), picks, [self.step, *pick_out], show_progress="hidden")
        # quick reads straight from the cache: no queue round trip (queue=False)
        self.group.input(guarded(s)(self.on_group), [self.group], [s, self.step, *self.view], queue=False)
        self.table.select(guarded(s)(self.on_select), [self.group], [s, self.response, self.text, self.timeline],
                          queue=False)
        self.more.click(guarded(s)(self.on_more), [self.group], [s, self.event_strip])
        self.response.input(guarded(s)(self.on_response), [self.group, self.response], [s, self.text, self.timeline],
                            queue=False)
        self.cv.wire()
        ins = [*self.inputs(), follow]
        refresh.click(guarded(s)(self.on_refresh_forced), ins, self.outputs())
        timer.tick(guarded(s, clear=False)(self.on_refresh), ins, self.outputs(), show_progress="hidden")

    # ----------------------------------------------------------------------------------------------- handlers
    def on_pick(self, step, filt, scope, keep: str | None = None, progress=gr.Progress()) -> dict:
        """Step, filter or scope changed: list the matching groups and show `keep` if listed, else the first."""
        step = as_int(step)
        try:
            choices, note = self.group_choices(step, filt, scope,
                                               lambda i, n: progress((i, n), desc="reading step files", unit="steps"))
        except UserError as e:  # e.g. a damaged step file: say so, and do not leave another step's group on show
            return {self.status: message_html(str(e), "error"), self.group: gr.update(choices=[], value=None),
                    self.picked: "", **self.empty_view("this step cannot be shown")}
        values = [v for _, v in choices]
        key = keep if keep in values else (values[0] if values else None)
        out = {self.group: gr.update(choices=choices, value=key), self.picked: note}
        out.update(self.group_view(key) if key else self.empty_view("no group matches this filter"))
        return out

    def on_prev(self, step, filt, scope) -> dict:
        return self.move(step, filt, scope, -1)

    def on_next(self, step, filt, scope) -> dict:
        return self.move(step, filt, scope, +1)

    def move(self, step, filt, scope, delta: int) -> dict:
        """The step before / after `step` among the steps with rollouts (stays at the ends)."""
        steps, step = self.src.steps(), as_int(step)
        if not steps:
            raise UserError("no rollouts written yet")
        if step in steps:
            target = steps[min(len(steps) - 1, max(0, steps.index(step) + delta))]
        else:
            target = steps[-1] if delta < 0 else steps[0]
        return {self.step: target, **self.on_pick(target, filt, scope)}

    def on_group(self, key) -> dict:
        return self.group_view(key)

    def on_select(self, key, evt: gr.SelectData) -> dict:
        row = evt.row_value or []
        index = as_int(row[0] if row else evt.index[0], "a response number")  # column "#": right even when sorted
        return {self.response: index, **self.on_response(key, index)}

    def on_more(self, key) -> dict:
        """A strip of 12 frames over the truth and around it, on demand."""
        step, position = parse_group_key(key)
        g = self.src.groups(step)[position]
        items, note = event_strip(self.src.reader(), g.media_key, g.video, g.gt_span, g.duration)
        return {self.event_strip: strip_html(items) + (message_html(note, "note") if note else "")}

    def on_response(self, key, index) -> dict:
        """The response's text, and the timeline's frames moved to its span."""
        text = self.response_text(key, index)
        step, position = parse_group_key(key)
        svg, _ = self.timeline_html(self.src.groups(step)[position], as_int(index, "a response number"))
        return {self.text: text, self.timeline: svg}

    def on_load(self, follow: bool = True) -> dict:
        return self.on_refresh(None, FILTERS[0], SCOPES[0], None, {}, follow, force=True)

    def on_refresh_forced(self, step, filt, scope, key, seen, follow) -> dict:
        return self.on_refresh(step, filt, scope, key, seen, follow, force=True)

    def on_refresh(self, step, filt, scope, key, seen, follow, force: bool = False) -> dict:
        """Pick up new steps and metrics; re-render only what changed (everything when `force`)."""
        seen = dict(seen or {})
        try:
            step = as_int(step)
        except UserError:
            step = None  # half-typed text in the step box: treat as no step chosen
        problem = self.src.problem()
        if problem:
            if seen.get("problem") == problem and not force:
                return {}
            seen["problem"] = problem
            note = (f"{problem}. The page fills in once the run writes its first files (it checks every few "
                    "seconds; or press Refresh).")
            return {self.status: message_html(note, "note"), self.picked: "", self.seen: seen,
                    **self.empty_view("nothing to show yet")}
        out: dict = {self.status: ""} if seen.pop("problem", None) else {}
        steps = self.src.steps()
        if force or steps != seen.get("steps"):
            target = steps[-1] if steps and (follow or step not in steps) else (step if steps else None)
            out[self.step] = gr.update(choices=[(str(x), x) for x in steps], value=target)
            if target is None:
                sft = self.src.reader().info().get("kind") == "sft"
                why = ("an SFT run samples no rollouts: its loss and evaluations are in the summary above, every "
                       "logged metric in Curves" if sft else "no rollouts written yet (rollouts/ is empty)")
                out.update({self.picked: message_html(why, "info" if sft else "note"),
                            **self.empty_view("no rollouts written yet")})
                if sft and self.tabs is not None and not seen.get("opened"):  # open where there is something
                    out[self.tabs] = gr.Tabs(selected="curves")              # to see: its loss curve
                    out.update(self.cv.curves(seen.get("smoothing", 0.0), seen.get("log", False)))
                    seen["curves"], seen["metrics"] = True, self.src.metrics_key()
            elif force or target != step:
                picked = self.on_pick(target, filt, scope, keep=key)
                picked.pop(self.step, None)  # keep the new list of steps set above
                out.update(picked)
            out[self.title] = self.title_md(steps)
            seen["steps"], seen["opened"] = steps, True
        mkey = self.src.metrics_key()
        if force or mkey != seen.get("alarm_key"):  # the drift alarm goes in the title: the status line is the
            alarm = drift_note(self.src.metrics())   # handlers' own and any pick clears it
            if self.title not in out and alarm != seen.get("alarm", ""):
                out[self.title] = self.title_md(steps)
            seen["alarm"], seen["alarm_key"] = alarm, mkey
            out[self.summary] = self.summary_html()
        if seen.get("curves") and (force or mkey != seen.get("metrics")):
            out.update(self.cv.curves(seen.get("smoothing", 0.0), seen.get("log", False)))
            seen["metrics"] = mkey
        out[self.seen] = seen
        return out

    # ----------------------------------------------------------------------------------------------- pieces
    def group_choices(self, step, filt, scope, progress=None) -> tuple[list[tuple[str, str]], str]:
        """([(label, 'step:position')], note) of the groups the filter keeps, this step or over the whole run."""
        if scope == SCOPES[1]:
            summaries, problems = self.src.all_summaries(progress)
        else:
            if step is None:
                return [], message_html("pick a step", "info")
            summaries, problems = self.src.summaries(int(step)), []
        kept = filter_groups(summaries, filt or FILTERS[0])
        where = "in the run" if scope == SCOPES[1] else f"at step {step}"
        matched = count_matches(summaries, filt or FILTERS[0])
        note = f"{matched} group(s) match of {len(summaries)} {where}"
        if matched > len(kept):
            note += f" (the newest {len(kept)} listed)"
        elif scope == SCOPES[1] and len(kept) > 1:
            note += " (newest first)"
        html = message_html(note, "info") + "".join(message_html(p, "note") for p in problems[:3])
        return [(s.label(scope == SCOPES[1]), s.key) for s in kept], html

    def group_view(self, key) -> dict:
        step, position = parse_group_key(key)
        groups = self.src.groups(step)
        if position >= len(groups):
            raise UserError(f"step {step} has {len(groups)} groups; there is no group at position {position}")
        g = groups[position]
        summary = self.src.summaries(step)[position]
        items, note = frame_items(self.src.reader(), g.media_key, g.video)
        headers, rows = response_rows(g)
        fates = [response_fate(r, g.duration) for r in g.responses]
        failed = [i for i, v in enumerate(fates) if v.failed]
        first = failed[0] if failed else 0  # open the offending answer first
        svg, frames_note = self.timeline_html(g, first, fates)
        choices = [(f"#{i} · reward {fmt(r.rewards.get('overall'))} · {r.finish_reason}", i)
                   for i, r in enumerate(g.responses)]
        return {
            self.step: step,  # in sync when the group came from a filter over all steps
            self.header: group_header(g, summary) + self.staleness_html(g, groups),
            self.gallery: strip_html(items),
            self.frames_note: (message_html(frames_note, "note") if frames_note else "")
            + message_html(note, "note" if not items or "missing" in note else "info"),
            self.timeline: svg,
            self.event_strip: "",
            self.table: highlighted(pd.DataFrame(rows, columns=headers), failed),
            self.response: gr.update(choices=choices, value=first if choices else None),
            self.text: (response_html(first, g.responses[first], fates[first]) if g.responses
                        else message_html("no responses", "note")),
        }

    def staleness_html(self, g, groups) -> str:
        """Which weights sampled the group and how stale it is; '' for a synchronous run (app/staleness.py)."""
        k = configured_staleness(self.src)
        return group_staleness_html(g, k, asynchronous(k, self.src.metrics(), groups))

    def timeline_html(self, g, chosen: int | None, fates=None) -> tuple[str, str]:
        """(svg, note): the group's spans coloured by tIoU, with the frames that show the truth and the span of
        response `chosen` on the same time axis."""
        fates = fates or [response_fate(r, g.duration) for r in g.responses]
        bars = [Bar(f"#{i}", r.parsed_span, span_iou(r, g.gt_span),
                    f"#{i}: " + (f"{r.parsed_span[0]:.2f}–{r.parsed_span[1]:.2f} s" if r.parsed_span else v.label)
                    + f", tIoU {fmt(span_iou(r, g.gt_span))}, reward {fmt(r.rewards.get('overall'))}, advantage "
                    f"{fmt(r.advantage)}" + (f" ({v.why})" if v.why else ""), "" if v.label == "ok" else v.text())
                for i, (r, v) in enumerate(zip(g.responses, fates))]
        bars += zoom_bars(g.responses)  # multi-turn: each zoom window on the same axis as the truth
        pred = g.responses[chosen].parsed_span if chosen is not None and chosen < len(g.responses) else None
        frames, note = event_frames(self.src.reader(), g.media_key, g.video, g.gt_span, pred, g.duration)
        svg = timeline_svg(timeline_data(g.gt_span, g.duration, bars), uid="run",
                           frames=[(frame_src(x), t, kind) for x, t, kind in frames])
        return svg, note

    def empty_view(self, why: str) -> dict:
        return {self.header: message_html(why, "info"), self.gallery: "",
                self.frames_note: "", self.timeline: "", self.event_strip: "",
                self.table: empty_table(), self.response: gr.update(choices=[], value=None), self.text: ""}

    def response_text(self, key, index) -> str:
        step, position = parse_group_key(key)
        groups = self.src.groups(step)
        if position >= len(groups):
            raise UserError(f"step {step} has no group at position {position}")
        responses = groups[position].responses
        i = as_int(index, "a response number")
        if i is None or not 0 <= i < len(responses):
            raise UserError(f"this group has {len(responses)} responses; there is no #{i}")
        return response_html(i, responses[i], response_fate(responses[i], groups[position].duration))

    def curves(self, smoothing: float = 0.0, log: bool = False) -> dict:
        return self.cv.curves(smoothing, log)

    def summary_html(self) -> str:
        """The summary row: trends of the headline metrics and the latest held-out evaluation."""
        points = run_eval_points(self.src)
        info = self.src.reader().info()
        metrics = self.src.metrics()
        return summary_html(metrics, [], points, kind=info.get("kind"),
                            more=plan_card_html(self.src.run_dir, info, metrics),
                            rollouts=rollouts_card_html(configured_staleness(self.src), metrics))

    def title_md(self, steps: list[int]) -> str:
        info = self.src.reader().info()
        parts = [f"**{self.src.run_dir.name}**", f"`{self.src.run_dir}`"]
        if info.get("kind"):
            parts.append(str(info["kind"]))
        if info.get("created"):
            parts.append(f"started {info['created']}")
        params = info.get("parameters")
        if isinstance(params, dict) and params.get("text"):  # "trainable parameters: 1.2M of 50.3M (2.4 %), LoRA ..."
            parts.append(str(params["text"]))
        parts.append(f"{len(steps)} step(s) with rollouts" + (f", newest {steps[-1]}" if steps else ""))
        parts.append(f"checked {datetime.datetime.now():%H:%M:%S}")
        alarm = drift_note(self.src.metrics())
        return " · ".join(parts) + (f"\n\n**⚠ {alarm}**" if alarm else "")


def zoom_bars(responses) -> list[Bar]:
    """The zoom windows of a multi-turn group's responses as timeline rows ("#3 zoom 1", grey: a window is not an
    answer), in response and turn order; none for one turn."""
    bars = []
    for i, r in enumerate(responses):
        windows = [t["zoom"] for t in (r.turns or []) if "zoom" in t]
        for k, (a, b) in enumerate(windows, 1):
            bars.append(Bar(f"#{i} z{k}", [a, b], None, f"#{i}: zoom {k} on {a:.2f}–{b:.2f} s", "zoom"))
    return bars
