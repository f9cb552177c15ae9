"""The rollout inspector (`mmpg inspect PATH`): a Gradio page over a run directory or an evaluation folder, or over
several runs to compare (`mmpg inspect RUN_A RUN_B`, or a folder holding runs). Its sources live in app/ and install
as the package `mmpg_app` (setup.py), the name every import uses: a package named `app` in site-packages would
shadow any other `app` a user imports.

It reads only through `mmpg.runs` (never imports the trainer, `mmpg.rl` or `mmpg.train`) and picks up new steps
while a run is writing. Modules:
    run_source.py  RunSource: the run's reader, and caches by file stat
    groups.py    group summaries, filters, the response table;  answers.py  what became of each answer
    evals.py     EvalSource, predictions worst first
    timeline.py  ground truth and predicted spans as SVG, coloured by tIoU on one 0-1 scale
    summary.py   the run summary on top: headline trends (smoothed, change over the last steps), latest evaluation
    curves.py    training curves as long tables for line plots (units, merging, smoothing, log scale)
    curves_view.py  the Curves tab
    frames.py    frames: the event (inside and around the truth and the chosen span) and the whole-video strip
    render.py    numbers, response text and messages as HTML, and CSS;  guard.py  handlers never raise into the page
    widgets.py   pickers, browser numbers and tables both views share
    compare.py, compare_view.py   several runs side by side (curves and evaluations overlaid)
    run_view.py, eval_view.py, server.py   the Gradio page and its server
The timing script and its large synthetic run are mmpg.bench.inspector and mmpg.bench.inspector_run; the tests' small
run is tests/synthetic_run.py.
"""


def launch(*args, **kwargs):
    """`mmpg_app.server.launch`, imported lazily (Gradio takes a second to import)."""
    from mmpg_app.server import launch as _launch

    return _launch(*args, **kwargs)
