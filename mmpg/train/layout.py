"""The GPU layout of a launch, checked by scripts/train_grounding.sh (and sft_grounding.sh) before it starts anything:

    python -m mmpg.train.layout train|sft --config CONFIG [key=value ...]      (the launch knobs from the environment)

prints on stdout the GPUs the trainer gets (`deepspeed --include localhost:...`; empty when the launch names none) and
on stderr one line saying the layout; a layout that cannot run is one line, exit 2, naming the nearest that can. The
trainer refuses the same layouts, but only once every rank has started (and with VLLM=1 the server has loaded the
model): a refusal that costs minutes and leaves a server to stop belongs before both.

What must divide, with W training ranks and sp = parallel.sequence_parallel_size: sp | W and sp | the model's
attention heads (read from config.json when the model is on disk, else left to the trainer); data.batch_size %
(W / sp) == 0 (each data-parallel group takes whole prompts); GRPO: trainer.micro_batch_size % rollout.n == 0.
W comes from TRAIN_GPUS (a list), NUM_GPUS (per node, times the hostfile's nodes), HOSTFILE (its slots), or the GPUs
this machine shows (CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`); without GPUs and NUM_GPUS only the checks that need
no W run. VLLM_GPUS (VLLM=1): the servers' GPUs, none of the trainer's (NCCL cannot put two ranks on one GPU), a
multiple of VLLM_TP (each server's tensor-parallel size); without TRAIN_GPUS the trainer takes those it leaves. A
config that does not load is left to the trainer, which says why in its own words.

With VLLM=1 (no VLLM_URL) a second stdout line says the vLLM servers the script starts, one word each: the GPUs it
gets as CUDA_VISIBLE_DEVICES, or `-` (none set: the old single server, or processes on a machine without GPUs). Data
rank r samples from server r mod N, so every server must have a rank: N <= W / sp (`plan_servers`).
`python -m mmpg.train.layout serve` (VLLM=serve: servers only) prints that line alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from mmpg.errors import UserError


@dataclasses.dataclass
class Ranks:
    """The training ranks a launch starts: `count` (None: the launcher decides), how the knobs gave it (`how`), and
    the GPU indices to pass to `deepspeed --include` (None: no list)."""

    count: int | None
    how: str
    gpus: list[str] | None = None


def gpu_list(text: str, knob: str) -> list[str]:
    """`0,1,2` -> ["0", "1", "2"]; anything but distinct non-negative integers is one UserError line."""
    items = [t.strip() for t in text.split(",")]
    if not all(t.isdigit() for t in items):
        raise UserError(f"{knob}={text}: expected GPU indices separated by commas, e.g. {knob}=0,1,2,3")
    if len(set(items)) != len(items):
        raise UserError(f"{knob}={text}: a GPU is named twice")
    return items


def visible_gpus(env) -> list[str] | None:
    """The GPU indices this machine shows: CUDA_VISIBLE_DEVICES when set, else `nvidia-smi -L`'s `GPU N:` lines;
    None without an NVIDIA driver (a CPU machine)."""
    if env.get("CUDA_VISIBLE_DEVICES", "").strip():
        return [t.strip() for t in env["CUDA_VISIBLE_DEVICES"].split(",") if t.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = [m.group(1) for m in re.finditer(r"^GPU (\d+):", out, re.M)]
    return found or None


def hostfile_slots(path: str, per_node: int | None) -> tuple[int, int]:
    """(nodes, ranks) of a DeepSpeed hostfile (`host slots=N` lines, # comments); NUM_GPUS caps each node's slots,
    as DeepSpeed's --num_gpus does."""
    nodes, ranks = 0, 0
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.search(r"\bslots=(\d+)", line)
        if m is None:
            raise UserError(f"HOSTFILE={path}, line {n}: {line!r} has no slots=N (DeepSpeed's `host slots=8` form)")
        nodes, ranks = nodes + 1, ranks + min(int(m.group(1)), per_node or int(m.group(1)))
    return nodes, ranks


def training_ranks(env, gpus: list[str] | None) -> Ranks:
    """The trainer's ranks from the knobs (module docstring), VLLM_GPUS checked against them."""
    num = env.get("NUM_GPUS", "").strip()
    if num and not num.isdigit() or num == "0":
        raise UserError(f"NUM_GPUS={num}: expected a number of processes per node, e.g. NUM_GPUS=8")
    train = gpu_list(env["TRAIN_GPUS"], "TRAIN_GPUS") if env.get("TRAIN_GPUS", "").strip() else None
    if train and num:
        raise UserError("set NUM_GPUS or TRAIN_GPUS, not both (TRAIN_GPUS names the trainer's GPUs, NUM_GPUS counts "
                        "the first ones)")
    server = vllm_gpus(env, gpus)
    named = ",".join(server or [])
    if server and train is None:
        if num:
            taken = [str(i) for i in range(int(num))]
            if set(taken) & set(server):
                raise UserError(f"NUM_GPUS={num} takes GPUs {','.join(taken)}, VLLM_GPUS={named} among them: "
                                f"name the trainer's GPUs with TRAIN_GPUS instead")
        elif gpus is None:
            raise UserError(f"VLLM_GPUS={named}: no GPU list here to give the trainer the others; name them with "
                            "TRAIN_GPUS (e.g. TRAIN_GPUS=0,1,2,3)")
        else:
            train = [g for g in gpus if g not in server]
            if not train:
                raise UserError(f"VLLM_GPUS={named} leaves the trainer no GPU; unset it to share the GPUs "
                                "(VLLM_MEM)")
    both = sorted(set(server or []) & set(train or []), key=int)
    if both:
        raise UserError(f"VLLM_GPUS and TRAIN_GPUS share GPU {','.join(both)}: give the server a GPU of its own, or "
                        "unset VLLM_GPUS to share the trainer's (the server then takes VLLM_MEM of each)")
    if train is not None:
        told = "of TRAIN_GPUS" if env.get("TRAIN_GPUS", "").strip() else f"left by VLLM_GPUS={named}"
        return Ranks(len(train), f"GPUs {','.join(train)} {told}", train)
    if env.get("HOSTFILE"):
        nodes, ranks = hostfile_slots(env["HOSTFILE"], int(num) if num else None)
        return Ranks(ranks, f"{nodes} node(s) of HOSTFILE{f' x at most NUM_GPUS={num}' if num else ''}")
    if num:
        return Ranks(int(num), f"NUM_GPUS={num}")
    if gpus is not None:
        return Ranks(len(gpus), "every GPU this machine shows")
    return Ranks(None, "the launcher's default (no GPU here, no NUM_GPUS)")


def vllm_gpus(env, gpus: list[str] | None) -> list[str] | None:
    """VLLM_GPUS, refused without VLLM=1 (or serve), with a count VLLM_TP does not divide, or naming a GPU this
    machine does not show."""
    text = env.get("VLLM_GPUS", "").strip()
    if not text:
        return None
    server = gpu_list(text, "VLLM_GPUS")
    if env.get("VLLM", "0") not in ("1", "serve"):
        raise UserError(f"VLLM_GPUS={text} is the vLLM server's GPU and there is no server without VLLM=1")
    tp = vllm_tp(env)
    if len(server) % tp:
        fits = _or(nearest_multiples(len(server), tp))
        raise UserError(f"VLLM_GPUS={text} names {len(server)} GPU(s), not a multiple of VLLM_TP={tp} (each server's "
                        f"tensor-parallel GPUs): give the servers {fits} GPUs, or VLLM_TP="
                        f"{_or(nearest_divisors(len(server), tp))}")
    unknown = [g for g in server if gpus is not None and g not in gpus]
    if unknown and not env.get("CUDA_VISIBLE_DEVICES", "").strip():
        raise UserError(f"VLLM_GPUS={text}: this machine shows GPUs {','.join(gpus)} only")
    return server


def vllm_tp(env) -> int:
    """The GPUs each vLLM server's engine spans (its --tensor-parallel-size): VLLM_TP, else VLLM_ARGS'
    --tensor-parallel-size N (the older way to ask for it), else 1."""
    text = env.get("VLLM_TP", "").strip()
    if text and (not text.isdigit() or int(text) < 1):
        raise UserError(f"VLLM_TP={text}: expected the GPUs of each vLLM server (its tensor-parallel size), e.g. "
                        "VLLM_TP=2")
    args = env.get("VLLM_ARGS", "")
    if re.search(r"--data-parallel-size", args):
        raise UserError("VLLM_ARGS: --data-parallel-size is not a flag of mmpg vllm-serve; list more GPUs in "
                        "VLLM_GPUS instead (one server per VLLM_TP of them, the trainer's ranks spread over them)")
    given = re.findall(r"--tensor-parallel-size[= ](\d+)", args)
    if text and given and given[-1] != text:
        raise UserError(f"VLLM_TP={text} and VLLM_ARGS' --tensor-parallel-size {given[-1]} disagree: set VLLM_TP "
                        "alone")
    return int(text or (given[-1] if given else 1))


def plan_servers(env, gpus: list[str] | None, ranks: Ranks, sp: int = 1) -> list[str]:
    """The vLLM servers the launch starts (VLLM=1 without VLLM_URL), each as its CUDA_VISIBLE_DEVICES ("": none set).
    VLLM_GPUS: one server per VLLM_TP of them. Colocated (no VLLM_GPUS): one per data-parallel rank (VLLM_SERVERS
    overrides the count), each on the first VLLM_TP GPUs of its share of the trainer's; one server alone, or a
    machine without GPUs, sets none (the single server of before sees every GPU)."""
    tp = vllm_tp(env)
    text = env.get("VLLM_SERVERS", "").strip()
    if text and (not text.isdigit() or int(text) < 1):
        raise UserError(f"VLLM_SERVERS={text}: expected the number of colocated vLLM servers, e.g. VLLM_SERVERS=1")
    server = vllm_gpus(env, gpus)
    if server and text:
        raise UserError(f"VLLM_SERVERS={text} counts colocated servers; with VLLM_GPUS the pool is one server per "
                        f"VLLM_TP={tp} of them: unset VLLM_SERVERS")
    data = ranks.count // sp if ranks.count and not env.get("HOSTFILE") else None
    if server:
        groups = [",".join(server[i:i + tp]) for i in range(0, len(server), tp)]
    else:
        mine = ranks.gpus or (gpus[:ranks.count] if gpus is not None and data else None)
        count = int(text) if text else min(data or 1, len(mine) // tp if mine else data or 1) or 1
        if mine and count * tp > len(mine):
            raise UserError(f"{count} colocated vLLM server(s) of VLLM_TP={tp} GPU(s) need {count * tp} GPUs; the "
                            f"trainer has {len(mine)}: lower VLLM_SERVERS or VLLM_TP")
        stride = len(mine) // count if mine else 0
        pin = mine and (count > 1 or env.get("TRAIN_GPUS", "").strip())
        groups = [",".join(mine[i * stride:i * stride + tp]) if pin else "" for i in range(count)]
    if data is not None and len(groups) > data:
        knob, fix = (f"VLLM_GPUS={','.join(server)}", f"give VLLM_GPUS at most {data * tp} GPUs (VLLM_TP={tp} "
                     "each)") if server else (f"VLLM_SERVERS={text}", f"use VLLM_SERVERS={data} or fewer")
        raise UserError(f"{knob} starts {len(groups)} vLLM servers for {data} data-parallel rank(s) ({ranks.how}"
                        f"{f', SP {sp}' if sp > 1 else ''}): rank r samples from server r mod {len(groups)}, so "
                        f"{len(groups) - data} would sit idle; {fix}, or launch more training ranks")
    return groups


def describe_servers(groups: list[str], env) -> str:
    """The layout line's part about the servers ("" for the colocated single server, as before)."""
    if env.get("VLLM_GPUS", "").strip():
        return f"the vLLM server on GPU {groups[0]}" if len(groups) == 1 else \
            f"{len(groups)} vLLM servers on GPUs {' | '.join(groups)}"
    if len(groups) == 1:
        return f"the vLLM server on GPU {groups[0]}, colocated" if groups[0] else ""
    where = f"on GPUs {' | '.join(groups)}" if groups[0] else "one per training process"
    return f"{len(groups)} vLLM servers {where}, colocated"


def nearest_multiples(value: int, step: int) -> list[int]:
    """The multiples of `step` just below and just above `value` (the one below only when it is > 0)."""
    below = value // step * step
    return [m for m in (below, below + step) if m > 0]


def nearest_divisors(value: int, around: int, also=lambda d: True) -> list[int]:
    """The divisors d of `value` that pass `also`, the nearest below and above `around`."""
    found = [d for d in range(1, value + 1) if value % d == 0 and also(d)]
    below = [d for d in found if d < around]
    above = [d for d in found if d > around]
    return below[-1:] + above[:1]


def _or(values) -> str:
    values = [str(v) for v in values]
    return " or ".join(values) if len(values) <= 2 else f"{', '.join(values[:-1])} or {values[-1]}"


def attention_heads(path: str) -> int | None:
    """The language model's query heads from config.json, when the model is on disk: a folder, or a hub id whose
    snapshot of `main` is cached. None otherwise (nothing is downloaded for a check)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        from mmpg.models.hub import hub_cache, is_hub_id

        if not is_hub_id(path) or "/" not in path:
            return None
        repo = Path(hub_cache()) / f"models--{path.replace('/', '--')}"
        try:
            folder = repo / "snapshots" / (repo / "refs" / "main").read_text().strip()
        except OSError:
            return None
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    heads = config.get("text_config", config).get("num_attention_heads")
    return int(heads) if heads else None


def check_layout(cfg, job: str, ranks: Ranks) -> str:
    """Refuse (UserError, one line) what cannot divide; else the one-line description of the layout."""
    sp, batch, w = cfg.parallel.sequence_parallel_size, cfg.data.batch_size, ranks.count
    if job == "train" and cfg.trainer.micro_batch_size % cfg.rollout.n:
        raise UserError(f"trainer.micro_batch_size={cfg.trainer.micro_batch_size} would split a group of rollout.n="
                        f"{cfg.rollout.n} (a group stays whole in one micro-batch): use trainer.micro_batch_size="
                        f"{_or(nearest_multiples(cfg.trainer.micro_batch_size, cfg.rollout.n))}")
    heads = attention_heads(cfg.model.path) if sp > 1 else None
    if heads and heads % sp:
        fits = nearest_divisors(heads, sp, lambda d: d > 1 and (w is None or w % d == 0))
        raise UserError(f"parallel.sequence_parallel_size={sp} (SP) cannot split the model's {heads} attention "
                        f"heads{f': use {_or(fits)}' if fits else ''}")
    if w is None:
        return f"training ranks: {ranks.how}; data.batch_size={batch}"
    if w % sp:
        fits = nearest_divisors(w, sp, lambda d: d > 1 and (heads is None or heads % d == 0))
        raise UserError(f"parallel.sequence_parallel_size={sp} (SP) does not divide the {w} training ranks "
                        f"({ranks.how}){f': use {_or(fits)}' if fits else ''}")
    groups = w // sp
    if batch % groups:
        over = f"{w} training ranks ({ranks.how})" if sp == 1 else \
            f"{groups} data-parallel groups of SP {sp} ({w} training ranks: {ranks.how})"
        counts = [d * sp for d in nearest_divisors(batch, groups)]
        raise UserError(f"data.batch_size={batch} prompts do not split evenly over the {over}: use "
                        f"data.batch_size={_or(nearest_multiples(batch, groups))}, or launch {_or(counts)} training "
                        "ranks")
    per = f"{batch // groups} prompt(s) per {'rank' if sp == 1 else 'group of ' + str(sp)}"
    return f"{w} training rank(s) ({ranks.how}); data.batch_size={batch} = {per}"


def split_args(argv: list[str]) -> tuple[str, str | None, list[str]]:
    """(job, --config, key=value overrides) of `JOB` + what the launch script hands `mmpg JOB` (--resume and its
    value, and any other flag, are not the layout's)."""
    if not argv or argv[0] not in ("train", "sft", "serve"):
        raise SystemExit("usage: python -m mmpg.train.layout train|sft|serve --config CONFIG [key=value ...]")
    config, overrides, i = None, [], 1
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if flag in ("--config", "--resume"):
            if not eq:
                i, value = i + 1, argv[i + 1] if i + 1 < len(argv) else ""
            config = value if flag == "--config" else config
        elif not argv[i].startswith("-") and eq:
            overrides.append(argv[i])
        i += 1
    return argv[0], config, overrides


def launch_layout(job: str, config: str | None, overrides: list[str], env) -> tuple[str, list[str] | None]:
    """(the trainer's GPU list for --include, the servers of `plan_servers` or None), the layout line on stderr."""
    gpus = visible_gpus(env)
    if job == "serve":  # a node of servers only: VLLM_GPUS grouped by VLLM_TP, else the one server on every GPU
        server = vllm_gpus(env, gpus)
        tp = vllm_tp(env)
        return "", [",".join(server[i:i + tp]) for i in range(0, len(server), tp)] if server else [""]
    ranks = training_ranks(env, gpus)
    from mmpg.config import load_config

    try:
        cfg = load_config(config, overrides)
    except UserError:
        cfg = None  # the trainer says what is wrong with the config, in its own words
    line = check_layout(cfg, job, ranks) if cfg is not None else None
    servers = None
    if env.get("VLLM", "0") == "1" and not env.get("VLLM_URL", "").strip():
        servers = plan_servers(env, gpus, ranks, cfg.parallel.sequence_parallel_size if cfg is not None else 1)
    if line is not None:
        told = describe_servers(servers, env) if servers else ""
        print(f"[mmpg] layout: {line}{'; ' + told if told else ''}", file=sys.stderr)
    return ",".join(ranks.gpus) if ranks.gpus else "", servers


def main(argv: list[str] | None = None, env=None) -> int:
    env = os.environ if env is None else env
    job, config, overrides = split_args(list(sys.argv[1:] if argv is None else argv))
    script = "sft_grounding.sh" if job == "sft" else "train_grounding.sh"
    try:
        train, servers = launch_layout(job, config, overrides, env)
    except UserError as err:
        print(f"{script}: {err}", file=sys.stderr)
        return 2
    print(train)
    if servers is not None:
        print(" ".join(g or "-" for g in servers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
