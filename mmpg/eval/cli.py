"""`mmpg eval`: evaluate a checkpoint, or every checkpoint of a training run, on a grounding benchmark.

    mmpg eval --checkpoint CKPT --annotations charades_sta_test.txt --videos Charades_v1_480 --protocol time_r1 \
        prompt_file=data/prompts/time_r1.py       the paper's prompt file, fetched once (docs/evaluation.md)
    mmpg eval --run runs/grpo --annotations test.json --videos videos max_samples=200
    torchrun --nproc_per_node 8 -m mmpg.cli eval --checkpoint CKPT --annotations ... --videos ...
    mmpg eval --fields                       every setting with its default and help, and the protocols
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from mmpg.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    from mmpg.eval.protocols import PROTOCOLS

    what = p.add_mutually_exclusive_group()
    what.add_argument("--checkpoint", default=None, help="checkpoint folder to evaluate (HF format, or a LoRA "
                      "adapter checkpoint: loaded on the base it names, merged)")
    what.add_argument("--run", default=None, help="a training run directory: evaluate each complete checkpoint into "
                      "RUN/evals/<benchmark>/step_N/ (finished ones skipped), then write over_steps.md|png there")
    p.add_argument("--annotations", default=None, help="benchmark annotation file (Charades-STA txt/JSON, "
                   "ActivityNet JSON, Time-R1 list, JSONL)")
    p.add_argument("--videos", default=None, help="folder holding the videos the annotations name")
    p.add_argument("--protocol", default="default", choices=list(PROTOCOLS),
                   help="settings preset of a published evaluation (see below); key=value overrides still win")
    p.add_argument("--benchmark", default=None, help="name of the benchmark in folder names and reports "
                   "(default: the annotation file's name, plus -PROTOCOL for a non-default protocol)")
    p.add_argument("--out", default=None, help="evaluation folder (--checkpoint only; default: RUN/evals/<benchmark>/"
                   "step_N for a run's checkpoint, else evals/<checkpoint name>/<benchmark>); a rerun continues it")
    p.add_argument("--fields", action="store_true", help="print every setting and protocol, and exit")
    p.add_argument("overrides", nargs="*", help="key=value settings, e.g. max_new_tokens=512 batch_size=4")


def epilog() -> str:
    from mmpg.eval.protocols import PROTOCOLS

    return "protocols: " + " ".join(f"{p.name}: {p.summary}" for p in PROTOCOLS.values()) + \
        " Details and sources: mmpg eval --fields."


def default_benchmark(annotations: str, protocol: str) -> str:
    stem = Path(annotations).stem
    return stem if protocol == "default" else f"{stem}-{protocol}"


def default_out(checkpoint: str, benchmark: str) -> Path:
    """RUN/evals/<benchmark>/step_N for a run's checkpoint (RUN/checkpoints/step_N), else evals/<name>/<benchmark>."""
    from mmpg.runs.evals import run_eval_dir
    from mmpg.runs.layout import RUN_JSON, step_dir_step

    path = Path(checkpoint).expanduser()
    step = step_dir_step(path.name)
    if step is not None and path.parent.name == "checkpoints" and (path.parent.parent / RUN_JSON).is_file():
        return run_eval_dir(path.parent.parent, benchmark, step)
    return Path("evals") / (path.resolve().name or "checkpoint") / benchmark


def _setup_logging() -> None:
    logger = logging.getLogger("mmpg.eval")
    if not any(getattr(h, "_mmpg_eval", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler._mmpg_eval = True
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _summary(result) -> str:
    from mmpg.eval.markdown import RULES, SUFFIX, pct

    m = result.metrics
    rule = m.get("threshold_rule", "gt")
    r1 = "/".join(pct(m.get(f"r1@{t}{SUFFIX[rule]}")) for t in (0.3, 0.5, 0.7))
    rate = result.decoded / result.decode_seconds if result.decode_seconds > 0 else 0.0
    return (f"wrote {result.folder}: R1@0.3/0.5/0.7 = {r1} % ({RULES[rule][0]}), mIoU = {pct(m.get('miou'))} %, "
            f"unparseable {pct(m.get('unparseable'))} %, failed {int(m.get('failed', 0))}; decoded "
            f"{result.decoded} samples ({result.reused} from an earlier run) in {result.decode_seconds:.1f} s "
            f"({rate:.2f} samples/s; {result.seconds:.1f} s with loading and writing); videos "
            f"{result.counts.videos}, vision-tower videos encoded {result.counts.vision_calls}, prefill tokens "
            f"{result.counts.prefix_tokens}")


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def run(args) -> int:
    from mmpg.eval.settings import describe, load_settings

    if args.fields:
        print(describe())
        return 0
    if not args.checkpoint and not args.run:
        raise UserError("pass --checkpoint CKPT or --run RUN_DIR (and --annotations FILE --videos DIR)")
    if not args.annotations:
        raise UserError("pass --annotations FILE: the benchmark to evaluate on")
    if args.run and args.out:
        raise UserError("--out goes with --checkpoint; with --run the folders are RUN/evals/<benchmark>/step_N")
    settings = load_settings(args.protocol, args.overrides)
    benchmark = args.benchmark or default_benchmark(args.annotations, args.protocol)
    _setup_logging()
    if args.run:
        from mmpg.eval.run_dir import evaluate_run
        from mmpg.runs.evals import run_benchmark_dir

        results = evaluate_run(args.run, args.annotations, args.videos, settings, protocol=args.protocol,
                               benchmark=benchmark)
        if _rank() == 0:
            for step, result in results:
                print(f"step {step}: " + (_summary(result) if result is not None else "already evaluated, skipped"))
            print(f"over steps: {run_benchmark_dir(args.run, benchmark)}/over_steps.md, over_steps.png")
        return 0
    from mmpg.eval.runner import evaluate_checkpoint

    out = Path(args.out) if args.out else default_out(args.checkpoint, benchmark)
    step = None
    if not args.out:
        from mmpg.runs.layout import step_dir_step

        step = step_dir_step(out.name) if out.name.startswith("step_") else None
    result = evaluate_checkpoint(args.checkpoint, args.annotations, args.videos, out, settings,
                                 protocol=args.protocol, benchmark=benchmark, step=step)
    if _rank() == 0:
        print(_summary(result))
    return 0
