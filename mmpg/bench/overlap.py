"""`mmpg bench --levels async`: GRPO steps per hour with the vLLM server sampling while the trainer updates
(`rollout.max_staleness` k = 1) against the synchronous loop (k = 0), on two pinned cores.

    mmpg bench --levels async [--async-steps 12] [--async-rounds 2] [--warmup 2] [--S 32] [--G 12]
                              [--async-frames 4] [--async-pixels 3136] [--async-iterations 1] [--out F.json]

One tiny Qwen2.5-VL that vLLM serves (head_dim 64, float32), synthetic videos, one `mmpg vllm-serve` on
--server-core and one `mmpg train` per arm on --trainer-core (`taskset -c`, one thread each); both arms differ in the
staleness alone (one config, `train_overrides`; rollout.tis_cap 2 in both). Arms alternate over --async-rounds (0, 1,
1, 0, ...: the machine's drift cancels), the server restarted before each run (no cached videos carry over).
Per arm, means over the steps after --warmup and before the last (at k = 1 nothing is in flight after it): the
trainer's timings from metrics.jsonl; the period between two metrics lines (steps per hour = 3600 / period); the
server's work (its rollout request and its side of the weight sync) and idle share; the trainer's idle share from
its CPU seconds (/proc schedstat, every wait included); the server's CPU seconds and both sides' queued seconds
(ready but waiting for their core). Ceiling: (R + U) / max(R, U) from the synchronous arm's rollout R and update U
(logprob + update); weight sync, reward and bookkeeping stay serial. The table's columns: docs/performance.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from mmpg.serve.launch import ServerProcess

PHASES = (("rollout", ("rollout",)), ("rollout wait", ("rollout_wait",)), ("update", ("logprob", "update")),
          ("weight sync", ("weight_sync",)), ("step", ("step",)))
SPEC = {"hidden_size": 256, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 512,
        "vision_depth": 2}  # = mmpg make-tiny --family qwen2_5_vl --hidden-size 256 --heads 4 --kv-heads 2


# ---- arithmetic (pure; tests/test_bench_overlap.py) -----------------------------------------------------------------
def arm_summary(k: int, runs: list[tuple[list[dict], dict]], warmup: int) -> dict:
    """One arm's row, pooled over its runs (rounds). Each run: (records, marks); records: the run's metrics lines;
    marks: step -> (wall s, {"server_cpu", "server_queued", "trainer_cpu", "trainer_queued"} seconds so far,
    `probe`) when its metrics line appeared. A run's steps measured are those after `warmup` and before its last
    whose previous step has a mark too; every mean is over all measured steps of all runs."""
    rows, period, delta = [], 0.0, {}  # rows: the measured steps' metrics
    steps = []
    for records, marks in runs:
        by_step = {r["step"]: r for r in records}
        last = max(by_step)  # left out: at k >= 1 no rollout is in flight after it, so it waits for none
        mine = [s for s in sorted(by_step) if warmup < s < last and s in marks and s - 1 in marks]
        if not mine:
            raise ValueError(f"k={k}: no step after the {warmup} warm-up step(s) to measure (steps logged: "
                             f"{sorted(by_step)})")
        steps, rows = steps or mine, rows + [by_step[s] for s in mine]
        period += sum(marks[s][0] - marks[s - 1][0] for s in mine)
        for key in marks[mine[0]][1]:
            delta[key] = delta.get(key, 0.0) + sum(marks[s][1][key] - marks[s - 1][1][key] for s in mine)
    n = len(rows)
    mean = {name: sum(sum(r.get(f"timing_s/{p}", 0.0) for p in parts) for r in rows) / n for name, parts in PHASES}
    server_sync = sum(r.get("perf/weight_sync_server_s", 0.0) for r in rows) / n
    return {"k": k, "steps": steps, "runs": len(runs), "n": n, "period_s": period / n,
            "steps_per_hour": 3600 * n / period, "phases": mean,
            "trainer_idle": 1 - delta["trainer_cpu"] / period,
            "server_work_s": mean["rollout"] + server_sync,
            "server_idle": 1 - (mean["rollout"] + server_sync) * n / period,
            "server_cpu_s": delta["server_cpu"] / n,
            "server_queued_s": delta["server_queued"] / n, "trainer_cpu_s": delta["trainer_cpu"] / n,
            "trainer_queued_s": delta["trainer_queued"] / n,
            "staleness_mean": sum(r.get("rollout/staleness_mean", 0.0) for r in rows) / n}


def ceiling(sync: dict) -> float:
    """(R + U) / max(R, U) of the synchronous arm's mean rollout R and update U (logprob + update)."""
    r, u = sync["phases"]["rollout"], sync["phases"]["update"]
    return (r + u) / max(r, u) if max(r, u) > 0 else 1.0


def format_table(arms: list[dict]) -> str:
    """A markdown table, one row per arm, the speed-up against the k = 0 arm and the ceiling beside it."""
    sync = next(a for a in arms if a["k"] == 0)
    head = ["k", "steps measured", "steps/h", "rollout s", "rollout wait s", "update s", "weight sync s", "step s",
            "period s", "trainer idle", "server work s", "server idle", "server CPU s", "queued s (trainer/server)",
            "speed-up", "ceiling"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for a in arms:
        p = a["phases"]
        wait = f"{p['rollout wait']:.2f}" if a["k"] else "-"
        runs = f" x {a['runs']}" if a["runs"] > 1 else ""
        cells = [str(a["k"]), f"{a['steps'][0]}-{a['steps'][-1]}{runs}", f"{a['steps_per_hour']:.0f}",
                 f"{p['rollout']:.2f}", wait, f"{p['update']:.2f}", f"{p['weight sync']:.2f}", f"{p['step']:.2f}",
                 f"{a['period_s']:.2f}", f"{a['trainer_idle']:.0%}", f"{a['server_work_s']:.2f}",
                 f"{a['server_idle']:.0%}", f"{a['server_cpu_s']:.2f}",
                 f"{a['trainer_queued_s']:.2f} / {a['server_queued_s']:.2f}",
                 f"{a['steps_per_hour'] / sync['steps_per_hour']:.2f}x", f"{ceiling(sync):.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- measuring ------------------------------------------------------------------------------------------------------
def task_seconds(pids) -> tuple[float, float]:
    """(CPU seconds, seconds runnable but waiting for a CPU) of every thread of these processes, from
    /proc/PID/task/TID/schedstat (ns on the CPU, ns waiting on a run queue); the wait is what other processes
    sharing the core (or the process's own other threads) cost it."""
    cpu = wait = 0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # gone meanwhile
        for tid in tids:
            try:
                on, queued = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[:2]
            except (OSError, ValueError):
                continue
            cpu, wait = cpu + int(on), wait + int(queued)
    return cpu / 1e9, wait / 1e9


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (/proc/PID/stat)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            rest = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(rest[2]) == pgid:  # the fields after the name: state ppid pgrp ...
            out.append(int(pid))
    return out


def probe(server_pgid: int, trainer_pid: int) -> dict:
    """The server's and the trainer's CPU and run-queue seconds so far (`task_seconds`)."""
    server, trainer = task_seconds(group_pids(server_pgid)), task_seconds([trainer_pid])
    return {"server_cpu": server[0], "server_queued": server[1], "trainer_cpu": trainer[0],
            "trainer_queued": trainer[1]}


class Marks(threading.Thread):
    """Polls a run's metrics.jsonl: step -> (wall s, `probe`) when its line appeared."""

    def __init__(self, metrics: Path, server_pgid: int, trainer_pid: int):
        super().__init__(daemon=True)
        self.metrics, self.ids, self.marks, self.done = metrics, (server_pgid, trainer_pid), {}, threading.Event()

    def run(self):
        seen = 0
        while not self.done.is_set():
            lines = self.metrics.read_text().splitlines() if self.metrics.is_file() else []
            complete = [line for line in lines if line.endswith("}")]
            if len(complete) > seen:
                now, counters = time.perf_counter(), probe(*self.ids)
                for line in complete[seen:]:
                    self.marks[json.loads(line)["step"]] = (now, counters)
                seen = len(complete)
            time.sleep(0.05)


def train_overrides(model: Path, synth: Path, out: Path, name: str, url: str, k: int, steps: int, S: int,
                    G: int, frames: int = 4, pixels: int = 3136, iterations: int = 1) -> list[str]:
    """The bench's GRPO config: 2 prompts x G responses of S tokens (no stop), `frames` frames of `pixels` pixels
    (H x W) per video, `iterations` optimizer updates per step (algorithm.num_iterations: mu)."""
    over = {"model.path": model, "model.dtype": "float32", "data.train": synth / "train.json",
            "data.videos": synth / "videos", "data.batch_size": 2, "data.fps": 1.0, "data.min_frames": frames,
            "data.max_frames": frames, "data.min_pixels": pixels, "data.max_pixels": pixels, "data.num_workers": 0,
            "rollout.n": G, "rollout.max_new_tokens": S, "rollout.engine": "vllm", "rollout.vllm_url": url,
            "rollout.vllm_wait_s": 900, "rollout.tis_cap": 2.0, "rollout.max_staleness": k,
            "trainer.micro_batch_size": 2 * G, "trainer.device": "cpu", "trainer.output_dir": out,
            "trainer.run_name": name, "trainer.total_steps": steps, "trainer.seed": 0, "optim.lr": 1e-4,
            "checkpoint.every_n_steps": 0, "logging.tensorboard": False, "eval.every_n_steps": 0,
            "algorithm.num_iterations": iterations}
    return [f"{key}={value}" for key, value in over.items()]


def run_arm(k: int, server, tmp: Path, args, log) -> tuple[list[dict], dict]:
    """One `mmpg train` run of the arm, pinned: (its metrics lines, its marks)."""
    from mmpg.runs import RunReader

    name = f"k{k}-{time.strftime('%H%M%S')}"
    run_dir = tmp / "runs" / name
    cmd = ["taskset", "-c", str(args.trainer_core), sys.executable, "-m", "mmpg.cli", "train",
           *train_overrides(tmp / "model", tmp / "synth", tmp / "runs", name, server.url, k, args.async_steps,
                            args.S[0] if args.S else 32, args.G[0] if args.G else 12, args.async_frames,
                            args.async_pixels, args.async_iterations)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.setdefault("FORCE_QWENVL_VIDEO_READER", "decord")
    with open(tmp / f"train-{name}.log", "w") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)  # taskset execs: pid = python's
        marks = Marks(run_dir / "metrics.jsonl", server.proc.pid, proc.pid)
        marks.start()
        try:
            proc.wait(timeout=args.timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
    marks.done.set()
    marks.join()
    if proc.returncode:
        tail = (tmp / f"train-{name}.log").read_text(errors="replace").splitlines()[-5:]
        raise RuntimeError(f"k={k}: mmpg train failed ({proc.returncode}): " + " | ".join(tail))
    records = RunReader(run_dir).metrics()
    log(f"  k={k}: {len(records)} steps in {time.perf_counter() - t0:.0f} s; " +
        ", ".join(f"step {r['step']} {r['timing_s/step']:.2f} s" for r in records))
    return records, marks.marks


class PinnedServer(ServerProcess):
    """A `mmpg vllm-serve` under `taskset -c core` (vLLM's CPU worker binds its threads to the cores it may use)."""

    def __init__(self, core: int, *args, **kwargs):
        self.core = core
        super().__init__(*args, **kwargs)

    def start(self) -> None:
        if self.cmd[0] != "taskset":
            self.cmd = ["taskset", "-c", str(self.core), *self.cmd]
        super().start()


def run(args) -> int:
    """Both arms (k = 0, then k = 1), the table, the JSON; 0 when both ran."""
    from mmpg.bench import tables
    from mmpg.toy.models import TinySpec, make_tiny
    from mmpg.toy.videos import generate_dataset

    args.warmup = 2 if args.warmup is None else args.warmup
    if args.async_steps <= args.warmup + 1:
        from mmpg.errors import UserError

        raise UserError(f"--async-steps {args.async_steps}: needs more than --warmup {args.warmup} + 1 steps")
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="mmpg-bench-async-") as tmp_name:
        tmp = Path(tmp_name)
        make_tiny("qwen2_5_vl", tmp / "model", seed=0, spec=TinySpec(**SPEC))
        generate_dataset(tmp / "synth", 16, 0, overwrite=True, min_duration=8.0, max_duration=12.0)
        print(f"mmpg bench --levels async: {args.async_steps} GRPO steps per arm (k = 0, 1), trainer on core "
              f"{args.trainer_core}, server on core {args.server_core}", flush=True)
        server = PinnedServer(args.server_core, tmp / "model", tmp / "server.log", max_model_len=2048, env=env)
        runs, idle_share = {0: [], 1: []}, None
        order = [k for r in range(args.async_rounds) for k in ((0, 1) if r % 2 == 0 else (1, 0))]  # drift cancels
        try:
            for i, k in enumerate(order):
                up = server.wait() if i == 0 else server.restart()
                print(f"  server up in {up:.0f} s", flush=True)
                if idle_share is None:  # the idle server's own CPU share: what "busy" counts when nothing is asked
                    c0, t0 = task_seconds(group_pids(server.proc.pid))[0], time.perf_counter()
                    time.sleep(10)
                    idle_share = (task_seconds(group_pids(server.proc.pid))[0] - c0) / (time.perf_counter() - t0)
                    print(f"  idle server's CPU share: {idle_share:.1%}", flush=True)
                runs[k].append(run_arm(k, server, tmp, args, lambda m: print(m, flush=True)))
                if len(runs[0]) == len(runs[1]):  # a round done: its own speed-up, to see the spread
                    pair = [arm_summary(j, runs[j][-1:], args.warmup) for j in (0, 1)]
                    speed = pair[1]["steps_per_hour"] / pair[0]["steps_per_hour"]
                    print(f"  round {len(runs[0])}: k=1 vs k=0 {speed:.2f}x (ceiling {ceiling(pair[0]):.2f}x)",
                          flush=True)
        finally:
            server.stop()
    arms = [arm_summary(k, runs[k], args.warmup) for k in (0, 1)]
    print("\n" + format_table(arms))
    speed = arms[1]["steps_per_hour"] / arms[0]["steps_per_hour"]
    print(f"\nk=1 vs k=0: {speed:.2f}x steps per hour (ceiling {ceiling(arms[0]):.2f}x; means over steps "
          f"{arms[0]['steps'][0]}-{arms[0]['steps'][-1]} of {args.async_rounds} run(s) per arm, the first "
          f"{args.warmup} of each are warm-up); idle server's CPU share {idle_share:.1%}")
    out = Path(args.out or tables.default_out_path())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"arms": arms, "runs": runs, "ceiling": ceiling(arms[0]), "speed_up": speed,
                               "idle_server_cpu_share": idle_share, "warmup": args.warmup,
                               "environment": tables.provenance()}, indent=1, default=str))
    print(f"wrote {out}")
    return 0
