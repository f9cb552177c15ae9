"""GPU layouts checked before a launch starts anything (mmpg/train/layout.py, run by scripts/train_grounding.sh):
the rules on their own, the script with DRY_RUN=1 on a stand-in machine of 8 GPUs (a `nvidia-smi` that lists them),
a refused layout starting neither the vLLM server nor the launcher, and every launch line of the docs passing."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from mmpg.config import load_config
from mmpg.errors import UserError
from mmpg.train import layout

ROOT = Path(__file__).resolve().parents[1]
SEVEN_B = ROOT / "configs" / "grounding_qwen25vl_7b.yaml"
EIGHT = [str(i) for i in range(8)]


def _ranks(gpus=EIGHT, **env):
    return layout.training_ranks(env, gpus)


def test_nearest_sizes():
    assert layout.nearest_multiples(32, 7) == [28, 35]
    assert layout.nearest_multiples(5, 7) == [7]  # nothing > 0 below
    assert layout.nearest_divisors(32, 7) == [4, 8]
    assert layout.nearest_divisors(28, 8, lambda d: d > 1) == [7, 14]


def test_the_ranks_each_knob_gives(tmp_path):
    assert (_ranks(NUM_GPUS="4").count, _ranks().count, _ranks(None).count) == (4, 8, None)
    r = _ranks(TRAIN_GPUS="0,1,2")
    assert (r.count, r.gpus) == (3, ["0", "1", "2"])
    host = tmp_path / "hostfile"
    host.write_text("# two nodes\nnode1 slots=8\nnode2 slots=8\n")
    assert _ranks(HOSTFILE=str(host)).count == 16 and _ranks(HOSTFILE=str(host), NUM_GPUS="4").count == 8
    # the server's GPU alone: the trainer takes the others, in the machine's order
    r = _ranks(VLLM="1", VLLM_GPUS="7")
    assert (r.count, r.gpus) == (7, EIGHT[:7]) and "left by VLLM_GPUS=7" in r.how
    env = {"VLLM": "1", "VLLM_GPUS": "0", "CUDA_VISIBLE_DEVICES": "0,3,5"}  # the visible list, not nvidia-smi's
    assert layout.training_ranks(env, layout.visible_gpus(env)).gpus == ["3", "5"]
    assert _ranks(VLLM="1", VLLM_GPUS="7", NUM_GPUS="7").count == 7  # GPUs 0-6: apart from the server's


@pytest.mark.parametrize("env, message", [
    ({"NUM_GPUS": "2", "TRAIN_GPUS": "0"}, "set NUM_GPUS or TRAIN_GPUS, not both"),
    ({"TRAIN_GPUS": "0,0"}, "TRAIN_GPUS=0,0: a GPU is named twice"),
    ({"TRAIN_GPUS": "0,a"}, "expected GPU indices"),
    ({"VLLM_GPUS": "7"}, "there is no server without VLLM=1"),
    ({"VLLM": "1", "VLLM_GPUS": "5,6,7", "VLLM_TP": "2"},
     "VLLM_GPUS=5,6,7 names 3 GPU(s), not a multiple of VLLM_TP=2 (each server's tensor-parallel GPUs): give the "
     "servers 2 or 4 GPUs, or VLLM_TP=1 or 3"),
    ({"VLLM": "1", "VLLM_GPUS": "6,7", "VLLM_TP": "2", "VLLM_ARGS": "--tensor-parallel-size 1"}, "disagree"),
    ({"VLLM": "1", "VLLM_GPUS": "6,7", "VLLM_ARGS": "--data-parallel-size 2"}, "list more GPUs in VLLM_GPUS"),
    ({"VLLM": "1", "VLLM_GPUS": "7", "TRAIN_GPUS": "0,1,7"}, "VLLM_GPUS and TRAIN_GPUS share GPU 7"),
    ({"VLLM": "1", "VLLM_GPUS": "7", "NUM_GPUS": "8"}, "NUM_GPUS=8 takes GPUs 0,1,2,3,4,5,6,7, VLLM_GPUS=7 among"),
    ({"VLLM": "1", "VLLM_GPUS": "9"}, "this machine shows GPUs 0,1,2,3,4,5,6,7 only"),
])
def test_gpu_knobs_refused(env, message):
    with pytest.raises(UserError, match=re.escape(message)):
        _ranks(**env)


def test_a_tensor_parallel_server_takes_its_gpus():
    r = _ranks(VLLM="1", VLLM_GPUS="6,7", VLLM_ARGS="--tensor-parallel-size 2")
    assert r.gpus == EIGHT[:6]


def _servers(sp=1, gpus=EIGHT, **env):
    return layout.plan_servers(env, gpus, layout.training_ranks(env, gpus), sp)


def test_the_servers_a_launch_starts():
    """Each server as its CUDA_VISIBLE_DEVICES ("": none set). Before, VLLM_GPUS of several GPUs was refused unless
    one tensor-parallel engine took them all, and colocated launches started one server for every rank."""
    assert _servers(VLLM="1", VLLM_GPUS="4,5,6,7", TRAIN_GPUS="0,1,2,3") == ["4", "5", "6", "7"]
    assert _servers(VLLM="1", VLLM_GPUS="4,5,6,7", TRAIN_GPUS="0,1,2,3", VLLM_TP="2") == ["4,5", "6,7"]
    # VLLM_ARGS' tensor-parallel size, the older way: one server of both GPUs, as before
    assert _servers(VLLM="1", VLLM_GPUS="6,7", VLLM_ARGS="--tensor-parallel-size 2") == ["6,7"]
    # a pool synced by NCCL: one group with every server's workers (before: refused, a pool took the file only)
    assert _servers(VLLM="1", VLLM_GPUS="4,5,6,7", VLLM_ARGS="--nccl") == ["4", "5", "6", "7"]
    assert _servers(VLLM="1", NUM_GPUS="8") == EIGHT  # colocated: one per training GPU
    assert _servers(VLLM="1", TRAIN_GPUS="2,3") == ["2", "3"]
    assert _servers(VLLM="1", NUM_GPUS="8", VLLM_TP="2") == ["0,1", "2,3", "4,5", "6,7"]
    assert _servers(4, VLLM="1", NUM_GPUS="8") == ["0", "4"]  # SP 4: one per data-parallel group, on its first GPU
    assert _servers(VLLM="1", NUM_GPUS="8", VLLM_SERVERS="2") == ["0", "4"]
    # one server, as before: no GPU set (it sees the trainer's), unless TRAIN_GPUS names the trainer's
    assert _servers(VLLM="1", NUM_GPUS="8", VLLM_SERVERS="1") == [""] == _servers(VLLM="1", NUM_GPUS="1")
    assert _servers(VLLM="1", TRAIN_GPUS="3") == ["3"]
    # a machine without GPUs: one server per training process, or one without NUM_GPUS
    assert _servers(gpus=None, VLLM="1", NUM_GPUS="2") == ["", ""]
    assert _servers(gpus=None, VLLM="1") == [""] == _servers(gpus=None, VLLM="1", NUM_GPUS="2", VLLM_SERVERS="1")


@pytest.mark.parametrize("sp, env, message", [
    (1, {"VLLM_GPUS": "4,5,6,7", "TRAIN_GPUS": "0,1"},
     "VLLM_GPUS=4,5,6,7 starts 4 vLLM servers for 2 data-parallel rank(s) (GPUs 0,1 of TRAIN_GPUS): rank r samples "
     "from server r mod 4, so 2 would sit idle; give VLLM_GPUS at most 2 GPUs (VLLM_TP=1 each), or launch more "
     "training ranks"),
    (4, {"VLLM_GPUS": "6,7"}, "for 1 data-parallel rank(s) (GPUs 0,1,2,3,4,5 left by VLLM_GPUS=6,7, SP 4)"),
    (2, {"NUM_GPUS": "4", "VLLM_SERVERS": "3"}, "use VLLM_SERVERS=2 or fewer"),
    (1, {"VLLM_TP": "0"}, "VLLM_TP=0: expected the GPUs of each vLLM server"),
    (1, {"NUM_GPUS": "2", "VLLM_SERVERS": "2", "VLLM_TP": "2"}, "need 4 GPUs; the trainer has 2"),
    (1, {"VLLM_GPUS": "6,7", "VLLM_SERVERS": "2"}, "unset VLLM_SERVERS"),
])
def test_servers_refused(sp, env, message):
    with pytest.raises(UserError, match=re.escape(message)):
        _servers(sp, VLLM="1", **env)


def test_what_must_divide_and_the_nearest_that_does(tmp_path):
    cfg = load_config(SEVEN_B)  # 32 prompts, groups of 8, micro-batch 8
    assert layout.check_layout(cfg, "train", layout.Ranks(8, "NUM_GPUS=8")) == \
        "8 training rank(s) (NUM_GPUS=8); data.batch_size=32 = 4 prompt(s) per rank"
    with pytest.raises(UserError) as err:
        layout.check_layout(cfg, "train", layout.Ranks(7, "TRAIN_GPUS"))
    assert str(err.value) == ("data.batch_size=32 prompts do not split evenly over the 7 training ranks (TRAIN_GPUS): "
                              "use data.batch_size=28 or 35, or launch 4 or 8 training ranks")
    sp = load_config(SEVEN_B, ["parallel.sequence_parallel_size=3"])
    with pytest.raises(UserError, match=r"sequence_parallel_size=3 \(SP\) does not divide the 8 training ranks "
                       r"\(NUM_GPUS=8\): use 2 or 4"):
        layout.check_layout(sp, "train", layout.Ranks(8, "NUM_GPUS=8"))
    sp = load_config(SEVEN_B, ["parallel.sequence_parallel_size=2"])  # 4 groups of 2: 32 / 4
    assert "8 prompt(s) per group of 2" in layout.check_layout(sp, "train", layout.Ranks(8, "NUM_GPUS=8"))
    with pytest.raises(UserError, match=r"over the 3 data-parallel groups of SP 2 \(6 training ranks: NUM_GPUS=6\): "
                       r"use data.batch_size=30 or 33, or launch 4 or 8 training ranks"):
        layout.check_layout(sp, "train", layout.Ranks(6, "NUM_GPUS=6"))
    micro = load_config(SEVEN_B, ["trainer.micro_batch_size=12"])
    with pytest.raises(UserError, match="use trainer.micro_batch_size=8 or 16"):
        layout.check_layout(micro, "train", layout.Ranks(8, "NUM_GPUS=8"))
    layout.check_layout(micro, "sft", layout.Ranks(8, "NUM_GPUS=8"))  # SFT has no groups
    # heads, read from the model's config.json on disk: Qwen2.5-VL-7B's 28
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"text_config": {"num_attention_heads": 28}}')
    heads = load_config(SEVEN_B, [f"model.path={model}", "parallel.sequence_parallel_size=8"])
    with pytest.raises(UserError, match="cannot split the model's 28 attention heads: use 4"):
        layout.check_layout(heads, "train", layout.Ranks(8, "NUM_GPUS=8"))


def test_heads_of_a_cached_hub_id(tmp_path, monkeypatch):
    """A hub id already in the Hugging Face cache is read there; one not cached is not fetched for a check."""
    snap = tmp_path / "hub" / "models--Qwen--Qwen2.5-VL-7B-Instruct"
    (snap / "refs").mkdir(parents=True)
    (snap / "refs" / "main").write_text("a" * 40)
    (snap / "snapshots" / ("a" * 40)).mkdir(parents=True)
    (snap / "snapshots" / ("a" * 40) / "config.json").write_text('{"num_attention_heads": 28}')
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert layout.attention_heads("Qwen/Qwen2.5-VL-7B-Instruct") == 28
    assert layout.attention_heads("Qwen/Qwen3-VL-8B-Instruct") is None


class Machine:
    """A stand-in GPU machine for scripts/train_grounding.sh: `nvidia-smi -L` lists 8 GPUs, env.sh is a stand-in
    (nothing installed), the vLLM server and the DeepSpeed launcher are stand-ins that record their argv."""

    def __init__(self, tmp_path: Path, gpus: int = 8, memory_mib: int | None = None):
        self.tmp = tmp_path
        bin_ = tmp_path / "bin"
        bin_.mkdir()
        lines = "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})'\n" for i in range(gpus))
        if memory_mib is not None:  # `nvidia-smi --query-gpu=memory.total ...`: each GPU's MiB
            lines = (f'case "$*" in *memory.total*) for i in $(seq {gpus}); do echo {memory_mib}; done; exit 0;; '
                     f"esac\n{lines}")
        (bin_ / "nvidia-smi").write_text(f"#!/bin/sh\n{lines}")
        (tmp_path / "env.sh").write_text(f"MMPG_ROOT={ROOT}\nexport PATH={Path(sys.executable).parent}:$PATH\n")
        for name, out in (("deepspeed", "trainer"), ("serve", "server")):
            (bin_ / name).write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/{out}.args\n')
        for f in bin_.iterdir():
            f.chmod(0o755)
        drop = ("NUM_GPUS", "TRAIN_GPUS", "VLLM", "VLLM_GPUS", "VLLM_ARGS", "HOSTFILE", "SP", "ZERO", "RESUME",
                "CUDA_VISIBLE_DEVICES", "DRY_RUN", "FLASH_ATTN", "MMPG_EXTRAS")
        self.env = {k: v for k, v in os.environ.items() if k not in drop}
        self.env.update(PATH=f"{bin_}:{self.env['PATH']}", MMPG_ENV_SH=str(tmp_path / "env.sh"),
                        MMPG_DEEPSPEED=str(bin_ / "deepspeed"), MMPG_VLLM_SERVE=str(bin_ / "serve"),
                        HF_HUB_OFFLINE="1")

    def launch(self, argv: list[str], **env):
        res = subprocess.run(["bash", *argv], cwd=ROOT, env={**self.env, **env}, capture_output=True, text=True,
                             timeout=300, check=False)
        started = [n for n in ("server", "trainer") if (self.tmp / f"{n}.args").exists()]
        return res, started


def test_a_refused_layout_starts_nothing(tmp_path):
    """Before, the script started the vLLM server and the launcher, and the trainer refused the batch on every rank
    once they were up; now one line, exit 2, and neither starts."""
    m = Machine(tmp_path)
    model = tmp_path / "model"  # on disk, so that nothing but the layout can stop the launch
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2_5_vl", "text_config": {"num_attention_heads": 28}}')
    res, started = m.launch(["scripts/train_grounding.sh", str(SEVEN_B), f"model.path={model}"], VLLM="1",
                            VLLM_GPUS="7", TRAIN_GPUS="0,1,2,3,4,5,6")
    assert res.returncode == 2 and started == [], res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if "batch_size" in ln]
    assert line == ("train_grounding.sh: data.batch_size=32 prompts do not split evenly over the 7 training ranks "
                    "(GPUs 0,1,2,3,4,5,6 of TRAIN_GPUS): use data.batch_size=28 or 35, or launch 4 or 8 training ranks")


def test_dry_run_prints_the_processes_and_starts_none(tmp_path):
    m = Machine(tmp_path)
    res, started = m.launch(["scripts/train_grounding.sh", str(SEVEN_B), "data.batch_size=28"], VLLM="1",
                            VLLM_GPUS="7", DRY_RUN="1")
    assert res.returncode == 0 and started == [], res.stderr
    assert "[mmpg] layout: 7 training rank(s) (GPUs 0,1,2,3,4,5,6 left by VLLM_GPUS=7); data.batch_size=28 = 4 " \
           "prompt(s) per rank; the vLLM server on GPU 7" in res.stderr
    server = next(ln for ln in res.stdout.splitlines() if ln.startswith("  server:"))
    trainer = next(ln for ln in res.stdout.splitlines() if ln.startswith("  trainer:"))
    assert server.startswith(f"  server:  CUDA_VISIBLE_DEVICES=7 setsid {m.env['MMPG_VLLM_SERVE']} --checkpoint "
                             "Qwen/Qwen2.5-VL-7B-Instruct --port 8000 --max-model-len ")
    assert server.endswith("> runs/vllm-serve-8000.log")
    assert trainer == (f"  trainer: {m.env['MMPG_DEEPSPEED']} --include localhost:0,1,2,3,4,5,6 --module mmpg.cli "
                       f"train --config {SEVEN_B} data.batch_size=28 rollout.engine=vllm "
                       "rollout.vllm_url=http://127.0.0.1:8000")
    # a pool on GPUs 4-7 for the 4 training GPUs: one server each, the trainer given all four
    res, started = m.launch(["scripts/train_grounding.sh", str(SEVEN_B)], VLLM="1", VLLM_GPUS="4,5,6,7",
                            TRAIN_GPUS="0,1,2,3", VLLM_MAX_LEN="9216", DRY_RUN="1")
    assert res.returncode == 0 and started == [], res.stderr
    assert "data.batch_size=32 = 8 prompt(s) per rank; 4 vLLM servers on GPUs 4 | 5 | 6 | 7" in res.stderr
    lines = res.stdout.splitlines()[1:]
    assert lines[:4] == [f"  server:  CUDA_VISIBLE_DEVICES={4 + i} setsid {m.env['MMPG_VLLM_SERVE']} --checkpoint "
                         f"Qwen/Qwen2.5-VL-7B-Instruct --port {8000 + i} --max-model-len 9216 > "
                         f"runs/vllm-serve-{8000 + i}.log" for i in range(4)]
    assert lines[4].endswith("rollout.vllm_url=http://127.0.0.1:8000,http://127.0.0.1:8001,http://127.0.0.1:8002,"
                             "http://127.0.0.1:8003") and len(lines) == 5
    res, started = m.launch(["scripts/sft_grounding.sh", str(SEVEN_B), "data.train=a b"], NUM_GPUS="8", DRY_RUN="1")
    assert res.returncode == 0 and started == [], res.stderr
    assert res.stdout.splitlines()[-1] == (f"  trainer: {m.env['MMPG_DEEPSPEED']} --num_gpus 8 --module mmpg.cli sft "
                                           f"--config {SEVEN_B} data.train=a\\ b")


def test_colocated_servers_take_the_share_the_plan_computes(tmp_path):
    """Colocated on 8 GPUs of 80 GiB without VLLM_MEM: each server gets the gpu_memory_utilization that
    `mmpg plan --vllm-mem` computes for the config on those GPUs (before: 0.3 whatever the model); VLLM_MEM wins."""
    import contextlib
    import io

    from mmpg.cli import main

    m = Machine(tmp_path, memory_mib=81920)
    res, started = m.launch(["scripts/train_grounding.sh", str(SEVEN_B)], VLLM="1", NUM_GPUS="8",
                            VLLM_MAX_LEN="9216", DRY_RUN="1")
    assert res.returncode == 0 and started == [], res.stderr
    servers = [ln for ln in res.stdout.splitlines() if ln.startswith("  server:")]
    assert len(servers) == 8
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "--config", str(SEVEN_B), "rollout.engine=vllm", "--gpus", "8", "--gpu-memory", "80",
                     "--vllm-mem"]) == 0
    share = out.getvalue().strip()
    assert share != "0.30" and all(f"--gpu-memory-utilization {share} " in ln for ln in servers), servers[0]
    assert f"[mmpg] VLLM_MEM {share}: the colocated servers' share" in res.stderr
    res, _ = m.launch(["scripts/train_grounding.sh", str(SEVEN_B)], VLLM="1", NUM_GPUS="8", VLLM_MEM="0.4",
                      VLLM_MAX_LEN="9216", DRY_RUN="1")
    assert all("--gpu-memory-utilization 0.4 " in ln for ln in res.stdout.splitlines() if ln.startswith("  server:"))


SCRIPT = re.compile(r"\bbash scripts/(?:train|sft)_grounding\.sh\b")


def _doc_launches() -> list[tuple[str, str]]:
    """(file:line, command) for every launch of train_grounding.sh / sft_grounding.sh in README.md and docs/, as
    tests/doc_commands.py collects the pages' commands (shell blocks with their continuations, the prose's code)."""
    from doc_commands import PAGES, documented_commands

    pages = [p for p in PAGES if p.parent.name != "data"]
    return [(c.where.rsplit("/", 1)[-1], c.text) for c in documented_commands(pages) if SCRIPT.search(c.text)]


def test_every_documented_launch_passes_the_layout_check(tmp_path):
    """The docs' launch lines, run as written with DRY_RUN=1 on 8 stand-in GPUs (a hostfile: two nodes of 8). The
    docs' own `VLLM_GPUS=7 TRAIN_GPUS=0,...,6` with the 7B config's batch of 32 was refused here before its
    data.batch_size=28."""
    launches = _doc_launches()
    mentions = {f"{p.name}:{n}" for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
                for n, line in enumerate(p.read_text().splitlines(), 1) if SCRIPT.search(line)}
    assert {where for where, _ in launches} == mentions  # every line that names a launch is collected
    assert any("VLLM_GPUS=7" in cmd for _, cmd in launches), launches
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=8\nnode2 slots=8\n")
    m = Machine(tmp_path)
    for where, cmd in launches:
        words = shlex.split(cmd)
        at = words.index("bash")
        # the server's length is derived in test_dry_run_prints_the_processes_and_starts_none; given here, it
        # saves a cold `mmpg vllm-len` per VLLM line
        env = {"VLLM_MAX_LEN": "9216", **dict(w.split("=", 1) for w in words[:at]), "DRY_RUN": "1"}
        if "HOSTFILE" in env:
            env["HOSTFILE"] = str(hostfile)
        res, started = m.launch([w for w in words[at + 1:] if w != "..."], **env)
        assert res.returncode == 0 and started == [], f"{where}: {cmd}\n{res.stderr}"
        assert "[mmpg] layout: " in res.stderr and "dry run" in res.stdout, f"{where}: {cmd}\n{res.stderr}"
