"""The bench's levels, one table (`LEVELS`): per level what runs it, how a plan expands its configs, what --dry-run
prints and which tables follow the main one. `mmpg bench` dispatches through it alone. Torch-free: code that needs
torch is named by its module, imported only where it runs.

A measured level (attention, model, rollout, step, eval) is run by `mmpg.bench.runner`, one fresh process per case;
its module's `setup(case, device) -> (prepare, step, info)`: `prepare` (or None) runs in the memory window before the
cold step, `step()` is one step (`phased = True`: it times its own phases, see `mmpg.bench.measure`), `info` holds
"P" (the prompt built) and "tokens" (the tokens the step's forward sees). Its --dry-run prints the plan with ceilings.
A level that runs alone (lora, async, vllm, data) is a program with its own table: its module's `run(args) -> exit code`; its
--dry-run prints the row's `alone` sentence.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

ROLLOUT_VARIANTS = ["hf_generate", "mmpg:copy", "mmpg:cascade"]  # vllm is opt-in: a server start costs minutes
DEFAULT_TAIL = 32  # tokens of a query's own tail after a video's shared part (question + assistant header)


class Table(NamedTuple):
    function: str  # "module:function", (rows) -> its text, "" when no row is its
    dry_run: bool = False  # printed under a --dry-run plan too (ceilings only); else after a measurement alone


class Level(NamedTuple):
    module: str  # measured: holds setup(case, device); run alone: holds run(args)
    variants: tuple[str, ...] = ()  # what setup takes: a label's name before ":" (`mmpg:flex` -> mmpg)
    baseline: str = ""  # the variant every speed-up and memory ratio of the config is against
    ceiling: str = ""  # the row key (`mmpg.bench.runner.ceilings`) the speed-up's %ceil is taken of
    tables: tuple[Table, ...] = ()  # printed after the main table, in this order
    expand: Callable[[dict, object], list[dict]] | None = None  # one config at its P, S, G -> the configs run
    borrows: str = ""  # a preset without configs of this level gives it those of that level (`expand` converts)
    spreads: bool = False  # --sp spreads its configs over ranks (`mmpg.bench.sp`)
    alone: str = ""  # runs alone: what one run measures, formatted with the CLI's arguments


def _rollout(config: dict, args) -> list[dict]:
    """A model config borrowed as a rollout one; the vllm variant appended when asked (--vllm, --vllm-url or vllm in
    --variants), with the --vllm-url / --vllm-checkpoint it uses (keys vllm_url, vllm_checkpoint; only when given)."""
    if config["level"] != "rollout":
        config = dict(config, level="rollout", variants=list(ROLLOUT_VARIANTS), grad_ckpt=False)
    given = {k: getattr(args, f"vllm_{k}", None) for k in ("url", "checkpoint")}
    if (getattr(args, "vllm", False) or given["url"] or "vllm" in (args.variants or [])) \
            and "vllm" not in config["variants"]:
        config = dict(config, variants=[*config["variants"], "vllm"])
    if "vllm" in config["variants"]:
        config = dict(config, **{f"vllm_{k}": v for k, v in given.items() if v})
    return [config]


def _step(config: dict, args) -> list[dict]:
    """Per --queries-per-video Q: Q > 1 queries of one video, each with its own tail, per query (mmpg) and as the
    tree; each followed, under --sp N > 1, by itself spread over N ranks without naive (the repeated forward does not
    spread)."""
    sp, out = getattr(args, "sp", 1) or 1, []
    for Q in getattr(args, "Q", None) or [1]:
        c = config if Q == 1 else dict(config, Q=Q, t=getattr(args, "tail", None) or DEFAULT_TAIL,
                                       variants=[*config["variants"], "tree"])
        out.append(c)
        if sp > 1:
            out.append(dict(c, sp=sp, variants=[v for v in c["variants"] if v.split(":")[0] != "naive"]))
    return out


def _eval(config: dict, args) -> list[dict]:
    """Q queries (--queries-per-video) of B videos (--videos-per-batch) answered once each; a lone query has no
    tree."""
    return [dict(config, Q=Q, B=B, t=getattr(args, "tail", None) or config["t"],
                 variants=[v for v in config["variants"] if v != "tree" or Q > 1])
            for Q in getattr(args, "Q", None) or [config.get("Q", 1)]
            for B in getattr(args, "B", None) or [config.get("B", 1)]]


LEVELS = {  # in the order the plan runs and the tables print them
    "attention": Level("mmpg.bench.attention", ("naive", "upstream", "mmpg"), "naive", "rho_flops"),
    "model": Level("mmpg.bench.model", ("repeated", "upstream", "mmpg"), "repeated", "rho_flops"),
    "rollout": Level("mmpg.bench.rollout", ("hf_generate", "mmpg", "vllm"), "hf_generate", "rho_lin",
                     tables=(Table("mmpg.bench.tables:rollout_table"),), expand=_rollout, borrows="model"),
    "step": Level("mmpg.bench.step", ("naive", "mmpg", "tree"), "naive", "rho_step",
                  tables=(Table("mmpg.bench.tables:tree_table", dry_run=True), Table("mmpg.bench.sp:sp_table")),
                  expand=_step, spreads=True),
    "eval": Level("mmpg.bench.evaluation", ("hf_generate", "mmpg", "tree"), "mmpg", "rho_eval",
                  tables=(Table("mmpg.bench.tables:eval_table"),), expand=_eval),
    "lora": Level("mmpg.bench.lora", alone="full vs LoRA (r {lora_r}) training and a reference copy vs adapters off, "
                  "one GRPO step each in a fresh process, memory per phase"),
    "async": Level("mmpg.bench.overlap", alone="{async_rounds} rounds per arm of {async_steps} GRPO steps on the "
                   "vLLM engine, synchronous (k=0) against overlapped (k=1), {async_iterations} update(s) per step"),
    "data": Level("mmpg.bench.data", alone="decoding of a generated {data_minutes:g}-minute 1280x720 30 fps video "
                  "(or --data-video) on one core: throughput at the 7B, long and Time-R1 settings, per-rank decode "
                  "time at sp 1 vs 2, the frame cache cold vs warm"),
    "vllm": Level("mmpg.bench.serving", alone="two ranks' rollout requests to one vLLM server per size "
                  "{vllm_sizes} (prompts per rank x G x tokens): one request carrying both (the ceiling), both at "
                  "once, one after the other; with --vllm-servers 2, both at once on two servers (a core each)"),
}
MEASURED = [name for name, level in LEVELS.items() if not level.alone]
ALONE = [name for name, level in LEVELS.items() if level.alone]


def module_for(case: dict) -> str:
    """The module whose `setup` measures the case; ValueError naming the choices for an unknown level or variant."""
    level = LEVELS.get(case["level"])
    if level is None or level.alone:
        raise ValueError(f"unknown bench level {case['level']!r}; choose one of {', '.join(MEASURED)}")
    if case["variant"] not in level.variants:
        raise ValueError(f"unknown {case['level']} variant {case['variant']!r}; choose one of "
                         f"{', '.join(level.variants)}")
    return level.module


def ceiling_key(row: dict, key: str) -> str:
    """The row's own ceiling: a tree row (Q queries of one video) has the tree's ceilings, under key + "_tree"."""
    return f"{key}_tree" if row["variant"].partition(":")[0] == "tree" and f"{key}_tree" in row else key
