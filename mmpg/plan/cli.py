"""`mmpg plan`: the per-device peak memory (by part) and the step time (by phase) of a recipe on N GPUs, whether it
fits, and the cheapest changes that make it fit — before a GPU is rented.

    mmpg plan --config configs/grounding_qwen25vl_7b.yaml --gpus 8 --gpu a100-80
    mmpg plan --config configs/cpu_demo.yaml --device cpu          # this machine's CPU, float32
    mmpg plan --config configs/sft_qwen25vl_7b.yaml --gpus 8       # an SFT step (the config's sft: group; --job)
    mmpg plan --published                                          # the plan beside what users reported
    mmpg plan --run runs/NAME --gpus 8                             # a run's plan beside its measured peak
    mmpg plan --config configs/grounding_qwen25vl_7b_long.yaml --gpus 8 --decode   # do the data workers keep up?
The memory model is `mmpg.plan.memory` (validated on CPU runs: `python -m mmpg.plan.validate`), the time model
`mmpg.plan.timing` (estimates at a stated utilisation). A device is taken to hold 90 % of its memory for tensors
(the rest: CUDA context, NCCL buffers, allocator fragmentation).
"""

from __future__ import annotations

import json
from pathlib import Path

from mmpg.errors import UserError

JOB_LINES = {"train": "GRPO step (mmpg train): rollout, reference logprobs where algorithm.beta > 0, update",
             "sft": "SFT step (mmpg sft): one target of S tokens per prompt, no rollout, no reference"}


def job_of(config: str | None) -> tuple[str, str]:
    """(job, why) for a config file: "sft" when its YAML has a top-level `sft:` group, else "train"."""
    if not config:
        return "train", "no --config"
    import yaml

    try:
        data = yaml.safe_load(Path(config).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return "train", "the config could not be read here"  # load_config says why in its own words
    if isinstance(data, dict) and "sft" in data:
        return "sft", f"{config} has an sft: group, --job train plans it as a GRPO step"
    return "train", f"{config} has no sft: group, --job sft plans an SFT step"


def add_arguments(p) -> None:
    p.add_argument("--config", default=None, help="YAML config (configs/*.yaml), as mmpg train takes it")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rollout.n=16 model.lora.r=64")
    p.add_argument("--gpus", type=int, default=None, help="devices of the run (data x sequence parallel; default 1, "
                   "with --run the device count the run recorded)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--gpu", default="a100-80", help="GPU preset: a100-40, a100-80, h100, h200, a40, l40s, 4090")
    where.add_argument("--gpu-memory", type=float, default=None, metavar="GB", help="memory of an unlisted GPU "
                       "(its time uses the a100-80 preset's rates)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: this machine's CPU (float32 "
                   "unless model.dtype says otherwise; the process's own peak)")
    p.add_argument("--video-tokens", type=int, default=None, help="the video's LM tokens (default: the data "
                   "budget's worst case)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="the whole prompt's tokens (default: video + 120)")
    p.add_argument("--mfu", type=float, default=0.35, help="assumed model FLOPs utilisation of the compute phases")
    p.add_argument("--bw-util", type=float, default=0.6, help="assumed fraction of memory bandwidth in decoding")
    p.add_argument("--json", action="store_true", help="print JSON (peak_bytes, parts, step_seconds, fits, ...)")
    p.add_argument("--vllm-mem", action="store_true", help="print only the colocated vLLM servers' "
                   "gpu_memory_utilization for the config (what scripts/train_grounding.sh gives VLLM_MEM)")
    p.add_argument("--published", action="store_true", help="print the plan beside published users' reports")
    p.add_argument("--job", choices=("train", "sft"), default=None, help="plan a GRPO step (train) or a supervised "
                   "one (sft: one target per prompt, no rollout, no reference). Default: sft for a config with an "
                   "sft: group, else train; with --run, the run's own kind")
    dec = p.add_mutually_exclusive_group()
    dec.add_argument("--decode", action="store_true", help="estimate whether data.num_workers decode videos as fast "
                     "as a step and how many workers it takes, from a probe of this machine's decoding on one core "
                     "(a few seconds: generated H.264 at 640x360 and 1280x720; mmpg.plan.decode)")
    dec.add_argument("--decode-fps", type=float, default=None, metavar="N", help="the decode estimate from your own "
                     "figure instead of the probe: frames of your footage one core loads per second through mmpg "
                     "(load_video at the config's settings)")
    p.add_argument("--video-minutes", type=float, default=None, metavar="M", help="the typical video's length for "
                   "the decode estimate (default: data.train's mean when readable here, else the plan's video, "
                   "data.max_frames / data.fps)")
    p.add_argument("--footage", default=None, metavar="WxH@FPS", help="the source videos' frame size and rate for "
                   "the decode estimate (default 1280x720@30)")
    p.add_argument("--run", default=None, metavar="RUN_DIR", help="plan a run from its config.yaml and print it "
                   "beside the run's measured perf/peak_memory_mb")


def _hardware(args):
    from mmpg.plan.timing import GPUS, Throughput, cpu_memory, cpu_throughput, gpu

    if not 0 < args.mfu <= 1 or not 0 < args.bw_util <= 1:
        raise UserError(f"--mfu {args.mfu} / --bw-util {args.bw_util}: give fractions in (0, 1]")
    if args.device == "cpu":
        tflops, bw = cpu_throughput()
        return "this CPU", cpu_memory(), Throughput("cpu", tflops, bw, 1.0, 1.0)
    if args.gpu_memory is not None:
        if args.gpu_memory <= 0:
            raise UserError(f"--gpu-memory {args.gpu_memory}: give the GPU's memory in GB, > 0")
        ref = GPUS["a100-80"]
        return f"{args.gpu_memory:g} GB GPU", args.gpu_memory * 2 ** 30, Throughput(
            ref.name, ref.bf16_tflops, ref.bandwidth_tbs, args.mfu, args.bw_util)
    g = gpu(args.gpu)
    return g.name, g.memory_gb * 2 ** 30, Throughput(g.name, g.bf16_tflops, g.bandwidth_tbs, args.mfu, args.bw_util)


def _gb(x: float) -> str:
    return f"{x / 2 ** 30:7.2f} GB" if x >= 2 ** 30 else f"{x / 2 ** 20:7.1f} MB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def render(p: dict, where: str) -> str:
    other = "naive" if p["layout"] == "grouped" else "grouped"
    lines = [f"{p['model']} ({_count(p['params'])} params, {_count(p['trainable_params'])} trained) on "
             f"{p['devices']} x {where}: P {p['P']} ({p['video_tokens']} video tokens), G {p['G']}, S {p['S']}, "
             f"ZeRO {p['zero']}{' + offload' if p['offload'] else ''}, sp {p['sp']}, {p['layout']} layout",
             f"per-device peak {_gb(p['peak_bytes'])} ({p['peak_phase']}) of {_gb(p['budget_bytes'])} usable: "
             f"{'FITS' if p['fits'] else 'DOES NOT FIT'}   ({other} layout: {_gb(p['other_layout_peak_bytes'])})",
             "  part                 bytes at the peak"]
    lines += [f"  {k:<20} {_gb(v)}" for k, v in p["parts"].items() if v]
    if p["cpu_offload_bytes"]:
        lines.append(f"  (host memory: offloaded states {_gb(p['cpu_offload_bytes'])} per device)")
    a = p["assumed"]
    lines.append(f"step time per device (ESTIMATE at {a['mfu']:.0%} of {a['tflops']:g} TFLOP/s, decode at "
                 f"{a['bw_util']:.0%} of {a['bandwidth_tbs']:g} TB/s):")
    lines += [f"  {k:<20} {v:9.2f} s" for k, v in p["step_seconds"].items()]
    lines.append(f"  ({other} layout: {p['other_layout_step_seconds']:.2f} s)")
    for row in p["what_fits"]:
        lines.append(f"  {'fits' if row['fits'] else 'no  '}  {_gb(row['peak_bytes'])}  {row['change']}")
    if p["what_fits"]:
        lines.insert(-len(p["what_fits"]), "what would make it fit (each change alone, cheapest first):")
    if "decode" in p:
        from mmpg.plan.decode import render as render_decode

        lines += render_decode(p["decode"])
    if p.get("disk"):
        from mmpg.plan.whole import render_disk

        lines += render_disk(p["disk"], p["zero"], p["devices"])
    if p.get("servers"):
        from mmpg.plan.serving import render as render_servers

        lines += render_servers(p["servers"], _gb)
    if p.get("note"):
        lines.append(p["note"])
    return "\n".join(lines)


def run(args) -> int:
    if args.published:
        from mmpg.plan.published import render_published

        print(render_published(as_json=args.json))
        return 0
    from mmpg.config import load_config

    if args.run:
        from mmpg.plan.run import render_run, run_plan

        if args.config:
            raise UserError("--run plans the run's own config.yaml: give --run or --config, not both")
        from mmpg.runs.reader import RunReader

        reader = RunReader(args.run)
        info = reader.info()
        if info.get("device", reader.config().get("trainer", {}).get("device")) == "cpu":
            args.device = "cpu"  # a CPU run is planned on this machine's CPU
        devices = info.get("devices") if isinstance(info.get("devices"), int) else 1
        out = run_plan(args.run, devices if args.gpus is None else args.gpus, *_hardware(args)[1:],
                       device=args.device, job=args.job)
        print(json.dumps(out, indent=1) if args.json else render(out["plan"], "device") + "\n" + render_run(out))
        return 0
    where, memory, hw = _hardware(args)
    cfg = load_config(args.config, list(args.overrides))
    for flag in ("video_tokens", "prompt_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 0:
            raise UserError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: give a count >= 0")
    from mmpg.plan.whole import plan, sft_plan

    job, why = (args.job, f"--job {args.job}") if args.job else job_of(args.config)
    p = (sft_plan if job == "sft" else plan)(cfg, 1 if args.gpus is None else args.gpus, args.device, memory, hw,
                                             args.video_tokens, args.prompt_tokens)
    p["job"] = job
    if args.vllm_mem:
        if "servers" not in p:
            raise UserError("--vllm-mem plans the vLLM servers of a GRPO config on GPUs: give rollout.engine=vllm "
                            "and --device cuda")
        print(f"{p['servers']['colocated']['gpu_memory_utilization']:.2f}")
        return 0
    if p["video_tokens"]:
        from mmpg.plan.decode import estimate

        p["decode"] = estimate(cfg, p, args.decode, args.decode_fps, args.video_minutes, args.footage)
    print(json.dumps(p, indent=1) if args.json else f"{JOB_LINES[job]}; {why}\n" + render(p, where))
    return 0
