"""The first run, rehearsed on the CPU: README's quickstart for the 7B recipe, followed line by line, with tiny
stand-ins for the weights only.

- The model is the 7B config's hub id, `Qwen/Qwen2.5-VL-7B-Instruct`, found in a local mirror of the Hugging Face
  cache (HF_HOME, HF_HUB_OFFLINE=1) that holds a tiny checkpoint under that name.
- Data: Charades-STA's text form (`VIDEO START END##sentence`) for training and test, and a TVGBench-format file,
  over short synthetic videos, at the paths the docs use.
- Each README line runs as printed, placeholders filled, `NUM_GPUS=8` as `NUM_GPUS=1` (one CPU process through the
  DeepSpeed launcher; GRPO: `NUM_GPUS=2`, two) and the CPU's sizes appended (float32, a few small frames, 2 prompts,
  8 new tokens, 2 steps): check-data, plan, SFT through scripts/sft_grounding.sh, GRPO through
  scripts/train_grounding.sh with `VLLM=1` (the colocated layout: one real vLLM server on the CPU per training
  process, each rank's requests served by its own, their --max-model-len derived from the config), killed (SIGKILL
  of the trainer) after its first checkpoint and continued with `RESUME=auto`, `mmpg eval --run`, the
  paper-protocol evaluations of docs/evaluation.md on the Charades-STA and TVGBench files (the prompt files from a
  stand-in curl, as tests/test_eval_commands.py serves them), and `mmpg inspect` on the run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from doc_commands import ROOT, documented_commands, words_after_env
from mmpg.serve.launch import free_port
from train_utils import env as cli_env
from vllm_server import IN_PROCESS

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

HUB_ID = "Qwen/Qwen2.5-VL-7B-Instruct"
CONFIG = "configs/grounding_qwen25vl_7b.yaml"
TIMEOUT_S = 900
GRPO_RANKS = 2  # the GRPO line's processes, each with its own colocated vLLM server
# the CPU's sizes, appended to each training line (the weights are the tiny stand-in's)
CPU_TRAIN = ["trainer.device=cpu", "model.dtype=float32", "model.attn_implementation=sdpa",
             "model.grouping_backend=sdpa", "data.fps=0.5", "data.min_frames=2", "data.max_frames=4",
             "data.min_pixels=3136", "data.max_pixels=3136", "data.total_pixels=12544", "data.batch_size=2",
             "data.num_workers=0", "data.val=", "eval.every_n_steps=0", "rollout.max_new_tokens=8",
             "trainer.total_steps=2", "checkpoint.every_n_steps=1", "rollout.vllm_wait_s=900"]
CPU_EVAL = ["fps=0.5", "max_frames=4", "min_pixels=3136", "max_pixels=3136", "total_pixels=12544",
            "max_new_tokens=8", "num_workers=0", "batch_size=4", "self_check=off"]


def quickstart() -> list[str]:
    """README's quickstart block, in order."""
    block = [c for c in documented_commands([ROOT / "README.md"]) if not c.inline]
    start = next(i for i, c in enumerate(block) if c.text.startswith("source .venv/bin/activate"))
    out = []
    for c in block[start + 1:]:
        if c.text.startswith("mmpg inspect"):
            return out + [c.text]
        out.append(c.text)
    raise AssertionError("README's quickstart ends with `mmpg inspect`")


def _mirror(cache: Path, source: Path, commit: str) -> Path:
    from test_hub_models import mirror

    return mirror(cache, source, HUB_ID, commit)


@pytest.fixture(scope="module")
def user(grpo_data, tmp_path_factory):
    """A user's folder: data/ as the docs lay it out, the hub cache, stand-in curl; runs/ for the runs."""
    from test_eval_commands import _standin_bin
    from vllm_server import tiny_vllm_checkpoint

    home = tmp_path_factory.mktemp("first_run")
    tiny = tiny_vllm_checkpoint("qwen2_5_vl", tmp_path_factory)  # skips without .venv-vllm
    _mirror(home / "hf" / "hub", tiny, "a" * 40)
    synth = grpo_data["synth"]
    charades = home / "data" / "charades"
    charades.mkdir(parents=True)
    (charades / "Charades_v1_480").symlink_to(synth / "videos")
    for split in ("train", "test"):
        lines = [f"{vid} {a:.1f} {b:.1f}##{sentence}"
                 for vid, rec in json.loads((synth / f"{split}.json").read_text()).items()
                 for (a, b), sentence in zip(rec["timestamps"], rec["sentences"])]
        (charades / f"charades_sta_{split}.txt").write_text("\n".join(lines) + "\n")
    tvg = home / "data" / "timer1"
    (tvg / "annotations").mkdir(parents=True)
    (tvg / "videos").mkdir()
    (tvg / "videos" / "tvgbench_data").symlink_to(synth / "videos")
    records = [{"path": f"./dataset/timer1/videos/tvgbench_data/{vid}.mp4", "question": sentence,
                "answer": f"{a}-{b}", "start": None, "end": None, "duration": rec["duration"],
                "question_type": "video temporal grounding", "source": "synthetic", "dataset_name": "charades"}
               for vid, rec in json.loads((synth / "test.json").read_text()).items()
               for (a, b), sentence in zip(rec["timestamps"], rec["sentences"])]
    (tvg / "annotations" / "tvgbench.json").write_text(json.dumps(records))
    _standin_bin(home)
    return home


def _free_ports(n: int) -> int:
    """The first of n free ports in a row (a pool's servers take VLLM_PORT, +1, ...)."""
    import socket

    for _ in range(50):
        first, socks = free_port(), []
        try:
            for p in range(first, first + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError(f"no {n} free ports in a row")


def _environ(home: Path) -> dict:
    e = cli_env()
    e.pop("MMPG_EXTRAS", None)
    e.update(HF_HOME=str(home / "hf"), HF_HUB_OFFLINE="1", MASTER_PORT=str(free_port()),
             VLLM_PORT=str(_free_ports(GRPO_RANKS)), PATH=f"{home / 'bin'}:{e['PATH']}")
    # the servers' engine and worker in one process each (tests/vllm_server.py: a start in 20 s of CPU instead of 42,
    # four starts here); the default layout is test_launch_real.py's VLLM=1 run's
    e.update(IN_PROCESS)
    e.pop("HF_HUB_CACHE", None)
    return e


def _fill(command: str, home: Path, sft_ckpt: str = "", run: str = "", ckpt: str = "", ranks: int = 1) -> list[str]:
    """The words of a README line with its placeholders filled (paths absolute: the scripts run from the project
    root) and NUM_GPUS=8 as `ranks` CPU processes."""
    values = {"ANN": home / "data/charades/charades_sta_train.txt", "TEST_ANN": home / "data/charades/"
              "charades_sta_test.txt", "DIR": home / "data/charades/Charades_v1_480",
              "runs/SFT_RUN/checkpoints/step_N": sft_ckpt, "runs/RUN": run, "CKPT": ckpt}
    words = []
    for w in shlex.split(command):
        key, eq, value = w.partition("=")
        if eq and value in values:
            w = f"{key}={values[value]}"
        elif w in values:
            w = str(values[w])
        words.append(f"NUM_GPUS={ranks}" if w == "NUM_GPUS=8" else w)
    return [w.replace("data/", f"{home}/data/", 1) if w.startswith("data/") or "=data/" in w and
            w.split("=", 1)[1].startswith("data/") and not w.startswith("data.") else w for w in words]


def _run(words: list[str], e: dict, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    env, argv = words_after_env(shlex.join(words))
    return subprocess.run(argv, cwd=ROOT, env={**e, **env}, capture_output=True, text=True, timeout=timeout,
                          check=False)


def _trainer_pids(output_dir: Path) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"mmpg.cli" in cmd and b"train" in cmd and any(str(output_dir).encode() in w for w in cmd):
            found.append(int(pid))
    return found


def _server_sessions(port: int) -> set[int]:
    """Session ids of processes running `mmpg.serve.vllm_server ... --port PORT`."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"mmpg.serve.vllm_server" in cmd and str(port).encode() in cmd:
                found.add(os.getsid(int(pid)))
        except (OSError, ProcessLookupError):
            continue
    return found


def _alive_in(*sessions: int) -> list[int]:
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) in sessions:
                alive.append(int(pid))
        except (OSError, ProcessLookupError):
            continue
    return alive


def _launch_and_kill(words: list[str], e: dict, run_root: Path, after_step: int) -> None:
    """Start the launch, SIGKILL the trainer once checkpoint `after_step` is complete, wait for the script to end."""
    env, argv = words_after_env(shlex.join(words))
    proc = subprocess.Popen(argv, cwd=ROOT, env={**e, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.time() + TIMEOUT_S
    try:
        while not list(run_root.glob(f"*/checkpoints/step_{after_step:08d}/COMPLETE")):
            assert proc.poll() is None, f"the launch ended before step {after_step}:\n{proc.stdout.read()[-4000:]}"
            assert time.time() < deadline, "timed out waiting for the checkpoint"
            time.sleep(0.2)
        for pid in _trainer_pids(run_root):
            os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode != 0, out[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def _inspect(run: Path, e: dict) -> str:
    port = free_port()
    proc = subprocess.Popen(["mmpg", "inspect", str(run), "--port", str(port)], cwd=ROOT, env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as page:
                    return page.read().decode()
            except OSError:
                time.sleep(0.5)
        raise AssertionError("mmpg inspect did not answer")
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_documented_first_run_on_stand_ins(user):
    home, e = user, _environ(user)
    runs = home / "runs"
    lines = quickstart()
    kinds = [(words_after_env(c)[1] + ["", ""])[:2] for c in lines]
    assert [k[1] if k[0] == "mmpg" else Path(k[1]).name for k in kinds] == [
        "check-data", "plan", "sft_grounding.sh", "train_grounding.sh", "eval", "inspect"], lines
    check, plan, sft, grpo, evaluate, inspect = lines

    proc = _run(_fill(check, home), e)
    assert proc.returncode == 0 and "skipped" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    proc = _run(_fill(plan, home) + ["--json"], e)  # the hub id's config.json, from the cache
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["fits"]

    # SFT from the hub id (the config's model.path), one CPU process through the DeepSpeed launcher
    proc = _run(_fill(sft, home) + CPU_TRAIN + [f"trainer.output_dir={runs}", "trainer.run_name=sft"], e)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    sft_run = runs / "sft"
    recorded = json.loads((sft_run / "run.json").read_text())["model"]
    assert recorded["repo_id"] == HUB_ID and recorded["revision"] == "a" * 40
    sft_ckpt = sorted((sft_run / "checkpoints").glob("step_*"))[-1]

    # GRPO from the SFT checkpoint with the vLLM server, killed after its first checkpoint, then RESUME=auto
    grpo_words = ["VLLM=1"] + _fill(grpo, home, sft_ckpt=str(sft_ckpt), ranks=GRPO_RANKS) + CPU_TRAIN + [
        f"trainer.output_dir={runs / 'grpo'}"]
    _launch_and_kill(grpo_words, e, runs / "grpo", after_step=1)
    (run,) = [p for p in (runs / "grpo").iterdir() if p.is_dir()]
    ports, sessions, done = [int(e["VLLM_PORT"]) + i for i in range(GRPO_RANKS)], {}, threading.Event()

    def watch():  # each server's session id, seen while it runs
        while not done.is_set():
            for p in ports:
                sessions.setdefault(p, set()).update(_server_sessions(p))
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        proc = _run(["RESUME=auto"] + grpo_words, e)
    finally:
        done.set()
        watcher.join()
    out = proc.stdout + proc.stderr
    logs = [ROOT / "runs" / f"vllm-serve-{p}.log" for p in ports]
    assert proc.returncode == 0, out[-5000:] + "".join(f"\n{log.name}:\n{log.read_text()[-3000:]}" for log in logs
                                                       if log.exists())
    assert f"checkpoint.resume=auto: continuing {run} from its step 1" in out
    assert [len(sessions[p]) for p in ports] == [1] * GRPO_RANKS, sessions  # a server per rank, seen running
    every = set().union(*sessions.values())
    for _ in range(60):
        if not _alive_in(*every):
            break
        time.sleep(0.5)
    assert not _alive_in(*every), f"server processes outlived the training: {_alive_in(*every)}"
    from mmpg.config import load_config
    from mmpg.rollout.lengths import config_worst_prompt

    words = _fill(grpo, home, sft_ckpt=str(sft_ckpt)) + CPU_TRAIN  # the servers' length is the config's
    cfg = load_config(ROOT / CONFIG, [w for w in words if "=" in w and not w.startswith("NUM_GPUS")])
    length = config_worst_prompt(cfg).server_len(cfg.rollout.max_new_tokens)
    for rank, log in enumerate(logs):  # each rank's requests reached its own server, and only those
        text = log.read_text()
        assert f"max_model_len {length})" in text, text[-2000:]
        served = re.search(r"stopped after (\d+) requests \(\d+ joined a running batch; by client: (.*)\)", text)
        assert served and served.group(2) == f"rank {rank}: {served.group(1)}", text[-2000:]
        log.unlink(missing_ok=True)
    m = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in m] == [1, 2]
    assert [r["step"] for r in m if "timing_s/weight_sync" in r] == [1, 2]  # sampled through the server
    assert [p.name for p in (runs / "grpo").iterdir() if p.is_dir()] == [run.name]  # no second run started

    # evaluation: README's every-checkpoint line, then the papers' protocols of docs/evaluation.md
    proc = _run(_fill(evaluate, home, run=str(run)) + CPU_EVAL, e)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert len(list((run / "evals").rglob("metrics.json"))) >= 1
    final = sorted((run / "checkpoints").glob("step_*"))[-1]
    paper = [c.text for c in documented_commands([ROOT / "docs" / "evaluation.md"])
             if not c.inline and (c.text.startswith("curl ") or "time_r1" in c.text and "eval_grounding.sh" in c.text)]
    assert any("tvgbench" in c for c in paper) and any("charades_sta_test" in c for c in paper), paper
    for command in paper:
        words = _fill(command, home, ckpt=str(final))
        if words[0] == "curl":  # the prompt file into the user's folder
            words = [w if not w.startswith("data/") else str(home / w) for w in words]
        else:
            words = [w if not w.startswith("prompt_file=data/") else f"prompt_file={home}/{w.split('=', 1)[1]}"
                     for w in words]
            at = next(i for i, w in enumerate(words) if "=" in w and i > words.index("bash"))  # before the settings
            out = home / "evals" / ("tvgbench" if "tvgbench" in command else "charades")
            words = words[:at] + ["--out", str(out)] + words[at:] + CPU_EVAL
        proc = _run(words, e)
        assert proc.returncode == 0, f"{command}\n{(proc.stdout + proc.stderr)[-4000:]}"
    queries = len((home / "data/charades/charades_sta_test.txt").read_text().splitlines())
    assert queries == len(json.loads((home / "data/timer1/annotations/tvgbench.json").read_text())) >= 2
    for bench in ("charades", "tvgbench"):  # every query answered and scored (a tiny model's answers need not parse)
        metrics = json.loads((home / "evals" / bench / "metrics.json").read_text())
        assert metrics["count"] == queries and metrics["failed"] == 0 and 0.0 <= metrics["miou"] <= 1.0, metrics

    page = _inspect(run, e)
    assert "gradio" in page.lower()
