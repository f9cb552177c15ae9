"""Build and serve the inspector page for one folder: a run directory (Rollouts, Curves, Evaluation tabs) or an
evaluation folder (Evaluation tab only); or the compare page for several run directories, or a folder holding
several (app/compare_view.py).

Security: the server binds 127.0.0.1 unless told otherwise, and Gradio may serve files only from inside the
folder (`allowed_paths` is that folder alone, or the compared run directories; Gradio resolves symlinks before
checking; the compare page serves no file at all). Every file path the app
hands to Gradio comes from `RunReader.resolve` / `EvalReader.resolve`, which refuse '..', absolute paths and
symlinks leading out; decoded video frames are handed over as arrays. Nothing is uploaded, nothing is written
into the folder.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no network calls from the page's server
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import gradio as gr  # noqa: E402

from mmpg_app.compare import find_runs, is_run_dir  # noqa: E402
from mmpg_app.compare_view import CompareView  # noqa: E402
from mmpg_app.eval_view import EvalView  # noqa: E402
from mmpg_app.evals import run_evals  # noqa: E402
from mmpg_app.guard import guarded  # noqa: E402
from mmpg_app.render import CSS  # noqa: E402
from mmpg_app.run_source import RunSource  # noqa: E402
from mmpg_app.run_view import RunView  # noqa: E402
from mmpg.errors import UserError  # noqa: E402

REFRESH_S = 5.0  # how often an open page checks the folder for new steps and metrics


def is_eval_folder(path: Path) -> bool:
    return (path / "eval.json").is_file()


def compare_paths(paths) -> list[Path] | None:
    """The folders to compare, or None for the one-folder page: several paths, or one folder that is neither a run
    directory nor an evaluation folder but holds run directories."""
    paths = [Path(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
    if len(paths) > 1:
        return paths
    root = paths[0]
    if root.is_dir() and not is_eval_folder(root) and not is_run_dir(root) and any(
            c.is_dir() and is_run_dir(c) for c in root.iterdir()):
        return paths
    return None


def build_compare(paths: list[Path]) -> gr.Blocks:
    runs = find_runs(paths)
    with gr.Blocks(title=f"mmpg inspect · {len(runs)} runs", analytics_enabled=False) as page:
        with gr.Row(equal_height=True):
            gr.Markdown(f"**Comparing {len(runs)} runs** · " + " · ".join(f"`{n}`" for n in runs), elem_id="title")
            refresh = gr.Button("Refresh", elem_id="refresh", scale=0, min_width=100)
        status = gr.HTML(elem_id="status")
        cv = CompareView(runs, status)
        cv.build()
        cv.wire(page, refresh)
    return page


def build_app(path, refresh_s: float = REFRESH_S) -> gr.Blocks:
    """The page for `path` (an existing folder; it need not be a run directory yet), or the compare page for a list
    of run directories or a folder holding several."""
    several = compare_paths(path)
    if several is not None:
        return build_compare(several)
    root = Path(path if isinstance(path, (str, os.PathLike)) else path[0])
    if not root.is_dir():
        raise UserError(f"{root}: no such folder; pass a run directory or an evaluation folder")
    eval_mode = is_eval_folder(root)
    with gr.Blocks(title=f"mmpg inspect · {root.name}", analytics_enabled=False) as page:
        with gr.Row(equal_height=True):
            title = gr.Markdown(f"**{root.name}** · `{root}`", elem_id="title")
            follow = gr.Checkbox(label="follow the newest step", value=False, visible=not eval_mode,
                                 elem_id="follow", scale=0, min_width=200)
            refresh = gr.Button("Refresh", elem_id="refresh", scale=0, min_width=100)
        status = gr.HTML(elem_id="status")
        seen = gr.State({})
        timer = gr.Timer(refresh_s, active=not eval_mode)
        if eval_mode:
            ev = EvalView(lambda: {f"{root.parent.name} · {root.name}": root}, status)
            with gr.Tabs():
                ev.build()
            ev.wire(lazy=False)
            page.load(guarded(status)(ev.on_load), None, ev.outputs())
            refresh.click(guarded(status)(ev.on_load), None, ev.outputs())
        else:
            rv = RunView(RunSource(root), status, title, seen)
            ev = EvalView(lambda: run_evals(root), status)
            rv.build_summary()
            with gr.Tabs() as rv.tabs:
                rv.build()
                ev.build()
            rv.wire(refresh, follow, timer)
            ev.wire(lazy=True)
            page.load(guarded(status)(rv.on_load), [follow], rv.outputs(), queue=False)
            refresh.click(guarded(status)(ev.on_refresh), [ev.pick], ev.outputs())
    return page


LAUNCH_TRIES = 3  # starts of the server when Gradio's own check of it fails (`launch`)


def launch(path, host: str = "127.0.0.1", port: int | None = None, block: bool = True,
           quiet: bool = False, refresh_s: float = REFRESH_S) -> tuple[gr.Blocks, str]:
    """Serve the page; returns (blocks, local URL). With block=False the server runs in a thread (tests, scripts);
    stop it with `blocks.close()`."""
    several = compare_paths(path)
    if several is not None:  # only the compared run directories, never the folder around them
        allowed = [str(src.run_dir.resolve()) for src in find_runs(several).values()]
        page = build_app(several, refresh_s=refresh_s)
    else:
        root = Path(path if isinstance(path, (str, os.PathLike)) else path[0]).resolve()
        allowed = [str(root)]
        page = build_app(root, refresh_s=refresh_s)
    attempt = 1
    while True:
        try:
            _, url, _ = page.launch(
                server_name=host, server_port=port, prevent_thread_lock=not block, quiet=quiet, share=False,
                inbrowser=False, show_error=False, ssr_mode=False, mcp_server=False, enable_monitoring=False,
                allowed_paths=allowed, footer_links=[], theme=gr.themes.Default(), css=CSS,
            )
            return page, url
        except ValueError as e:
            # Gradio asks its new server for the page a few times and gives up at the first connection error or
            # 3-s timeout, which a machine busy with training can cause; then it stops with "localhost is not
            # accessible" though the server was up. Closed and started again, up to LAUNCH_TRIES times.
            if "localhost is not accessible" not in str(e):
                raise
            page.close()
            if attempt == LAUNCH_TRIES:
                raise UserError(f"the inspector's server on {host}:{port or 'a free port'} did not answer its own "
                                f"check {LAUNCH_TRIES} times (a busy machine, or a proxy set for localhost: "
                                "NO_PROXY=localhost,127.0.0.1)") from e
            attempt += 1
            print(f"[mmpg] the inspector's server did not answer its start check; starting it again "
                  f"({attempt} of {LAUNCH_TRIES})", file=sys.stderr, flush=True)
