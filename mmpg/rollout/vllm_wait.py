"""Waiting for a vLLM server to come up, and saying why when it does not.

The trainer polls the server's /health for up to rollout.vllm_wait_s. A server the launch script started
(scripts/train_grounding.sh with VLLM=1) is named by $MMPG_VLLM_PID and $MMPG_VLLM_LOG: if that process exits before it
answers (a checkpoint it cannot load, a length the model does not allow, a GPU without memory), the wait ends at once
instead of running out, and the error quotes the last lines of the server's log, where vLLM says why. A server that
refuses the client's token (401) ends the wait at once too.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from mmpg.serve.wire import ServerError, call

SERVER_PID_ENV, SERVER_LOG_ENV = "MMPG_VLLM_PID", "MMPG_VLLM_LOG"  # set by scripts/train_grounding.sh (VLLM=1)
LOG_LINES = 5  # of a server's log quoted when it did not come up


def wait_for_server(url: str, wait_s: float, poll_s: float = 2.0, server_pid: int | None = None,
                    server_log: str | None = None, index: int = 0) -> dict:
    """Poll /health until the server answers or `wait_s` seconds pass (then a ServerError saying what to do).
    server_pid / server_log (default: $MMPG_VLLM_PID / $MMPG_VLLM_LOG, which the launch script sets for the servers it
    started, entry `index` of each for the index-th server of a pool): a server process that has exited ends the wait
    at once, and either error quotes the log's last lines."""
    # a pool of servers (several URLs): the launch script names their pids and logs in the same order, comma-separated
    pids, logs = (os.environ.get(k, "").split(",") for k in (SERVER_PID_ENV, SERVER_LOG_ENV))
    env_pid, env_log = (pids[index] if index < len(pids) else ""), (logs[index] if index < len(logs) else "")
    server_pid = server_pid if server_pid is not None else (int(env_pid) if env_pid.isdigit() else None)
    server_log = server_log if server_log is not None else env_log or None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return call(url, "/health", timeout=min(10.0, max(1.0, wait_s)), what="a health check")
        except ServerError as e:
            if e.status == 401:  # a server that is up and refuses this client's token: waiting cannot help
                raise
            if server_pid is not None and not process_running(server_pid):
                raise ServerError(f"the vLLM server for {url} (pid {server_pid}) exited before it answered"
                                  f"{log_tail(server_log)}") from None
            if time.monotonic() + poll_s > deadline:
                raise ServerError(f"{e} (waited {wait_s:g} s: rollout.vllm_wait_s){log_tail(server_log)}") from None
            time.sleep(poll_s)


def process_running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (an exited child its parent has not reaped yet is a zombie:
    it still exists, in state Z)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc here: os.kill said it exists
    return state not in ("Z", "X")


def log_tail(path: str | None, lines: int = LOG_LINES) -> str:
    """"; its log PATH ends: a | b | c" (the log's last non-empty lines), or "" without a log."""
    if not path:
        return ""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as e:
        return f"; its log {path} cannot be read ({e.strerror})"
    last = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
    return f"; its log {path} ends: " + " | ".join(last) if last else f"; its log {path} is empty"
