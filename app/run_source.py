"""A run directory as the inspector sees it: the `RunReader` (made once the folder is a run directory) and caches
of what it reads, so that a refresh every few seconds re-parses only the files that changed.

A parsed file is cached under its `stat_key` (modification time, size, inode): a run that is still writing adds
new files, a resumed run rewrites some, and either shows up at the next read. Handlers run in threads, so the
caches are behind one lock.

    source = RunSource("runs/my_run")        # never raises; `source.problem()` says what is missing
    source.steps()                           # [int], listed afresh
    groups = source.groups(12)               # [GroupRecord] of step 12
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

from mmpg_app.groups import GroupSummary, summarize
from mmpg.errors import UserError
from mmpg.runs import EVAL_JSONL, METRICS_JSONL, GroupRecord, RunReader
from mmpg.runs.layout import rollout_path


class RunSource:
    """A run directory's `RunReader` and the caches over it. Holds at most `max_steps` parsed step files (a step of
    16 groups x 8 long responses is about 1 MB of text) and a summary of every step seen (a few numbers per group,
    for filters over the whole run).
    """

    def __init__(self, run_dir: str | os.PathLike, max_steps: int = 16):
        self.run_dir = Path(run_dir)
        self._reader: RunReader | None = None
        self._groups: OrderedDict[int, tuple[tuple, list[GroupRecord]]] = OrderedDict()
        self._summaries: dict[int, tuple[tuple, list[GroupSummary]]] = {}
        self._metrics: tuple[tuple, list[dict]] | None = None
        self._max_steps = max_steps
        self._lock = threading.Lock()  # Gradio runs handlers in threads

    def reader(self) -> RunReader:
        """The RunReader; UserError (saying what is missing) while the folder is not a run directory."""
        if self._reader is None:
            self._reader = RunReader(self.run_dir)
        return self._reader

    def problem(self) -> str | None:
        """Why nothing can be shown (empty folder, newer layout, ...), or None."""
        try:
            self.reader()
        except UserError as e:
            return str(e)
        return None

    def steps(self) -> list[int]:
        return self.reader().steps()

    def metrics(self) -> list[dict]:
        """metrics.jsonl records, re-read only when the file changed."""
        key = stat_key(self.run_dir / METRICS_JSONL)
        with self._lock:
            if self._metrics is not None and self._metrics[0] == key:
                return self._metrics[1]
        records = self.reader().metrics()
        with self._lock:
            self._metrics = (key, records)
        return records

    def metrics_key(self) -> tuple:
        """Changes whenever metrics.jsonl or eval.jsonl changes."""
        return stat_key(self.run_dir / METRICS_JSONL) + stat_key(self.run_dir / EVAL_JSONL)

    def eval_metrics(self) -> list[dict]:
        return self.reader().eval_metrics()

    def groups(self, step: int) -> list[GroupRecord]:
        """The GroupRecords of one step (UserError if the step has no rollouts or its file is damaged)."""
        key = stat_key(rollout_path(self.run_dir, step))
        with self._lock:
            hit = self._groups.get(step)
            if hit is not None and hit[0] == key:
                self._groups.move_to_end(step)
                return hit[1]
        groups = self.reader().rollouts(step)
        with self._lock:
            self._groups[step] = (key, groups)
            self._groups.move_to_end(step)
            while len(self._groups) > self._max_steps:
                self._groups.popitem(last=False)
            self._summaries[step] = (key, [summarize(step, i, g) for i, g in enumerate(groups)])
        return groups

    def summaries(self, step: int) -> list[GroupSummary]:
        key = stat_key(rollout_path(self.run_dir, step))
        with self._lock:
            hit = self._summaries.get(step)
            if hit is not None and hit[0] == key:
                return hit[1]
        self.groups(step)
        return self._summaries[step][1]

    def all_summaries(self, progress=None) -> tuple[list[GroupSummary], list[str]]:
        """Summaries of every step (slow the first time on a long run: every step file is parsed once, about 4 ms a
        step of 16 groups), and one message per step that could not be read. progress(done, total) is called as
        it goes."""
        out, problems = [], []
        steps = self.steps()
        for i, step in enumerate(steps):
            if progress is not None and i % 25 == 0:
                progress(i, len(steps))
            try:
                out.extend(self.summaries(step))
            except UserError as e:
                problems.append(str(e))
        return out, problems


def stat_key(path: Path) -> tuple:
    """What says a file changed (modification time, size, inode); () while it does not exist."""
    try:
        st = path.stat()
    except OSError:
        return ()
    return (st.st_mtime_ns, st.st_size, st.st_ino)
