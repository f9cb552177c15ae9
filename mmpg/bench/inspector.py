"""How fast the inspector opens a large run: prints a table, optionally writes JSON. Not a test (timings depend on
the machine and its load).

    python -m mmpg.bench.inspector                # writes data/generated/inspector_bench (1,000 x 16 x 8) once
    python -m mmpg.bench.inspector --run DIR --json out.json --browser

Server side (cold caches, a fresh RunSource each time the "open" is measured):
    open          the page's load handler: list steps, read metrics, the newest step's groups, the first group's view
                  (best of 3; open_first: the first of them, which also plans the run's memory, kept per config)
    group         one group's view from a step not read yet (parses that step file), and again from the cache
    curves        the Curves tab's first draw (every panel's table)
    all steps     the "all steps" filter: every step file parsed once, then from the cache
Browser (--browser, Debian's chromium through Playwright): page load until the response table and the run summary
show (first: the browser fetches Gradio's scripts; then: cached), a step picked in the dropdown until its first group
is on screen, another group of it picked, the Curves tab until every plot is drawn, and the same page load for a
one-component Gradio page (the floor no Gradio app goes below).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import tempfile
import time
from pathlib import Path

DEFAULT_RUN = "data/generated/inspector_bench"


def _timed(fn, repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def server_side(run: Path, seed: int = 0) -> dict[str, float]:
    import gradio as gr

    from mmpg_app.groups import FILTERS, SCOPES
    from mmpg_app.run_source import RunSource
    from mmpg_app.run_view import RunView

    def view() -> RunView:
        with gr.Blocks():
            rv = RunView(RunSource(run), gr.HTML(), gr.Markdown(), gr.State({}))
            rv.build_summary()
            with gr.Tabs():
                rv.build()
        return rv

    opens = []
    for _ in range(3):
        rv = view()  # a fresh RunSource: nothing cached
        opens.append(_timed(rv.on_load))
    out = {"open_s": min(opens), "open_first_s": opens[0]}  # first: also makes the run's memory plan (then kept)
    rv = view()
    steps = rv.src.steps()
    rng = random.Random(seed)
    cold = []
    for _ in range(5):
        step = rng.choice(steps)
        cold.append(_timed(lambda: rv.on_pick(step, FILTERS[0], SCOPES[0])))
    out["group_cold_s"] = max(cold)  # the step file parsed, the group list built, the first group's view
    out["group_cached_s"] = _timed(lambda: rv.group_view(f"{steps[0]}:1"), repeat=3)
    out["curves_s"] = _timed(rv.curves)
    out["all_steps_cold_s"] = _timed(lambda: rv.group_choices(steps[-1], FILTERS[4], SCOPES[1]))
    out["all_steps_cached_s"] = _timed(lambda: rv.group_choices(steps[-1], FILTERS[4], SCOPES[1]), repeat=3)
    return out


def _gradio_floor(ctx) -> tuple[float, float]:
    """Seconds a one-component Gradio page takes to show data from its load event in the same browser: the floor
    no Gradio app goes below (page scripts, the queue's round trip)."""
    import gradio as gr

    with gr.Blocks(analytics_enabled=False) as demo:
        md = gr.Markdown("waiting", elem_id="floor")
        demo.load(lambda: "loaded", None, md)
    _, url, _ = demo.launch(server_name="127.0.0.1", server_port=_free_port(), prevent_thread_lock=True, quiet=True,
                            ssr_mode=False)
    try:
        times = []
        for _ in range(3):
            page = ctx.new_page()
            t = time.perf_counter()
            page.goto(url)
            page.get_by_text("loaded").wait_for()
            times.append(time.perf_counter() - t)
            page.close()
        return times[0], min(times[1:])  # first (scripts fetched: another port is another origin), then cached
    finally:
        demo.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def browser_side(run: Path, chromium: str) -> dict[str, float]:
    from playwright.sync_api import sync_playwright

    from mmpg_app.server import launch

    page_app, url = launch(run, port=_free_port(), block=False, quiet=True)
    profile = tempfile.mkdtemp(prefix="mmpg-bench-chromium-")
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
            "--no-first-run", "--disable-component-update", "--disable-sync"]
    out = {}
    try:
        with sync_playwright() as p:
            ctx = p.chromium.launch_persistent_context(profile, executable_path=chromium, headless=True, args=args,
                                                       viewport={"width": 1400, "height": 1000})
            ctx.set_default_timeout(120_000)
            opens = []
            for _ in range(3):  # the first load also fetches Gradio's scripts; later ones find them cached
                page = ctx.new_page()
                t = time.perf_counter()
                page.goto(url)
                page.locator("#responses [role=row].virtual-row").first.wait_for()
                page.locator("#summary .mmpg-card").first.wait_for()  # the run summary on top, too
                opens.append(time.perf_counter() - t)
                if len(opens) < 3:
                    page.close()
            out["browser_open_first_s"], out["browser_open_s"] = opens[0], min(opens[1:])
            page.locator("#step input").click()
            page.locator("#step input").fill("")
            page.locator("#step input").press_sequentially("500")  # typing filters the 1,000 choices
            t = time.perf_counter()
            page.get_by_role("option", name="500", exact=True).click()
            page.wait_for_function("() => (document.getElementById('group-header')?.innerText || '')"
                                   ".includes('step 500')")
            out["browser_step_s"] = time.perf_counter() - t  # a step picked: its group list and first group
            page.locator("#group input").click()
            t = time.perf_counter()
            page.get_by_role("option").nth(7).click()
            page.wait_for_function("() => (document.getElementById('group-header')?.innerText || '')"
                                   ".includes('group 7')")
            out["browser_group_s"] = time.perf_counter() - t  # another group of that step
            t = time.perf_counter()
            page.get_by_role("tab", name="Curves").click()
            for pid in ("reward", "iou", "length", "kl", "clip", "timing", "eval"):
                page.locator(f"#curve-{pid} canvas, #curve-{pid} svg").first.wait_for()
            out["browser_curves_s"] = time.perf_counter() - t
            out["browser_gradio_floor_first_s"], out["browser_gradio_floor_s"] = _gradio_floor(ctx)
            ctx.close()
    finally:
        page_app.close()
        shutil.rmtree(profile, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mmpg.bench.inspector", description=__doc__.splitlines()[0])
    ap.add_argument("--run", default=DEFAULT_RUN, help="run directory to time; written (1,000 x 16 x 8) if absent")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--g", type=int, default=8, help="responses per group")
    ap.add_argument("--browser", action="store_true", help="also time the page in Debian's chromium")
    ap.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    run = Path(args.run)
    if not (run / "metrics.jsonl").is_file():
        from mmpg.bench.inspector_run import make_run

        t = time.perf_counter()
        make_run(run, steps=args.steps, groups=args.groups, g=args.g)
        print(f"wrote {run} ({args.steps} steps x {args.groups} groups x {args.g}) in {time.perf_counter() - t:.1f} s")
    figures = {"run": str(run), "load_avg_1min": os.getloadavg()[0], "cpus": os.cpu_count()}
    figures.update(server_side(run))
    if args.browser:
        figures.update(browser_side(run, args.chromium))
    print(f"{'what':<30}{'seconds':>10}")
    for k, v in figures.items():
        if k.endswith("_s"):
            print(f"{k[:-2]:<30}{v:>10.3f}")
    print(f"(load average {figures['load_avg_1min']:.1f} on {figures['cpus']} cpus)")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
