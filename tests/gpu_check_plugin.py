"""pytest plugin for scripts/gpu_check.sh: one JSON line per finished test, appended and flushed as it ends, so a run
stopped by its time limit still leaves the results of every test that finished (a JUnit file is written only at the
end). Loaded with `-p gpu_check_plugin` (tests/ on PYTHONPATH); the file is $MMPG_GPU_CHECK_RESULTS.

    {"v": 1, "nodeid": ..., "outcome": "passed" | "failed" | "skipped", "when": "setup" | "call" | "teardown",
     "duration_s": float, "message": first line of the skip reason or failure, "properties": {record_property ...}}
"""

from __future__ import annotations

import json
import os


def _message(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        return crash.message.splitlines()[0] if crash is not None and crash.message else str(report.longrepr)[-300:]
    return ""


def pytest_runtest_logreport(report):
    path = os.environ.get("MMPG_GPU_CHECK_RESULTS")
    if not path:
        return
    # one line per test: the call's outcome, or the setup's when it skipped/failed there, or a failed teardown
    if not (report.when == "call" or (report.when == "setup" and not report.passed)
            or (report.when == "teardown" and report.failed)):
        return
    record = {"v": 1, "nodeid": report.nodeid, "outcome": report.outcome, "when": report.when,
              "duration_s": round(report.duration, 3), "message": _message(report)[:300],
              "properties": {k: v for k, v in report.user_properties}}
    with open(path, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")
        f.flush()
