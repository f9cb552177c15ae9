"""Rollout/training overlap in the inspector: which weights sampled a group, and how stale a run's rollouts were.

With rollout.max_staleness = k >= 1 a step may train on groups that older weights sampled. A group record carries
policy_version v (the weights after training step v sampled it; 0: the initial weights; absent in records written
before the field existed, read as synchronous), and

    staleness = step - 1 - v        (0: sampled by the weights the step trains, i.e. synchronous; at most k)

metrics.jsonl carries rollout/staleness_mean and rollout/staleness_max of each step's groups. A run is shown as
asynchronous when its config sets k > 0 or anything it wrote is stale (a logged max above 0, a group of the step on
show); a synchronous run's groups carry no staleness line and its card says "synchronous". Staleness is no
success: nothing here is painted green, and a group staler than the run's own bound (or sampled by weights newer
than the step) is shown as an error.

    k = configured_staleness(src)                    # rollout.max_staleness of config.yaml; None when unknown
    group_staleness_html(group, k, asynchronous(k, metrics, groups))
    rollouts_card_html(k, metrics)                   # the summary's "rollouts" card
"""

from __future__ import annotations

import html
import math
import threading
from pathlib import Path

from mmpg.errors import UserError
from mmpg.runs import GroupRecord, metric_series
from mmpg.runs.layout import CONFIG_YAML

MEAN_KEY, MAX_KEY = "rollout/staleness_mean", "rollout/staleness_max"
_CACHE: dict[str, tuple[tuple, int | None]] = {}  # config.yaml path -> (its stat, rollout.max_staleness)
_LOCK = threading.Lock()


def steps_text(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def configured_staleness(src) -> int | None:
    """rollout.max_staleness of a RunSource's config.yaml (0 for a config written before the setting existed); None
    without a readable config.yaml. Parsed again only when the file changes."""
    path = Path(src.run_dir) / CONFIG_YAML
    try:
        st = path.stat()
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
    except OSError:
        return None
    with _LOCK:
        hit = _CACHE.get(str(path))
        if hit is not None and hit[0] == key:
            return hit[1]
    try:
        rollout = src.reader().config().get("rollout") or {}
        value = rollout.get("max_staleness", 0) if isinstance(rollout, dict) else 0
        k = int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    except (UserError, AttributeError):  # damaged YAML, or a config that is not a mapping: unknown
        k = None
    with _LOCK:
        _CACHE[str(path)] = (key, k)
    return k


def logged_staleness(metrics: list[dict]) -> tuple[float | None, int | None, int]:
    """(mean over the logged steps of rollout/staleness_mean, largest rollout/staleness_max, steps logged);
    (None, None, 0) when the run logged neither."""
    means = [v for v in metric_series(metrics, MEAN_KEY)[1] if _finite(v)]
    maxes = [v for v in metric_series(metrics, MAX_KEY)[1] if _finite(v)]
    mean = sum(means) / len(means) if means else None
    top = int(round(max(maxes))) if maxes else (int(math.ceil(max(means))) if means else None)
    return mean, top, max(len(means), len(maxes))


def asynchronous(k: int | None, metrics: list[dict], groups: list[GroupRecord] = ()) -> bool:
    """Whether the run overlapped rollouts with training: its config allows it, or something it wrote is stale."""
    _, top, _ = logged_staleness(metrics)
    return bool(k) or bool(top) or any(g.staleness != 0 for g in groups)


def group_staleness_html(g: GroupRecord, k: int | None, shown: bool) -> str:
    """One line under a group's facts: 'sampled by the weights after step 4 · 1 step stale'; '' when not `shown`
    (a synchronous run). A group staler than rollout.max_staleness, or sampled by weights newer than its step, is an
    error line."""
    if not shown:
        return ""
    if g.policy_version is None:
        return ('<div class="mmpg-facts mmpg-staleness">sampled by: not recorded (a record written before '
                "policy_version existed)</div>")
    who = "the initial weights" if g.policy_version == 0 else f"the weights after step {g.policy_version}"
    line = f"sampled by {who} · {steps_text(g.staleness)} stale"
    bound = "" if k is None else f" (rollout.max_staleness = {k})"
    why = (f"staleness = step - 1 - policy_version = {g.step} - 1 - {g.policy_version}: the updates between the "
           f"weights that sampled this group and those step {g.step} trained{bound}")
    problem = ""
    if g.staleness < 0:
        problem = f"weights newer than step {g.step} cannot have sampled its groups: the record is inconsistent"
    elif k is not None and g.staleness > k:
        problem = f"staler than the run's rollout.max_staleness = {k}"
    if problem:
        return f'<div class="mmpg-error mmpg-staleness" title="{html.escape(why)}">{html.escape(line)}: {problem}</div>'
    return f'<div class="mmpg-facts mmpg-staleness" title="{html.escape(why)}">{html.escape(line)}</div>'


def rollouts_card_html(k: int | None, metrics: list[dict]) -> str:
    """The summary's card: 'synchronous', or 'up to k steps stale (mean m)' with the logged figures under it. A
    logged max above the configured k is named in red; nothing on it is green."""
    mean, top, steps = logged_staleness(metrics)
    logged = (f"over {steps} step(s): mean {mean:.2f}, max {steps_text(top)}" if mean is not None
              else f"over {steps} step(s): max {steps_text(top)}" if top is not None else "not logged yet")
    if not asynchronous(k, metrics):
        text = "synchronous"
        sub = "each step's groups sampled by the weights the step trains" + (
            f" (rollout.max_staleness = {k})" if k is not None else "")
    else:
        bound = max(k or 0, top or 0)
        text = f"up to {steps_text(bound)} stale" + (f" (mean {mean:.2f})" if mean is not None else "")
        sub = f"rollout.max_staleness = {'unknown' if k is None else k}; staleness {logged}"
    over = top is not None and k is not None and top > k
    warn = (f'<div class="mmpg-down mmpg-staleness-over">a group {steps_text(top)} stale: more than '
            f"rollout.max_staleness = {k}</div>" if over else "")
    return (f'<div class="mmpg-card" data-metric="rollouts" title="staleness: the updates between the weights that '
            f'sampled a group and those that trained on it (0: synchronous)"><div class="mmpg-card-name">rollouts'
            f'</div><div class="mmpg-rollouts"><b>{html.escape(text)}</b></div>'
            f'<div class="mmpg-sub">{html.escape(sub)}</div>{warn}</div>')


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))
