"""`mmpg bench`: measure the repeated baseline, the upstream `prefix_grouper` package and mmpg's grouped forward.

Parses the arguments, plans the configs (a preset, its levels, the overrides) and dispatches through the levels'
table alone (`mmpg.bench.levels.LEVELS`: what runs a level, how it expands, what it prints). Prints a fixed-width
table and writes JSON (default runs/bench/<timestamp>.json). A program, never a test.

    mmpg bench --preset cpu-targets                 the two judged rows (attention level and model level)
    mmpg bench --preset cpu-grid --dry-run          the grid with its ceilings and memory estimates, nothing run
    mmpg bench --preset gpu --out $OUT/bench.json   on one GPU
    mmpg bench --preset docs-cpu                    docs/performance.md's headline tables in one run
    mmpg bench --preset rollout-vllm-cpu            the vLLM engine beside the HF engine and generate
    mmpg bench --preset cpu-targets --levels step,eval --queries-per-video 3
                                                    Q queries of one video: per query vs the tree (the video once)
    mmpg bench --preset sp-cpu --sp 2               one GRPO step with its row spread over 2 gloo processes
    mmpg bench --levels lora [--lora-r 16]          memory of full vs LoRA training (its own table)
    mmpg bench --levels async [--S 32 --G 12]       GRPO steps per hour, rollout/training overlap vs synchronous
    mmpg bench --levels data [--data-minutes 2]     video decoding on one core: presets, sp 2 parts, frame cache
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import sys

from mmpg.bench.levels import ALONE, LEVELS, MEASURED
from mmpg.bench.presets import PRESET_LEVELS, PRESETS, preset_configs
from mmpg.errors import UserError


DEFAULT_PRESET = "cpu-targets"  # what scripts/bench.sh runs, and what `mmpg bench` alone describes
DEFAULT_LEVELS = ["attention", "model"]  # a preset's levels without --levels, when its configs are of several


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _str_list(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default=None, choices=PRESETS,
                        help="plan to run; without it (and without --levels) mmpg bench prints what cpu-targets would "
                             "run and measures nothing (a run takes minutes)")
    parser.add_argument("--levels", type=_str_list, default=None,
                        help=f"comma list of {','.join(MEASURED)}, or {' or '.join(ALONE)} alone (default: "
                             f"{','.join(DEFAULT_LEVELS)}); rollout reuses the preset's model configs; step times one "
                             "whole GRPO step per phase (rollout, reward, logprob, update) on the trainer's code (the "
                             "gpu preset's step is untested); eval answers Q queries of one video greedily, per query "
                             "vs the tree")
    parser.add_argument("--family", default="qwen2", help="model family for model/rollout levels (qwen2, qwen3, "
                        "qwen2_5_vl, qwen3_vl; VL families have no upstream variant); the step level takes a VL "
                        "family and uses qwen2_5_vl for a text-only one")
    parser.add_argument("--P", type=_int_list, default=None, help="override prefix lengths, e.g. 1024,4096")
    parser.add_argument("--S", type=_int_list, default=None, help="override response lengths")
    parser.add_argument("--G", type=_int_list, default=None, help="override group sizes")
    parser.add_argument("--queries-per-video", dest="Q", type=_int_list, default=None,
                        help="step level: Q queries of one video per step (e.g. 1,3); Q > 1 adds the tree variant "
                        "(the video's shared part forwarded once for all Q) beside per-query grouping (mmpg)")
    parser.add_argument("--videos-per-batch", dest="B", type=_int_list, default=None,
                        help="eval level: videos whose queries one batch answers (e.g. 1,8; default 1): the engine's "
                        "batching of several videos against one at a time, as `mmpg eval` batches eval.batch_size "
                        "prompts")
    parser.add_argument("--tail", type=int, default=None,
                        help="with --queries-per-video (and the eval level): tokens of each query's own tail after "
                        "the shared part (question + assistant header; default 32)")
    parser.add_argument("--variants", type=_str_list, default=None,
                        help="keep only these variants (e.g. naive,mmpg or mmpg:flex)")
    parser.add_argument("--vllm", action="store_true",
                        help="add the vLLM engine (variant vllm) to the rollout level: starts a `mmpg vllm-serve` "
                        "(.venv-vllm, 127.0.0.1) per config on a saved copy of its model, 1-3 min on a CPU; "
                        "qwen2_5_vl with head_dim >= 32 (else the row says skipped); also asked by vllm in --variants")
    parser.add_argument("--vllm-url", default=None,
                        help="time the vllm variant against this running server instead (implies --vllm; it must "
                        "serve the config's model, e.g. one started on --vllm-checkpoint's folder)")
    parser.add_argument("--vllm-checkpoint", default=None,
                        help="serve this checkpoint folder instead of a saved copy of the config's model (its "
                        "architecture must be the config's; checked)")
    parser.add_argument("--lora-r", type=int, default=16, help="--levels lora: the LoRA rank compared with full "
                        "training (mmpg.bench.lora: full vs LoRA, reference copy vs adapters off; its own table)")
    parser.add_argument("--sp", type=int, default=1,
                        help="step level: also run each config with its packed row spread over this many gloo "
                        "processes (sequence parallelism, `mmpg.bench.sp`), beside sp 1; per-rank peak memory and "
                        "time with their ceilings in a table of their own (default 1: off)")
    parser.add_argument("--async-steps", type=int, default=12, help="--levels async: GRPO steps per arm (the "
                        "first --warmup of them, default 2, are not in the means)")
    parser.add_argument("--async-rounds", type=int, default=2, help="--levels async: runs per arm, alternating "
                        "k = 0, 1 then 1, 0 (the machine's drift cancels); the means pool them")
    parser.add_argument("--async-frames", type=int, default=4, help="--levels async: frames per video")
    parser.add_argument("--async-pixels", type=int, default=3136, help="--levels async: pixels (H x W) per frame")
    parser.add_argument("--async-iterations", type=int, default=1, help="--levels async: optimizer updates per "
                        "step (algorithm.num_iterations, mu): 2 makes the tiny model's update about as long as its "
                        "rollout (the ceiling near 2x)")
    parser.add_argument("--vllm-sizes", default="2x4x48,4x8x24", help="--levels vllm: each rank's request as "
                        "prompts x G x new tokens, comma-separated")
    parser.add_argument("--vllm-servers", type=int, default=2, help="--levels vllm: 2 also measures the two ranks "
                        "on two servers (a core each) against one; 1: one server only")
    parser.add_argument("--trainer-core", type=int, default=0, help="--levels async / vllm: the core the trainer "
                        "(async: `mmpg train`; vllm: the two ranks' clients) runs on")
    parser.add_argument("--server-core", type=int, default=1, help="--levels async / vllm: the core the vLLM server "
                        "runs on")
    parser.add_argument("--data-minutes", type=float, default=20.0, help="--levels data: minutes of the generated "
                        "1280x720 30 fps video (rendered once into data/generated/bench/, about 5 min for 20 on one "
                        "core; 2 is a quick run)")
    parser.add_argument("--data-video", default=None, help="--levels data: time this video file instead of the "
                        "generated one")
    parser.add_argument("--data-core", type=int, default=0, help="--levels data: the core decoding runs on (one "
                        "core and one torch thread: per-core rates); -1 leaves the process on all its cores")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (fresh process each)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per process (>= 1: the memory step)")
    parser.add_argument("--max-gb", type=float, default=None,
                        help="skip configs whose naive variant needs more (default: 12 on CPU, 85%% of the GPU)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per worker process")
    parser.add_argument("--out", default=None, help="JSON path (default runs/bench/<timestamp>.json)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan with ceilings; measure nothing")
    parser.add_argument("--in-process", action="store_true",
                        help="measure in this process (smoke tests; no memory columns: they need a fresh process)")


def planned_configs(args) -> list[dict]:
    """The configs to run: the preset, its levels, overrides and variant filter applied (duplicates dropped), each
    level's configs expanded by its `expand` (`mmpg.bench.levels`), in the table's order."""
    preset = args.preset or DEFAULT_PRESET
    built = preset_configs(preset, args.family)
    levels = _levels(args, preset, built)
    out, seen = [], set()
    for name, level in LEVELS.items():
        if name not in levels:
            continue
        own = [c for c in built if c["level"] == name] or [c for c in built if c["level"] == level.borrows]
        for config in own:
            for P, S, G in itertools.product(args.P or [config["P"]], args.S or [config["S"]],
                                             args.G or [config["G"]]):
                sized = dict(config, P=P, S=S, G=G)
                for c in level.expand(sized, args) if level.expand else [sized]:
                    if args.variants:
                        c["variants"] = [v for v in c["variants"]
                                         if v in args.variants or v.split(":")[0] in args.variants]
                    key = repr(sorted((k, repr(v)) for k, v in c.items()))
                    if c["variants"] and key not in seen:
                        seen.add(key)
                        out.append(c)
    return out


def _levels(args, preset: str, built: list[dict]) -> list[str]:
    """--levels, else the preset's own (`PRESET_LEVELS`), else its configs' one level, else DEFAULT_LEVELS; checked,
    --sp with them."""
    only = {c["level"] for c in built}
    levels = args.levels or PRESET_LEVELS.get(preset) or (list(only) if len(only) == 1 else DEFAULT_LEVELS)
    unknown = set(levels) - set(MEASURED)
    if unknown:
        raise UserError(f"unknown bench level(s) {', '.join(sorted(unknown))}; choose from {', '.join(MEASURED)}")
    sp, spreading = getattr(args, "sp", 1) or 1, [n for n in MEASURED if LEVELS[n].spreads]
    if sp < 1 or (sp > 1 and not set(levels) <= set(spreading)):
        raise UserError(f"--sp {sp}: a positive size, for the {' and '.join(spreading)} level alone (--levels "
                        f"{','.join(spreading)}); got levels {','.join(levels)}")
    return levels


def default_max_gb() -> float:
    import torch

    if torch.cuda.is_available():
        return 0.85 * torch.cuda.get_device_properties(0).total_memory / 1e9
    return 12.0


def meta(args, rounds, repeats, warmup, max_gb, env, partial) -> dict:
    return {"preset": args.preset, "rounds": rounds, "repeats": repeats, "warmup": warmup, "max_gb": max_gb,
            "dry_run": args.dry_run, "in_process": args.in_process, "partial": partial, "argv": sys.argv[1:], **env}


def _run_alone(args, name: str) -> int:
    """A level with its own program and table (`Level.alone`): its dry run says what a run would measure."""
    level = LEVELS[name]
    if args.dry_run:
        print(f"mmpg bench --levels {name} ({level.module}): {level.alone.format(**vars(args))}; --dry-run measures "
              "nothing")
        return 0
    return importlib.import_module(level.module).run(args)


def run(args) -> int:
    from mmpg.bench import runner, tables

    alone = [name for name in ALONE if name in (args.levels or ())]
    if alone:
        if args.levels != alone[:1]:
            raise UserError(f"--levels {alone[0]} runs alone (its own table); run the other levels separately")
        return _run_alone(args, alone[0])

    if args.preset is None:
        if args.levels is None and not args.dry_run:
            return _no_preset(args)
        args.preset = DEFAULT_PRESET
    rounds, repeats, warmup = (v if v is not None else d
                               for v, d in zip((args.rounds, args.repeats, args.warmup), PRESETS[args.preset]))
    configs = planned_configs(args)
    env = tables.provenance()
    max_gb = args.max_gb if args.max_gb is not None else default_max_gb()
    out_path = args.out or tables.default_out_path()
    print(f"mmpg bench --preset {args.preset}: {len(configs)} configs, {rounds} rounds x {repeats} repeats "
          f"(+{warmup} warm-up) per variant, on {env['device']}, {env['date']}, commit {env['commit']}")
    for desc in dict.fromkeys(tables.describe_config(c) for c in configs):
        print(f"  {desc}")
    rows = []
    for config in configs:
        if args.dry_run:
            shape = runner.shape_of(config)
            est = runner.naive_bytes(config, shape) / 1e9
            note = f"naive ~{est:.1f} GB" + (f" > {max_gb:g} GB: would be skipped" if est > max_gb else "")
            rows += [dict(level=config["level"], P=shape["P"], S=config["S"], G=config["G"], variant=v, note=note,
                          config=config, **runner.queries_of(config), **runner.ceilings(config, shape))
                     for v in config["variants"]]
            continue
        done = runner.run_config(config, rounds=rounds, warmup=warmup, repeats=repeats, timeout=args.timeout,
                                 max_gb=max_gb, in_process=args.in_process,
                                 log=lambda msg: print(msg, file=sys.stderr, flush=True))
        rows += runner.add_ratios(done)
        print(tables.format_table(done), file=sys.stderr, flush=True)  # progress; the full table comes last
        tables.write_json(out_path, rows, meta(args, rounds, repeats, warmup, max_gb, env, partial=True))
    runner.add_ratios(rows)
    print(tables.format_table(rows))
    present = {r["level"] for r in rows}
    for table in (t for name, level in LEVELS.items() if name in present for t in level.tables):
        module, _, function = table.function.partition(":")
        text = "" if args.dry_run and not table.dry_run else getattr(importlib.import_module(module), function)(rows)
        if text:
            print("\n" + text)
    path = tables.write_json(out_path, rows, meta(args, rounds, repeats, warmup, max_gb, env, partial=False))
    print(f"wrote {path}")
    failed = [r for r in rows if (r.get("note") or "").split(":")[0] not in ("", "OOM", "n/a", "skipped")
              and not (r.get("note") or "").startswith("naive ~")]
    return 1 if failed else 0


def _no_preset(args) -> int:
    """`mmpg bench` with neither --preset nor --levels: the plan of the default preset, nothing run or written."""
    args.preset = DEFAULT_PRESET
    configs = planned_configs(args)
    print(f"mmpg bench: nothing measured. --preset {DEFAULT_PRESET} would run {len(configs)} configs "
          f"({', '.join(sorted({c['level'] for c in configs}))} levels; minutes on a CPU):")
    for c in configs:
        print(f"  {c['level']}: P={c.get('P')} S={c.get('S')} G={c.get('G')} variants {', '.join(c['variants'])}")
    print(f"Run it with --preset {DEFAULT_PRESET}, choose another ({', '.join(PRESETS)}), or add --dry-run to print "
          "a plan's ceilings; bash scripts/bench.sh runs the default preset.")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m mmpg.bench.cli ...`, the same program as `mmpg bench ...` (scripts/bench.sh runs it so)."""
    parser = argparse.ArgumentParser(prog="mmpg bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UserError as err:
        print(f"mmpg bench: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
