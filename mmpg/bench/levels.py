"""The bench's levels, one table: each level's module, the variants its `setup` takes, the baseline the others are
compared with and the ceiling of its %ceil column. Torch-free; only the worker imports a level's module (by name,
`module_for`), and no level module imports the worker or the runner.

A level module's `setup(case, device) -> (prepare, step, info)`: `prepare` (or None) runs in the memory window
before the cold step, `step()` is one step (`phased = True`: it times its own phases, see `mmpg.bench.measure`),
`info` holds "P" (the prompt built) and "tokens" (the tokens the step's forward sees).
"""

from __future__ import annotations

from typing import NamedTuple


class Level(NamedTuple):
    module: str  # holds setup(case, device)
    variants: tuple[str, ...]  # what setup takes: a label's name before ":" (`mmpg:flex` -> mmpg)
    baseline: str  # the variant every speed-up and memory ratio of the config is against
    ceiling: str  # the row key (`mmpg.bench.runner.ceilings`) the speed-up's %ceil is taken of


LEVELS = {  # in the order the plan runs and the table prints them
    "attention": Level("mmpg.bench.attention", ("naive", "upstream", "mmpg"), "naive", "rho_flops"),
    "model": Level("mmpg.bench.model", ("repeated", "upstream", "mmpg"), "repeated", "rho_flops"),
    "rollout": Level("mmpg.bench.rollout", ("hf_generate", "mmpg", "vllm"), "hf_generate", "rho_lin"),
    "step": Level("mmpg.bench.step", ("naive", "mmpg", "tree"), "naive", "rho_step"),
    "eval": Level("mmpg.bench.evaluation", ("hf_generate", "mmpg", "tree"), "mmpg", "rho_eval"),
}


def module_for(case: dict) -> str:
    """The module whose `setup` measures the case; ValueError naming the choices for an unknown level or variant."""
    level = LEVELS.get(case["level"])
    if level is None:
        raise ValueError(f"unknown bench level {case['level']!r}; choose one of {', '.join(LEVELS)}")
    if case["variant"] not in level.variants:
        raise ValueError(f"unknown {case['level']} variant {case['variant']!r}; choose one of "
                         f"{', '.join(level.variants)}")
    return level.module


def ceiling_key(row: dict, key: str) -> str:
    """The row's own ceiling: a tree row (Q queries of one video) has the tree's ceilings, under key + "_tree"."""
    return f"{key}_tree" if row["variant"].partition(":")[0] == "tree" and f"{key}_tree" in row else key
