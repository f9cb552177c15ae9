"""`mmpg doctor` on the CPU, run as its own process (forked from the warm one, tests/forked_cli.py; the installed
console script is tests/test_cli.py's): its report says NOT RUN with the reason for every CUDA row, PASS with a figure
for every CPU row it ran, and a fault injected into one row makes it exit 1 naming that row. The training row and the
speed table (about 45 s more) run in the slow test."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from mmpg.doctor import results, train_check
from train_utils import env as cli_env
from train_utils import run_cli

ROOT = Path(__file__).resolve().parents[1]


def _doctor(args: list[str], out: Path, fault: str = "", timeout: float = 300) -> tuple[subprocess.CompletedProcess,
                                                                                        dict]:
    environ = {k: v for k, v in cli_env().items() if k != "MMPG_DOCTOR_FAULT"}
    environ.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", FORCE_QWENVL_VIDEO_READER="decord")
    if fault:
        environ["MMPG_DOCTOR_FAULT"] = fault
    proc = run_cli(["doctor", "--out", str(out), *args], timeout=timeout, environ=environ)
    data = json.loads((out / "doctor.json").read_text()) if (out / "doctor.json").exists() else {}
    return proc, data


def _rows(data: dict) -> dict[str, dict]:
    return {r["id"]: r for r in data["rows"]}


CUDA_ROWS = ["grouped/flash/qwen2_5_vl/bfloat16", "grouped/sdpa/qwen2_5_vl/bfloat16", "grouped/flex/qwen2/bfloat16",
             "cascade/flash/bfloat16", "cascade/sdpa/bfloat16", "decode/flash/qwen2", "sync/nccl",
             "sync/nccl-pool"]


def _check_cpu_report(proc, data: dict, out: Path, cpu_rows: int) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(data)
    cpu = [i for i in rows if i.endswith("/float32") or i.startswith(("decode/sdpa", "decode/math", "decode/auto"))]
    assert len(cpu) >= cpu_rows, sorted(rows)
    for row_id in cpu:
        assert rows[row_id]["status"] == "PASS" and rows[row_id]["figure"], rows[row_id]
    for row_id in CUDA_ROWS:
        assert rows[row_id]["status"] == "NOT RUN" and "CUDA" in rows[row_id]["detail"], rows[row_id]
    assert rows["env/cuda"]["status"] == "NOT RUN" and rows["env/transformers"]["status"] == "PASS"
    md = (out / "doctor.md").read_text()
    assert md.count("**PASS**") == sum(r["status"] == "PASS" for r in rows.values())
    assert data["exit"] == 0 and data["failed"] == []
    assert "0 FAIL" in proc.stdout
    return rows


def test_doctor_on_the_cpu_reports_every_row(tmp_path):
    """A few rows of each kind (the whole run is the slow test below): CPU rows PASS with a figure, CUDA rows NOT RUN
    with the reason."""
    only = ("grouped/auto,grouped/sdpa/qwen2_5_vl,grouped/flash,grouped/flex/qwen2,cascade,decode/sdpa/qwen2,"
            "decode/flash/qwen2,sync")
    proc, data = _doctor(["--quick", "--device", "cpu", "--only", only], tmp_path)
    rows = _check_cpu_report(proc, data, tmp_path, 4)
    assert "max abs dlogp" in rows["grouped/sdpa/qwen2_5_vl/float32"]["figure"]
    assert "identical" in rows["decode/sdpa/qwen2"]["figure"]
    assert rows["grouped/auto"]["figure"] == "resolves to sdpa"


def test_a_faulty_path_fails_and_is_named(tmp_path):
    proc, data = _doctor(["--quick", "--only", "grouped/sdpa/qwen2,cascade/sdpa"], tmp_path,
                         fault="grouped/sdpa/qwen2")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(data)
    assert rows["grouped/sdpa/qwen2/float32"]["status"] == "FAIL"
    assert "logprobs differ by 0.1" in rows["grouped/sdpa/qwen2/float32"]["detail"]
    assert rows["grouped/sdpa/qwen2_5_vl/float32"]["status"] == "PASS"  # the fault is in one row only
    assert rows["cascade/sdpa/float32"]["status"] == "PASS"
    assert data["failed"] == ["grouped/sdpa/qwen2/float32"]
    assert "FAILED: grouped/sdpa/qwen2/float32 (logprobs differ" in proc.stdout
    assert not any(i.startswith("decode/") for i in rows)  # --only


def test_a_raising_path_is_a_failed_row():
    from mmpg.doctor.checks import guarded

    def boom():
        raise RuntimeError("no kernel image is available for execution on the device")

    row = guarded(boom, "cascade", "cascade/flash/bfloat16", "cascade kernel flash")
    assert row.status == "FAIL" and "no kernel image" in row.detail
    assert results.exit_code([row]) == 1


def test_train_judge():
    ok = [{"step": s, "actor/logprob_gap_max": 0.002, "timing_s/step": 1.0} for s in (1, 2, 3)]
    ok[0].update({"check/grouped_vs_repeated_max": 0.001, "check/bound": 0.0125})
    assert train_check.judge(ok, 0, "")[0] == "PASS"
    status, _, detail = train_check.judge(ok[:1], 0, "")
    assert status == "FAIL" and "1 of 3 steps" in detail
    bad = [dict(ok[0], **{"check/grouped_vs_repeated_max": 0.2}), *ok[1:]]
    assert "above its bound" in train_check.judge(bad, 0, "")[2]
    assert "drift alarm" in train_check.judge([*ok[:2], dict(ok[2], **{"alarm/logprob_drift": 1.0})], 0, "")[2]


@pytest.mark.slow
def test_doctor_full_run_on_the_cpu(tmp_path):
    """The whole run a user gets (about a minute on 2 idle cores): every CPU row, training and the speed table."""
    proc, data = _doctor(["--device", "cpu"], tmp_path, timeout=900)
    rows = _check_cpu_report(proc, data, tmp_path, 15)
    assert rows["train/bf16"]["status"] == "PASS" and "self-check max abs dlogp" in rows["train/bf16"]["figure"]
    for row_id in ("speed/forward", "speed/decode"):
        assert rows[row_id]["status"] == "PASS" and "x" in rows[row_id]["figure"], rows[row_id]
    assert all(rows[f"decode/auto/{f}"]["figure"] == "chose sdpa" for f in ("qwen2_5_vl", "qwen3_vl", "qwen2"))


def test_driver_too_old_for_torch_is_named(monkeypatch):
    """torch built for CUDA 13.0 on a driver that supports 12.8: the CUDA row says what is wrong and what to do."""
    import torch

    from mmpg.doctor.environment import cuda_status

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", lambda: 12080, raising=False)
    usable, why = cuda_status()
    assert not usable
    assert "supports CUDA up to 12.8" in why and "needs CUDA >= 13.0" in why and "update the driver" in why


def test_gpu_check_script_is_mmpg_doctor_under_a_time_limit(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MMPG_DOCTOR_FAULT"}
    env.update(OUT=str(tmp_path / "a"), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    run = lambda **extra: subprocess.run(  # noqa: E731
        ["bash", "scripts/gpu_check.sh", "--quick", "--only", "cascade/sdpa/float32"], cwd=ROOT,
        env={**env, **extra}, capture_output=True, text=True, timeout=300)
    proc = run()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = _rows(json.loads((tmp_path / "a" / "doctor.json").read_text()))
    assert rows["cascade/sdpa/float32"]["status"] == "PASS"
    proc = run(OUT=str(tmp_path / "b"), MMPG_DOCTOR_LIMIT_S="1")
    assert proc.returncode == 124 and "stopped at the 1 s limit" in proc.stderr


def test_asking_for_cuda_without_one_is_one_error(tmp_path):
    import argparse

    import torch

    from mmpg.doctor import cli
    from mmpg.errors import UserError

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(UserError, match="--device cuda, but .*--device auto or cpu"):
        cli.run(parser.parse_args(["--device", "cuda", "--out", str(tmp_path)]))
