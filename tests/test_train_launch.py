"""scripts/train_grounding.sh's knobs with a stand-in DeepSpeed launcher and a stand-in vLLM server (fast): which
flags each gets, the server's GPUs, the server stopped when training ends, the sft job, hostfiles, the port; and
`mmpg` taking the launcher's --local_rank wherever it comes. tests/test_launch_real.py runs the real launchers."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, extra_env: dict, *args: str, trainer_rc: int = 0):
    """(completed process, trainer argv, server argv + its CUDA_VISIBLE_DEVICES, server pid)."""
    trainer = tmp_path / "deepspeed"
    # the stand-in trainer ends once the server has written what it records (the script stops the server then)
    trainer.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/trainer.args\n'
                       f'for i in $(seq 300); do [ -f {tmp_path}/server.pid ] && break; sleep 0.1; done\n'
                       f'exit {trainer_rc}\n')
    server = tmp_path / "serve"
    server.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/server.args\necho "${{CUDA_VISIBLE_DEVICES:-unset}}" > '
                      f'{tmp_path}/server.gpus\necho $$ > {tmp_path}/server.tmp\n'
                      f'mv {tmp_path}/server.tmp {tmp_path}/server.pid\nexec sleep 300\n')
    trainer.chmod(0o755)
    server.chmod(0o755)
    env = dict(os.environ, MMPG_EXTRAS="dev", MMPG_DEEPSPEED=str(trainer), MMPG_VLLM_SERVE=str(server), VLLM="1",
               **extra_env)
    res = subprocess.run(["bash", "scripts/train_grounding.sh", "configs/cpu_demo.yaml", "model.path=/models/q25",
                          *args], check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    read = lambda name: (tmp_path / name).read_text().strip() if (tmp_path / name).exists() else None
    return res, read("trainer.args"), (read("server.args"), read("server.gpus")), read("server.pid")


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    return True


def test_colocated_server_gets_the_model_and_stops_with_training(tmp_path):
    res, trainer, (server, gpus), pid = _run(tmp_path, {}, "trainer.total_steps=3", trainer_rc=7)
    assert res.returncode == 7, res.stderr  # the trainer's status is the script's
    assert trainer.endswith("--module mmpg.cli train --config configs/cpu_demo.yaml model.path=/models/q25 "
                            "trainer.total_steps=3 rollout.engine=vllm rollout.vllm_url=http://127.0.0.1:8000")
    # no GPU here: the CPU server's share of the machine's memory for its K/V (0.2; before: 0.3, a GPU's default)
    assert server.startswith("--checkpoint /models/q25 --port 8000 --gpu-memory-utilization 0.20 --max-model-len ")
    assert gpus == "unset"  # the length derived from the config: tests/test_vllm_lengths.py
    for _ in range(50):
        if not _alive(pid):
            break
        time.sleep(0.1)
    assert not _alive(pid), "the server outlived the training"


def test_own_gpus_port_and_extra_flags(tmp_path):
    res, trainer, (server, gpus), _ = _run(tmp_path, {"VLLM_GPUS": "3", "TRAIN_GPUS": "0,1", "VLLM_PORT": "8123",
                                                      "VLLM_ARGS": "--max-model-len 16384"})
    assert res.returncode == 0, res.stderr
    assert trainer.startswith("--include localhost:0,1 --module mmpg.cli train")
    assert trainer.endswith("rollout.vllm_url=http://127.0.0.1:8123")
    assert server == "--checkpoint /models/q25 --port 8123 --max-model-len 16384" and gpus == "3"


def _pool(tmp_path, servers: int, gpus: int, extra_env: dict):
    """scripts/train_grounding.sh with VLLM=1 on a stand-in machine of `gpus` GPUs (0: none, a CPU), stand-in
    servers and launcher: (completed process, trainer argv, its MMPG_VLLM_* environment, the servers' records in port
    order as (pid, CUDA_VISIBLE_DEVICES, argv)). The stand-in trainer ends once `servers` servers have recorded theirs
    (the real one waits for their /health): the script stops them when it exits."""
    rec, bin_ = tmp_path / "rec", tmp_path / "bin"
    rec.mkdir()
    bin_.mkdir()
    smi = "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})'\n" for i in range(gpus))
    (bin_ / "nvidia-smi").write_text(f"#!/bin/sh\n{smi or 'exit 9'}\n")
    (bin_ / "deepspeed").write_text(f'#!/bin/sh\necho "$@" > {rec}/trainer.args\n'
                                    f"env | grep '^MMPG_VLLM_' > {rec}/trainer.env\nfor i in $(seq 300); do\n"
                                    f'  [ "$(ls {rec} | grep -c pid$)" -ge {servers} ] && break; sleep 0.1\ndone\n')
    (bin_ / "serve").write_text(f'#!/bin/sh\necho "${{CUDA_VISIBLE_DEVICES:-unset}} $@" > {rec}/$$.args\n'
                                f"echo $$ > {rec}/$$.tmp\nmv {rec}/$$.tmp {rec}/$$.pid\nexec sleep 300\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    (tmp_path / "env.sh").write_text(f"MMPG_ROOT={ROOT}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM", "MMPG_VLLM")) and k not in
           ("NUM_GPUS", "TRAIN_GPUS", "CUDA_VISIBLE_DEVICES", "HOSTFILE", "SP", "DRY_RUN")}
    env.update(PATH=f"{bin_}:{env['PATH']}", MMPG_ENV_SH=str(tmp_path / "env.sh"), MMPG_DEEPSPEED=str(bin_ / "deepspeed"),
               MMPG_VLLM_SERVE=str(bin_ / "serve"), HF_HUB_OFFLINE="1", VLLM="1", **extra_env)
    res = subprocess.run(["bash", "scripts/train_grounding.sh", "configs/cpu_demo.yaml", "model.path=/models/q25"],
                         check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if not (rec / "trainer.args").exists():
        return res, None, None, []
    got = dict(line.split("=", 1) for line in (rec / "trainer.env").read_text().splitlines())
    found = []
    for args in rec.glob("*.args"):
        if args.stem != "trainer":
            gpu, argv = args.read_text().strip().split(" ", 1)
            found.append((args.stem, gpu, argv))
    found.sort(key=lambda r: int(r[2].split("--port ")[1].split()[0]))
    return res, (rec / "trainer.args").read_text().strip(), got, found


def _all_stopped(pids) -> bool:
    for _ in range(50):
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_a_pool_of_servers_one_per_gpu_each_on_its_port(tmp_path):
    """VLLM_GPUS=4,5,6,7 (before: one server, refused with "names 4 GPU(s) but the server's engine uses 1"): four
    servers, server i on GPU 4+i and port 8000+i with its own log, one length for all; the trainer gets their URLs,
    pids and logs in the same order; all four stopped when it exits."""
    res, trainer, got, servers = _pool(tmp_path, 4, 8, {"VLLM_GPUS": "4,5,6,7", "TRAIN_GPUS": "0,1,2,3"})
    assert res.returncode == 0, res.stderr
    assert [gpu for _, gpu, _ in servers] == ["4", "5", "6", "7"]
    length = servers[0][2].split("--max-model-len ")[1]
    assert [argv for _, _, argv in servers] == [f"--checkpoint /models/q25 --port {8000 + i} --max-model-len {length}"
                                                for i in range(4)] and length.isdigit()
    assert trainer.startswith("--include localhost:0,1,2,3 --module mmpg.cli train")
    assert trainer.endswith("rollout.vllm_url=" + ",".join(f"http://127.0.0.1:{8000 + i}" for i in range(4)))
    assert got["MMPG_VLLM_PID"] == ",".join(pid for pid, _, _ in servers)
    assert got["MMPG_VLLM_LOG"] == ",".join(str(ROOT / "runs" / f"vllm-serve-{8000 + i}.log") for i in range(4))
    assert _all_stopped([pid for pid, _, _ in servers]), "a server outlived the training"


def test_a_pool_of_tensor_parallel_servers(tmp_path):
    res, trainer, _, servers = _pool(tmp_path, 2, 8, {"VLLM_GPUS": "4,5,6,7", "TRAIN_GPUS": "0,1,2,3", "VLLM_TP": "2",
                                                      "VLLM_MAX_LEN": "4096"})
    assert res.returncode == 0, res.stderr
    assert [(gpu, argv) for _, gpu, argv in servers] == [
        ("4,5", "--checkpoint /models/q25 --port 8000 --max-model-len 4096 --tensor-parallel-size 2"),
        ("6,7", "--checkpoint /models/q25 --port 8001 --max-model-len 4096 --tensor-parallel-size 2")]
    assert trainer.endswith("rollout.vllm_url=http://127.0.0.1:8000,http://127.0.0.1:8001")
    from mmpg.serve import vllm_server  # `mmpg vllm-serve` takes the flag (before: not one of its flags)

    assert vllm_server.parse_args(servers[0][2].split()).tensor_parallel_size == 2


@pytest.mark.parametrize("gpus, pinned", [(2, ["0", "1"]), (0, ["unset", "unset"])])
def test_colocated_one_server_per_training_process(tmp_path, gpus, pinned):
    """No VLLM_GPUS, NUM_GPUS=2 (before: one server for both ranks): a server per training process, on its GPU with
    VLLM_MEM of its memory, or on a machine without GPUs two CPU servers; rank r samples from server r."""
    res, trainer, got, servers = _pool(tmp_path, 2, gpus, {"NUM_GPUS": "2", "VLLM_MEM": "0.4",
                                                           "VLLM_MAX_LEN": "4096"})
    assert res.returncode == 0, res.stderr
    assert [(gpu, argv) for _, gpu, argv in servers] == [
        (pinned[i], f"--checkpoint /models/q25 --port {8000 + i} --gpu-memory-utilization 0.4 --max-model-len 4096")
        for i in range(2)]
    assert trainer.startswith("--num_gpus 2 --module mmpg.cli train")
    assert trainer.endswith("rollout.vllm_url=http://127.0.0.1:8000,http://127.0.0.1:8001")
    assert got["MMPG_VLLM_PID"] == ",".join(pid for pid, _, _ in servers)
    assert _all_stopped([pid for pid, _, _ in servers]), "a server outlived the training"


def test_colocated_cpu_servers_split_the_machines_memory(tmp_path):
    """Without GPUs the colocated servers' K/V comes out of one machine's memory: two take 0.2 between them (before:
    0.3 each, which two real CPU servers beside the trainer could not get)."""
    res, _, _, servers = _pool(tmp_path, 2, 0, {"NUM_GPUS": "2", "VLLM_MAX_LEN": "4096"})
    assert res.returncode == 0, res.stderr
    assert [argv for _, _, argv in servers] == [
        f"--checkpoint /models/q25 --port {8000 + i} --gpu-memory-utilization 0.10 --max-model-len 4096"
        for i in range(2)]


def test_a_pool_the_tensor_parallel_size_does_not_divide_starts_nothing(tmp_path):
    res, trainer, _, servers = _pool(tmp_path, 1, 8, {"VLLM_GPUS": "5,6,7", "TRAIN_GPUS": "0,1", "VLLM_TP": "2"})
    assert res.returncode == 2 and trainer is None and servers == [], res.stderr
    assert "train_grounding.sh: VLLM_GPUS=5,6,7 names 3 GPU(s), not a multiple of VLLM_TP=2" in res.stderr


@pytest.mark.parametrize("env, message", [({"HOSTFILE": "hosts"}, "one node"),
                                          ({"NUM_GPUS": "2", "TRAIN_GPUS": "0"}, "not both")])
def test_refusals(tmp_path, env, message):
    if "HOSTFILE" in env:  # two nodes (8 ranks: the config's 8 prompts divide over them)
        (tmp_path / env["HOSTFILE"]).write_text("node1 slots=4\nnode2 slots=4\n")
        env = {"HOSTFILE": str(tmp_path / env["HOSTFILE"])}
    res, trainer, (server, _), _ = _run(tmp_path, env)
    assert res.returncode == 2 and message in res.stderr
    assert trainer is None and server is None


def test_get_prints_one_resolved_field():
    def get(*argv):
        res = subprocess.run(["mmpg", "train", "--config", "configs/cpu_demo.yaml", *argv], check=False, cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        return res.returncode, res.stdout.strip(), res.stderr

    assert get("model.path=/m/x", "--get", "model.path")[:2] == (0, "/m/x")
    rc, _, err = get("--get", "model.nope")
    assert rc == 2 and "no config field 'nope'" in err


def _launch(tmp_path, script: str, extra_env: dict, *args: str):
    """(completed process, the stand-in launcher's argv) for a launch without VLLM."""
    launcher = tmp_path / "deepspeed"
    launcher.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/launcher.args\n')
    launcher.chmod(0o755)
    env = dict(os.environ, MMPG_EXTRAS="dev", MMPG_DEEPSPEED=str(launcher), **extra_env)
    (tmp_path / "launcher.args").unlink(missing_ok=True)
    res = subprocess.run(["bash", script, "configs/cpu_demo.yaml", *args], check=False, cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    path = tmp_path / "launcher.args"
    return res, path.read_text().strip() if path.exists() else None


def test_sft_script_runs_mmpg_sft_through_the_same_launch(tmp_path):
    res, argv = _launch(tmp_path, "scripts/sft_grounding.sh", {"NUM_GPUS": "2", "MASTER_PORT": "29611"}, "a.b=1")
    assert res.returncode == 0, res.stderr
    assert argv == "--master_port 29611 --num_gpus 2 --module mmpg.cli sft --config configs/cpu_demo.yaml a.b=1"
    res, argv = _launch(tmp_path, "scripts/sft_grounding.sh", {"VLLM": "1"})
    assert res.returncode == 2 and "mmpg sft has none" in res.stderr and argv is None


def test_sp_knob_sets_sequence_parallelism(tmp_path):
    res, argv = _launch(tmp_path, "scripts/train_grounding.sh", {"NUM_GPUS": "8", "SP": "4"}, "a.b=1")
    assert res.returncode == 0, res.stderr
    assert argv == ("--num_gpus 8 --module mmpg.cli train --config configs/cpu_demo.yaml "
                    "parallel.sequence_parallel_size=4 a.b=1")


def test_the_long_video_config_loads_and_fits_its_heads():
    """configs/grounding_qwen25vl_7b_long.yaml: sp 4 over Qwen2.5-VL-7B's 28 query / 4 kv heads, a budget of 64k
    video tokens, 16 prompts over the 2 data-parallel groups of 8 GPUs."""
    from mmpg.config import load_config
    from mmpg.grouping.ulysses import check_heads

    cfg = load_config(ROOT / "configs" / "grounding_qwen25vl_7b_long.yaml")
    sp = cfg.parallel.sequence_parallel_size
    assert sp == 4 and check_heads(28, 4, sp) is None and cfg.data.batch_size % (8 // sp) == 0
    assert cfg.data.total_pixels // (28 * 28) == 65536 and cfg.data.fps == 1.0


@pytest.mark.parametrize("hosts, local", [("localhost slots=2", True), ("# this machine\n127.0.0.1 slots=2\n", True),
                                          ("node1 slots=4\nnode2 slots=4", False),
                                          ("localhost slots=2\nnode2 slots=2", False)])
def test_a_hostfile_of_this_machine_alone_skips_deepspeeds_ssh(tmp_path, hosts, local):
    """DeepSpeed runs `ssh HOST hostname` for any hostfile (and `ssh HOST hostname -I` for the master address): with
    no ssh server, `localhost slots=2` failed. Other hostfiles keep DeepSpeed's checks."""
    (tmp_path / "hostfile").write_text(hosts)
    pdsh = tmp_path / "bin" / "pdsh"  # DeepSpeed's default launcher for several nodes, checked for by the script
    pdsh.parent.mkdir()
    pdsh.write_text("#!/bin/sh\n")
    pdsh.chmod(0o755)
    res, argv = _launch(tmp_path, "scripts/train_grounding.sh", {"HOSTFILE": str(tmp_path / "hostfile"),
                                                                 "PATH": f"{pdsh.parent}:{os.environ['PATH']}"})
    assert res.returncode == 0, res.stderr
    expected = f"--hostfile {tmp_path / 'hostfile'}" + (" --no_ssh_check --master_addr 127.0.0.1" if local else
                                                        " --launcher pdsh")
    assert argv == f"{expected} --module mmpg.cli train --config configs/cpu_demo.yaml"


def test_a_missing_hostfile_is_refused(tmp_path):
    res, argv = _launch(tmp_path, "scripts/train_grounding.sh", {"HOSTFILE": str(tmp_path / "nope")})
    assert res.returncode == 2 and f"HOSTFILE={tmp_path / 'nope'}: no such file" in res.stderr and argv is None


# `python -m mmpg.cli --local_rank=N train ...` is what `deepspeed --module mmpg.cli train ...` runs.
@pytest.mark.parametrize("argv", [["--local_rank=1", "train", "--config", "c.yaml", "a.b=2"],
                                  ["--local_rank", "1", "train", "--config", "c.yaml", "a.b=2"],
                                  ["train", "--local_rank=1", "--config", "c.yaml", "a.b=2"],
                                  ["train", "--config", "c.yaml", "a.b=2", "--local-rank=1"]])
@pytest.mark.parametrize("command", ["train", "sft"])
def test_local_rank_is_taken_anywhere_and_left_out_of_the_recorded_command(monkeypatch, argv, command):
    from mmpg import cli

    seen = []
    monkeypatch.setattr(cli, "_cmd_train", lambda args: seen.append(args) or 0)
    monkeypatch.setenv("LOCAL_RANK", "")  # so that monkeypatch removes what main sets
    monkeypatch.delenv("LOCAL_RANK")
    assert cli.main([command if a == "train" else a for a in argv]) == 0
    (args,) = seen
    assert args.command == command and args.config == "c.yaml" and args.overrides == ["a.b=2"]
    assert args.argv == ["--config", "c.yaml", "a.b=2"]  # what run.json records after "mmpg <command>"
    assert os.environ["LOCAL_RANK"] == "1"


def test_local_rank_for_eval_and_the_launchers_variable_wins(monkeypatch):
    from mmpg import cli

    seen = []
    monkeypatch.setattr(cli, "_cmd_eval", lambda args: seen.append(args) or 0)
    monkeypatch.setenv("LOCAL_RANK", "3")  # the deepspeed launcher sets both; they agree there
    assert cli.main(["--local_rank=0", "eval", "--checkpoint", "ck", "--annotations", "a.json", "max_samples=2"]) == 0
    assert (seen[0].checkpoint, seen[0].overrides, seen[0].argv) == ("ck", ["max_samples=2"],
                                                                     ["--checkpoint", "ck", "--annotations", "a.json",
                                                                      "max_samples=2"])
    assert os.environ["LOCAL_RANK"] == "3"


def test_a_bad_local_rank_is_one_usage_error(capsys):
    from mmpg import cli

    for argv in (["--local_rank=x", "train"], ["train", "--local_rank"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2
        assert "--local_rank" in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize("flash, extras, hint", [(None, "dev", True), ("1", "dev,gpu-auto", False),
                                                 ("must", "dev,gpu", False)])
def test_a_launch_never_builds_flash_attn_unless_asked(tmp_path, flash, extras, hint):
    """On a GPU machine without flash-attn the default launch installs the dev extras only (no flash-attn build,
    which takes minutes to an hour) and says in one line how to ask for it; FLASH_ATTN=1 / must ask."""
    env_sh = tmp_path / "env.sh"
    env_sh.write_text(f'echo "$1" > {tmp_path}/extras\nMMPG_ROOT={ROOT}\n')
    trainer = tmp_path / "deepspeed"
    trainer.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/trainer.args\n')
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    for stand_in in (trainer, smi):
        stand_in.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("MMPG_EXTRAS", "FLASH_ATTN")}
    env.update(MMPG_ENV_SH=str(env_sh), MMPG_DEEPSPEED=str(trainer), PATH=f"{smi.parent}:{env['PATH']}",
               **({"FLASH_ATTN": flash} if flash else {}))
    res = subprocess.run(["bash", "scripts/train_grounding.sh", "configs/cpu_demo.yaml"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "extras").read_text().strip() == extras
    lines = [ln for ln in res.stderr.splitlines() if "flash-attn" in ln]
    if hint:
        assert len(lines) == 1 and "FLASH_ATTN=1 bash scripts/train_grounding.sh" in lines[0], res.stderr
        assert "minutes to an hour" in lines[0]
    else:
        assert lines == [], res.stderr
    assert "train --config configs/cpu_demo.yaml" in (tmp_path / "trainer.args").read_text()


def test_a_bad_flash_attn_knob_is_refused(tmp_path):
    env = dict(os.environ, FLASH_ATTN="yes")
    res = subprocess.run(["bash", "scripts/train_grounding.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60, check=False)
    assert res.returncode == 2 and "FLASH_ATTN=yes: use 1" in res.stderr
