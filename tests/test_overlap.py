"""Rollout/training overlap (`mmpg.rl.overlap`): the schedule of weight versions, errors, and the side group's
collectives running beside the main thread's on two ranks (torchrun, gloo)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from mmpg.errors import UserError
from mmpg.rl.collect import LoaderWaits, Timer
from mmpg.rl.grpo import GRPOStep
from mmpg.rl.overlap import Prefetcher


def drive(k: int, start: int, total: int, update_s: float = 0.0, rollout_s: float = 0.0):
    """The main thread's side of the protocol, as GRPOStep.run takes it; returns {step: version sampled with} and the
    versions the server held while each rollout ran (must never change mid-rollout)."""
    held = {"version": start}
    sampled, during, entered = {}, {}, {}

    def collect(t, gate):
        entered[t] = held["version"]
        time.sleep(rollout_s / 2)  # pulling and decoding the batch, before the weights are there
        version = gate()
        assert version == held["version"], "sampled with weights the server does not hold"
        before = held["version"]
        time.sleep(rollout_s)
        during[t] = (before, held["version"])
        sampled[t] = version
        return [f"groups {t}"], {"step": t}

    p = Prefetcher(collect, k, start, total)
    for step in range(start + 1, total + 1):
        groups, info = p.take(step)
        assert groups == [f"groups {step}"] and info == {"step": step}
        time.sleep(update_s)
        p.quiesce(step)
        time.sleep(0.01)
        held["version"] = step  # the weight sync
        p.published(step)
    p.thread.join(timeout=10)
    assert not p.thread.is_alive()
    drive.entered = entered
    return sampled, during


@pytest.mark.parametrize("k", [1, 2, 3])
def test_each_step_is_sampled_with_the_weights_k_steps_old(k):
    sampled, during = drive(k, 0, 8, update_s=0.01)
    assert sampled == {t: max(0, t - 1 - k) for t in range(1, 9)}
    assert all(a == b for a, b in during.values())  # no weight sync landed during a rollout
    # each step's batch was pulled before its weights were on the server (while the previous sync ran)
    assert all(drive.entered[t] < t - 1 - k for t in range(k + 2, 9)), drive.entered


def test_the_schedule_does_not_depend_on_which_side_is_slower():
    fast_rollouts, _ = drive(1, 0, 6, update_s=0.02)
    slow_rollouts, _ = drive(1, 0, 6, rollout_s=0.02)
    assert fast_rollouts == slow_rollouts == {1: 0, 2: 0, 3: 1, 4: 2, 5: 3, 6: 4}


def test_a_resumed_run_samples_its_first_steps_with_the_checkpoint_weights():
    sampled, _ = drive(2, 5, 10)
    assert sampled == {6: 5, 7: 5, 8: 5, 9: 6, 10: 7}


def test_the_rollouts_really_overlap_the_update():
    """k = 1, rollout 0.15 s (0.05 of it before the weights are needed), update 0.1 s, sync 0.01 s: taking turns,
    6 steps take 1.56 s; overlapped, about 1.0 s."""
    t0 = time.perf_counter()
    drive(1, 0, 6, update_s=0.1, rollout_s=0.1)
    seconds = time.perf_counter() - t0
    assert seconds < 0.8 * 6 * (0.15 + 0.1 + 0.01), f"{seconds:.2f} s: the rollouts did not overlap the updates"


def test_a_refusal_in_the_thread_is_a_user_error_at_the_next_take():
    def collect(t, gate):
        gate()
        if t == 2:
            raise UserError("video.mp4: the server refused the request")
        return [], {}

    p = Prefetcher(collect, 1, 0, 5)
    p.take(1)
    with pytest.raises(UserError, match="video.mp4: the server refused"):
        p.take(2)
    p.thread.join(timeout=10)
    assert not p.thread.is_alive()


def test_a_bug_in_the_thread_is_raised_not_waited_for():
    def collect(t, gate):
        raise KeyError("oops")

    p = Prefetcher(collect, 1, 0, 3)
    with pytest.raises(RuntimeError, match="rollout thread failed: KeyError"):
        p.take(1)


def test_quiesce_waits_for_the_rollouts_that_must_not_see_the_new_weights():
    release = threading.Event()

    def collect(t, gate):
        gate()
        if t == 2:
            release.wait(5)
        return [t], {}

    p = Prefetcher(collect, 1, 0, 4)
    p.take(1)
    waiter = threading.Thread(target=p.quiesce, args=(1,))
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive(), "quiesce(1) returned while step 2's rollout (weights of step 0) was running"
    release.set()
    waiter.join(timeout=5)
    assert not waiter.is_alive()
    p.stop()


def test_loader_waits_count_the_part_of_an_interval_they_cover():
    """Spans [1, 3] (closed) and [5, ...] (still open): within [2, 6] they cover 1 + 1 s; an open span counts up to
    the interval's end; after a step only the open one is kept."""
    waits = LoaderWaits()
    waits.spans = [[1.0, 3.0], [5.0, None]]
    assert waits.within(2.0, 6.0) == 2.0
    assert waits.within(0.0, 10.0) == 7.0
    assert waits.within(3.0, 5.0) == 0.0
    waits.forget_ended()
    assert waits.spans == [[5.0, None]]


def drive_data(load_s: float, update_s: float, steps: int = 4) -> list[dict]:
    """k = 1, the rollout thread waiting `load_s` for each step's batch (before its weights are needed), the update
    `update_s`: the main thread's side as GRPOStep.run does it; per step its timing (data, rollout_wait)."""
    waits = LoaderWaits()
    step_fn = SimpleNamespace(loader_waits=waits)

    def collect(t, gate):
        with waits():
            time.sleep(load_s)
        gate()
        return [t], {}

    p = Prefetcher(collect, 1, 0, steps)
    out = []
    for step in range(1, steps + 1):
        timer = Timer()
        GRPOStep._wait_for_rollouts(step_fn, timer, lambda: p.take(step))
        time.sleep(update_s)
        GRPOStep._wait_for_rollouts(step_fn, timer, lambda: p.quiesce(step))
        p.published(step)
        waits.forget_ended()
        out.append(timer.seconds)
    return out


def test_overlapped_data_wait_is_the_part_the_step_saw():
    """The first step waits for its whole batch; later batches are pulled while the update runs. With an update
    longer than the load the steps see (nearly) none of it. With a load of 0.6 s and an update of 0.1 s, a step
    waits at the sync for the next step's batch (the rest of its load): over 4 steps 4 x 0.6 s of loading, of which
    at most 4 x 0.1 s hid behind the updates. The data wait is always a part of the wait for the rollout thread."""
    hidden = drive_data(load_s=0.2, update_s=0.6)
    assert hidden[0]["data"] >= 0.15, hidden
    assert all(t["data"] < 0.05 for t in hidden[1:]), hidden
    seen = drive_data(load_s=0.6, update_s=0.1)
    assert seen[0]["data"] >= 0.5 and 4 * 0.5 - 0.1 <= sum(t["data"] for t in seen) <= 4 * 0.6 + 0.3, seen
    assert all(t["data"] <= t["rollout_wait"] + 1e-9 for t in hidden + seen)


def test_k_zero_is_refused():
    with pytest.raises(ValueError, match="k >= 1"):
        Prefetcher(lambda t, v: ([], {}), 0, 0, 1)


TWO_RANKS = r'''
import os, sys, threading, time
import torch
from mmpg import dist
from mmpg.rl.overlap import Prefetcher
dist.init("cpu")
dist.make_side_group()
me = dist.rank()

def collect(t, gate):
    version = gate()
    # the thread's collectives (side group) while the main thread runs its own (world group) at the same time
    counts = dist.gather_data(10 * t + me)
    together = dist.all_true(True)
    total = dist.all_sum([float(t)])[0]
    return [counts, together, total, version], {"on_side": dist.on_side()}

p = Prefetcher(collect, 1, 0, 12)
for step in range(1, 13):
    groups, info = p.take(step)
    assert groups == [[10 * step, 10 * step + 1], True, 2.0 * step, max(0, step - 2)], groups
    assert info["on_side"] and not dist.on_side()
    for _ in range(20):  # the update's collectives, overlapping the thread's
        assert dist.all_sum([1.0])[0] == 2.0
    p.quiesce(step)
    p.published(step)
dist.shutdown()
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"ok{me}"), "w").close()
'''


@pytest.mark.slow
def test_two_ranks_thread_and_main_collectives_do_not_cross(tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(29300 + os.getpid() % 200), str(script)], capture_output=True, text=True, timeout=180,
                         cwd=Path(__file__).resolve().parents[1], env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert (tmp_path / "ok0").is_file() and (tmp_path / "ok1").is_file()
