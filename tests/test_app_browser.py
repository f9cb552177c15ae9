"""The inspector in a real browser: Debian's chromium driven by Playwright (no browser is downloaded), the app
served on 127.0.0.1 on a small run directory written by the writers of `mmpg.runs`.

Screenshots go to test-artifacts/inspector/ (or $MMPG_TEST_ARTIFACTS). Skipped, with the reason, where chromium or
the playwright package is missing; scripts/test.sh installs chromium with apt-get when it runs as root.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from app_launch import launch_free

from mmpg.config import load_config
from mmpg.plan.memory import predict
from mmpg.plan.recipe import recipe_from_config
from mmpg.runs import run_eval_dir
from synthetic_run import (
    SMALL_DURATION, SMALL_EVAL, SMALL_GT, SMALL_PEAK_MB, SMALL_SPANS, make_eval_folder, make_small_run,
    make_small_sft_run,
)

pytestmark = [pytest.mark.slow,  # Gradio's own pandas 3 deprecation notices, not ours:
              pytest.mark.filterwarnings("ignore:.*(no_silent_downcasting|copy keyword).*")]

CHROMIUM = os.environ.get("MMPG_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
                 "--no-first-run", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(os.environ.get("MMPG_TEST_ARTIFACTS") or Path(__file__).resolve().parents[1] / "test-artifacts"
                 ) / "inspector"
TIMEOUT_MS = 60_000  # two shared cores: generous, the usual wait is well under a second


@pytest.fixture(scope="module")
def browser():
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no chromium at {CHROMIUM}: install Debian's package (apt-get install chromium; scripts/test.sh "
                    "does it when run as root) or set MMPG_CHROMIUM")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed (dev extra)")
    profile = tempfile.mkdtemp(prefix="mmpg-chromium-")
    with sync_api.sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True,
                                                   args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 1000})
        ctx.set_default_timeout(TIMEOUT_MS)
        yield ctx
        ctx.close()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("browser")
    run = make_small_run(root / "run", video_dir=root / "videos")
    ev = make_eval_folder(run_eval_dir(run, "charades", 3))
    empty = root / "empty"
    empty.mkdir()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return {"run": run, "eval": ev, "empty": empty, "sft": make_small_sft_run(root / "sft")}


@pytest.fixture(scope="module")
def serve():
    pages = []

    def start(path):
        page, url = launch_free(path, block=False, quiet=True, refresh_s=1.0)
        pages.append(page)
        return url

    yield start
    for p in pages:
        p.close()


@pytest.fixture(scope="module")
def run_url(serve, folders):
    """One server on the small run for the tests that only read it."""
    return serve(folders["run"])


def pick(page, elem_id: str, label: str) -> None:
    """Choose `label` in a Gradio dropdown, as a user does: open it, click the option, and wait for its list to
    close (on a busy machine the list can outlive the click, and the next dropdown's options then mix with it)."""
    page.locator(f"#{elem_id} input").click()
    page.get_by_role("option", name=label, exact=True).click()
    page.wait_for_function("() => document.querySelectorAll('[role=option]').length === 0")


def table_rows(page, elem_id: str) -> list[list[str]]:
    rows = page.locator(f"#{elem_id} [role=row].virtual-row")
    return [[c.strip() for c in r.locator("[role=gridcell]").all_inner_texts()] for r in rows.all()]


def wait_rows(page, elem_id: str, first_cell_pattern: str | None = None, count: int | None = None):
    page.wait_for_function(
        """([id, n, pat]) => {
            const rows = document.querySelectorAll(`#${id} [role=row].virtual-row`);
            if (n !== null && rows.length !== n) return false;
            if (pat === null) return rows.length > 0;
            return Array.from(rows).some(r => new RegExp(pat).test(r.innerText));
        }""", arg=[elem_id, count, first_cell_pattern])


def wait_text(page, elem_id: str, text: str) -> None:
    """Wait until the element #elem_id exists and its text contains `text`."""
    page.wait_for_function("([id, t]) => (document.getElementById(id)?.innerText || '').includes(t)",
                           arg=[elem_id, text])


def no_error_page(page) -> None:
    """No traceback, no server error page, no Gradio error toast (our handlers report through #status)."""
    body = page.inner_text("body")
    assert "Traceback" not in body and "Internal Server Error" not in body
    toasts = page.locator("[data-testid=toast-body]").all_inner_texts()
    assert not toasts, toasts


def fmt(x) -> str:
    return f"{x:g}"


def test_pick_step_and_group_see_responses_timeline_and_text(browser, run_url):
    page = browser.new_page()
    page.goto(run_url)
    wait_rows(page, "responses", count=4)
    pick(page, "step", "2")
    wait_text(page, "picked", "at step 2")
    labels = page.locator("#group input")
    labels.click()  # the list now holds step 2's groups
    options = page.get_by_role("option").all_inner_texts()
    assert len(options) == 2 and options[1].strip().startswith("group 1"), options
    page.get_by_role("option").nth(1).click()
    wait_text(page, "group-header", "sample-1")
    wait_rows(page, "responses", count=4, first_cell_pattern="10")
    rows = table_rows(page, "responses")
    assert len(rows) == 4
    expected = [(fmt(s[0]), fmt(s[1])) for s, _ in SMALL_SPANS[(2, 1)]]
    assert [(r[1], r[2]) for r in rows] == expected
    assert page.locator("#timeline svg.mmpg-timeline rect.span-bar").count() == 4
    assert page.locator("#timeline svg rect.gt-bar").count() == 1
    assert labels.input_value().startswith("group 1")
    assert "stale" not in page.inner_text("#group-header")  # a synchronous run: no word of staleness
    page.locator("#responses [role=row].virtual-row").nth(2).locator("[role=gridcell]").nth(3).click()
    wait_text(page, "response-text", "Response #2")
    assert page.locator("#response-text .mmpg-think").count() == 1
    assert page.locator("#response-text .mmpg-answer").inner_text().find("14.0 to 19.5") >= 0
    assert page.locator("#frames img").count() == 8  # no thumbnails: decoded from the video file
    no_error_page(page)
    page.screenshot(path=str(ARTIFACTS / "rollouts_step2_group1.png"), full_page=True)
    page.close()


def test_filter_over_the_run_and_step_buttons(browser, run_url):
    page = browser.new_page()
    page.goto(run_url)
    wait_rows(page, "responses", count=4)
    page.get_by_label("all steps").check()
    pick(page, "filter", "truncated responses")
    wait_text(page, "picked", "1 group(s) match of 6")
    assert page.locator("#group input").input_value().startswith("step 2 · group 0")
    wait_rows(page, "responses", count=4, first_cell_pattern="length")
    assert [r[-1] for r in table_rows(page, "responses")] == ["stop", "stop", "length", "stop"]
    assert page.locator("#frames img").count() == 4  # the stored thumbnails, served from inside the run
    page.wait_for_function("() => Array.from(document.querySelectorAll('#frames img'))"
                           ".every(i => i.complete && i.naturalWidth > 0)")
    assert page.locator("#timeline text.note", has_text="truncated").count() == 1  # named, not "unparsed"
    page.screenshot(path=str(ARTIFACTS / "rollouts_filter_truncated.png"), full_page=True)
    page.get_by_label("this step").check()
    pick(page, "filter", "all groups")
    assert page.locator("#step input").input_value() == "2"  # the Step box followed the group found over the run
    page.locator("#step-prev").click()  # from step 2 to step 1
    wait_text(page, "picked", "at step 1")
    assert page.locator("#step input").input_value() == "1"
    page.wait_for_timeout(1500)  # a timer tick (every second here) while the choices changed: no error toast
    no_error_page(page)
    page.close()


def test_curves_render(browser, run_url):
    page = browser.new_page()
    page.goto(run_url)
    wait_rows(page, "responses", count=4)
    page.get_by_role("tab", name="Curves").click()
    for pid in ("reward", "iou", "signal", "length", "kl", "clip", "timing", "eval"):
        page.locator(f"#curve-{pid} canvas, #curve-{pid} svg").first.wait_for()
    wait_text(page, "curves-note", "3 step(s) in metrics.jsonl")  # drawn plots may come before the note's text
    note = page.inner_text("#curves-note")
    assert "3 step(s) in metrics.jsonl, 3 evaluation(s)" in note
    assert "Not logged by this run: Loss; Policy entropy (GRPO health); Gradient norm" in note
    for pid in ("loss", "entropy", "grad", "gap"):  # folded into the note, not drawn empty
        assert not page.locator(f"#curve-{pid}").is_visible()
    assert "mean tIoU of the sampled spans" in page.inner_text("#caption-iou")  # the panel's one-line description
    page.get_by_label("log scale (log10 of the values)").check()
    page.get_by_label("0.9", exact=True).check()
    page.wait_for_timeout(1500)
    no_error_page(page)
    page.screenshot(path=str(ARTIFACTS / "curves.png"), full_page=True)
    page.close()


def test_evaluation_views(browser, serve, folders, run_url):
    for name, url in (("eval_tab_of_run", run_url), ("eval_folder", serve(folders["eval"]))):
        page = browser.new_page()
        page.goto(url)
        if name == "eval_tab_of_run":
            wait_rows(page, "responses", count=4)
            page.get_by_role("tab", name="Evaluation").click()
        wait_rows(page, "eval-samples", count=len(SMALL_EVAL))
        rows = table_rows(page, "eval-samples")
        assert [r[0] for r in rows] == ["4", "2", "3", "1", "0"]  # worst first
        assert rows[0][-1].startswith("failed")
        page.locator("#eval-samples [role=row].virtual-row").nth(3).locator("[role=gridcell]").nth(2).click()
        wait_text(page, "eval-header", "eval query 1")
        assert page.locator("#eval-timeline rect.span-bar").count() == 1
        assert "video file not available" in page.inner_text("#eval-frames-note")
        assert page.locator("#eval-metrics").inner_text().find("miou") >= 0
        headline = page.locator("#eval-headline")  # R1@m at the top of the tab, above the metrics table
        assert headline.inner_text().split()[:2] == ["R1@0.5", "0.500"]  # 2 of 4 samples at tIoU >= 0.5
        assert headline.bounding_box()["y"] < page.locator("#eval-metrics").bounding_box()["y"]
        page.wait_for_function("() => { const i = document.querySelector('#eval-plots img');"
                               " return i && i.complete && i.naturalWidth > 0; }")  # served from inside the folder
        no_error_page(page)
        page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)
        page.close()


def test_bad_folders_show_a_message(browser, serve, folders, tmp_path):
    page = browser.new_page()
    page.goto(serve(folders["empty"]))
    wait_text(page, "status", "not a run directory")
    no_error_page(page)
    page.screenshot(path=str(ARTIFACTS / "empty_folder.png"), full_page=True)
    # the run starts writing while the page is open: the timer picks it up
    make_small_run(folders["empty"])
    wait_text(page, "title", "3 step(s) with rollouts")  # a tick may land mid-write: later ones catch up
    wait_rows(page, "responses", count=4)
    # a damaged step file: the other steps still work, the damaged one says what is wrong
    path = folders["empty"] / "rollouts" / "step_00000001.jsonl"
    path.write_text("garbage\n" + path.read_text())
    pick(page, "step", "1")
    wait_text(page, "status", "damaged line")
    no_error_page(page)
    page.screenshot(path=str(ARTIFACTS / "damaged_step.png"), full_page=True)
    page.close()


def test_a_training_runs_heldout_evaluation_and_drift_alarm(browser, serve, grpo_data, tmp_path):
    """A real `mmpg train` run with eval.every_n_steps: its held-out evaluation (the `mmpg eval` decode path, one
    folder per step in the run) is listed in the Evaluation tab; a drift alarm line written into its metrics shows
    under the title on the next refresh."""
    import json

    from mmpg.runs import RunWriter
    from train_utils import overrides, run_cli

    synth = grpo_data["synth"]
    proc = run_cli(["train"] + overrides(grpo_data, tmp_path, "heldout", **{
        "trainer.total_steps": 1, "eval.every_n_steps": 1, "data.val": str(synth / "val.json"),
        "eval.max_new_tokens": 6}), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "heldout"
    n_val = sum(len(v["sentences"]) for v in json.loads((synth / "val.json").read_text()).values())
    page = browser.new_page()
    page.goto(serve(run))
    wait_rows(page, "responses", count=4)
    page.get_by_role("tab", name="Evaluation").click()
    wait_rows(page, "eval-samples", count=n_val)
    assert page.locator("#eval-metrics").inner_text().find("miou") >= 0
    RunWriter(run, tensorboard=False).log_metrics(2, {"actor/logprob_gap_max": 0.5, "alarm/logprob_drift": 1.0})
    page.wait_for_function("() => document.body.innerText.includes('logprob drift: 1 step(s) flagged')")
    no_error_page(page)
    page.screenshot(path=str(ARTIFACTS / "heldout_eval.png"), full_page=True)
    page.close()


def bar_fills(page, elem_id: str) -> list[tuple[int, int, int]]:
    fills = page.locator(f"#{elem_id} svg rect.span-bar").evaluate_all("rs => rs.map(r => r.getAttribute('fill'))")
    return [tuple(int(f[i:i + 2], 16) for i in (1, 3, 5)) for f in fills]


def test_the_lowest_reward_group_is_drawn_red(browser, run_url):
    """Colours are tIoU on one absolute scale: the run's worst group (3:1, tIoU 0 or 0.11 for every answer, though
    the format reward alone gives each 1) is red, its values are written on the bars, the best group is green."""
    page = browser.new_page()
    page.goto(run_url)
    wait_rows(page, "responses", count=4)
    pick(page, "filter", "lowest mean reward")
    page.wait_for_function("() => document.querySelector('#group input').value.startsWith('group 1')")
    wait_text(page, "group-header", "sample-1")
    fills = bar_fills(page, "timeline")
    assert len(fills) == 3 and all(r >= 0xc8 and g <= 0x80 for r, g, _ in fills), fills  # red, never green
    assert page.locator("#timeline text.bar-value").all_text_contents() == ["0.00", "0.00", "0.11"]
    assert "overall = format + accuracy" in page.inner_text("#reward-help")
    pick(page, "filter", "highest mean reward")
    wait_text(page, "group-header", "sample-0")
    assert all(g >= 0x90 and r <= 0x90 for r, g, _ in bar_fills(page, "timeline"))  # green
    no_error_page(page)
    page.close()


def test_each_failure_has_its_label_and_the_step_box_follows(browser, run_url):
    page = browser.new_page()
    page.goto(run_url)
    wait_rows(page, "responses", count=4)
    page.get_by_label("all steps").check()
    pick(page, "filter", "out-of-range answers")
    wait_text(page, "picked", "2 group(s) match of 6 in the run (newest first)")
    wait_rows(page, "responses", count=4, first_cell_pattern="out of range: 24.0 to 30.0")
    assert page.locator("#step input").input_value() == "3"
    wait_text(page, "response-text", "Response #3")  # the offending answer opens first, named
    assert "out of range" in page.inner_text("#response-text .mmpg-fate")
    row = page.locator("#responses [role=row].virtual-row").nth(3).locator("[role=gridcell]").first
    assert "253, 226, 225" in row.evaluate("c => getComputedStyle(c).backgroundColor + c.getAttribute('style')"
                                           " + getComputedStyle(c.parentElement).backgroundColor")
    assert page.locator("#timeline text.note", has_text="out of range: 24.0 to 30.0").count() == 1
    page.locator("#group input").click()
    page.get_by_role("option").filter(has_text="step 2 · group 1").click()
    wait_rows(page, "responses", count=4, first_cell_pattern="clamped from 16.0 to 24.0")
    assert page.locator("#step input").input_value() == "2"
    pick(page, "filter", "truncated responses")
    wait_rows(page, "responses", count=4, first_cell_pattern="truncated")
    assert "hit max_new_tokens" in page.inner_text("#response-text .mmpg-fate")
    no_error_page(page)
    page.screenshot(path=str(ARTIFACTS / "rollouts_failures.png"), full_page=True)
    page.close()


def test_the_summary_shows_the_reward_trend_and_the_latest_evaluation(browser, run_url, folders):
    page = browser.new_page()
    page.goto(run_url)
    wait_text(page, "summary", "GRPO run: is it learning?")
    for name in ("reward", "tIoU", "parse rate", "zero-advantage groups"):
        card = page.locator(f'#summary [data-metric="{name}"]')
        assert card.locator("svg.spark polyline").count() == 2 and card.locator(".mmpg-change").count() == 1
    assert "▲ +0.27" in page.inner_text('#summary [data-metric="reward"]')  # step 3 against step 2
    evals = page.inner_text('#summary [data-metric="evaluation"]')
    assert "step 3" in evals and "step 1" in evals and "0.300" in evals and "+0.200" in evals
    assert page.locator("#summary").bounding_box()["y"] < page.locator("#timeline").bounding_box()["y"]  # on top
    memory = page.locator('#summary [data-metric="memory"]')  # the run's plan beside its measured peak
    planned = predict(recipe_from_config(load_config(str(folders["run"] / "config.yaml"), []), 1, "cpu"))
    assert memory.locator(".mmpg-planned").inner_text() == f"{planned['peak_bytes'] / 2 ** 30:.2f} GB"
    assert memory.locator(".mmpg-measured").inner_text() == f"{max(SMALL_PEAK_MB.values()) / 1024:.2f} GB"
    assert "ru_maxrss" in memory.inner_text() and memory.is_visible()
    no_error_page(page)
    page.screenshot(path=str(ARTIFACTS / "summary_grpo.png"))
    page.close()


def test_an_asynchronous_runs_group_names_the_weights_that_sampled_it(browser, serve, tmp_path):
    """rollout.max_staleness = 2: the newest step's first group (3:0) was sampled by the initial weights, 2 steps
    before the weights step 3 trained; the summary's card says how stale the run's rollouts were."""
    page = browser.new_page()
    page.goto(serve(make_small_run(tmp_path / "stale", max_staleness=2)))
    wait_text(page, "group-header", "sampled by the initial weights · 2 steps stale")
    assert "up to 2 steps stale (mean 0.83)" in page.inner_text('#summary [data-metric="rollouts"]')
    no_error_page(page)
    page.screenshot(path=str(ARTIFACTS / "rollouts_asynchronous.png"))
    page.close()


def test_an_sft_run_opens_on_its_loss_and_evaluation(browser, serve, folders):
    page = browser.new_page()
    page.goto(serve(folders["sft"]))
    wait_text(page, "summary", "SFT run: is the loss falling?")
    loss = page.locator('#summary [data-metric="loss"]')
    assert loss.locator("svg.spark").bounding_box()["height"] >= 120  # a readable curve, not a sparkline
    assert "▼" in loss.inner_text()
    evals = page.inner_text('#summary [data-metric="evaluation"]')
    assert "R1@0.7" in evals and "0.300" in evals and "step 0" in evals and "step 40" in evals
    assert "no plan: model '/checkpoints/gone'" in page.inner_text('#summary [data-metric="memory"]')
    page.locator("#curve-loss canvas, #curve-loss svg").first.wait_for()  # it opens on Curves: the loss
    assert page.get_by_role("tab", name="Curves").get_attribute("aria-selected") == "true"
    assert not page.locator("#curve-reward").is_visible()  # nothing an SFT run does not log
    page.get_by_role("tab", name="Rollouts").click()
    wait_text(page, "picked", "an SFT run samples no rollouts")
    no_error_page(page)
    page.screenshot(path=str(ARTIFACTS / "summary_sft.png"))
    page.close()


def test_frames_inside_the_truth_on_the_time_axis(browser, run_url):
    """For every group of the first step a frame inside the true span, drawn at its time on the timeline's axis and
    large enough to read (a stored thumbnail for video 0, frames decoded from the file for video 1)."""
    page = browser.new_page()
    page.goto(run_url)
    wait_rows(page, "responses", count=4)
    pick(page, "step", "1")
    wait_text(page, "picked", "at step 1")
    for position, label in ((0, "group 0"), (1, "group 1")):
        page.locator("#group input").click()
        page.get_by_role("option").filter(has_text=label).click()
        wait_text(page, "group-header", f"sample-{position}")
        page.wait_for_function("n => document.querySelectorAll('#timeline g.frame').length >= n", arg=3)
        gt = SMALL_GT[position]
        times = [float(t) for t in page.locator("#timeline g.frame[data-kind=truth]").evaluate_all(
            "gs => gs.map(g => g.getAttribute('data-t'))")]
        assert times and all(gt[0] <= t <= gt[1] for t in times), (position, times)
        frame = page.locator("#timeline g.frame[data-kind=truth] image").first
        assert frame.bounding_box()["width"] >= 120  # px on a 1400 px wide page
        leader = page.locator("#timeline g.frame[data-kind=truth] line.frame-leader").first
        x2 = float(leader.get_attribute("x2"))
        assert abs(x2 - (70 + 810 * times[0] / SMALL_DURATION[position])) < 0.1  # on the axis of the spans
    no_error_page(page)
    page.screenshot(path=str(ARTIFACTS / "event_frames.png"), full_page=True)
    page.close()


def test_the_sort_hint_says_what_sorts(browser, run_url):
    """The table's label names the ⋮ menu, and that menu does sort (a click on a header does not)."""
    page = browser.new_page()
    page.goto(run_url)
    wait_rows(page, "responses", count=4)
    assert "open a column's ⋮ menu" in page.inner_text("#responses")
    overall = lambda: [float(r[4]) for r in table_rows(page, "responses")]  # noqa: E731
    before = overall()
    header = page.locator("#responses [role=columnheader]").nth(4)
    assert header.inner_text().startswith("overall")
    header.hover()
    header.get_by_role("button", name="Open cell menu").click()
    page.get_by_role("menuitem", name="Sort descending").click()
    page.wait_for_function("() => true")
    wait_rows(page, "responses", count=4)
    page.wait_for_timeout(500)
    assert overall() == sorted(before, reverse=True) != before
    no_error_page(page)
    page.close()


def test_two_runs_overlay(browser, serve, folders):
    """The compare page on an SFT and a GRPO run: one table row each, their held-out mIoU on one chart."""
    page = browser.new_page()
    page.goto(serve([folders["sft"], folders["run"]]))
    wait_rows(page, "compare-table", count=2)
    rows = table_rows(page, "compare-table")
    assert [r[0] for r in rows] == ["sft", "run"] and [r[1] for r in rows] == ["sft", "grpo"]
    chart = page.locator("#compare-eval-miou")
    chart.locator("canvas, svg").first.wait_for()
    legend = chart.inner_text()
    assert "sft" in legend and "run" in legend and "Held-out mIoU" in legend
    assert page.locator("#compare-reward-mean").is_visible()  # the GRPO run's reward alone
    page.get_by_label("0.6", exact=True).check()
    page.wait_for_timeout(1000)
    no_error_page(page)
    page.screenshot(path=str(ARTIFACTS / "compare.png"), full_page=True)
    page.close()


def test_more_frames_of_the_event_on_demand(browser, run_url):
    page = browser.new_page()
    page.goto(run_url)
    wait_rows(page, "responses", count=4)
    page.locator("#group input").click()
    page.get_by_role("option").filter(has_text="group 1").click()  # step 3, video 1: decoded from its file
    wait_text(page, "group-header", "sample-1")
    page.locator("#more-frames").click()
    page.wait_for_function("() => document.querySelectorAll('#event-strip img').length === 12")
    captions = page.locator("#event-strip figcaption").all_inner_texts()
    times = [float(c.split(" s")[0]) for c in captions]
    assert times[0] == 7.0 and times[-1] == 19.0 and times == sorted(times)  # truth 10-16 s and 3 s either side
    assert sum("truth" in c for c in captions) >= 5
    no_error_page(page)
    page.close()
