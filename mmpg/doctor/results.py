"""The report of `mmpg doctor`: one row per check, PASS / FAIL / NOT RUN with its figure and the reason, written as
Markdown (doctor.md) and JSON (doctor.json) and printed.

A row PASSES when its check ran and its figure is within its bound; FAILS when the check ran and disagreed, or
raised; is NOT RUN when this machine cannot run it (no CUDA device, a package not installed, one GPU where two are
needed), always with the reason. The exit code is 0 when nothing failed, 1 when some row failed (the summary line
names them), whatever was NOT RUN.

    doctor.json  {"v": 1, "exit": int, "failed": [row ids], "environment": {...}, "rows": [Row, ...]}
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

STATUSES = ("PASS", "FAIL", "NOT RUN")


@dataclasses.dataclass
class Row:
    section: str  # environment, grouped, cascade, train, decode, sync, speed
    id: str  # short stable key ("grouped/sdpa/qwen2_5_vl"): what MMPG_DOCTOR_FAULT and the exit line name
    path: str  # what was checked, in words
    status: str  # PASS, FAIL or NOT RUN
    figure: str = ""  # the measured figure (and its bound)
    detail: str = ""  # why NOT RUN or FAIL; versions where they matter
    seconds: float = 0.0

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"row {self.id}: status {self.status!r}; one of {', '.join(STATUSES)}")


def not_run(section: str, id: str, path: str, why: str) -> Row:
    return Row(section, id, path, "NOT RUN", detail=why)


def failed(rows: list[Row]) -> list[Row]:
    return [r for r in rows if r.status == "FAIL"]


def exit_code(rows: list[Row]) -> int:
    """0 when no row failed, 1 otherwise (NOT RUN never fails the run: its reason is in the report)."""
    return 1 if failed(rows) else 0


def _cell(text) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def markdown(rows: list[Row], environment: list[str], title: str) -> str:
    lines = [f"## {title}", "", *[f"    {line}" for line in environment], "",
             "| section | check | status | figure | detail | s |", "|---|---|---|---|---|---:|"]
    lines += [f"| {r.section} | {_cell(r.path)} | **{r.status}** | {_cell(r.figure)} | {_cell(r.detail)} | "
              f"{r.seconds:.1f} |" for r in rows]
    return "\n".join(lines) + "\n"


def summary(rows: list[Row]) -> str:
    counts = {s: sum(r.status == s for r in rows) for s in STATUSES}
    line = f"mmpg doctor: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['NOT RUN']} NOT RUN"
    bad = failed(rows)
    if bad:
        line += "; FAILED: " + ", ".join(f"{r.id} ({r.detail or r.figure})"[:200] for r in bad)
    return line


def write(out: Path, rows: list[Row], environment: list[str], record: dict, title: str) -> int:
    """Write doctor.md and doctor.json into `out` (created), print the table and the summary; returns the exit code."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    code = exit_code(rows)
    data = {"v": 1, "exit": code, "failed": [r.id for r in failed(rows)], "environment": record,
            "rows": [dataclasses.asdict(r) for r in rows]}
    (out / "doctor.json").write_text(json.dumps(data, indent=1, default=str))
    text = markdown(rows, environment, title)
    (out / "doctor.md").write_text(text)
    return code
