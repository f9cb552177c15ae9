"""`mmpg eval` end to end on the CPU with the tiny Qwen2.5-VL checkpoint and synthetic videos: the files it writes, a
run interrupted part-way and restarted (same metrics, finished samples not decoded again), two ranks == one process,
missing and corrupt videos under both policies, and every checkpoint of a training run."""

from __future__ import annotations

import json
import shutil

import pytest

from mmpg.errors import UserError
from mmpg.eval.runner import evaluate_checkpoint
from mmpg.eval.settings import load_settings
from mmpg.runs.evals import EvalReader
from train_utils import overrides, run_cli

pytestmark = pytest.mark.slow

# Small frames, short answers: each sample takes a fraction of a second on the CPU.
FAST = ["fps=1", "max_frames=4", "min_pixels=3136", "max_pixels=3136", "max_new_tokens=8", "num_workers=0",
        "batch_size=4"]
PLOTS = ["iou_histogram.png", "recall_vs_threshold.png", "start_end.png"]


def _rows(folder):
    return [(r.index, r.sample_id, r.text, r.pred_span, r.iou, r.error) for r in EvalReader(folder).predictions()]


def _scores(metrics: dict) -> dict:
    """metrics.json without the perf/* counts, which describe the call that finished it (a rerun decodes less)."""
    return {k: v for k, v in metrics.items() if not k.startswith("perf/")}


def _main(args, capsys):
    from mmpg.cli import main

    code = main(["eval"] + [str(a) for a in args])
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    return out.out


@pytest.fixture(scope="module")
def train_eval(grpo_data, tmp_path_factory):
    """One-process evaluation of the 11 training-split samples (the reference for resume and sharding)."""
    synth = grpo_data["synth"]
    out = tmp_path_factory.mktemp("eval") / "train"
    result = evaluate_checkpoint(grpo_data["model"], synth / "train.json", synth / "videos", out, load_settings(
        "default", FAST))
    assert result.decoded == 11 and result.reused == 0
    return out, result.metrics


OUR_PROMPT = 'The video lasts {duration} seconds. When does "{query}" happen? Answer <answer>START to END</answer>.'


def test_end_to_end_on_the_synthetic_test_split(grpo_data, tmp_path, capsys):
    synth, out = grpo_data["synth"], tmp_path / "out"
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(OUR_PROMPT)
    printed = _main(["--checkpoint", grpo_data["model"], "--annotations", synth / "test.json", "--videos",
                     synth / "videos", "--protocol", "time_r1", "--out", out] + FAST + [f"prompt_file={prompt}"],
                    capsys)
    assert "R1@0.3/0.5/0.7 =" in printed and "decoded 2 samples" in printed
    assert sorted(p.name for p in out.iterdir()) == ["eval.json", "metrics.json", "plots", "predictions.jsonl",
                                                    "report.md"]
    assert sorted(p.name for p in (out / "plots").iterdir()) == PLOTS
    reader = EvalReader(out)
    metrics, info, records = reader.metrics(), reader.info(), reader.predictions()
    assert [r.index for r in records] == [0, 1] and all(r.error is None and r.text for r in records)
    assert metrics["count"] == metrics["total"] == 2 and metrics["threshold_rule"] == "gt"
    assert {"miou", "r1@0.3", "r1@0.5_ge", "r1@0.7", "unparseable", "failed"} <= set(metrics)
    s = info["settings"]
    assert (info["protocol"], s["template"], s["scoring"], s["max_new_tokens"], s["fps"], s["dtype"]) == \
        ("time_r1", "file", "last_span", 8, 1.0, "float32")
    assert s["video"]["total_pixels"] == 3584 * 28 * 28 and info["checkpoint"].endswith("qwen2_5_vl")
    report = (out / "report.md").read_text()
    for text in ("tIoU > m (Time-R1)", "tIoU >= m (VideoChat-R1)", "Unparseable answers (scored IoU 0)",
                 "Failed samples", "| max_new_tokens | 8 |", "| dtype | float32 |", "| video.fps | 1.0 |",
                 "When does", "| scoring | last_span |", "plots/recall_vs_threshold.png", "time_r1",
                 "## Coverage", "queries in the annotation file: **2**", "evaluated: **2**; scored: **2**"):
        assert text in report, text
    assert "## Fast paths" in report and "| grouped_backend | sdpa |" in report  # mmpg.choices, as decided here
    assert report.index("tIoU > m (Time-R1) |") < report.index("tIoU >= m (VideoChat-R1) |")


def test_interrupted_and_rerun_gives_the_same_metrics_without_decoding_finished_samples(
        grpo_data, train_eval, tmp_path, monkeypatch):
    from mmpg.rollout import HFEngine

    ref, ref_metrics = train_eval
    out = tmp_path / "killed"
    shutil.copytree(ref, out)
    lines = (out / "predictions.jsonl").read_bytes().splitlines(keepends=True)
    # a kill after 4 whole lines and half of the fifth; the summary files are not written yet
    (out / "predictions.jsonl").write_bytes(b"".join(lines[:4]) + lines[4][: len(lines[4]) // 2])
    for name in ("metrics.json", "report.md"):
        (out / name).unlink()
    shutil.rmtree(out / "plots")
    prompts = []
    original = HFEngine.generate_groups
    monkeypatch.setattr(HFEngine, "generate_groups", lambda self, inputs, *a, **k: (
        prompts.append(int(inputs["input_ids"].shape[0])), original(self, inputs, *a, **k))[1])
    synth = grpo_data["synth"]
    result = evaluate_checkpoint(grpo_data["model"], synth / "train.json", synth / "videos", out,
                                 load_settings("default", FAST))
    assert (result.decoded, result.reused, sum(prompts)) == (7, 4, 7)  # only the 7 unfinished samples
    assert _scores(result.metrics) == _scores(ref_metrics) and _rows(out) == _rows(ref)
    assert (result.metrics["perf/samples_decoded"], ref_metrics["perf/samples_decoded"]) == (7, 11)
    assert sorted(p.name for p in (out / "plots").iterdir()) == PLOTS
    prompts.clear()
    again = evaluate_checkpoint(grpo_data["model"], synth / "train.json", synth / "videos", out,
                                load_settings("default", FAST))
    assert (again.decoded, again.reused, prompts) == (0, 11, []) and _scores(again.metrics) == _scores(ref_metrics)
    with pytest.raises(UserError, match="other settings"):  # the same folder with other settings is refused
        evaluate_checkpoint(grpo_data["model"], synth / "train.json", synth / "videos", out,
                            load_settings("default", FAST + ["max_new_tokens=9"]))


def test_two_ranks_give_the_same_predictions_and_metrics_as_one_process(grpo_data, train_eval, tmp_path):
    ref, ref_metrics = train_eval
    synth, out = grpo_data["synth"], tmp_path / "sharded"
    proc = run_cli(["eval", "--checkpoint", grpo_data["model"], "--annotations", str(synth / "train.json"),
                    "--videos", str(synth / "videos"), "--out", str(out), *FAST], procs=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("wrote ") == 1  # rank 0 alone reports
    assert _rows(out) == _rows(ref)
    assert EvalReader(out).metrics() == ref_metrics  # the same batches: the same counts too (perf/*)
    assert EvalReader(out).info()["runtime"]["world_size"] == 2


def test_missing_and_corrupt_videos_are_counted_and_scored_or_skipped(grpo_data, tmp_path, capsys):
    synth = grpo_data["synth"]
    good = json.loads((synth / "test.json").read_text())
    vid, entry = next(iter(good.items()))
    corrupt = tmp_path / "corrupt.mp4"
    corrupt.write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8)
    lines = [{"id": "good", "video": str(synth / "videos" / f"{vid}.mp4"), "duration": entry["duration"],
              "query": entry["sentences"][0], "span": entry["timestamps"][0]},
             {"id": "missing", "video": str(tmp_path / "missing.mp4"), "duration": 10.0, "query": "x", "span": [1, 2]},
             {"id": "corrupt", "video": str(corrupt), "duration": 10.0, "query": "y", "span": [1, 2]}]
    ann = tmp_path / "bad.jsonl"
    ann.write_text("".join(json.dumps(x) + "\n" for x in lines))
    for mode, count in (("fail", 3), ("skip", 1)):
        out = tmp_path / mode
        _main(["--checkpoint", grpo_data["model"], "--annotations", ann, "--out", out, *FAST, f"bad_videos={mode}"],
              capsys)
        m, records = EvalReader(out).metrics(), EvalReader(out).predictions()
        assert (m["total"], m["count"], m["failed"]) == (3, count, 2)
        errors = {r.sample_id: r.error for r in records}
        assert errors["good"] is None and "missing.mp4: video file not found" in errors["missing"]
        assert "corrupt.mp4" in errors["corrupt"]
        report = (out / "report.md").read_text()
        assert "Failed samples (video missing, unreadable or corrupt): **2** of 3" in report
        assert ("scored as failures" if mode == "fail" else "left out of the metrics (bad_videos=skip)") in report
        assert "`missing` (index 1)" in report and "`corrupt` (index 2)" in report


def test_every_checkpoint_of_a_training_run(grpo_data, tmp_path, capsys):
    proc = run_cli(["train"] + overrides(grpo_data, tmp_path, "run", **{
        "trainer.total_steps": 2, "checkpoint.every_n_steps": 1, "checkpoint.keep_last": 0}))
    assert proc.returncode == 0, proc.stderr[-4000:]
    run, synth = tmp_path / "run", grpo_data["synth"]
    args = ["--run", run, "--annotations", synth / "test.json", "--videos", synth / "videos"] + FAST
    printed = _main(args, capsys)
    assert "step 1: wrote" in printed and "step 2: wrote" in printed
    bench = run / "evals" / "test"
    for step in (1, 2):
        folder = bench / f"step_{step:08d}"
        assert EvalReader(folder).metrics()["count"] == 2 and EvalReader(folder).info()["step"] == step
        assert EvalReader(folder).info()["checkpoint"] == str((run / "checkpoints" / folder.name).resolve())
    table = (bench / "over_steps.md").read_text()
    assert "| 1 |" in table and "| 2 |" in table and (bench / "over_steps.png").read_bytes()[:4] == b"\x89PNG"
    printed = _main(args, capsys)  # everything finished: nothing decoded again
    assert "step 1: already evaluated, skipped" in printed and "step 2: already evaluated, skipped" in printed
    # a run's checkpoint given alone goes into the run's evaluation folder by default
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(OUR_PROMPT)
    single = _main(["--checkpoint", run / "checkpoints" / "step_00000002", "--annotations", synth / "test.json",
                    "--videos", synth / "videos", "--protocol", "videochat_r1"] + FAST + [f"prompt_file={prompt}"],
                   capsys)
    assert "evals/test-videochat_r1/step_00000002" in single
    assert EvalReader(bench.parent / "test-videochat_r1" / "step_00000002").metrics()["threshold_rule"] == "ge"


def test_self_check_of_the_decode_engine(grpo_data, tmp_path, monkeypatch, caplog):
    """The first batch's answers are rescored by the repeated forward (self_check on by default): it passes on the
    real engine; an engine whose logprobs are off (here: shifted by 0.01 on purpose) stops the evaluation with one
    line, and self_check=warn goes on."""
    import logging

    from mmpg.rollout import HFEngine

    synth = grpo_data["synth"]
    with caplog.at_level(logging.INFO, logger="mmpg.grouping"):
        evaluate_checkpoint(grpo_data["model"], synth / "test.json", synth / "videos", tmp_path / "ok",
                            load_settings("default", FAST))
    assert any(r.getMessage().startswith("self-check passed: decode engine vs repeated forward") for r in caplog.records)
    real = HFEngine.generate_groups

    def off(self, *args, **kwargs):
        r = real(self, *args, **kwargs)
        r.logprobs = r.logprobs + 0.01 * r.completion_mask
        return r

    monkeypatch.setattr(HFEngine, "generate_groups", off)
    with pytest.raises(UserError, match=r"^self-check: the decode engine differs from the repeated forward by 0\.01"):
        evaluate_checkpoint(grpo_data["model"], synth / "test.json", synth / "videos", tmp_path / "bad",
                            load_settings("default", FAST))
    result = evaluate_checkpoint(grpo_data["model"], synth / "test.json", synth / "videos", tmp_path / "warn",
                                 load_settings("default", FAST + ["self_check=warn"]))
    assert result.decoded == 2
