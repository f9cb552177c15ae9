"""`mmpg ...` runs for tests, forked from a warm process instead of started cold.

A cold `python -m mmpg.cli train ...` spends ~10 s of one core importing torch, transformers, DeepSpeed and the
video readers before it reads its config; the suite starts over a hundred of them. Here one process per test worker
(the *warm process*, this file run as a script) imports that stack once and then forks a child per run: each child
is a new process with its own pid, session, environment, working folder, stdout and stderr files, that calls
`mmpg.cli.main(argv)` and exits with its code, running the interpreter's exit handlers as a cold process does. Several
children make the ranks of one distributed run (the environment torchrun gives its ranks: RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT); as torchrun does, when one rank fails the others are ended.

What a cold start adds is tested where it matters with real processes (`run_cli(..., fresh=True)`, the launcher,
resume-after-SIGKILL and console-script tests): module import order, import-time environment reads (there are none in
mmpg, tests/test_forked_cli.py checks the warm process stays single-threaded and that children see their own
environment), and torchrun's own handling of a failing rank.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from mmpg.serve.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
CLI = ROOT / "mmpg" / "cli.py"


def rank_envs(env: dict, procs: int) -> list[dict]:
    """The environment of each rank, as `torchrun --nproc_per_node procs` on one host gives it."""
    if procs == 1:
        return [dict(env)]
    port = str(free_port())
    return [{**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(procs), "LOCAL_WORLD_SIZE": str(procs),
             "GROUP_RANK": "0", "ROLE_RANK": str(r), "ROLE_WORLD_SIZE": str(procs), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": port} for r in range(procs)]


class WarmProcess:
    """The test side: starts the warm process on first use, sends it runs, reads their outputs back."""

    def __init__(self, env: dict):
        self.env = dict(env)
        self.proc = None

    def _start(self):
        log = open(Path(tempfile.gettempdir()) / f"mmpg-warm-{os.getpid()}.log", "ab")
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__))], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log, env=self.env, cwd=ROOT, text=True, bufsize=1)
        log.close()
        line = self.proc.stdout.readline()
        if json.loads(line or "{}").get("ready") is not True:
            raise RuntimeError(f"the warm process did not start: {line!r} (its log: {log.name})")
        atexit.register(self.close)

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None

    def run(self, argv: list[str], env: dict, cwd: Path, timeout: float, procs: int = 1,
            target: str = "mmpg.cli:main") -> subprocess.CompletedProcess:
        """Run `target(argv)` (module:function, returning an exit code) in `procs` forked children."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        with tempfile.TemporaryDirectory(prefix="mmpg-forked-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"argv": argv, "envs": rank_envs(env, procs), "cwd": str(cwd), "out": str(out),
                       "err": str(err), "target": target}
            self.proc.stdin.write(json.dumps(request) + "\n")
            pids = json.loads(self.proc.stdout.readline())["pids"]
            result, done = {}, threading.Event()

            def read():
                result.update(json.loads(self.proc.stdout.readline() or "{}"))
                done.set()

            threading.Thread(target=read, daemon=True).start()
            if not done.wait(timeout):
                for pid in pids:
                    _kill_group(pid)
                done.wait(30)
                raise subprocess.TimeoutExpired(["mmpg"] + argv, timeout, out.read_bytes(), err.read_bytes())
            return subprocess.CompletedProcess(["mmpg"] + argv, result["code"], out.read_text(errors="replace"),
                                               err.read_text(errors="replace"))


def _kill_group(pid: int):
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---- the warm process ----


def _warm_up():
    """Import what `mmpg train`, `mmpg sft` and `mmpg eval` import, and nothing that starts a thread."""
    import decord  # noqa: F401
    import deepspeed  # noqa: F401
    import qwen_vl_utils  # noqa: F401
    import torch.distributed  # noqa: F401
    import transformers.models.qwen2_5_vl.modeling_qwen2_5_vl  # noqa: F401
    import transformers.models.qwen3_vl.modeling_qwen3_vl  # noqa: F401

    import mmpg.cli  # noqa: F401
    import mmpg.eval.cli  # noqa: F401
    import mmpg.rl.trainer  # noqa: F401
    import mmpg.sft.job  # noqa: F401


def _child(request: dict, env: dict, replies: int):
    """In the forked child: become the run's own process, run the target, exit as a cold interpreter exits."""
    code = 1
    try:
        os.setsid()
        os.close(replies)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, path in ((1, request["out"]), (2, request["err"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(f, fd)
            os.close(f)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(env)
        for entry in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        import torch

        threads = env.get("OMP_NUM_THREADS")
        torch.set_num_threads(int(threads) if threads else len(os.sched_getaffinity(0)))
        sys.argv = [str(CLI)] + request["argv"]
        module, _, function = request["target"].partition(":")
        code = getattr(importlib.import_module(module), function)(request["argv"])
        code = 0 if code is None else code
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - the traceback a cold interpreter prints
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


def _wait_all(pids: list[int]) -> int:
    """Every rank's exit; the first failing rank ends the others (torchrun's rule), the run's code is then 1."""
    left, failed = set(pids), False
    code = 0
    while left:
        pid, status = os.waitpid(-1, 0)
        if pid not in left:
            continue
        left.discard(pid)
        rc = os.waitstatus_to_exitcode(status)
        if len(pids) == 1:
            code = rc  # as subprocess reports it: -N for a signal
        elif rc != 0 and not failed:
            failed, code = True, 1
            for other in left:
                _kill_group(other)
    return code


def serve():
    replies = os.dup(1)
    os.dup2(2, 1)  # nothing imported may write into the replies
    _warm_up()
    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        raise SystemExit(f"the warm process has threads after its imports: {threading.enumerate()}, "
                         f"{len(os.listdir('/proc/self/task'))} in the OS (an OpenMP pool: run with OMP_NUM_THREADS=1)")

    def reply(obj):
        os.write(replies, (json.dumps(obj) + "\n").encode())

    reply({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        pids = []
        for env in request["envs"]:
            pid = os.fork()
            if pid == 0:
                _child(request, env, replies)
            pids.append(pid)
        reply({"pids": pids})
        started = time.monotonic()
        reply({"code": _wait_all(pids), "seconds": round(time.monotonic() - started, 2)})


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    serve()
