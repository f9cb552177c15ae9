"""How DeepSpeed's launcher reaches the nodes of a hostfile, chosen and checked by scripts/train_grounding.sh:

    python -m mmpg.train.launcher train|sft      (HOSTFILE, LAUNCHER, NODE_RANK, ... from the environment)

prints the `deepspeed` flags, one per line, that come before the job's entry point; a launch that cannot work is
one line on stderr and exit 2, before anything starts. Three ways:

    this machine alone   a hostfile naming only localhost / 127.0.0.1 / this hostname: no ssh, no master lookup
    NODE_RANK=R|auto     one launch per node, started by the user or a scheduler on each node (no ssh between
                         nodes; scripts/slurm/train_grounding.sbatch runs it under srun): DeepSpeed's --no_ssh, this
                         node's line R of the hostfile (auto: the line naming SLURMD_NODENAME, else this hostname),
                         the master at MASTER_ADDR (default the first host)
    LAUNCHER=NAME        one launch that starts every node: DeepSpeed 0.19's --launcher backends (`LAUNCHERS`),
                         pdsh by default as in DeepSpeed; the programs each runs here must be on PATH

Why here: DeepSpeed finds a missing pdsh or mpirun only after its ssh checks, and its MPI and Slurm backends set no
RANK / WORLD_SIZE and no master address: the script exports MASTER_ADDR / MASTER_PORT, the backends pass them on,
and `mmpg.dist.adopt_launcher_ranks` reads the ranks from the launcher's own variables. The flags are tested against
stand-ins (tests/test_slurm.py), not on a cluster.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys
from pathlib import Path

from mmpg.errors import UserError

# DeepSpeed 0.19's --launcher values: the programs its backend runs or checks on this node, and where they come from
LAUNCHERS = {
    "pdsh": (("pdsh",), "apt-get install pdsh or dnf install pdsh; every node needs passwordless ssh"),
    "openmpi": (("mpirun", "ompi_info"), "apt-get install openmpi-bin or dnf install openmpi"),
    "mvapich": (("mpirun", "mpiname"), "MVAPICH2-GDR, mvapich.cse.ohio-state.edu"),
    "mpich": (("mpirun",), "apt-get install mpich"),
    "impi": (("mpirun",), "Intel MPI, from the oneAPI HPC toolkit"),
    "slurm": (("srun", "sinfo"), "the Slurm client; run inside an allocation (salloc)"),
}
MPI = ("openmpi", "mvapich", "mpich", "impi")  # hostfile slots only: DeepSpeed refuses --num_gpus / --include
TOKEN = "MMPG_VLLM_TOKEN"  # the vLLM server's shared token (mmpg.serve.wire), which every trainer rank sends
LOCAL = ("localhost", "127.0.0.1")


def hostfile_hosts(path: str) -> list[str]:
    """The hosts of a DeepSpeed hostfile, in order (`host slots=N` lines, # comments)."""
    hosts = []
    for line in Path(path).read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if words and words[0] not in hosts:
            hosts.append(words[0])
    if not hosts:
        raise UserError(f"HOSTFILE={path} names no host; write one `host slots=N` line per node")
    return hosts


def node_rank(value: str, hosts: list[str], env) -> str:
    """NODE_RANK as a line of the hostfile: a number below len(hosts), or auto (module docstring)."""
    if value == "auto":
        names = [env.get("SLURMD_NODENAME", ""), socket.gethostname(), socket.gethostname().split(".")[0]]
        found = next((hosts.index(n) for n in names if n and n in hosts), None)
        if found is None:
            me = " / ".join(dict.fromkeys(n for n in names if n))
            raise UserError(f"NODE_RANK=auto: this node ({me}) is not among HOSTFILE's hosts ({', '.join(hosts)}); "
                            f"give its line as NODE_RANK=0..{len(hosts) - 1}")
        return str(found)
    if not value.isdigit() or int(value) >= len(hosts):
        raise UserError(f"NODE_RANK={value}: expected this node's line of HOSTFILE, 0..{len(hosts) - 1} (or auto)")
    return value


def missing_programs(name: str, which=shutil.which) -> list[str]:
    return [p for p in LAUNCHERS[name][0] if which(p) is None]


def deepspeed_flags(env, which=shutil.which, home: Path | None = None) -> tuple[list[str], str | None]:
    """(the deepspeed flags for env's HOSTFILE, a note for a dry run or None). Raises UserError (one line)."""
    path = env["HOSTFILE"]
    hosts = hostfile_hosts(path)
    launcher, rank = env.get("LAUNCHER", "").strip(), env.get("NODE_RANK", "").strip()
    flags = ["--hostfile", path]
    if rank:
        if launcher:
            raise UserError(f"NODE_RANK={rank} starts this node's processes alone (one launch per node, as "
                            f"scripts/slurm/train_grounding.sbatch does); LAUNCHER={launcher} starts every node from "
                            "one: set one of them")
        master = env.get("MASTER_ADDR") or hosts[0]
        return flags + ["--no_ssh", "--node_rank", node_rank(rank, hosts, env), "--master_addr", master], None
    if len(hosts) == 1 and hosts[0] in (*LOCAL, socket.gethostname()):
        # DeepSpeed checks every hostfile with `ssh HOST hostname` and asks it for the master address; this machine
        # alone needs neither, and without an ssh server both fail
        return flags + ["--no_ssh_check", "--master_addr", "127.0.0.1"], None
    name = launcher or "pdsh"
    if name not in LAUNCHERS:
        raise UserError(f"LAUNCHER={launcher}: DeepSpeed's launchers are {', '.join(LAUNCHERS)} (or NODE_RANK: one "
                        "launch per node)")
    for knob in ("TRAIN_GPUS", "VLLM_GPUS") + (("NUM_GPUS",) if name in MPI else ()):
        if env.get(knob, "").strip():
            raise UserError(f"{knob} with a HOSTFILE of {len(hosts)} nodes and LAUNCHER={name}: give each node's "
                            "processes as its `slots=N` in HOSTFILE instead")
    note = None
    missing = missing_programs(name, which)
    if missing:
        others = [n for n in LAUNCHERS if n != name and not missing_programs(n, which)]
        line = (f"LAUNCHER={name}{'' if launcher else ' (the default)'} needs {' and '.join(missing)} on this node's "
                f"PATH, not found: install it ({LAUNCHERS[name][1]}), or "
                + (f"pick LAUNCHER={' or '.join(others)} (found here)" if others else "pick another LAUNCHER")
                + "; on Slurm, sbatch scripts/slurm/train_grounding.sbatch needs none (docs/training.md#several-nodes)")
        if env.get("DRY_RUN") != "1":
            raise UserError(line)
        note = f"the launch would stop here: {line}"
    flags += ["--launcher", name]
    extra = env.get("LAUNCHER_ARGS", "").split()
    if name == "pdsh":
        if env.get("MASTER_ADDR"):
            flags += ["--master_addr", env["MASTER_ADDR"]]
        check_token_reaches_nodes(env, home)
    else:  # mpirun / srun start the processes: no ssh check, the master given (DeepSpeed would ask it over ssh)
        flags += ["--no_ssh_check", "--master_addr", env.get("MASTER_ADDR") or hosts[0]]
        if name == "openmpi":  # mpirun passes on only what -x names (by name: the value stays out of ps)
            extra = ["-x", "MASTER_ADDR", "-x", "MASTER_PORT", *(["-x", TOKEN] if env.get(TOKEN) else []), *extra]
    if extra:
        flags += ["--launcher_args", " ".join(extra)]
    return flags, note


def check_token_reaches_nodes(env, home: Path | None = None) -> None:
    """pdsh passes on to the other nodes only DeepSpeed's variables (NCCL_*, PYTHON*, UCX_*, ...) and those written
    in .deepspeed_env (DeepSpeed reads ~/ and ./): a trainer rank elsewhere without the server's token gets 401."""
    if env.get("VLLM") != "1" or not env.get("VLLM_URL") or not env.get(TOKEN):
        return
    name = env.get("DS_ENV_FILE", ".deepspeed_env")
    files = [(home or Path.home()) / name, Path.cwd() / name]
    if any(re.search(rf"^{TOKEN}=", f.read_text(), re.M) for f in files if f.is_file()):
        return
    raise UserError(f"LAUNCHER=pdsh passes {TOKEN} to no other node: add the line {TOKEN}=<the token> to "
                    f"~/{name} (DeepSpeed's list of variables for every node; keep it readable by you alone), or "
                    "use LAUNCHER=openmpi or slurm, which pass it on")


def main(argv: list[str] | None = None, env=None) -> int:
    env = os.environ if env is None else env
    argv = list(sys.argv[1:] if argv is None else argv)
    script = "sft_grounding.sh" if argv[:1] == ["sft"] else "train_grounding.sh"
    try:
        flags, note = deepspeed_flags(env)
    except (UserError, OSError) as err:
        print(f"{script}: {err}", file=sys.stderr)
        return 2
    if note:
        print(f"[mmpg] {note}", file=sys.stderr)
    print("\n".join(flags))
    return 0


if __name__ == "__main__":
    sys.exit(main())
