"""scripts/zoom_learning.sh (`mmpg.toy.demo.zoom_learning`): the zoom-against-one-look experiment of
docs/performance.md, run end to end at a tiny size (4 videos, a couple of steps a stage): both arms train and are
evaluated as the module says (the zoom SFT's first steps without the tool's schema, then with it), one arm alone
writes no comparison and a run of both reuses it, the table and summary.json hold the five rows, and a second run
reuses every stage."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from train_utils import ROOT, env

pytestmark = pytest.mark.slow

FLAGS = ["--videos", "4", "--unlisted-steps", "1", "--clip-steps", "1", "--answer-steps", "1", "--sft-steps", "2", "--one-look-sft-steps", "1", "--grpo-steps", "1", "--test-samples", "1"]


def _run(workdir, *more):
    return subprocess.run(["bash", "scripts/zoom_learning.sh", "--workdir", str(workdir), *FLAGS, *more], cwd=ROOT,
                          env=env(), capture_output=True, text=True, timeout=900, check=False)


def _config(run):
    return yaml.safe_load((run / "config.yaml").read_text())


def test_both_arms_train_and_are_evaluated_and_a_second_run_reuses_them(tmp_path):
    from mmpg.toy.demo.zoom_learning import (ANSWER_FILE, CLIP_FILE, FIRST_TURN_FILE, ONE_LOOK, TASK, TEST_CLIP_FILE,
                                             WINDOWS, Paths)
    from mmpg.toy.zoom_task import clip_times, zoom_scenes

    # --videos 4, seed 0, --unlisted-steps 1, --answer-steps 1, --clip-steps 1: this experiment's folders
    paths = Paths.under(tmp_path / "w", 4, 0, 1, 1, 1)
    # the first stages' data in the folder's name: a folder of whole-trajectory first stages is not resumed as this one
    assert paths.runs.parent.name.endswith("-seed0-first1-clips1-answer1")
    alone = _run(tmp_path / "w", "--arm", "one_look")  # one arm: its rows, no comparison written
    assert alone.returncode == 0, alone.stdout[-3000:] + alone.stderr[-3000:]
    assert "one_look arm only" in alone.stdout and "| one look, + GRPO | 1 |" in alone.stdout
    assert "zoom, SFT" not in alone.stdout and not (paths.results / "summary.json").exists()
    assert not (paths.runs / "zoom-sft").exists() and (tmp_path / "w" / ".build.lock").is_file()
    proc = _run(tmp_path / "w")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(": reused ") == 2 and "built now: nothing" in proc.stdout  # the one-look arm's stages
    out = json.loads((paths.results / "summary.json").read_text())
    assert [(r["arm"], r["stage"], r["steps"]) for r in out["rows"]] == [
        ("zoom", "sft-unlisted", 1), ("zoom", "sft-clips", 1), ("zoom", "sft-answer", 1), ("zoom", "sft", 2),
        ("zoom", "grpo", 1),
        ("one_look", "sft", 1), ("one_look", "grpo", 1)]
    assert out["rows"][0]["label"] == "zoom, SFT of the first turn alone (no tool schema)"
    assert out["rows"][1]["label"] == "zoom, SFT of the answer on the clip alone (one look at the rule's window)"
    assert out["rows"][2]["label"] == "zoom, SFT of the answer turn alone"
    for r in out["rows"]:
        clips = r["stage"] == "sft-clips"  # evaluated as one look at the test video's rule window, the true span
        assert r["metrics"]["count"] == 1  # --test-samples 1
        # the zoom protocol for the zoom arm
        assert ("zoom/used_share" in r["metrics"]) == (r["arm"] == "zoom" and not clips)
        calls = r["first_calls"]  # the zoom arm's first turns against the rule's window; none for one look
        assert (calls is None) if r["arm"] == "one_look" or clips else (0.0 <= calls["rule_call_share"] <= 1.0)
        read = r["readout"]  # the zoom SFT stages' answer readout on the test video's rule trajectory
        assert (read is None) if r["arm"] == "one_look" or r["stage"] == "grpo" or clips else (
            read["count"] == read["attention_count"] == 1 and len(read["flash_rank"]) == 4
            and read["nats"]["start_units"] > 0)
        if read:  # kept beside the checkpoint's evaluations, reused by the run after
            assert (Path(r["checkpoint"]).parent.parent / "evals" / "readout" / f"{Path(r['checkpoint']).name}.json"
                    ).is_file()
        overview = TASK.duration * TASK.overview_fps
        zoomed = r["metrics"].get("zoom/clip_frames_mean", 0.0)
        test_clip = json.loads((paths.data / TEST_CLIP_FILE).read_text())
        (scene,) = [s for s in zoom_scenes(4, 2, TASK) if test_clip["video"].endswith(f"{s.video_id}.mp4")]
        assert r["frames"] == (len(clip_times(scene, TASK, *test_clip["clip"])) if clips else overview + zoomed
                               if r["arm"] == "zoom" else ONE_LOOK["max_frames"])
        settings = json.loads((Path(r["eval"]) / "eval.json").read_text())["settings"]
        # each stage evaluated behind the prompt it trained on: the unlisted stage's without the tool's schema
        assert settings["template"] == ("zoom" if r["arm"] == "zoom" and not clips else "time_r1")
        assert settings["zoom_list_tools"] is (r["stage"] != "sft-unlisted")
    runs = paths.runs
    unlisted, clip, answer, zoom_sft, zoom_grpo = (_config(runs / f"zoom-{k}")
                                                   for k in ("sft-unlisted", "sft-clips", "sft-answer", "sft", "grpo"))
    # the rule's first turns alone (one a training video) without the schema, then all 4 windows with it
    assert unlisted["sft"]["trajectories"].endswith(FIRST_TURN_FILE) and unlisted["data"]["queries_per_video"] == 1
    assert zoom_sft["sft"]["trajectories"].endswith("trajectories.jsonl")
    assert zoom_sft["data"]["queries_per_video"] == zoom_sft["trainer"]["micro_batch_size"] == WINDOWS
    assert unlisted["data"]["template"] == zoom_sft["data"]["template"] == "zoom"
    first = [json.loads(line) for line in (paths.data / FIRST_TURN_FILE).read_text().splitlines()]
    every = [json.loads(line) for line in (paths.data / "trajectories.jsonl").read_text().splitlines()]
    assert len(first) == 3 and len(every) == 3 * WINDOWS  # 3 training videos of 4
    rule = [t for t in every if "weight" not in t["messages"][0]]  # the calls in the loss, in order
    for f, r in zip(first, rule, strict=True):  # the same trajectory, its answer forwarded but out of the loss
        assert [m["weight"] for m in f["messages"] if "weight" in m] == [0] and f["messages"][-1]["weight"] == 0
        assert [{k: v for k, v in m.items() if k != "weight"} for m in f["messages"]] == r["messages"]
        assert {k: v for k, v in f.items() if k != "messages"} == {k: v for k, v in r.items() if k != "messages"}
    assert unlisted["sft"]["list_tools"] is False and zoom_sft["sft"]["list_tools"] is True
    # the answer stage: every trajectory, its call out of the loss, 8 videos a step, behind the listed prompt
    assert answer["sft"]["trajectories"].endswith(ANSWER_FILE) and answer["data"]["queries_per_video"] == 1
    assert answer["sft"]["list_tools"] is True
    answers = [json.loads(line) for line in (paths.data / ANSWER_FILE).read_text().splitlines()]
    assert [[m.get("weight", 1) for m in t["messages"] if m["role"] == "assistant"] for t in answers] == \
        [[0, 1]] * len(every)
    assert [{k: v for k, v in t.items() if k != "messages"} for t in answers] == \
        [{k: v for k, v in t.items() if k != "messages"} for t in every]
    assert zoom_sft["model"]["path"].startswith(str(runs / "zoom-sft-answer"))
    # the clip stage: one look at each trajectory's window at the zoom's frame rate, the rule's copied answer
    assert clip["model"]["path"].startswith(str(runs / "zoom-sft-unlisted"))
    assert answer["model"]["path"].startswith(str(runs / "zoom-sft-clips"))
    assert (clip["data"]["template"], clip["data"]["fps"], clip["data"]["max_frames"], clip["sft"]["think"]) == (
        "time_r1", TASK.zoom_fps, TASK.zoom_max_frames, "The flash is visible.")
    assert clip["data"]["train"].endswith(CLIP_FILE)
    clip_lines = [json.loads(line) for line in (paths.data / CLIP_FILE).read_text().splitlines()]
    assert [(c["video"], c["span"], c["clip"]) for c in clip_lines] == [(t["video"], t["answer"], t["window"])
                                                                       for t in every if t["messages"][-1][
                                                                           "content"].startswith("<think>The flash")]
    assert zoom_grpo["data"]["template"] == "zoom" and zoom_grpo["model"]["path"].startswith(str(runs / "zoom-sft"))
    one = _config(runs / "one_look-grpo")
    assert (one["data"]["template"], one["data"]["fps"], one["data"]["max_frames"]) == (
        "time_r1", ONE_LOOK["fps"], ONE_LOOK["max_frames"])
    assert one["model"]["path"].startswith(str(runs / "one_look-sft"))
    assert "mIoU points (the issue's bar: +10)" in proc.stdout
    # each stage's training time from its run's metrics.jsonl, also the one-look stages the run before trained; an
    # evaluation's only where this command decoded it
    stages = [f"{r['arm']}-{r['stage']}" for r in out["rows"]]
    assert all(out["seconds"][s] > 0 for s in stages) and out["seconds"]["zoom-grpo-eval"] > 0
    assert not any(k.startswith("one_look") and k.endswith("-eval") for k in out["seconds"])
    assert "| zoomed | first call the rule's (distinct calls) | start's units / tenths (nats) | start right | " \
        "flash pair's rank, last layer |" in proc.stdout
    # --readout: the kept readout of a checkpoint, printed without training
    answer_row = out["rows"][2]
    read = subprocess.run(["bash", "scripts/zoom_learning.sh", "--readout", answer_row["checkpoint"], "--test-samples",
                           "1"], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300, check=False)
    assert read.returncode == 0, read.stderr[-3000:]
    units = answer_row["readout"]["nats"]["start_units"]
    assert read.stdout.startswith(answer_row["checkpoint"]) and f"start_units {units:.2f}" in read.stdout
    bad = subprocess.run(["bash", "scripts/zoom_learning.sh", "--readout", str(tmp_path)], cwd=ROOT, env=env(),
                         capture_output=True, text=True, timeout=300, check=False)
    assert bad.returncode == 2 and "not a checkpoint folder" in bad.stderr
    again = _run(tmp_path / "w")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count(": reused ") == 7 and "built now: nothing" in again.stdout
    scores = ("miou", "r1@0.3", "r1@0.5", "unparseable", "count")
    summary = json.loads((paths.results / "summary.json").read_text())
    rows = summary["rows"]
    assert summary["seconds"] == {s: out["seconds"][s] for s in stages}  # all reused: the stages' own times, no eval
    assert [(r["checkpoint"], r["frames"], {k: r["metrics"][k] for k in scores}, r["readout"]) for r in rows] == \
        [(r["checkpoint"], r["frames"], {k: r["metrics"][k] for k in scores}, r["readout"]) for r in out["rows"]]
    for other in (Paths.under(tmp_path / "w", 4, 1, 1, 1, 1), Paths.under(tmp_path / "w", 4, 0, 0, 1, 1),
                  Paths.under(tmp_path / "w", 4, 0, 1, 1), Paths.under(tmp_path / "w", 4, 0, 1, 0, 1)):
        # another training seed, no unlisted stage or no answer stage: the same model, videos and frames, own runs
        assert (other.model, other.data, other.frames) == (paths.model, paths.data, paths.frames)
        assert other.runs != paths.runs and other.results != paths.results
