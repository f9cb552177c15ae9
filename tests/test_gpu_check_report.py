"""scripts/gpu_check.sh's decisions (issue 15, findings 2 and 9), checked on a CPU with a GPU run's outputs written
by hand: the check fails loudly when a GPU is there but the flash tests were skipped (flash-attn did not install),
and its time limits come from the FLOPs model and fit the 10 minutes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mmpg.grouping import gpu_check

CASE = '<testcase classname="tests.test_grouping_gpu" name="{name}" time="1.0">{body}</testcase>'


def _junit(tmp_path, cases) -> str:
    body = "".join(CASE.format(name=n, body=b) for n, b in cases)
    path = tmp_path / "gpu-tests.xml"
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{body}</testsuite></testsuites>')
    return str(path)


SKIP = '<skipped type="pytest.skip" message="could not import \'flash_attn\': No module named \'flash_attn\'"/>'
ALL_PASS = [("test_gpu_backend_vl[bf16-flash-qwen2_5_vl]", ""), ("test_gpu_backend_vl[bf16-flex-qwen3_vl]", ""),
            ("test_gpu_backend_text[sdpa]", ""), ("test_cuda_model_with_cpu_processor_output", "")]


def test_everything_ran_and_passed(tmp_path):
    rows, code = gpu_check.summary(_junit(tmp_path, ALL_PASS), 0, gpu_present=True)
    assert code == 0 and all(status == "passed" for _, status, _ in rows)


def test_gpu_present_but_flash_skipped_fails_loudly(tmp_path):
    cases = [(n, SKIP if "flash" in n else "") for n, _ in ALL_PASS]
    rows, code = gpu_check.summary(_junit(tmp_path, cases), 0, gpu_present=True)
    assert code != 0
    flash = dict((name, (status, detail)) for name, status, detail in rows)["flash kernel (flash-attn varlen)"]
    assert flash[0] == "NOT RUN" and "No module named 'flash_attn'" in flash[1]


def test_failures_timeouts_and_missing_results_fail(tmp_path):
    failing = [(n, '<failure message="boom"/>' if "flex" in n else "") for n, _ in ALL_PASS]
    assert gpu_check.summary(_junit(tmp_path, failing), 0, gpu_present=True)[1] != 0
    rows, code = gpu_check.summary(_junit(tmp_path, ALL_PASS), 124, gpu_present=True)
    assert code != 0 and ("bench --preset gpu", "FAILED", "timed out") in rows
    rows, code = gpu_check.summary(str(tmp_path / "missing.xml"), None, gpu_present=True)
    assert code != 0 and {status for _, status, _ in rows} == {"NOT RUN"}


def test_no_gpu_is_its_own_exit_status(tmp_path):
    rows, code = gpu_check.summary(_junit(tmp_path, ALL_PASS), 0, gpu_present=False)
    assert code == 3 and rows[0][1] == "NOT FOUND"


def test_command_line_prints_the_table_and_exits_non_zero(tmp_path):
    cases = [(n, SKIP if "flash" in n else "") for n, _ in ALL_PASS]
    proc = subprocess.run([sys.executable, "-m", "mmpg.grouping.gpu_check", "summary", "--junit",
                           _junit(tmp_path, cases), "--bench-status", "0", "--gpu", "yes"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "NOT RUN" in proc.stdout and "NOT every GPU path ran" in proc.stdout


def test_plan_fits_ten_minutes_and_follows_the_flops_model():
    limits = gpu_check.plan(budget_s=570)
    assert limits["TESTS_S"] + limits["BENCH_S"] + gpu_check.SUMMARY_S <= 570
    # 6.5e15 FLOPs x 4/3 (gradient checkpointing) at 250 TFLOP/s: about 35 s per repeated step
    assert limits["STEP_S"] == pytest.approx(35, abs=2)
    assert limits["WORKER_S"] >= limits["STEP_S"] * 2  # warm-up + one timed step
    assert limits["BENCH_EST_S"] <= limits["BENCH_S"]
    roomy = gpu_check.plan(budget_s=3600)
    assert roomy["BENCH_VARIANTS"] == "" and roomy["BENCH_EST_S"] > limits["BENCH_EST_S"]  # upstream kept


def test_plan_prints_shell_assignments():
    proc = subprocess.run([sys.executable, "-m", "mmpg.grouping.gpu_check", "plan", "--budget", "570"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "TESTS_S=180" in proc.stdout and "BENCH_VARIANTS='naive,repeated,mmpg'" in proc.stdout


def test_driver_too_old_for_torch_is_named(monkeypatch):
    """torch 2.14.1 from PyPI is built for CUDA 13.0; on a 12.8 driver the script used to die in get_device_name(0)
    under `set -e` before any test. Now the check says what is wrong and exits 3."""
    import torch

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", lambda: 12080, raising=False)
    lines, code = gpu_check.environment()
    assert code == 3
    assert "driver supports CUDA up to 12.8" in lines[1] and "too old" in lines[2] and "580" in lines[2]
