"""Which run `checkpoint.resume=auto` continues when `trainer.run_name` is empty (`RESUME=auto` in the launch
scripts, which leave the name to the time stamp).

A named run is continued by name (`mmpg.train.setup.resume_point`). Without a name every start would get a new
time-stamped folder, so `auto` would find nothing to continue and start afresh without a word. Instead it continues
the newest run under `trainer.output_dir` of the same job (run.json "kind") started with the same `--config` file
that holds a complete checkpoint ("newest": whose latest checkpoint was completed last), and one line says which,
at which step, and what else there was; with none, one line says a new run starts. A verl or EasyR1 user gets the
same by rerunning a script with a fixed experiment name (`resume_mode: auto`); here the config file plays that part,
and two runs of one config with different overrides stay two runs until one is resumed (the line names the run and
whether its recorded overrides differ from this command's).
"""

from __future__ import annotations

import json
from pathlib import Path

from mmpg.runs import COMPLETE, RUN_JSON, latest_checkpoint

IGNORED = ("--resume", "checkpoint.resume=", "trainer.total_steps=")  # what a continued run may change freely


def config_file(command: list[str]) -> str | None:
    """The resolved --config path of a recorded command (`mmpg train --config X ...`), None without one."""
    for i, word in enumerate(command):
        if word == "--config" and i + 1 < len(command):
            return str(Path(command[i + 1]).expanduser().resolve())
        if word.startswith("--config="):
            return str(Path(word.partition("=")[2]).expanduser().resolve())
    return None


def _overrides(command: list[str]) -> list[str]:
    """The command's key=value overrides, without those a continued run may change."""
    out, skip = [], False
    for word in command[2:]:
        if skip:
            skip = False
            continue
        if word in ("--config", "--resume"):
            skip = True
            continue
        if "=" in word and not word.startswith("-") and not word.startswith(IGNORED):
            out.append(word)
    return out


def _runs_of(output_dir: Path, kind: str, config: str | None) -> list[tuple[Path, dict]]:
    found = []
    for run in sorted(p for p in output_dir.iterdir() if p.is_dir()) if output_dir.is_dir() else []:
        try:
            info = json.loads((run / RUN_JSON).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # not a run directory (or a damaged one: its own reader says so)
        command = info.get("command") if isinstance(info.get("command"), list) else []
        if info.get("kind") == kind and config_file([str(c) for c in command]) == config:
            found.append((run, info))
    return found


def run_to_continue(output_dir: str, kind: str, command: list[str]) -> tuple[str | None, str]:
    """(the run name `auto` continues or None for a new run, the line that says so)."""
    config = config_file(command)
    root = Path(output_dir)
    what = f"{kind} runs of {config or 'no --config'} under {root}"
    found = _runs_of(root, kind, config)
    candidates = []
    for run, info in found:
        latest = latest_checkpoint(run)
        if latest is not None:
            candidates.append(((latest[1] / COMPLETE).stat().st_mtime, run, info, latest[0]))
    runs = len(found)
    if not candidates:
        why = f"{runs} without a complete checkpoint" if runs else "none"
        return None, (f"checkpoint.resume=auto: no earlier {what} to continue ({why}): starting a new run "
                      "(trainer.run_name=NAME continues a given one)")
    _, run, info, step = max(candidates, key=lambda c: (c[0], c[1].name))
    among = f"the newest checkpoint of {runs} {what}" if runs > 1 else f"the one {what.replace(' runs ', ' run ', 1)}"
    line = (f"checkpoint.resume=auto: continuing {run} from its step {step} ({among}; trainer.run_name=NAME picks "
            "another)")
    recorded = [str(c) for c in info.get("command", [])]
    if _overrides(recorded) != _overrides(command):
        line += f"; it was started with other overrides: {' '.join(_overrides(recorded)) or 'none'}"
    return run.name, line
