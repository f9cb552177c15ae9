"""`mmpg bench --levels async` (mmpg.bench.overlap): its per-arm arithmetic and table on fabricated metrics and marks,
every expected number worked out by hand. No timing is measured."""

from __future__ import annotations

import argparse

import pytest

from mmpg.bench import cli
from mmpg.bench.overlap import arm_summary, ceiling, format_table, task_seconds
from mmpg.errors import UserError


def _record(step, rollout, update, logprob, sync, total, wait=None):
    r = {"step": step, "timing_s/rollout": rollout, "timing_s/update": update, "timing_s/logprob": logprob,
         "timing_s/weight_sync": sync, "timing_s/step": total, "perf/weight_sync_server_s": sync}
    if wait is not None:
        r["timing_s/rollout_wait"] = wait
    return r


# k = 0: step 1 is warm-up (10 s); steps 2 and 3: rollout 4 + 2, update (logprob + update) 1+3 and 1+1.
# Step 4, each run's last, is left out (at k = 1 nothing is in flight after it): its figures would change every mean.
SYNC = [_record(1, 9.0, 0.5, 0.5, 0.0, 10.0), _record(2, 4.0, 3.0, 1.0, 0.5, 9.0), _record(3, 2.0, 1.0, 1.0, 0.5, 5.0),
        _record(4, 0.1, 0.1, 0.1, 0.1, 0.4)]


def _marks(*rows):
    """step -> (wall s, counters) from (step, wall, server CPU, server queued, trainer CPU, trainer queued)."""
    keys = ("server_cpu", "server_queued", "trainer_cpu", "trainer_queued")
    return {r[0]: (r[1], dict(zip(keys, r[2:]))) for r in rows}


# Periods: step 2 100 -> 110 (10 s), step 3 110 -> 116 (6 s): 16 s for 2 steps; server busy 4.5 + 2.5 = 7 s of
# them; server queued 1 + 0 s, trainer CPU 5 + 3 s, trainer queued 0.5 + 0.5 s.
SYNC_MARKS = _marks((1, 100.0, 50.0, 2.0, 10.0, 1.0), (2, 110.0, 54.5, 3.0, 15.0, 1.5),
                    (3, 116.0, 57.0, 3.0, 18.0, 2.0), (4, 116.5, 57.1, 3.0, 18.1, 2.0))
# k = 1: steps 2 and 3 each wait 1 s for their rollouts of 4 s, update 2 + 2, step 5 s; periods 5 s and 5 s, the
# server busy 4 s of each.
OVER = [_record(1, 9.0, 0.5, 0.5, 0.0, 10.0, wait=9.0), _record(2, 4.0, 1.5, 0.5, 0.5, 5.0, wait=1.0),
        _record(3, 4.0, 1.5, 0.5, 0.5, 5.0, wait=1.0), _record(4, 4.0, 1.5, 0.5, 0.0, 0.5, wait=0.0)]
OVER_MARKS = _marks((1, 0.0, 0.0, 0.0, 0.0, 0.0), (2, 5.0, 4.0, 0.0, 4.0, 0.0), (3, 10.0, 8.0, 0.0, 8.0, 0.0),
                    (4, 10.5, 8.1, 0.0, 8.4, 0.0))


def test_arm_summary_of_the_synchronous_arm():
    a = arm_summary(0, [(SYNC, SYNC_MARKS)], warmup=1)
    assert a["steps"] == [2, 3]
    assert a["period_s"] == pytest.approx(8.0)  # 16 s / 2 steps
    assert a["steps_per_hour"] == pytest.approx(450.0)  # 3600 * 2 / 16
    assert a["phases"] == pytest.approx({"rollout": 3.0, "rollout wait": 0.0, "update": 3.0, "weight sync": 0.5,
                                         "step": 7.0})
    assert a["trainer_idle"] == pytest.approx(1 - 8.0 / 16.0)  # trainer CPU 5 + 3 s of 16 s
    # server work: rollout 3 + its side of the sync 0.5 per step, 7 s of 16 s; its CPU 7 s / 2 steps
    assert a["server_work_s"] == pytest.approx(3.5) and a["server_idle"] == pytest.approx(1 - 7.0 / 16.0)
    assert a["server_cpu_s"] == pytest.approx(3.5)
    assert (a["server_queued_s"], a["trainer_cpu_s"], a["trainer_queued_s"]) == pytest.approx((0.5, 4.0, 0.5))


def test_arm_summary_of_the_overlapped_arm_and_the_table():
    sync, over = arm_summary(0, [(SYNC, SYNC_MARKS)], warmup=1), arm_summary(1, [(OVER, OVER_MARKS)], warmup=1)
    assert over["steps_per_hour"] == pytest.approx(720.0)  # 3600 * 2 / 10
    assert over["trainer_idle"] == pytest.approx(0.2)  # CPU 4 + 4 s of 10 s
    assert over["server_idle"] == pytest.approx(0.1)  # rollout 4 + sync 0.5, twice, of 10 s
    assert ceiling(sync) == pytest.approx(2.0)  # R 3 = U 3: (3 + 3) / 3
    table = format_table([sync, over]).splitlines()
    assert len(table) == 4
    cells = [c.strip() for c in table[3].strip("|").split("|")]
    assert cells[:3] == ["1", "2-3", "720"]
    assert cells[4] == "1.00" and cells[-2:] == ["1.60x", "2.00x"]  # 720 / 450; the ceiling of the k = 0 arm
    sync_cells = [c.strip() for c in table[2].strip("|").split("|")]
    assert sync_cells[4] == "-" and sync_cells[9] == "50%" and sync_cells[-3:] == ["0.50 / 0.50", "1.00x", "2.00x"]


def test_runs_pool_their_steps():
    """Two runs of an arm: the k = 0 run above and one whose steps 2, 3 take periods of 4 s each (8 s, server busy
    3 s of each): 4 steps in 24 s -> 600 steps/h; rollout mean (4 + 2 + 1 + 1) / 4 = 2, server work 2 + 0.5 per
    step: idle 1 - 10 / 24; trainer CPU 8 + 6 s: idle 1 - 14 / 24."""
    fast = [_record(1, 9.0, 0.5, 0.5, 0.0, 10.0), _record(2, 1.0, 1.0, 1.0, 0.5, 3.5),
            _record(3, 1.0, 1.0, 1.0, 0.5, 3.5), _record(4, 1.0, 1.0, 1.0, 0.5, 0.1)]
    marks = _marks((1, 0.0, 0.0, 0.0, 0.0, 0.0), (2, 4.0, 2.0, 0.0, 3.0, 0.0), (3, 8.0, 4.0, 0.0, 6.0, 0.0),
                   (4, 8.1, 4.0, 0.0, 6.1, 0.0))
    a = arm_summary(0, [(SYNC, SYNC_MARKS), (fast, marks)], warmup=1)
    assert a["n"] == 4 and a["runs"] == 2 and a["steps"] == [2, 3]
    assert a["steps_per_hour"] == pytest.approx(600.0) and a["period_s"] == pytest.approx(6.0)
    assert a["server_idle"] == pytest.approx(1 - 10.0 / 24.0) and a["trainer_idle"] == pytest.approx(1 - 14 / 24)
    assert a["phases"]["rollout"] == pytest.approx(2.0) and a["phases"]["step"] == pytest.approx(5.25)
    assert format_table([a]).splitlines()[2].split("|")[2].strip() == "2-3 x 2"


def test_ceiling_of_unequal_phases_and_warmup_choice():
    a = arm_summary(0, [(SYNC, SYNC_MARKS)], warmup=2)  # step 3 alone (4 is the last): R 2, U 2 -> 2x; period 6 s
    assert a["steps"] == [3] and a["steps_per_hour"] == pytest.approx(600.0)
    a["phases"].update(rollout=1.0, update=3.0)
    assert ceiling(a) == pytest.approx(4.0 / 3.0)
    with pytest.raises(ValueError, match="no step after the 3 warm-up"):
        arm_summary(0, [(SYNC, SYNC_MARKS)], warmup=3)


def test_task_seconds_counts_this_process():
    import os

    before = task_seconds([os.getpid()])[0]
    busy = sum(i for i in range(2_000_000))  # some CPU time of our own
    assert busy > 0 and task_seconds([os.getpid()])[0] > before
    assert task_seconds([2 ** 22 + 12345]) == (0.0, 0.0)  # no such process


def test_async_level_runs_alone():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(UserError, match="--levels async runs alone"):
        cli.run(parser.parse_args(["--levels", "async,step"]))
