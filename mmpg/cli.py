"""The `mmpg` command. Each subcommand parses its flags and calls one library function; no logic lives here.

User errors (`mmpg.errors.is_user_error`: a `UserError`, or what mmpg.grouping raises for an unsupported
transformers) print one line `mmpg: error: ...` and exit with status 2, like argparse's own.
`--local_rank N` is taken anywhere on the command line (the deepspeed launcher puts it before the subcommand).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from mmpg import __version__
from mmpg.errors import UserError, is_user_error

# mmpg.toy.models.FAMILIES and mmpg.toy.zoom_task.WINDOW_RULES, whose modules import torch or the video renderer (too
# slow for --help); tests/test_cli.py checks they agree
TINY_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen2", "qwen3")
ZOOM_RULES = ("frames", "stamps")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _cmd_make_tiny(args) -> int:
    from mmpg.toy.models import TinySpec, make_tiny

    spec = TinySpec(hidden_size=args.hidden_size, num_layers=args.layers, num_heads=args.heads,
                    num_kv_heads=args.kv_heads, intermediate_size=args.intermediate_size or 2 * args.hidden_size,
                    vision_depth=args.vision_depth)
    out = make_tiny(args.family, args.out, seed=args.seed, spec=spec, overwrite=args.overwrite)
    print(f"wrote tiny {args.family} checkpoint (seed {args.seed}) to {out}")
    return 0


def _cmd_synth(args) -> int:
    from mmpg.toy.videos import generate_dataset

    if args.zoom:
        from mmpg.toy.zoom_task import ZoomTask, write_zoom_dataset

        task = ZoomTask(duration=args.zoom_duration, overview_fps=args.overview_fps, zoom_fps=args.zoom_fps,
                        zoom_max_frames=args.zoom_frames, window_rule=args.zoom_rule)
        summary = write_zoom_dataset(args.out, args.n, args.seed, task, overwrite=args.overwrite,
                                     windows=args.zoom_windows)
        print(f"wrote {summary['videos']} zoom-task videos (seed {args.seed}: {summary['train']} train, "
              f"{summary['test']} test) and the rule policy's trajectories ({summary['trajectories']}) to "
              f"{summary['out']}")
        print(f"  train and evaluate with data.fps={task.overview_fps:g} zoom.fps={task.zoom_fps:g} "
              f"zoom.max_frames={task.zoom_max_frames} (the rule policy's trajectories use these)")
        return 0
    summary = generate_dataset(args.out, args.n, args.seed, overwrite=args.overwrite,
                               min_duration=args.min_duration, max_duration=args.max_duration, easy=args.easy,
                               queries=args.queries)
    print(f"wrote {args.n} synthetic grounding videos (seed {args.seed}) to {args.out}")
    for key, value in summary.items():
        print(f"  {key}: {value}")
    return 0


def _cmd_demo(args) -> int:
    from mmpg.toy.demo import run_demo

    if args.build_only:
        from mmpg.toy.demo.pipeline import Paths, ensure_artifacts

        paths = Paths.under(Path(args.workdir), "")
        built = ensure_artifacts(paths)
        print(f"built {', '.join(built)}" if built else "nothing to build", f"({paths.model}, {paths.data})")
        return 0
    preset = "quick" if args.quick else "long" if args.long else "default"
    return run_demo(args.workdir, preset=preset, seed=args.seed, sft_steps=args.sft_steps, grpo_steps=args.grpo_steps)


def _cmd_check_data(args) -> int:
    from mmpg.data.check import run_check

    return run_check(args.annotations, args.videos, args.format)


def _cmd_train(args) -> int:
    from mmpg.config import describe, load_config

    if args.fields is not None:
        print(describe(args.fields or None))
        return 0
    overrides = list(args.overrides)
    if args.resume:
        overrides.append(f"checkpoint.resume={args.resume}")
    cfg = load_config(args.config, overrides)
    if args.get is not None:
        value = cfg
        for part in args.get.split("."):
            if not hasattr(value, part):
                raise UserError(f"--get {args.get}: no config field {part!r} (mmpg {args.command} --fields lists them)")
            value = getattr(value, part)
        print(value)
        return 0
    from mmpg.config.generated import unbuilt_input  # a demo config before `mmpg demo --build-only`: say so

    problem = unbuilt_input(cfg.model.path, cfg.data.train, cfg.data.val, cfg.data.videos)
    if problem:
        raise UserError(problem)
    if args.command == "sft":
        from mmpg.sft.job import sft

        return sft(cfg, ["mmpg", "sft"] + list(args.argv))
    from mmpg.rl.trainer import train

    return train(cfg, ["mmpg", "train"] + list(args.argv))


def _cmd_eval(args) -> int:
    from mmpg.eval.cli import run

    return run(args)


def _cmd_export(args) -> int:
    from mmpg.models.lora_export import export_checkpoint

    info = export_checkpoint(args.checkpoint, args.out, dtype=args.dtype, overwrite=args.overwrite)
    what = f"LoRA adapter merged into {info['base']}" if info["adapter_merged"] else "full-weight checkpoint, re-saved"
    print(f"wrote {args.out}: a plain HF model ({what}; {info['dtype']}, safetensors, processor files)")
    return 0


def _cmd_vllm_serve(args) -> int:
    from mmpg.serve.launch import serve

    return serve(list(args.argv))


def _cmd_inspect(args) -> int:
    from mmpg_app.server import launch  # the inspector, app/ in the repository (setup.py)

    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"mmpg inspect: serving on {args.host}: anyone who can reach this machine can read {' '.join(args.path)}",
              file=sys.stderr)
    launch(args.path[0] if len(args.path) == 1 else args.path, host=args.host, port=args.port)
    return 0


def _train_epilog() -> str:
    from mmpg.config import GROUPS

    return ("config groups: " + ", ".join(GROUPS) + ". Every field with its default and help: mmpg train --fields "
            "[GROUP]. Overrides are key=value, e.g. rollout.n=8 optim.lr=1e-6 trainer.total_steps=200.")


def build_parser() -> argparse.ArgumentParser:
    from mmpg.data.formats import FORMAT_CHOICES

    parser = argparse.ArgumentParser(prog="mmpg", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny", help="build a tiny random-weight Qwen checkpoint offline")
    p.add_argument("--family", required=True, choices=TINY_FAMILIES, help="model family: the two video "
                   "families (Qwen2.5-VL, Qwen3-VL) or the text-only Qwen2 / Qwen3")
    p.add_argument("--out", required=True, help="folder to write (must be empty or absent)")
    p.add_argument("--seed", type=_non_negative_int, default=0)
    p.add_argument("--hidden-size", type=_positive_int, default=64)
    p.add_argument("--layers", type=_positive_int, default=2)
    p.add_argument("--heads", type=_positive_int, default=4)
    p.add_argument("--kv-heads", type=_positive_int, default=2)
    p.add_argument("--intermediate-size", type=_positive_int, default=None, help="default: 2 x hidden size")
    p.add_argument("--vision-depth", type=_positive_int, default=2)
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.set_defaults(func=_cmd_make_tiny)

    p = sub.add_parser("synth", help="render synthetic grounding videos with annotations")
    p.add_argument("--out", required=True, help="folder to write (must be empty or absent)")
    p.add_argument("--n", type=_positive_int, required=True, help="number of videos")
    p.add_argument("--seed", type=_non_negative_int, default=0)
    p.add_argument("--min-duration", type=float, default=8.0, help="seconds")
    p.add_argument("--max-duration", type=float, default=90.0, help="seconds")
    p.add_argument("--easy", action="store_true", help="the task a tiny model learns on a CPU: one large white "
                   "shape on black, 64x64, 2 fps, whole seconds")
    p.add_argument("--queries", type=_positive_int, default=1, help="with --easy: ask about each video's moment in "
                   "2..N wordings (N <= 5), several queries per video as real datasets have (default 1)")
    p.add_argument("--zoom", action="store_true", help="the task where zooming wins (multi-turn grounding): a "
                   "0.5 s white flash inside a coloured square's 6-8 s, placed between the overview's frames; also "
                   "writes the rule policy's zoom trajectories (trajectories.jsonl); --min/max-duration ignored")
    p.add_argument("--zoom-duration", type=float, default=40.0, help="with --zoom: each video's seconds (longer "
                   "videos at an equal frame budget leave one look fewer frames on the flash)")
    p.add_argument("--overview-fps", type=float, default=0.5, help="with --zoom: the overview's frame rate, which "
                   "the flash is placed between (train and evaluate with data.fps at this)")
    p.add_argument("--zoom-fps", type=float, default=4.0, help="with --zoom: the zoom tool's frame rate (zoom.fps)")
    p.add_argument("--zoom-frames", type=_positive_int, default=48, help="with --zoom: the zoom tool's frame cap "
                   "(zoom.max_frames)")
    p.add_argument("--zoom-rule", choices=ZOOM_RULES, default="frames", help="with --zoom: the rule "
                   "policy's zoom window: between the overview frames around the square (frames, default) or between "
                   "the times Qwen3-VL writes before the frame pairs around it (stamps: wider, copied from the prompt)")
    p.add_argument("--zoom-windows", type=_positive_int, default=1, help="with --zoom: trajectories per training "
                   "video: the rule's window and up to N-1 others of its length moved along the video, each holding "
                   "the flash (more clips to learn the answer's copy from; default 1)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.set_defaults(func=_cmd_synth)

    p = sub.add_parser("check-data", help="check annotations and videos before a run")
    p.add_argument("--annotations", required=True, help="annotation file (Charades-STA, ActivityNet, Time-R1, JSONL)")
    p.add_argument("--videos", required=True, help="folder holding the videos")
    p.add_argument("--format", default="auto", choices=FORMAT_CHOICES)
    p.set_defaults(func=_cmd_check_data)

    from mmpg.train import prepare as prepare_cli

    p = sub.add_parser("prepare-videos", help="decode a config's training (and held-out) videos into its "
                       "data.frame_cache with N processes, so the first epoch reads frames instead of decoding",
                       description=prepare_cli.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    prepare_cli.add_arguments(p)
    p.set_defaults(func=prepare_cli.run)

    from mmpg.bench import cli as bench_cli

    p = sub.add_parser("bench", help="benchmark grouped vs repeated vs upstream prefix_grouper (prints tables, JSON)")
    bench_cli.add_arguments(p)
    p.set_defaults(func=bench_cli.run)

    from mmpg.plan import cli as plan_cli

    p = sub.add_parser("plan", help="per-GPU peak memory by part and step time by phase of a config on N GPUs, "
                       "whether it fits, what would make it fit", description=plan_cli.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    plan_cli.add_arguments(p)
    p.set_defaults(func=plan_cli.run)

    for name, text in (("train", "GRPO training on DeepSpeed (one process, torchrun or the deepspeed launcher)"),
                       ("sft", "supervised warm start on grounding annotations (same config tree and run directory)")):
        p = sub.add_parser(name, help=text, epilog=_train_epilog())
        p.add_argument("--config", default=None, help="YAML config (configs/*.yaml); defaults <- file <- overrides")
        p.add_argument("--resume", default=None, help="'auto' (latest complete checkpoint of the run) or a "
                       "checkpoint folder; same as checkpoint.resume=...")
        p.add_argument("--fields", nargs="?", const="", default=None, metavar="GROUP",
                       help="print every config field (of GROUP) with its default and help, and exit")
        p.add_argument("--get", default=None, metavar="KEY", help="print one field's value after the config file "
                       "and the overrides (e.g. model.path), and exit; for launch scripts")
        p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rollout.n=8")
        p.set_defaults(func=_cmd_train)

    from mmpg.eval import cli as eval_cli

    p = sub.add_parser("eval", help="evaluate a checkpoint (or every checkpoint of a run) on a grounding benchmark: "
                       "R1@0.3/0.5/0.7, mIoU, report, plots", epilog=eval_cli.epilog())
    eval_cli.add_arguments(p)
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("inspect", help="browse a run's rollouts, rewards and curves (or an evaluation folder) "
                       "in a local web page")
    p.add_argument("path", metavar="RUN_DIR", nargs="+",
                   help="a run directory (it may still be written) or an evaluation folder; several run directories, "
                   "or a folder holding several, open the compare page (their curves and evaluations overlaid)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_positive_int, default=None, help="port (default: 7860 or the next free one)")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("export", help="write a checkpoint as a plain HF model folder (a LoRA adapter merged into "
                       "its base) that from_pretrained, mmpg eval and vLLM load",
                       description="A LoRA checkpoint (adapter_config.json + adapter_model.safetensors) is merged "
                       "into the base it names (W + alpha/r B A); a full-weight checkpoint is re-saved as its HF model "
                       "without the trainer and DeepSpeed state. Written to a temp folder, then renamed.")
    p.add_argument("--checkpoint", required=True, help="checkpoint folder (e.g. RUN/checkpoints/step_00000040)")
    p.add_argument("--out", required=True, help="folder to write (must be empty or absent)")
    p.add_argument("--dtype", default="auto", help="weights' dtype: auto (the base checkpoint's), float32, bfloat16, "
                   "float16; the merge runs in it")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.set_defaults(func=_cmd_export)

    from mmpg.serve import vllm_server

    p = sub.add_parser("vllm-serve", help="serve rollouts with vLLM for rollout.engine=vllm (runs in .venv-vllm, "
                       "made by scripts/env.sh vllm)", description="An HTTP server around vllm.LLM on 127.0.0.1: "
                       "generate (token ids + frames), weight updates after every optimizer step, health.")
    vllm_server.add_arguments(p)
    p.set_defaults(func=_cmd_vllm_serve)

    from mmpg.rollout import lengths

    p = sub.add_parser("vllm-len", help="print the vLLM server's --max-model-len for a config: its longest prompt + "
                       "rollout.max_new_tokens + a margin", description=lengths.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    lengths.add_arguments(p)
    p.set_defaults(func=lengths.run)

    from mmpg.doctor import cli as doctor_cli

    p = sub.add_parser("doctor", help="check this machine: every path (grouped forward, cascade decoding, training, "
                       "eval decoding) on tiny models against its exact reference, a speed table; a report",
                       description=doctor_cli.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    doctor_cli.add_arguments(p)
    p.set_defaults(func=doctor_cli.run)

    p = sub.add_parser("demo", help="the default job: a tiny video model learns grounding on a CPU (SFT, then GRPO)",
                       description="Build a tiny Qwen2.5-VL and easy synthetic videos (once), evaluate the untrained "
                       "model, warm it up with SFT, train it with GRPO, evaluating after each stage, and print the "
                       "three evaluations beside trivial baselines.")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--quick", action="store_true", help="shorter stages, a few minutes (what CI runs)")
    length.add_argument("--long", action="store_true", help="longer stages: better numbers, about twice the time")
    p.add_argument("--seed", type=_non_negative_int, default=0, help="training seed (data order, sampling)")
    p.add_argument("--sft-steps", type=_positive_int, default=None, help="override the preset's SFT steps")
    p.add_argument("--grpo-steps", type=_positive_int, default=None, help="override the preset's GRPO steps")
    p.add_argument("--workdir", default="data/generated/demo", help="where the tiny model, videos, runs and "
                   "results are kept")  # mmpg.config.generated.DEMO_WORKDIR
    p.add_argument("--build-only", action="store_true", help="only build the tiny model and the videos if missing")
    p.set_defaults(func=_cmd_demo)
    return parser


LOCAL_RANK_FLAGS = ("--local_rank", "--local-rank")  # deepspeed's launcher; torch.distributed.launch's


def take_local_rank(argv: list[str]) -> tuple[list[str], str | None]:
    """(argv without `--local_rank=N` / `--local_rank N`, N or None). The deepspeed launcher runs
    `python -m mmpg.cli --local_rank=N train ...`: the flag comes before the subcommand, where no subparser sees it."""
    rest, rank, i = [], None, 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if flag in LOCAL_RANK_FLAGS:
            if not eq:
                if i + 1 >= len(argv):
                    raise UserError(f"{flag} needs a value (the launcher's local rank)")
                i, value = i + 1, argv[i + 1]
            if not value.isdigit():
                raise UserError(f"{flag}={value}: expected the local rank, an integer >= 0")
            rank = value
        else:
            rest.append(argv[i])
        i += 1
    return rest, rank


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        argv, local_rank = take_local_rank(list(sys.argv[1:] if argv is None else argv))
    except UserError as err:
        parser.error(str(err))
    if local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", local_rank)  # the launcher sets it too; the flag wins only when it did not
    args = parser.parse_args(argv)
    args.argv = argv[1:]  # the subcommand's own arguments, as recorded in run.json
    try:
        return int(args.func(args) or 0)
    except Exception as err:  # noqa: BLE001 - re-raised unless it is the user's to fix
        if not is_user_error(err):
            raise
        print(f"mmpg: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
