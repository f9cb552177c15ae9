"""The suite's forked runs (tests/forked_cli.py) behave as cold processes where the tests rely on it: each child is its
own process and session with the environment, folder and thread count it was given, a rank's failure ends the other
ranks, a timeout kills the run, and a signal is reported as subprocess reports it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from forked_cli import WarmProcess
from train_utils import ROOT, env


def probe(argv: list[str]) -> int:
    """Runs in a forked child: prints what it sees, then does what argv asks."""
    import threading

    import torch

    print(json.dumps({"pid": os.getpid(), "sid": os.getsid(0), "cwd": os.getcwd(), "rank": os.environ.get("RANK"),
                      "world": os.environ.get("WORLD_SIZE"), "port": os.environ.get("MASTER_PORT"),
                      "marker": os.environ.get("MMPG_PROBE"), "threads": torch.get_num_threads(),
                      "python_threads": threading.active_count(), "argv": sys.argv[1:]}))
    print("to stderr", file=sys.stderr)
    action = argv[0] if argv else ""
    if action == "exit":
        return int(argv[1])
    if action == "raise":
        raise SystemExit("a message")
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "fail-rank":
        if os.environ["RANK"] == argv[1]:
            return 3
        time.sleep(120)
    if action == "sleep":
        time.sleep(float(argv[1]))
    return 0


@pytest.fixture(scope="module")
def warm():
    process = WarmProcess(env())
    yield process
    process.close()


def _run(warm, argv, procs=1, timeout=60, **extra):
    return warm.run(argv, {**env(), **extra}, warm_cwd(), timeout, procs, target="test_forked_cli:probe")


def warm_cwd():
    return ROOT / "tests"


def test_a_child_is_its_own_process_with_the_environment_it_was_given(warm):
    first = _run(warm, ["exit", "0"], MMPG_PROBE="one", OMP_NUM_THREADS="2")
    second = _run(warm, ["exit", "5"], MMPG_PROBE="two", OMP_NUM_THREADS="1")
    assert (first.returncode, second.returncode) == (0, 5)
    one, two = json.loads(first.stdout), json.loads(second.stdout)
    assert one["pid"] != two["pid"] and one["sid"] == one["pid"] and two["sid"] == two["pid"]
    assert os.getpid() not in (one["pid"], two["pid"])
    assert (one["marker"], two["marker"]) == ("one", "two")
    assert (one["threads"], two["threads"]) == (2, 1)
    assert one["cwd"] == str(ROOT / "tests") and one["python_threads"] == 1
    assert one["argv"] == ["exit", "0"] and first.stderr == "to stderr\n"


def test_exit_paths_are_reported_as_a_cold_process_reports_them(warm):
    raised = _run(warm, ["raise"])
    assert raised.returncode == 1 and raised.stderr.endswith("a message\n")
    killed = _run(warm, ["kill"])
    assert killed.returncode == -signal.SIGKILL


def test_ranks_get_torchruns_environment_and_a_failing_rank_ends_the_others(warm):
    both = _run(warm, ["exit", "0"], procs=2)
    lines = [json.loads(x) for x in both.stdout.splitlines()]
    assert both.returncode == 0 and sorted(x["rank"] for x in lines) == ["0", "1"]
    assert {x["world"] for x in lines} == {"2"} and len({x["port"] for x in lines}) == 1
    t0 = time.monotonic()
    failed = _run(warm, ["fail-rank", "1"], procs=2)
    assert failed.returncode == 1 and time.monotonic() - t0 < 30


def test_a_run_past_its_timeout_is_killed(warm):
    with pytest.raises(subprocess.TimeoutExpired):
        _run(warm, ["sleep", "120"], timeout=2)
    assert _run(warm, ["exit", "0"]).returncode == 0  # and the warm process serves the next run
