"""`checkpoint.resume=auto` without `trainer.run_name` (`RESUME=auto` in the launch scripts): the newest run of the
same job and --config file that holds a complete checkpoint is continued and named in one line; with none, one line
says a new run starts. Never a silent fresh start."""

from __future__ import annotations

import json
import os
import time

from mmpg.runs import mark_complete
from mmpg.train.resume import config_file, run_to_continue


def _run(root, name, kind, command, steps=(), mtime=None):
    run = root / name
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"layout_version": 1, "kind": kind, "command": command}))
    for step in steps:
        ckpt = run / "checkpoints" / f"step_{step:08d}"
        ckpt.mkdir(parents=True)
        mark_complete(ckpt)
        if mtime is not None:
            os.utime(ckpt / "COMPLETE", (mtime + step, mtime + step))
    return run


def test_the_newest_run_of_the_same_config_and_job_is_continued(tmp_path):
    config = tmp_path / "grounding.yaml"
    other = tmp_path / "other.yaml"
    cmd = ["mmpg", "train", "--config", str(config), "data.batch_size=8"]
    now = time.time()
    _run(tmp_path / "runs", "20261201-100000", "grpo", cmd, steps=(10, 20), mtime=now - 1000)
    _run(tmp_path / "runs", "20261202-100000", "grpo", cmd, steps=(5,), mtime=now)  # completed last
    _run(tmp_path / "runs", "20261203-100000", "grpo", cmd)  # started after, killed before its first checkpoint
    _run(tmp_path / "runs", "20261204-100000", "sft", ["mmpg", "sft", "--config", str(config)], steps=(50,),
         mtime=now + 100)  # another job
    _run(tmp_path / "runs", "20261205-100000", "grpo", ["mmpg", "train", "--config", str(other)], steps=(50,),
         mtime=now + 100)  # another config
    (tmp_path / "runs" / "not-a-run").mkdir()

    name, line = run_to_continue(str(tmp_path / "runs"), "grpo", ["mmpg", "train", "--config", str(config),
                                                                   "data.batch_size=8", "--resume", "auto"])
    assert name == "20261202-100000"
    assert "continuing" in line and "from its step 5" in line and "the newest checkpoint of 3 grpo runs" in line
    assert "other overrides" not in line

    name, line = run_to_continue(str(tmp_path / "runs"), "grpo", ["mmpg", "train", "--config", str(config),
                                                                   "data.batch_size=16"])
    assert name == "20261202-100000"
    assert line.endswith("it was started with other overrides: data.batch_size=8")


def test_nothing_to_continue_is_said(tmp_path):
    config = tmp_path / "grounding.yaml"
    name, line = run_to_continue(str(tmp_path / "missing"), "grpo", ["mmpg", "train", "--config", str(config)])
    assert name is None and "no earlier grpo runs" in line and "(none): starting a new run" in line
    _run(tmp_path / "runs", "a", "grpo", ["mmpg", "train", "--config", str(config)])
    name, line = run_to_continue(str(tmp_path / "runs"), "grpo", ["mmpg", "train", f"--config={config}"])
    assert name is None and "(1 without a complete checkpoint): starting a new run" in line


def test_config_paths_compare_resolved(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    assert config_file(["mmpg", "train", "--config", "configs/x.yaml"]) == str(tmp_path / "configs" / "x.yaml")
    assert config_file(["mmpg", "train", "--config=./configs/x.yaml"]) == str(tmp_path / "configs" / "x.yaml")
    assert config_file(["mmpg", "train", "a=b"]) is None
