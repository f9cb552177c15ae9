"""The rollout inspector: a Gradio page over a run directory or an evaluation folder (`mmpg inspect PATH`), or
over several runs to compare (`mmpg inspect RUN_A RUN_B`, or a folder holding runs).

It reads only through `mmpg.runs` (never imports the trainer, `mmpg.rl` or `mmpg.train`) and picks up new steps
while a run is writing. Modules:
    data.py      RunSource (reader + caches by file stat), group summaries, filters, table rows, text parts
    evals.py     EvalSource, predictions worst first
    timeline.py  ground truth and predicted spans as SVG, coloured by tIoU on one 0-1 scale
    summary.py   the run summary on top: headline trends (smoothed, change over the last steps), latest evaluation
    curves.py    training curves as long tables for line plots (units, merging, smoothing, log scale)
    curves_view.py  the Curves tab
    frames.py    frames: the event (inside and around the truth and the chosen span) and the whole-video strip
    render.py    HTML pieces and CSS;  guard.py  handlers never raise into the page
    compare.py, compare_view.py   several runs side by side (curves and evaluations overlaid)
    run_view.py, eval_view.py, server.py   the Gradio page and its server
    synthetic.py, bench.py   a large synthetic run and the timing script
"""


def launch(*args, **kwargs):
    """`app.server.launch`, imported lazily (Gradio takes a second to import)."""
    from app.server import launch as _launch

    return _launch(*args, **kwargs)
