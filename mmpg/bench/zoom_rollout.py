"""Multi-turn rollouts with the zoom tool on the HF engine: each branch's K/V kept between turns against every later
turn re-sent as a new prompt (the overview prefilled again per branch), a program that prints a table:

    python -m mmpg.bench.zoom_rollout                 # a tiny Qwen2.5-VL (LM hidden 256, 4 layers), G 8
    python -m mmpg.bench.zoom_rollout --family qwen3_vl --overview-fps 1

It builds what it measures: a tiny checkpoint (`mmpg.toy.models.make_tiny`) and the toy zoom task's videos
(`mmpg.toy.zoom_task`, 40 s), decoded at --pixels per frame (an overview of --overview-fps, clips of --zoom-frames
at 4 fps). The model is random, so the tool's side is scripted: one token in --stop-every of the vocabulary ends a
turn (at most --new-tokens tokens), and each of the first --turns turns is taken as a zoom on the window of
--zoom-frames frames at 4 fps around the flash; the turn after the last tool turn ends the trajectory. Both paths
sample the same tokens (temperature 1, each branch seeded by its prompt, row and turn), which the program checks.

    kept     `HFEngine()`: the overview prefilled once for the tree, each tool turn one chunk behind its branch's
             K/V, each prompt's overview read once per decode step for all its branches
    re-sent  `HFEngine(keep_turns=False)`: each later turn's conversation a new prompt per branch, its overview and
             clips encoded and prefilled again

Columns: wall time (median of --rounds, the two paths interleaved after a warm-up), LM tokens forwarded in prefills
(vision-tower patches aside) and videos through the vision tower. The ceiling is the ratio of the work both do as they
run, in LM token-forwards: prefilled tokens plus one per decode step and live row (the same in both); it counts no
attention, which the kept path also reads once per prompt, so the measured speed-up may pass it at long overviews.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mmpg.bench.zoom_rollout", description=__doc__.splitlines()[0])
    p.add_argument("--family", default="qwen2_5_vl", choices=("qwen2_5_vl", "qwen3_vl"))
    p.add_argument("--prompts", type=int, default=2, help="videos (one query each) in the batch")
    p.add_argument("--G", type=int, default=8, help="trajectories per prompt")
    p.add_argument("--turns", type=int, default=2, help="tool turns per trajectory (zoom.max_turns)")
    p.add_argument("--new-tokens", type=int, default=16, help="most tokens of a model turn")
    p.add_argument("--stop-every", type=int, default=8, help="one token in N of the vocabulary ends a turn")
    p.add_argument("--overview-fps", type=float, default=2.0)
    p.add_argument("--zoom-frames", type=int, default=16, help="frames of a clip (at 4 fps: a 4-second window)")
    p.add_argument("--pixels", type=int, default=224 * 224, help="pixels per frame (min = max)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return p.parse_args(argv)


class _Scripted:
    """The tool's side: turn k < turns zooms on the longest window the tool returns, centred on the flash of the
    sample's video; the next ends the trajectory."""

    def __init__(self, env, flashes: dict, turns: int):
        self.env, self.flashes, self.turns, self.settings = env, flashes, turns, env.settings

    def step(self, sample, turn, tool_turns):
        from mmpg.rollout.zoom import call_text

        if tool_turns >= self.turns:
            return None
        lo, hi = self.env.shown(sample)
        width = self.settings.max_window_s  # the longest window the tool returns: --zoom-frames at 4 fps
        start = max(lo, min(hi - width, self.flashes[sample.sample_id] - width / 2))
        return self.env.step(sample, call_text(round(start, 2), round(start + width, 2)), tool_turns)


def _setup(args, tmp: Path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmpg.data.formats import load_annotations
    from mmpg.data.prompts import build_prompt_inputs
    from mmpg.data.video import VideoSpec, load_video
    from mmpg.rollout.zoom import ZoomEnvironment, ZoomSettings
    from mmpg.toy.models import TinySpec, make_tiny
    from mmpg.toy.zoom_task import write_zoom_dataset

    spec = TinySpec(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512, vision_depth=2)
    ckpt = make_tiny(args.family, tmp / "model", seed=0, spec=spec)
    write_zoom_dataset(tmp / "zoom", max(2, args.prompts + 1), seed=0, test_fraction=0.01)
    samples = load_annotations(tmp / "zoom" / "train.json", tmp / "zoom" / "videos").samples[: args.prompts]
    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(ckpt)
    video = VideoSpec.for_family(args.family, fps=args.overview_fps, min_frames=4, max_frames=768,
                                 min_pixels=args.pixels, max_pixels=args.pixels)
    videos = [load_video(s.video, video, s.clip_start, s.clip_end) for s in samples]
    inputs = build_prompt_inputs(processor, samples, videos, "zoom")
    settings = ZoomSettings(fps=4.0, max_frames=args.zoom_frames, max_turns=args.turns)
    env = _Scripted(ZoomEnvironment(settings, video), {s.sample_id: sum(s.span) / 2 for s in samples}, args.turns)
    return model, processor, inputs, samples, env


def _run(model, processor, inputs, samples, env, args, keep: bool) -> dict:
    from mmpg.models.vision_calls import VisionCalls
    from mmpg.rollout import HFEngine, SamplingParams
    from mmpg.rollout.multiturn import sample_trajectories

    vocab = model.config.get_text_config().vocab_size
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0,
                              stop_token_ids=tuple(range(0, vocab, args.stop_every)))
    engine = HFEngine(model, processor, keep_turns=keep)
    with VisionCalls(model) as vision:
        t0 = time.perf_counter()
        out = sample_trajectories(engine, model, processor, inputs, samples, args.G, env, sampling,
                                  prompt_seeds=list(range(len(samples))))
        seconds = time.perf_counter() - t0
        calls = vision.take()
    decode = int(out.own_mask.sum())  # every model token is one row's decode step (its last is sampled, not fed)
    return {"seconds": seconds, "prefill": out.prefix_tokens, "decode": decode, "vision": calls,
            "ids": out.completion_ids, "zooms": sum(out.zooms)}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model, processor, inputs, samples, env = _setup(args, Path(tmp))
        _run(model, processor, inputs, samples, env, args, True)  # warm-up (and the clips' decoding)
        runs = {True: [], False: []}
        for _ in range(args.rounds):
            for keep in (True, False):
                runs[keep].append(_run(model, processor, inputs, samples, env, args, keep))
    kept, sent = runs[True][-1], runs[False][-1]
    if kept["zooms"] == 0:
        print("error: no branch zoomed (every turn was cut at --new-tokens): raise --new-tokens or lower --stop-every",
              file=sys.stderr)
        return 1
    if not torch.equal(kept["ids"], sent["ids"]):
        print("error: the two paths sampled different tokens", file=sys.stderr)
        return 1
    work = {k: r["prefill"] + r["decode"] for k, r in ((True, kept), (False, sent))}
    med = {k: statistics.median(r["seconds"] for r in v) for k, v in runs.items()}
    overview = int(inputs["input_ids"].shape[1])
    print(f"zoom rollouts, HF engine: {args.family} (LM hidden 256, 4 layers), {args.prompts} prompt(s) x G {args.G}, "
          f"prompt ~{overview} tokens, {args.turns} zoom(s) of {args.zoom_frames} frames per branch "
          f"({kept['zooms']} clips in all), turns of <= {args.new_tokens} tokens, torch threads "
          f"{torch.get_num_threads()}")
    print(f"{'path':<10}{'seconds':>10}{'prefill tokens':>16}{'decode tokens':>15}{'vision videos':>15}")
    for name, keep in (("re-sent", False), ("kept", True)):
        r = kept if keep else sent
        print(f"{name:<10}{med[keep]:>10.3f}{r['prefill']:>16}{r['decode']:>15}{r['vision']:>15}")
    print(f"speed-up {med[False] / med[True]:.2f}x; ceiling (LM token-forwards, re-sent / kept) "
          f"{work[False] / work[True]:.2f}x; same tokens: yes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
