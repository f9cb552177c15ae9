"""The run summary's memory card (app/plan_card.py): the run's own plan beside its measured perf/peak_memory_mb,
what that figure means on the run's device, one line when the config cannot be planned, and the plan made once per
version of config.yaml / run.json."""

from __future__ import annotations

import json
import time

import pytest

import mmpg_app.plan_card as plan_card
from mmpg_app.run_source import RunSource
from mmpg_app.plan_card import plan_card_html
from mmpg_app.summary import summary_html
from mmpg.config import load_config
from mmpg.models.geometry import MODELS
from mmpg.plan.memory import predict
from mmpg.plan.recipe import recipe_from_config
from mmpg.plan.run import run_device
from synthetic_run import SMALL_PEAK_MB, make_small_run, make_small_sft_run


def card(run) -> str:
    src = RunSource(run)
    return plan_card_html(src.run_dir, src.reader().info(), src.metrics())


def test_the_card_sets_the_plan_beside_the_measured_peak(tmp_path):
    run = make_small_run(tmp_path / "run")
    html = card(run)
    cfg = load_config(str(run / "config.yaml"), [])
    mem = predict(recipe_from_config(cfg, 1, "cpu"))
    # a CPU run in float32: the weights part is 4 bytes per parameter of the preset, nothing sharded
    assert mem["parts"]["weights"] == 4 * MODELS["qwen3-vl-2b"].params()
    planned_mb = mem["peak_bytes"] / 2 ** 20
    measured_mb = max(SMALL_PEAK_MB.values())  # 32950 MB at step 2: the largest, not the last
    assert f'mmpg-planned">{planned_mb / 1024:.2f} GB' in html
    assert f'mmpg-measured">{measured_mb / 1024:.2f} GB' in html and "largest of 3 step(s)" in html
    top = sorted(((v, k) for k, v in mem["parts"].items() if v), reverse=True)[:3]
    for v, k in top:  # the largest parts, by name and size
        assert f"{k} {v / 2 ** 30:.2f} GB" in html
    # a CPU run that did not record its measure logged the whole process's ru_maxrss: shown, never divided
    assert "1 × CPU" in html and "ru_maxrss" in html and "whole process" in html
    assert "not comparable with the plan" in html and "×" not in html.replace("1 × CPU", "")
    page = summary_html(RunSource(run).metrics(), [], kind="grpo", more=html)
    assert page.index('data-metric="evaluation"') < page.index('data-metric="memory"')  # in the summary row


def test_a_cpu_run_that_records_its_measure_is_compared_within_the_stated_error(tmp_path):
    from mmpg.plan.run import CPU_STATED_ERROR

    run = make_small_run(tmp_path / "run")
    info = json.loads((run / "run.json").read_text())
    record = {"measure": "cpu.rss_above_baseline", "baseline_mb": 950.0, "high_water": "VmHWM", "from_step": 1,
              "mmap_threshold": 64 << 10}  # the plan's validation threshold: its stated error applies
    (run / "run.json").write_text(json.dumps({**info, "peak_memory": record}))
    cfg = load_config(str(run / "config.yaml"), [])
    planned_mb = predict(recipe_from_config(cfg, 1, "cpu"))["peak_bytes"] / 2 ** 20
    html = card(run)
    ratio = max(SMALL_PEAK_MB.values()) / planned_mb
    within = "within" if abs(ratio - 1) <= CPU_STATED_ERROR else "outside"
    assert f"×{ratio:.2f} of the plan, {within} its CPU error (±23.5%)" in html
    assert "above the process&#x27;s resident set (0.93 GB) before the model was loaded" in html
    assert "code pages left out" in html and "ru_maxrss" not in html
    # a run at the default 1 MiB threshold holds the heap's slack too: the ratio, no verdict against the band
    (run / "run.json").write_text(json.dumps({**info, "peak_memory": {**record, "mmap_threshold": 1 << 20}}))
    html = card(run)
    assert f"×{ratio:.2f} of the plan (its CPU error, ±23.5%, is stated at a 64 KiB allocator threshold only)" in html
    assert "within its CPU error" not in html and "outside its CPU error" not in html
    # a run of an older mmpg resumed by this one: its lines before the record's first step are not compared
    (run / "run.json").write_text(json.dumps({**info, "peak_memory": {**record, "from_step": 3}}))
    html = card(run)
    assert f'mmpg-measured">{SMALL_PEAK_MB[3] / 1024:.2f} GB' in html and "largest of 1 step(s)" in html


def test_a_gpu_run_is_planned_on_its_recorded_devices(tmp_path):
    run = make_small_run(tmp_path / "run")
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "device": "cuda", "devices": 2}))
    html = card(run)
    cfg = load_config(str(run / "config.yaml"), [])
    planned = predict(recipe_from_config(cfg, 2, "cuda"))["peak_bytes"] / 2 ** 30
    assert f'mmpg-planned">{planned:.2f} GB' in html and "2 × GPU" in html and "max_memory_allocated" in html
    # a run that did not record them: trainer.device (auto taken as a GPU) on one device, and the card says so
    device, devices, note = run_device({}, load_config(None, ["trainer.device=auto"]))
    assert (device, devices) == ("cuda", 1) and "did not record its device" in note and "count" in note


def test_a_run_that_cannot_be_planned_shows_one_line_why(tmp_path):
    sft = make_small_sft_run(tmp_path / "sft")  # its model is a checkpoint that no longer exists
    html = card(sft)
    assert "no plan: model &#x27;/checkpoints/gone&#x27;: no config.json there and not a preset" in html
    assert "mmpg-planned" not in html and "\n" not in html
    run = make_small_run(tmp_path / "run")
    (run / "config.yaml").write_text("model: [unclosed\n")
    assert "no plan:" in card(run) and "not a valid YAML config" in card(run)
    (run / "config.yaml").unlink()
    assert "no plan: no config.yaml in the run directory" in card(run)


def test_an_sft_run_is_planned_without_a_rollout(tmp_path):
    sft = make_small_sft_run(tmp_path / "sft")
    (sft / "config.yaml").write_text("model:\n  path: qwen3-vl-2b\ntrainer:\n  device: cpu\n  micro_batch_size: 2\n"
                                     "data:\n  max_frames: 4\n")
    html = card(sft)
    assert "mmpg-planned" in html and "SFT planned as an update" in html and "no perf/peak_memory_mb logged" in html
    assert "(update)" in html and "kv_cache" not in html


def test_the_plan_is_made_once_per_config_and_the_measured_peak_stays_current(tmp_path, monkeypatch):
    run = make_small_run(tmp_path / "run")
    calls = []
    real = plan_card.inspect_plan
    monkeypatch.setattr(plan_card, "inspect_plan", lambda *a: calls.append(a) or real(*a))
    first = card(run)
    assert card(run) == first and len(calls) == 1  # a refresh: no new plan
    with open(run / "metrics.jsonl", "a") as f:  # a new step with a higher peak: shown without planning again
        f.write(json.dumps({"v": 1, "step": 4, "time": 0, "perf/peak_memory_mb": 40960.0}) + "\n")
    assert 'mmpg-measured">40.00 GB' in card(run) and "largest of 4 step(s)" in card(run) and len(calls) == 1
    (run / "config.yaml").write_text((run / "config.yaml").read_text() + "algorithm:\n  beta: 0.04\n")
    assert card(run) != first and len(calls) == 2  # the config changed (a resumed run): planned again


@pytest.mark.parametrize("bad", ["trainer:\n  device: cpu\n  micro_batch_size: 3\nmodel:\n  path: qwen3-vl-2b\n"])
def test_impossible_settings_are_one_line_too(tmp_path, bad):
    run = make_small_run(tmp_path / "run")
    (run / "config.yaml").write_text(bad)
    html = card(run)
    assert "no plan: trainer.micro_batch_size=3 must be a multiple of rollout.n" in html


def test_prefetch_plans_in_the_background_and_the_page_reuses_it(tmp_path, monkeypatch):
    run = make_small_run(tmp_path / "run")
    calls = []
    real = plan_card.inspect_plan
    monkeypatch.setattr(plan_card, "inspect_plan", lambda *a: calls.append(a) or real(*a))
    plan_card.prefetch(run)
    deadline = time.monotonic() + 30
    while plan_card._plan_key(run) not in plan_card._CACHE and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(calls) == 1 and "mmpg-planned" in card(run) and len(calls) == 1
