"""scripts/gpu_check.sh's decisions, checked on a CPU with a GPU run's outputs written by hand: the summary's rows
(PASS only when every test or run behind a path ran and passed; a skipped flash test, a test cut off by its stage's
limit, a train run over the logprob bound are not passes), the exit status, and the time plan (8 minutes, the bench
sized by the FLOPs model to what is left)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmpg.grouping import gpu_check, gpu_report

G, C = "tests/test_grouping_gpu.py::", "tests/test_cascade_gpu.py::"
TESTS = [G + "test_gpu_attention_release_geometry[flash-bf16-gqa7]",
         G + "test_gpu_attention_release_geometry[sdpa_masked-bf16-gqa7]",
         G + "test_gpu_attention_release_geometry[varlen_lse-fp32-gqa4]",
         G + "test_gpu_attention_release_geometry[flex-bf16-gqa4]",
         G + "test_gpu_backend_vl[qwen2_5_vl-flash-bf16]", G + "test_flash_attention_2_loaded_model",
         G + "test_gpu_backend_vl[qwen3_vl-flex-fp32]", G + "test_gpu_backend_text[sdpa]",
         G + "test_gpu_sdpa_masked_kernel_choice",
         C + "test_cuda_kernel_release_geometry[dense-flash-bf16-gqa7]",
         C + "test_cuda_kernel_release_geometry[leftpad-sdpa-fp32-gqa4]",
         C + "test_cuda_kernel_matches_math[dense-flash-fp32]", C + "test_cuda_kernel_matches_math[leftpad-flash-bf16]",
         C + "test_cuda_kernel_matches_math[dense-sdpa-bf16]", C + "test_cuda_cascade_bf16[flash]",
         C + "test_cuda_cascade_equals_copy_fp32[qwen2_5_vl-sdpa]"]


def _lines(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _work(tmp_path, outcome=lambda test_id: ("passed", ""), stages=None, train=None, bench=None, gpu=True):
    """A work folder as gpu_check.sh leaves it after a device run."""
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    stages = stages or {}
    _lines(work / "stages.jsonl", [{"stage": s, "rc": stages.get(s, 0), "elapsed_s": 1, "limit_s": 120}
                                   for s in ("install", "env", "collect", "tests-grouped", "tests-cascade", "train")])
    (work / "env.json").write_text(json.dumps({"gpu": "NVIDIA H200" if gpu else None, "capability": "9.0",
                                               "torch": "2.11.0+cu130", "cuda": "13.0", "deps_problems": [],
                                               "lines": ["torch ...", "no NVIDIA driver found"]}))
    (work / "collected.txt").write_text("\n".join(TESTS) + "\n")
    records = []
    for test_id in TESTS:
        result = outcome(test_id)
        if result is not None:
            records.append({"nodeid": test_id, "outcome": result[0], "message": result[1],
                            "properties": {"max_abs_out": 0.001} if result[0] == "passed" else {}})
    _lines(work / "tests.jsonl", records)
    _train(work / "train", train or {})
    runs = bench if bench is not None else [("bench-model-P8192", 0, [("repeated", 2.0, ""), ("mmpg:flex", 0.4, "")])]
    lines = []
    for name, rc, variants in runs:
        lines.append({"name": name, "rc": rc, "limit_s": 200, "json": f"{name}.json", "args": "--preset gpu"})
        rows = [{"level": "model", "P": 8192, "S": 512, "G": 16, "variant": v, "time_s": t if not note else None,
                 "speedup": variants[0][1] / t if not note else None, "pct_ceiling": 60, "note": note}
                for v, t, note in variants]
        (out / f"{name}.json").write_text(json.dumps({"meta": {}, "rows": rows}))
    _lines(work / "bench.jsonl", lines)
    return work, out


def _train(runs, overrides):
    """Four runs of scripts/gpu_train_check.sh: name -> dict(rc=, gap=, steps=, alarm=) overrides."""
    model = runs / "tiny"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 2}}))
    for name in gpu_report.TRAIN_RUNS:
        o = {"rc": 0, "gap": 0.003, "steps": 3, "alarm": 0} | overrides.get(name, {})
        run = runs / name
        run.mkdir()
        (run / "config.yaml").write_text(f"model:\n  path: {model}\n  dtype: bfloat16\ntrainer:\n  total_steps: 3\n")
        _lines(run / "metrics.jsonl", [{"step": i + 1, "actor/logprob_gap_max": o["gap"], "timing_s/step": 1.5,
                                        "alarm/logprob_drift": o["alarm"]} for i in range(o["steps"])])
        if o["rc"] is not None:
            (runs / f"{name}.rc").write_text(str(o["rc"]))


def _rows(work, out, mode="device"):
    return {r.path: r for r in gpu_report.all_rows(work, out, mode)}


FLASH_SKIP = "flash-attn is not importable (No module named 'flash_attn'); install FlashAttention 2"


def test_everything_ran_and_passed(tmp_path):
    work, out = _work(tmp_path)
    rows = gpu_report.all_rows(work, out, "device")
    counted = [r for r in rows if r.counts]
    assert {r.status for r in counted} == {"PASS"}, [(r.path, r.status, r.detail) for r in counted]
    assert gpu_report.exit_code(rows, "device") == 0
    # the two paths no run of this script can check are NOT RUN, with the reason, and do not count
    assert {r.path: r.status for r in rows if not r.counts} == {gpu_report.UPSTREAM_ROW.path: "NOT RUN",
                                                                gpu_report.VLLM_ROW.path: "NOT RUN"}
    bench = _rows(work, out)["bench model P=8192 S=512 G=16"]
    assert bench.figure.startswith("mmpg:flex 5.00x vs repeated")


def test_flash_skipped_is_not_run_and_fails_the_check(tmp_path):
    work, out = _work(tmp_path, lambda t: ("skipped", FLASH_SKIP) if "flash" in t else ("passed", ""))
    rows = _rows(work, out)
    flash = rows["grouped flash (flash-attn varlen), tiny models"]
    assert flash.status == "NOT RUN" and "No module named 'flash_attn'" in flash.detail
    assert "no flash-attn wheel" in flash.detail
    assert rows["grouped flex forward + backward, release heads"].status == "PASS"
    assert gpu_report.exit_code(list(rows.values()), "device") == 1


def test_no_fp32_flash_kernel_is_no_gap(tmp_path):
    """flash-attn has no fp32 kernel: that skip leaves nothing untested; the bf16 case decides the row."""
    def outcome(t):
        return ("skipped", "flash-attn has no fp32 kernels") if "flash-fp32" in t else ("passed", "")
    rows = _rows(*_work(tmp_path, outcome))
    assert rows["cascade kernel flash (flash_attn_with_kvcache), tiny"].status == "PASS"


def test_failure_and_cut_off_tests(tmp_path):
    def outcome(t):
        if "flex-bf16-gqa4" in t:
            return "failed", "AssertionError: dq differs by 0.31 (relative)"
        return None if t.startswith(C) else ("passed", "")  # the cascade file never finished
    work, out = _work(tmp_path, outcome, stages={"tests-cascade": 124})
    rows = _rows(work, out)
    flex = rows["grouped flex forward + backward, release heads"]
    assert flex.status == "FAIL" and "dq differs by 0.31" in flex.detail
    cut = rows["cascade kernel sdpa (memory-efficient), tiny"]
    assert cut.status == "NOT RUN" and "stopped at its 120 s limit" in cut.detail


def test_train_rows(tmp_path):
    work, out = _work(tmp_path, train={"bf16-zero0-grouped": {"gap": 0.27},  # the 5.17 fault's size
                                       "bf16-zero3-grouped": {"rc": None, "steps": 1},  # killed at the limit
                                       "bf16-zero3-repeated": {"rc": 1, "steps": 0}}, stages={"train": 124})
    rows = {r.path: r for r in gpu_report.train_rows(work / "train", "not reached: the stage stopped")}
    over = rows["mmpg train bf16 zero0 grouped (one process)"]
    assert over.status == "FAIL" and "above the bound 0.0125" in over.detail  # 1.6 * 2^-8 * 2 layers
    assert rows["mmpg train bf16 zero0 repeated (one process)"].status == "PASS"
    repeated = rows["mmpg train bf16 zero0 repeated (one process)"]
    assert "logprob_gap_max 0.003 (bound 0.0125), 3/3 steps" in repeated.figure
    assert rows["mmpg train bf16 zero3 grouped (one process)"].status == "NOT RUN"
    assert rows["mmpg train bf16 zero3 repeated (one process)"].status == "FAIL"


def test_bench_rows(tmp_path):
    work, out = _work(tmp_path, bench=[("bench-model-P8192", 1, [("repeated", 2.0, ""),
                                                                 ("mmpg:flex", 0, "worker exit 1: CUDA error")])])
    with open(work / "bench.jsonl", "a") as f:
        f.write(json.dumps({"name": "bench-step", "args": "--levels step", "skipped": "needs ~210 s, 80 s left"}))
    rows = _rows(work, out)
    assert rows["bench model P=8192 S=512 G=16"].status == "FAIL"
    skipped = rows["bench-step (mmpg bench --levels step)"]
    assert skipped.status == "NOT RUN" and "80 s left" in skipped.detail


def test_no_gpu_is_its_own_exit_status(tmp_path):
    work, out = _work(tmp_path, gpu=False, stages={"env": 3})
    rows = gpu_report.all_rows(work, out, "device")
    assert gpu_report.exit_code(rows, "device") == 3
    assert _rows(work, out)["CUDA device"].detail == "no NVIDIA driver found"


def test_rehearsal_fails_only_on_what_needs_no_gpu(tmp_path):
    gpu_rows = [gpu_report.Row("equivalence", "x", "NOT RUN", detail="needs a CUDA device")]
    assert gpu_report.exit_code(gpu_rows, "rehearse") == 0
    cpu = gpu_report.Row("CPU counterparts", "y", "NOT RUN", needs_gpu=False)
    assert gpu_report.exit_code([*gpu_rows, cpu], "rehearse") == 1
    assert gpu_report.exit_code([gpu_report.Row("train", "z", "FAIL")], "rehearse") == 1


def test_report_command_writes_markdown_and_json(tmp_path):
    work, out = _work(tmp_path, lambda t: ("skipped", FLASH_SKIP) if "flash" in t else ("passed", ""))
    proc = subprocess.run([sys.executable, "-m", "mmpg.grouping.gpu_check", "report", "--work", str(work),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "| equivalence | grouped flash (flash-attn varlen), tiny models | **NOT RUN** |" in proc.stdout
    record = json.loads((out / "gpu_check.json").read_text())
    assert record["exit"] == 1 and record["mode"] == "device"
    assert sum(r["status"] == "PASS" for r in record["rows"]) == (out / "gpu_check.md").read_text().count("**PASS**")


def test_plan_fits_eight_minutes_and_sizes_the_bench():
    limits = gpu_check.plan("device")
    assert limits["TOTAL_S"] == 480 and sum(v for k, v in limits.items() if k != "TOTAL_S") == 480
    runs = gpu_check.plan_bench(limits["BENCH_S"])
    assert sum(r.estimate_s for r in runs) <= limits["BENCH_S"]
    # 3B LM, S 512, G 16: the repeated step at P 8192 is 15.3 s by the FLOPs model at 250 TFLOP/s, so a worker with
    # one warm-up and one timed step takes 45 + 3 x 15.3 s; the grouped one 45 + 3 x 2.0 s: 142 s in all
    assert [r.name for r in runs] == ["bench-model-P8192"] and runs[0].estimate_s == 142
    assert gpu_check._step_s(16384, grouped=False) == pytest.approx(34.9, abs=0.2)
    roomy = [r.name for r in gpu_check.plan_bench(2000)]
    assert roomy == ["bench-model-P16384", "bench-attention", "bench-step", "bench-rollout"]
    assert gpu_check.plan_bench(60) == []
    assert [r.name for r in gpu_check.plan_bench(50, "rehearse")] == ["bench-tiny"]


def test_plan_prints_shell_assignments():
    proc = subprocess.run([sys.executable, "-m", "mmpg.grouping.gpu_check", "plan", "--mode", "device"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "TESTS_GROUPED_S=120" in proc.stdout and "TOTAL_S=480" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "mmpg.grouping.gpu_check", "plan-bench", "--left", "150"],
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.split()[:3] == ["bench-model-P8192", "142", "137"]


def test_pytest_plugin_writes_one_line_per_test(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok(record_property):\n    record_property('max_abs_out', 0.5)\n"
        "def test_bad():\n    assert 1 == 2, 'one is not two'\n"
        "def test_skip():\n    pytest.skip('no flash here')\n")
    results = tmp_path / "results.jsonl"
    env = {**os.environ, "MMPG_GPU_CHECK_RESULTS": str(results),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "gpu_check_plugin", "-p", "no:cacheprovider",
                    str(tmp_path / "test_sample.py")], capture_output=True, text=True, timeout=120, env=env,
                   cwd=tmp_path)
    got = {r["nodeid"].split("::")[-1]: r for r in map(json.loads, results.read_text().splitlines())}
    assert got["test_ok"]["outcome"] == "passed" and got["test_ok"]["properties"] == {"max_abs_out": 0.5}
    assert got["test_bad"]["outcome"] == "failed" and "one is not two" in got["test_bad"]["message"]
    assert got["test_skip"]["outcome"] == "skipped" and got["test_skip"]["message"] == "no flash here"


def test_driver_too_old_for_torch_is_named(monkeypatch):
    """torch 2.14.1 from PyPI is built for CUDA 13.0; on a 12.8 driver the script used to die in get_device_name(0)
    under `set -e` before any test. Now the check says what is wrong and exits 3."""
    import torch

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", lambda: 12080, raising=False)
    lines, code = gpu_check.environment()
    assert code == 3
    assert "driver supports CUDA up to 12.8" in lines[1] and "too old" in lines[2] and "580" in lines[2]
