"""Several nodes from one launch: scripts/train_grounding.sh's LAUNCHER (mmpg/train/launcher.py picks DeepSpeed's
flags and checks the launcher's programs before anything starts) and the ranks of processes that mpirun or srun start
without RANK / WORLD_SIZE (mmpg.dist.adopt_launcher_ranks). tests/test_slurm.py covers the launch per node."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmpg import dist
from mmpg.errors import UserError
from mmpg.train.launcher import deepspeed_flags

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def hostfile(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("# two nodes\nnode1 slots=8\nnode2 slots=8  # the second\n")
    return str(path)


def which_of(*found):
    return lambda program: f"/usr/bin/{program}" if program in found else None


@pytest.mark.parametrize("launcher, found, extra", [
    ("", ("pdsh",), ["--launcher", "pdsh"]),  # DeepSpeed's default: ssh checks and the master's address its own
    ("openmpi", ("mpirun", "ompi_info"), ["--launcher", "openmpi", "--no_ssh_check", "--master_addr", "node1",
                                          "--launcher_args", "-x MASTER_ADDR -x MASTER_PORT"]),
    ("slurm", ("srun", "sinfo"), ["--launcher", "slurm", "--no_ssh_check", "--master_addr", "node1"]),
    ("mpich", ("mpirun",), ["--launcher", "mpich", "--no_ssh_check", "--master_addr", "node1"]),
])
def test_each_launcher_gets_its_flags(hostfile, launcher, found, extra):
    flags, note = deepspeed_flags({"HOSTFILE": hostfile, "LAUNCHER": launcher}, which=which_of(*found))
    assert flags == ["--hostfile", hostfile, *extra] and note is None


def test_a_missing_launcher_is_one_line_naming_what_to_install_and_what_is_here(hostfile):
    with pytest.raises(UserError) as err:
        deepspeed_flags({"HOSTFILE": hostfile}, which=which_of("mpirun", "ompi_info"))
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("LAUNCHER=pdsh (the default) needs pdsh on this node's PATH, not found: install it "
                           "(apt-get install pdsh or dnf install pdsh; every node needs passwordless ssh), or pick "
                           "LAUNCHER=openmpi or mpich or impi (found here)")
    assert "sbatch scripts/slurm/train_grounding.sbatch" in line
    with pytest.raises(UserError, match="LAUNCHER=slurm needs srun and sinfo"):
        deepspeed_flags({"HOSTFILE": hostfile, "LAUNCHER": "slurm"}, which=which_of())
    with pytest.raises(UserError, match="LAUNCHER=ssh: DeepSpeed's launchers are pdsh, openmpi, mvapich, mpich"):
        deepspeed_flags({"HOSTFILE": hostfile, "LAUNCHER": "ssh"}, which=which_of())
    # a dry run says it and goes on printing what the launch would run
    flags, note = deepspeed_flags({"HOSTFILE": hostfile, "DRY_RUN": "1"}, which=which_of())
    assert flags[-2:] == ["--launcher", "pdsh"] and note.startswith("the launch would stop here: LAUNCHER=pdsh")


def test_knobs_the_launcher_cannot_honour_are_refused(hostfile):
    with pytest.raises(UserError, match="NUM_GPUS with a HOSTFILE of 2 nodes and LAUNCHER=openmpi: give each node"):
        deepspeed_flags({"HOSTFILE": hostfile, "LAUNCHER": "openmpi", "NUM_GPUS": "4"}, which=which_of("mpirun",
                                                                                                    "ompi_info"))
    with pytest.raises(UserError, match="TRAIN_GPUS with a HOSTFILE of 2 nodes"):
        deepspeed_flags({"HOSTFILE": hostfile, "TRAIN_GPUS": "0,1"}, which=which_of("pdsh"))
    with pytest.raises(UserError, match="NODE_RANK=1 starts this node's processes alone"):
        deepspeed_flags({"HOSTFILE": hostfile, "NODE_RANK": "1", "LAUNCHER": "pdsh"})
    with pytest.raises(UserError, match=r"NODE_RANK=2: expected this node's line of HOSTFILE, 0..1"):
        deepspeed_flags({"HOSTFILE": hostfile, "NODE_RANK": "2"})


def test_node_rank_launches_this_node_alone(hostfile):
    flags, _ = deepspeed_flags({"HOSTFILE": hostfile, "NODE_RANK": "auto", "SLURMD_NODENAME": "node2"})
    assert flags == ["--hostfile", hostfile, "--no_ssh", "--node_rank", "1", "--master_addr", "node1"]
    flags, _ = deepspeed_flags({"HOSTFILE": hostfile, "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.5"})
    assert flags[-2:] == ["--master_addr", "10.0.0.5"]
    with pytest.raises(UserError, match="NODE_RANK=auto: this node .*node9.* is not among HOSTFILE's hosts"):
        deepspeed_flags({"HOSTFILE": hostfile, "NODE_RANK": "auto", "SLURMD_NODENAME": "node9"})


def test_the_vllm_token_must_reach_the_nodes_pdsh_starts(hostfile, tmp_path):
    """pdsh passes on only DeepSpeed's own variables and those of .deepspeed_env: a trainer rank on node2 would meet
    the server's 401 after loading the model; refused up front instead. Open MPI gets it by name (-x)."""
    env = {"HOSTFILE": hostfile, "VLLM": "1", "VLLM_URL": "http://node3:8000", "MMPG_VLLM_TOKEN": "s3cret"}
    with pytest.raises(UserError, match="LAUNCHER=pdsh passes MMPG_VLLM_TOKEN to no other node: add the line"):
        deepspeed_flags(env, which=which_of("pdsh"), home=tmp_path)
    (tmp_path / ".deepspeed_env").write_text("NCCL_DEBUG=WARN\nMMPG_VLLM_TOKEN=s3cret\n")
    assert deepspeed_flags(env, which=which_of("pdsh"), home=tmp_path)[0][-2:] == ["--launcher", "pdsh"]
    flags, _ = deepspeed_flags({**env, "LAUNCHER": "openmpi", "LAUNCHER_ARGS": "--mca btl_tcp_if_include ib0"},
                               which=which_of("mpirun", "ompi_info"), home=tmp_path)
    assert flags[-1] == "-x MASTER_ADDR -x MASTER_PORT -x MMPG_VLLM_TOKEN --mca btl_tcp_if_include ib0"
    assert "s3cret" not in " ".join(flags)  # by name: the value stays out of the process list


def test_the_script_passes_the_launcher_and_the_master_to_mpirun(tmp_path, hostfile):
    """scripts/train_grounding.sh with LAUNCHER=openmpi: the stand-in DeepSpeed launcher gets --launcher openmpi,
    the master (the hostfile's first host) is exported for the processes mpirun starts; without mpirun, one line."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "deepspeed").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/argv\necho "$MASTER_ADDR:$MASTER_PORT" '
                                    f'> {tmp_path}/master\n')
    (tmp_path / "env.sh").write_text(f"MMPG_ROOT={ROOT}\nexport PATH={Path(sys.executable).parent}:$PATH\n")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "NUM_GPUS", "LAUNCHER")}
    env.update(MMPG_ENV_SH=str(tmp_path / "env.sh"), MMPG_DEEPSPEED=str(bin_ / "deepspeed"), HOSTFILE=hostfile,
               LAUNCHER="openmpi", PATH=f"{bin_}:/usr/bin:/bin")

    def launch():
        return subprocess.run(["bash", "scripts/train_grounding.sh", "configs/cpu_demo.yaml", "data.batch_size=16"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)

    res = launch()
    assert res.returncode == 2 and not (tmp_path / "argv").exists()
    assert res.stderr.strip().startswith("train_grounding.sh: LAUNCHER=openmpi needs mpirun and ompi_info on this")
    for program in ("mpirun", "ompi_info"):
        (bin_ / program).write_text("#!/bin/sh\n")
        (bin_ / program).chmod(0o755)
    (bin_ / "deepspeed").chmod(0o755)
    res = launch()
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "argv").read_text().split() == [
        "--hostfile", hostfile, "--launcher", "openmpi", "--no_ssh_check", "--master_addr", "node1",
        "--launcher_args", "-x", "MASTER_ADDR", "-x", "MASTER_PORT", "--master_port", "29500", "--module", "mmpg.cli",
        "train", "--config", "configs/cpu_demo.yaml", "data.batch_size=16"]
    assert (tmp_path / "master").read_text().strip() == "node1:29500"


@pytest.mark.parametrize("launched, expected", [
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_RANK": "3"},
     ("Open MPI (mpirun)", "3", "16", "3")),
    ({"MV2_COMM_WORLD_RANK": "9", "MV2_COMM_WORLD_SIZE": "16", "MV2_COMM_WORLD_LOCAL_RANK": "1"},
     ("MVAPICH (mpirun)", "9", "16", "1")),
    ({"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1"}, ("Slurm (srun)", "5", "8", "1")),
])
def test_mpi_and_srun_processes_join_one_world(launched, expected):
    """Before, such a process found no WORLD_SIZE and trained alone, a world of one, as each of the others did."""
    env = {"MASTER_ADDR": "node1", "MASTER_PORT": "29500", **launched}
    assert dist.adopt_launcher_ranks(env) == expected[0]
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == expected[1:]


def test_what_is_not_adopted():
    launched = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "OMPI_COMM_WORLD_RANK": "1",
                "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    assert dist.adopt_launcher_ranks(dict(launched)) is None  # a launcher's RANK wins (DeepSpeed's, torchrun's)
    # a batch script's own variables (no job step) and a step of one task are no world
    assert dist.adopt_launcher_ranks({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0"}) is None
    assert dist.adopt_launcher_ranks({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_LOCALID": "0"}) is None
    with pytest.raises(UserError, match="started by Open MPI .mpirun. as rank 1 of 2 without MASTER_ADDR or "):
        dist.adopt_launcher_ranks({k: v for k, v in launched.items() if k.startswith("OMPI")})


def test_deepspeeds_cpu_all_reduce_file_is_released_only_where_deepspeed_makes_one(monkeypatch, tmp_path):
    """DeepSpeed names its file <SHM_BUFFER>_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank> and maps it only when every rank
    is local (LOCAL_SIZE == world size); one process is a world of one. tests/test_launch_real.py checks that a
    2-process run through the DeepSpeed launcher leaves none."""
    monkeypatch.setattr(dist, "SHM_DIR", str(tmp_path))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29731")
    mine = tmp_path / f"{dist.SHM_BUFFER}_{os.getuid()}_127.0.0.1_29731_0"
    other = tmp_path / f"{dist.SHM_BUFFER}_{os.getuid()}_127.0.0.1_29732_0"  # another run's
    mine.write_bytes(b"x")
    other.write_bytes(b"x")
    monkeypatch.delenv("LOCAL_SIZE", raising=False)  # torchrun: DeepSpeed maps no file
    assert not dist.release_shared_memory() and mine.exists()
    monkeypatch.setenv("LOCAL_SIZE", "2")  # ranks on other machines: none either
    assert not dist.release_shared_memory() and mine.exists()
    monkeypatch.setenv("LOCAL_SIZE", "1")
    assert dist.release_shared_memory() and not mine.exists() and other.exists()
    assert not dist.release_shared_memory()  # released once
