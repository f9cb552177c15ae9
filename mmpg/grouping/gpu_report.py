"""The summary of scripts/gpu_check.sh: one row per GPU path, PASS / FAIL / NOT RUN with its figure, from what the
stages left in the work folder:

    stages.jsonl       {"stage", "rc", "elapsed_s", "limit_s"} per stage (rc 124/137: stopped at its limit; 3: not
                       started, no usable GPU)
    env.json           `gpu_check env --json`
    collected.txt      the test ids pytest collected; tests.jsonl: one line per finished test (tests/gpu_check_plugin)
    train/<run>/       run directories of scripts/gpu_train_check.sh, train/<run>.rc its exit status
    bench.jsonl        {"name", "args", "rc", "limit_s", "json"} per bench run, {"name", "args", "skipped": why} per
                       planned run the time left did not allow
    audit.txt          the rehearsal's import audit (scripts/gpu_check_audit)

A path PASSES only when every test (or run) behind it ran and passed; a test skipped for a missing package, or not
reached before its stage's limit, leaves the path NOT RUN. Skips that are no gap (flash-attn has no fp32 kernel) do
not count. `report` writes gpu_check.json and gpu_check.md to the output folder and prints the table.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

NO_GAP = ("has no fp32 kernel",)  # skip reasons that leave no path untested
FLASH_NOTE = ("no flash-attn wheel for the image's torch 2.11.0+cu130 in wheels/ (PyPI has only the sdist; building "
              "it on the device takes longer than a lease)")
# (path, regex on the test id, needs a GPU); the first match takes a test
TEST_PATHS = [
    ("grouped flash (flash-attn varlen), release heads", r"test_gpu_attention_release_geometry\[flash", True),
    ("grouped sdpa, masked CUDA path, release heads", r"test_gpu_attention_release_geometry\[sdpa_masked", True),
    ("grouped varlen LSE merge + backward (torch kernel), release heads",
     r"test_gpu_attention_release_geometry\[varlen_lse", True),
    ("grouped flex forward + backward, release heads", r"test_gpu_attention_release_geometry\[flex", True),
    ("grouped flash (flash-attn varlen), tiny models",
     r"test_grouping_gpu.py::(test_gpu_backend_(vl|text)\[.*flash|test_flash_|test_gpu_autocast)", True),
    ("grouped flex forward + backward, tiny models", r"test_grouping_gpu.py::test_gpu_backend_(vl|text)\[.*flex", True),
    ("grouped sdpa, masked CUDA path, tiny models",
     r"test_grouping_gpu.py::(test_gpu_backend_text\[sdpa|test_cuda_model_with_cpu|test_gpu_sdpa_masked)", True),
    ("cascade kernel flash (flash_attn_with_kvcache), release heads", r"test_cuda_kernel_release_geometry\[.*flash",
     True),
    ("cascade kernel sdpa (memory-efficient), release heads", r"test_cuda_kernel_release_geometry\[.*sdpa", True),
    ("cascade kernel flash (flash_attn_with_kvcache), tiny", r"test_cuda_kernel_matches_math\[.*flash", True),
    ("cascade kernel sdpa (memory-efficient), tiny", r"test_cuda_kernel_matches_math\[.*sdpa", True),
    ("cascade decoding with flash, tiny model", r"test_cuda_cascade_bf16\[flash", True),
    ("cascade decoding (math, sdpa) = copy path, tiny models", r"test_cascade_gpu.py::test_cuda_cascade_", True),
    ("CPU: grouped backends at release heads", r"test_release_geometry.py::test_grouped", False),
    ("CPU: cascade sdpa kernel at release heads", r"test_release_geometry.py::test_cascade", False),
    ("CPU: GPU-path defects checked on the CPU", r"test_gpu_paths_on_cpu.py", False),
    ("vLLM rollout engine on CUDA (tests/test_vllm_gpu.py)", r"test_vllm_gpu.py", True),
    ("other tests", r".", False),
]
TRAIN_RUNS = ("bf16-zero0-grouped", "bf16-zero0-repeated", "bf16-zero3-grouped", "bf16-zero3-repeated")


@dataclasses.dataclass
class Row:
    section: str
    path: str
    status: str  # PASS, FAIL or NOT RUN
    figure: str = ""
    detail: str = ""
    needs_gpu: bool = True
    counts: bool = True  # False: a path this run cannot check by design (the reason is its detail)


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by a kill
    return out


def _stage(work: Path, name: str) -> dict | None:
    return next((s for s in _jsonl(work / "stages.jsonl") if s["stage"] == name), None)


def _stopped(stage: dict | None) -> str:
    if stage is None:
        return "its stage did not start"
    if stage["rc"] == 3:
        return "no usable GPU (see the CUDA device row)"
    if stage["rc"] in (124, 137):
        return f"not reached: the stage stopped at its {stage['limit_s']} s limit"
    if stage["rc"] not in (0, 1):  # pytest: 1 = some test failed; 2-4 = interrupted, internal or usage error
        return f"not reached: the stage exited {stage['rc']} (see gpu_check.log)"
    return ""


def _figures(records: list[dict]) -> str:
    worst: dict[str, float] = {}
    for r in records:
        for key, value in r.get("properties", {}).items():
            if isinstance(value, (int, float)):
                worst[key] = max(worst.get(key, value), value)
    return ", ".join(f"{k} {v:.2g}" for k, v in sorted(worst.items()))


def _test_stage(test_id: str) -> str:
    """The gpu_check.sh stage that runs a test (one pytest process per file)."""
    return {"test_grouping_gpu.py": "tests-grouped", "test_cascade_gpu.py": "tests-cascade",
            "test_vllm_gpu.py": "tests-vllm"}.get(
        test_id.split("::")[0].rsplit("/", 1)[-1], "tests-cpu")


def test_rows(work: Path) -> list[Row]:
    """One row per TEST_PATHS entry that has tests (collected or run)."""
    results = {r["nodeid"]: r for r in _jsonl(work / "tests.jsonl")}
    collected = (work / "collected.txt").read_text().split() if (work / "collected.txt").exists() else []
    ids = list(dict.fromkeys([*collected, *results]))
    groups: dict[str, list[str]] = {}
    for test_id in ids:
        path = next(p for p, rx, _ in TEST_PATHS if re.search(rx, test_id))
        groups.setdefault(path, []).append(test_id)
    rows = []
    for path, rx, gpu in TEST_PATHS:
        if path not in groups:
            continue
        recs = [results.get(t) for t in groups[path]]
        ran = [r for r in recs if r is not None]
        passed = [r for r in ran if r["outcome"] == "passed"]
        failed = [r for r in ran if r["outcome"] == "failed"]
        skipped = [r for r in ran if r["outcome"] == "skipped" and not any(n in r["message"] for n in NO_GAP)]
        missing = [t for t, r in zip(groups[path], recs) if r is None]
        stopped = "; ".join(dict.fromkeys(_stopped(_stage(work, _test_stage(t))) for t in missing)) or "not run"
        count = f"{len(passed)} of {len(recs) - (len(ran) - len(passed) - len(failed) - len(skipped))} passed"
        if failed:
            status, detail = "FAIL", f"{count}; {failed[0]['nodeid'].split('::')[-1]}: {failed[0]['message']}"
        elif passed and not skipped and not missing:
            status, detail = "PASS", count
        else:
            why = skipped[0]["message"] if skipped else stopped
            if "flash" in path and skipped and ("not importable" in why or "No module named" in why):
                why += "; " + FLASH_NOTE
            status = "NOT RUN"
            detail = (f"{count}, {len(skipped)} skipped, {len(missing)} not reached; " if passed else "") + why
        rows.append(Row("equivalence" if gpu else "CPU counterparts", path, status, _figures(passed), detail, gpu))
    return rows


def _read_config(run: Path) -> dict:
    import yaml

    path = run / "config.yaml"
    return yaml.safe_load(path.read_text()) if path.exists() else {}


def _bound(config: dict) -> float | None:
    """The bf16 logprob bound of the drift alarm and the self-check for the run's model (mmpg.grouping.selfcheck)."""
    import torch

    from mmpg.grouping.selfcheck import PER_LAYER_ULPS

    model = Path(config.get("model", {}).get("path", ""), "config.json")
    if not model.exists() or config.get("model", {}).get("dtype") != "bfloat16":
        return None
    cfg = json.loads(model.read_text())
    layers = cfg.get("text_config", cfg).get("num_hidden_layers", 1)
    unit, ratio = PER_LAYER_ULPS[torch.bfloat16]
    return ratio * unit * layers


def train_rows(runs: Path, stopped: str = "") -> list[Row]:
    rows = []
    for name in TRAIN_RUNS:
        run = runs / name
        metrics = _jsonl(run / "metrics.jsonl")
        rc_file = runs / f"{name}.rc"
        rc = int(rc_file.read_text()) if rc_file.exists() else None
        config = _read_config(run)
        total = config.get("trainer", {}).get("total_steps")
        path = f"mmpg train {name.replace('-', ' ')} (one process)"
        if not metrics:
            why = f"exit {rc}, no step logged (see the log)" if rc not in (None, 124, 137) else (
                stopped or "did not finish")
            rows.append(Row("train", path, "FAIL" if rc not in (None, 124, 137) else "NOT RUN", "", why))
            continue
        gap = max(m.get("actor/logprob_gap_max", 0.0) for m in metrics)
        check = max((m["check/grouped_vs_repeated_max"] for m in metrics if "check/grouped_vs_repeated_max" in m),
                    default=None)
        alarm = any(m.get("alarm/logprob_drift") for m in metrics)
        bound = _bound(config)
        step_s = sum(m["timing_s/step"] for m in metrics) / len(metrics)
        figure = f"logprob_gap_max {gap:.2g}" + (f" (bound {bound:.3g})" if bound else "")
        figure += f", {len(metrics)}/{total} steps, {step_s:.1f} s/step"
        figure += f", self-check {check:.2g}" if check is not None else ""
        problems = []
        if rc != 0:
            problems.append(f"exit {rc}" if rc is not None else stopped or "did not finish")
        if total and len(metrics) < total:
            problems.append(f"{len(metrics)} of {total} steps")
        if bound is not None and gap > bound:
            problems.append(f"logprob gap {gap:.3g} above the bound {bound:.3g}")
        if alarm:
            problems.append("drift alarm")
        status = "PASS" if not problems else ("NOT RUN" if rc in (None, 124, 137) and not alarm and (
            bound is None or gap <= bound) else "FAIL")
        rows.append(Row("train", path, status, figure, "; ".join(problems), True))
    return rows


def bench_rows(work: Path, out: Path) -> list[Row]:
    runs = _jsonl(work / "bench.jsonl")
    if not runs:
        return [Row("bench", "mmpg bench GPU presets", "NOT RUN", "", _stopped(_stage(work, "bench")))]
    rows = []
    for run in runs:
        label = f"{run['name']} (mmpg bench {run.get('args', '')})"
        if run.get("skipped"):
            rows.append(Row("bench", label, "NOT RUN", "", run["skipped"]))
            continue
        path = out / run["json"]
        data = json.loads(path.read_text()) if path.exists() else {"rows": []}
        configs: dict[tuple, list[dict]] = {}
        for r in data["rows"]:
            configs.setdefault((r["level"], r["P"], r["S"], r["G"]), []).append(r)
        if not configs:
            why = (f"stopped at its {run['limit_s']} s limit" if run["rc"] in (124, 137) else f"exit {run['rc']}")
            rows.append(Row("bench", label, "NOT RUN" if run["rc"] in (124, 137) else "FAIL", "", why))
            continue
        for (level, P, S, G), variants in configs.items():
            notes = [f"{v['variant']}: {v['note']}" for v in variants if v.get("note") and v.get("time_s") is None]
            errors = [n for n in notes if n.split(": ", 1)[1].split(":")[0] not in ("skipped", "OOM", "n/a")]
            timed = [v for v in variants if v.get("time_s") is not None]
            best = max(timed[1:], key=lambda v: v.get("speedup") or 0, default=None)
            figure = ""
            if best is not None and best.get("speedup"):
                ceil = best.get("pct_ceiling")
                figure = (f"{best['variant']} {best['speedup']:.2f}x vs {timed[0]['variant']} "
                          f"({best['time_s']:.3g} s vs {timed[0]['time_s']:.3g} s)"
                          + (f", {ceil:.0f} % of its ceiling" if ceil else ""))
            status = "FAIL" if errors else ("PASS" if len(timed) == len(variants) else "NOT RUN")
            rows.append(Row("bench", f"bench {level} P={P} S={S} G={G}", status, figure, "; ".join(notes)))
    return rows


def env_rows(work: Path, mode: str) -> list[Row]:
    env = json.loads((work / "env.json").read_text()) if (work / "env.json").exists() else {}
    install = _stage(work, "install")
    rows = []
    if mode == "device":
        ok = install is not None and install["rc"] == 0
        rows.append(Row("environment", "bundle installed offline (pip --no-index --no-deps --target)",
                        "PASS" if ok else ("NOT RUN" if install is None else "FAIL"), "",
                        "" if ok else _stopped(install) or f"exit {install['rc']}: see gpu_check.log"))
        deps = env.get("deps_problems")
        if install is not None and install.get("note") == "nothing to install":
            rows.append(Row("environment", "bundle requirements met by the image", "PASS", "",
                            "no wheels/: the bundle's packages import from this machine"))
        else:
            rows.append(Row("environment", "bundle requirements met by the image",
                            "NOT RUN" if deps is None else ("PASS" if not deps else "FAIL"), "",
                            "; ".join(deps or []) if deps is not None else "the env stage did not finish"))
    else:
        ok = install is not None and install["rc"] == 0
        rows.append(Row("environment", "bundle complete for the image (pip resolves it offline for cp312)",
                        "PASS" if ok else "FAIL", "", "" if ok else "see gpu_check.log (bundle-check)", False))
        audit = _stage(work, "audit")
        rows.append(Row("environment", "every third-party import of the stages is the image's or the bundle's",
                        "PASS" if audit and audit["rc"] == 0 else "FAIL", "",
                        (work / "audit.txt").read_text().strip().splitlines()[0][:160]
                        if (work / "audit.txt").exists() else "no audit", False))
        rows.append(Row("environment", "bundle requirements met by the image", "NOT RUN", "",
                        "checked on the device only (`gpu_check env --site`)"))
    gpu = env.get("gpu")
    rows.append(Row("environment", "CUDA device", "PASS" if gpu else "NOT RUN",
                    f"{gpu}, sm {env.get('capability')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, "
                    f"nvidia-smi: {env.get('nvidia_smi', 'n/a')}" if gpu else "",
                    "" if gpu else (env.get("lines") or ["the env stage did not finish"])[-1]))
    return rows


UPSTREAM_ROW = Row("bench", "bench upstream prefix_grouper variant", "NOT RUN", "",
                   "left out: it does not fit the 8 minutes beside the rest, and its package is not in the bundle",
                   counts=False)
VLLM_ROW = Row("rollout", "vLLM rollout engine on CUDA (tests/test_vllm_gpu.py)", "NOT RUN", "",
               "vLLM's CUDA wheel is 321 MiB (0.33.0) and pins a torch of its own: it cannot travel in 64 MiB and "
               "the GPU machine reaches no registry", counts=False)


def all_rows(work: Path, out: Path, mode: str) -> list[Row]:
    tests = test_rows(work)
    vllm = [] if any(r.path == VLLM_ROW.path for r in tests) else [VLLM_ROW]  # MMPG_GPU_VLLM=1 ran its tests
    return [*env_rows(work, mode), *tests, *train_rows(work / "train", _stopped(_stage(work, "train"))),
            *bench_rows(work, out), UPSTREAM_ROW, *vllm]


def markdown(rows: list[Row], stages: list[dict], mode: str) -> str:
    lines = [f"## gpu_check ({'rehearsal on the CPU' if mode == 'rehearse' else 'GPU run'})", "",
             "| stage | limit s | elapsed s | exit |", "|---|---:|---:|---:|"]
    lines += [f"| {s['stage']} | {s['limit_s']} | {s['elapsed_s']} | {s['rc']} |" for s in stages]
    lines += ["", "| section | path | status | figure | detail |", "|---|---|---|---|---|"]
    cell = lambda text: str(text).replace("|", "/").replace("\n", " ")  # noqa: E731
    lines += [f"| {r.section} | {cell(r.path)} | **{r.status}** | {cell(r.figure)} | {cell(r.detail)} |"
              for r in rows]
    return "\n".join(lines) + "\n"


def exit_code(rows: list[Row], mode: str) -> int:
    """device: 0 when every path passed (a flash path without flash-attn counts as not passed; the vLLM and upstream
    rows, which no run of this script can check, do not count), 3 without a usable GPU, else 1. rehearse: 1 when a
    row failed or a row that needs no GPU did not run (the GPU rows are NOT RUN by design), else 0."""
    if mode == "device":
        if any(r.path == "CUDA device" and r.status != "PASS" for r in rows):
            return 3
        return 0 if all(r.status == "PASS" for r in rows if r.counts) else 1
    return 1 if any(r.status == "FAIL" or (r.status != "PASS" and not r.needs_gpu) for r in rows) else 0


def report(work: Path, out: Path, mode: str) -> int:
    rows = all_rows(work, out, mode)
    stages = _jsonl(work / "stages.jsonl")
    code = exit_code(rows, mode)
    env = json.loads((work / "env.json").read_text()) if (work / "env.json").exists() else {}
    record = {"v": 1, "mode": mode, "exit": code, "stages": stages, "env": env,
              "rows": [dataclasses.asdict(r) for r in rows], "tests": _jsonl(work / "tests.jsonl")}
    (out / "gpu_check.json").write_text(json.dumps(record, indent=1))
    text = markdown(rows, stages, mode)
    (out / "gpu_check.md").write_text(text)
    print(text)
    counts = {s: sum(r.status == s for r in rows) for s in ("PASS", "FAIL", "NOT RUN")}
    print(f"gpu_check ({mode}): {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['NOT RUN']} NOT RUN; exit {code}")
    return code
