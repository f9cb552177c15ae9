"""scripts/slurm/train_grounding.sbatch on one machine, with stand-ins for Slurm: `scontrol show hostnames` lists the
job's nodes, `srun` runs its command once per node of its --nodelist, in parallel, as Slurm's task there
(SLURMD_NODENAME, SLURM_PROCID, SLURM_STEP_NUM_TASKS, ...), and records what it was asked. With a stand-in DeepSpeed
launcher each node's command line is checked (hostfile, node rank, master, config, overrides; the vLLM server on its
own node with VLLM=1); with the real one, two "nodes" of one CPU process each train one GRPO step together (gloo)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mmpg.serve.launch import free_port
from train_utils import env as cli_env
from train_utils import metrics, overrides

ROOT = Path(__file__).resolve().parents[1]
SBATCH = "scripts/slurm/train_grounding.sbatch"

SRUN = r'''#!PYTHON
"""srun: its command once per node of --nodelist (else the job's), each as that node's task; a line per call."""
import json, os, signal, subprocess, sys
args, opts = sys.argv[1:], {}
while args and args[0].startswith("-"):
    key, _, value = args.pop(0).partition("=")
    opts[key] = value
nodes = opts.get("--nodelist", os.environ["SLURM_JOB_NODELIST"]).split(",")
with open(os.environ["SRUN_LOG"], "a") as log:
    log.write(json.dumps({"opts": opts, "cmd": args, "nodes": nodes}) + "\n")
procs = [subprocess.Popen(args, env=dict(os.environ, SLURMD_NODENAME=n, SLURM_NODEID=str(k), SLURM_PROCID=str(k),
                                         SLURM_LOCALID="0", SLURM_STEP_NUM_TASKS=str(len(nodes))))
         for k, n in enumerate(nodes)]
signal.signal(signal.SIGTERM, lambda *_: [p.terminate() for p in procs] and sys.exit(143))
sys.exit(max(p.wait() for p in procs))
'''
# a stand-in DeepSpeed launcher / vLLM server: one JSON line per call with the node, argv and what the env says
RECORDER = r'''#!PYTHON
import json, os, sys, time
keys = ("SLURMD_NODENAME", "MMPG_VLLM_TOKEN", "CUDA_VISIBLE_DEVICES")
argv = sys.argv[1:]
hostfile = open(argv[argv.index("--hostfile") + 1]).read() if "--hostfile" in argv else None
log, t0 = os.environ["RECORD_LOG"], time.time()
wait_for, _, count = os.environ.get("WAIT_FOR", "").partition("*")  # serve*4: until 4 calls of serve have run
while wait_for and wait_for != os.path.basename(sys.argv[0]) and time.time() - t0 < 60:
    if os.path.exists(log) and open(log).read().count(f'"who": "{wait_for}"') >= int(count or 1):
        break
    time.sleep(0.1)
with open(log, "a") as out:
    out.write(json.dumps({"who": os.path.basename(sys.argv[0]), "argv": argv, "hostfile": hostfile,
                          **{k: os.environ.get(k) for k in keys}}) + "\n")
'''


class Cluster:
    """A job of `nodes` on this machine: bin/ with srun, scontrol, deepspeed and serve stand-ins; env.sh a stand-in."""

    def __init__(self, tmp: Path, nodes: list[str], job: int = 4242):
        self.tmp, self.nodes, self.job = tmp, nodes, job
        bin_ = tmp / "bin"
        bin_.mkdir()
        for name, text in (("srun", SRUN), ("deepspeed", RECORDER), ("serve", RECORDER)):
            (bin_ / name).write_text(text.replace("PYTHON", sys.executable, 1))
        (bin_ / "scontrol").write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && echo "$3" | tr , "\\n"\n')
        for f in bin_.iterdir():
            f.chmod(0o755)
        (tmp / "env.sh").write_text(f"MMPG_ROOT={ROOT}\nexport PATH={Path(sys.executable).parent}:$PATH\n")
        drop = ("NUM_GPUS", "TRAIN_GPUS", "VLLM", "VLLM_URL", "VLLM_GPUS", "VLLM_ARGS", "HOSTFILE", "LAUNCHER",
                "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "MMPG_VLLM_TOKEN", "DRY_RUN", "JOB", "MMPG_EXTRAS",
                "CUDA_VISIBLE_DEVICES", "RESUME", "SP", "ZERO", "FLASH_ATTN")
        self.env = {k: v for k, v in cli_env().items() if k not in drop and not k.startswith("SLURM")}
        self.env.update(PATH=f"{bin_}:{self.env['PATH']}", MMPG_ENV_SH=str(tmp / "env.sh"), SLURM_JOB_ID=str(job),
                        SLURM_JOB_NODELIST=",".join(nodes), SLURM_SUBMIT_DIR=str(ROOT), SRUN_LOG=str(tmp / "srun"),
                        RECORD_LOG=str(tmp / "calls"), MMPG_DEEPSPEED=str(bin_ / "deepspeed"),
                        MMPG_VLLM_SERVE=str(bin_ / "serve"), HF_HUB_OFFLINE="1")
        self.hostfile = ROOT / "runs" / f"slurm-{job}.hostfile"

    def submit(self, *args: str, stand_in: bool = True, timeout: float = 300, **env) -> subprocess.CompletedProcess:
        """What the job runs: `bash SBATCH ARGS` (sbatch hands its arguments to the script) on the first node."""
        e = dict(self.env, **env)
        if not stand_in:
            e.pop("MMPG_DEEPSPEED")
        try:
            return subprocess.run(["bash", str(ROOT / SBATCH), *args], cwd=self.tmp, env=e, capture_output=True,
                                  text=True, timeout=timeout, check=False)
        finally:
            self.hostfile.unlink(missing_ok=True)
            (ROOT / "runs" / f"vllm-serve-{self.job}.log").unlink(missing_ok=True)

    def lines(self, name: str) -> list[dict]:
        path = self.tmp / name
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_each_node_runs_the_launch_script_with_its_rank_the_master_and_the_overrides(tmp_path):
    job = Cluster(tmp_path, ["gpu-a7", "gpu-b3"])
    res = job.submit("configs/cpu_demo.yaml", "data.batch_size=8", "rollout.n=4", NUM_GPUS="2")
    assert res.returncode == 0, res.stderr
    (step,) = job.lines("srun")  # one job step: a task per node, started together, no ssh anywhere
    assert step["nodes"] == ["gpu-a7", "gpu-b3"]
    assert step["opts"] == {"--nodes": "2", "--ntasks-per-node": "1", "--nodelist": "gpu-a7,gpu-b3",
                            "--kill-on-bad-exit": "1"}
    assert step["cmd"] == ["bash", "scripts/train_grounding.sh", "configs/cpu_demo.yaml", "data.batch_size=8",
                           "rollout.n=4"]
    hostfile, port = str(job.hostfile), 29500 + 4242 % 1000
    calls = sorted(job.lines("calls"), key=lambda c: c["SLURMD_NODENAME"])
    assert [c["SLURMD_NODENAME"] for c in calls] == ["gpu-a7", "gpu-b3"]
    for rank, call in enumerate(calls):  # DeepSpeed starts the node's 2 processes, ranks 2 * rank + (0, 1)
        assert call["argv"] == ["--hostfile", hostfile, "--no_ssh", "--node_rank", str(rank), "--master_addr",
                                "gpu-a7", "--master_port", str(port), "--num_gpus", "2", "--module", "mmpg.cli",
                                "train", "--config", "configs/cpu_demo.yaml", "data.batch_size=8", "rollout.n=4"]
    assert "[mmpg] layout: 4 training rank(s) (2 node(s) of HOSTFILE" in res.stderr  # checked on each node
    assert f"job 4242: train on gpu-a7 gpu-b3 (2 processes each; master gpu-a7:{port})" in res.stdout


def test_the_hostfile_and_the_sft_job(tmp_path):
    job = Cluster(tmp_path, ["n1", "n2", "n3"], job=77)
    res = job.submit("configs/sft_cpu_demo.yaml", "data.batch_size=12", JOB="sft", SLURM_GPUS_ON_NODE="4")
    assert res.returncode == 0, res.stderr
    calls = job.lines("calls")
    assert [c["hostfile"] for c in calls] == ["n1 slots=4\nn2 slots=4\nn3 slots=4\n"] * 3  # Slurm's GPUs per node
    assert {c["argv"][c["argv"].index("mmpg.cli") + 1] for c in calls} == {"sft"}
    assert job.lines("srun")[0]["cmd"][:2] == ["bash", "scripts/sft_grounding.sh"]  # its own default config too
    res = job.submit("configs/cpu_demo.yaml", JOB="grpo", NUM_GPUS="1")
    assert res.returncode == 2 and "JOB=grpo: use train or sft" in res.stderr
    res = job.submit("configs/sft_cpu_demo.yaml", JOB="sft", VLLM="1", NUM_GPUS="1")
    assert res.returncode == 2 and "VLLM=1 samples GRPO rollouts; JOB=sft has none" in res.stderr


def test_refusals_name_what_to_do(tmp_path):
    job = Cluster(tmp_path, ["n1"])
    res = job.submit("configs/cpu_demo.yaml", SLURM_JOB_NODELIST="")
    assert res.returncode == 2 and "not inside a Slurm job: submit it with sbatch" in res.stderr
    res = job.submit("configs/cpu_demo.yaml")  # no GPUs here, none asked of Slurm, no NUM_GPUS
    assert res.returncode == 2 and "#SBATCH --gpus-per-node=8" in res.stderr
    res = job.submit("configs/cpu_demo.yaml", NUM_GPUS="1", VLLM="1")
    assert res.returncode == 2 and "VLLM=1 runs the vLLM server on a node of its own" in res.stderr
    assert "sbatch --nodes=2" in res.stderr and job.lines("srun") == []


def vllm_job(tmp_path, servers: int, **env):
    """VLLM=1 on 3 nodes (n3 serves): the job's result, its steps by node, the servers by port and the trainers."""
    job = Cluster(tmp_path, ["n1", "n2", "n3"])
    port = int(env.get("VLLM_PORT", 8000))
    try:
        res = job.submit("configs/cpu_demo.yaml", "model.path=/models/q25", "data.batch_size=16", VLLM="1",
                         VLLM_MAX_LEN="4096", WAIT_FOR=f"serve*{servers}", **env)
    finally:  # a pool's servers each write their own log
        for p in range(port, port + servers):
            (ROOT / "runs" / f"vllm-serve-{p}.log").unlink(missing_ok=True)
    steps = {tuple(step["nodes"]): step for step in job.lines("srun")}  # the two steps run side by side
    calls = job.lines("calls")
    served = sorted((c for c in calls if c["who"] == "serve"),
                    key=lambda c: int(c["argv"][c["argv"].index("--port") + 1]))
    return res, steps, served, [c for c in calls if c["who"] == "deepspeed"]


def test_vllm_on_the_last_node_with_a_token_for_the_job(tmp_path):
    """Every GPU of the server node serves (before: one server on port 8000, the node's other GPUs idle)."""
    res, steps, servers, trainers = vllm_job(tmp_path, 2, NUM_GPUS="2")
    assert res.returncode == 0, res.stderr
    assert set(steps) == {("n3",), ("n1", "n2")}
    assert steps["n3",]["opts"] == {"--nodes": "1", "--ntasks": "1", "--nodelist": "n3"}
    assert steps["n1", "n2"]["opts"]["--nodelist"] == "n1,n2"
    assert [(s["CUDA_VISIBLE_DEVICES"], s["argv"]) for s in servers] == [
        (str(i), ["--checkpoint", "/models/q25", "--host", "n3", "--port", str(8000 + i), "--max-model-len", "4096",
                  "--nccl"]) for i in range(2)]  # bound to its node's name; weights by NCCL across machines
    assert len(trainers) == 2 and all(t["argv"][-4:] == ["model.path=/models/q25", "data.batch_size=16",
                                                         "rollout.engine=vllm",
                                                         "rollout.vllm_url=http://n3:8000,http://n3:8001"]
                                      for t in trainers)
    token = servers[0]["MMPG_VLLM_TOKEN"]
    assert token and len(token) == 48 and all(t["MMPG_VLLM_TOKEN"] == token for t in trainers + servers)
    assert "2 vLLM servers on n3:8000-8001 (GPUs 0 | 1;" in res.stdout


def test_a_pool_of_tensor_parallel_servers_on_the_last_node(tmp_path):
    """VLLM_TP=2 on an 8-GPU node: 4 servers of 2 GPUs on ports VLLM_PORT.., in the order the trainers list them."""
    res, _, servers, trainers = vllm_job(tmp_path, 4, SLURM_GPUS_ON_NODE="8", VLLM_TP="2", VLLM_PORT="8100",
                                         VLLM_ARGS="--dtype bfloat16")
    assert res.returncode == 0, res.stderr
    assert [(s["CUDA_VISIBLE_DEVICES"], s["argv"]) for s in servers] == [
        (f"{2 * i},{2 * i + 1}", ["--checkpoint", "/models/q25", "--host", "n3", "--port", str(8100 + i),
                                  "--max-model-len", "4096", "--tensor-parallel-size", "2", "--dtype", "bfloat16"])
        for i in range(4)]
    urls = ",".join(f"http://n3:{8100 + i}" for i in range(4))
    assert len(trainers) == 2 and all(t["argv"][-1] == f"rollout.vllm_url={urls}" for t in trainers)
    # the user's VLLM_GPUS picks the pool (every knob of the servers stays off the trainers' command lines)
    (tmp_path / "b").mkdir()
    res, _, servers, trainers = vllm_job(tmp_path / "b", 1, SLURM_GPUS_ON_NODE="8", VLLM_TP="2", VLLM_GPUS="6,7")
    assert res.returncode == 0, res.stderr
    assert [s["CUDA_VISIBLE_DEVICES"] for s in servers] == ["6,7"] and servers[0]["argv"][5] == "8000"
    assert all(t["argv"][-1] == "rollout.vllm_url=http://n3:8000" for t in trainers)


def test_a_server_of_the_users_own_starts_nothing(tmp_path):
    job = Cluster(tmp_path, ["n1", "n2"])
    res = job.submit("configs/cpu_demo.yaml", "data.batch_size=16", NUM_GPUS="8", VLLM="1",
                     VLLM_URL="http://gpu9:9000,http://gpu9:9001")
    assert res.returncode == 0, res.stderr
    (step,) = job.lines("srun")  # the trainers alone, on both nodes
    assert step["nodes"] == ["n1", "n2"] and step["cmd"][:2] == ["bash", "scripts/train_grounding.sh"]
    calls = job.lines("calls")
    assert {c["who"] for c in calls} == {"deepspeed"} and len(calls) == 2
    assert all(c["argv"][-1] == "rollout.vllm_url=http://gpu9:9000,http://gpu9:9001" for c in calls)


@pytest.mark.parametrize("env, says", [
    ({"VLLM_TP": "3"}, "the vLLM servers on n3 (VLLM_GPUS: every GPU of the node unless set): VLLM_GPUS=0,1,2,3,4,5,"
                       "6,7 names 8 GPU(s), not a multiple of VLLM_TP=3"),
    ({"VLLM_GPUS": "4,5,6", "VLLM_TP": "2"}, "the vLLM servers on n3: VLLM_GPUS=4,5,6 names 3 GPU(s), not a multiple "
                                            "of VLLM_TP=2"),
    ({"VLLM_GPUS": "6,7,8,9"}, "VLLM_GPUS=6,7,8,9 names GPU 8; the server node n3 has 8 (0-7"),
    ({"VLLM_GPUS": "0,x"}, "VLLM_GPUS=0,x: expected GPU indices separated by commas"),
    ({"VLLM_TP": "0"}, "VLLM_TP=0: expected the GPUs of each vLLM server"),
    ({"VLLM_PORT": "http"}, "VLLM_PORT=http: expected the first vLLM server's port"),
    ({"VLLM_SERVERS": "2"}, "VLLM_SERVERS=2 counts colocated servers"),
])
def test_a_pool_the_server_node_cannot_hold_is_refused_before_anything_starts(tmp_path, env, says):
    job = Cluster(tmp_path, ["n1", "n2", "n3"])
    res = job.submit("configs/cpu_demo.yaml", SLURM_GPUS_ON_NODE="8", VLLM="1", **env)
    assert res.returncode == 2 and job.lines("srun") == []
    (line,) = res.stderr.splitlines()
    assert line.startswith("train_grounding.sbatch: ") and says in line, line


@pytest.mark.slow
def test_two_nodes_train_one_grpo_step_together(grpo_data, tmp_path):
    """The real DeepSpeed launcher on each 'node' (--no_ssh, its node rank), one gloo process each: one world of 2."""
    job = Cluster(tmp_path, ["node-a", "node-b"], job=5151)
    out = tmp_path / "out"
    args = overrides(grpo_data, out, "slurm", **{"data.batch_size": 2, "trainer.total_steps": 1, "data.val": "",
                                                 "eval.every_n_steps": 0, "reward.function": "reward_fns:space_share"})
    res = job.submit("configs/cpu_demo.yaml", *args, stand_in=False, timeout=600, NUM_GPUS="1",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))  # the stand-in nodes' names resolve nowhere
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-4000:]
    assert "2 rank(s)" in text and "dist_world_size=2" in text
    (step,) = metrics(out / "slurm")
    assert step["step"] == 1 and step["actor/grad_norm"] > 0  # a step was learned, by the world of both nodes
    assert json.loads((out / "slurm" / "run.json").read_text())["devices"] == 2
