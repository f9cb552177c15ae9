"""The trajectory tree's update against the per-branch forward (glance and zoom's training forward), a program that
prints a table:

    python -m mmpg.bench.zoom                      # CPU shapes: a 4-layer LM, overview ~512 tokens, clips ~128
    python -m mmpg.bench.zoom --preset 3b          # Qwen2.5-VL-3B's shape: overview ~8k tokens, clips ~2k, G 16

One prompt (an overview video of ~P LM tokens after 8 text tokens) and G branches, branch i holding zooms[i mod 4]
clips (0-3 by default) of ~C tokens each between turns of S text tokens, as multi-turn rollouts write them:

    per-branch  `repeated_logprobs(completion_visuals=)`: G rows [prompt | branch i], the overview encoded and
                forwarded G times (what the anchors' trainers do: every sample re-sends its whole conversation)
    tree        `grouped_logprobs(completion_visuals=)`: one row [prompt | branch 1 | ... | branch G], the overview
                encoded and forwarded once, each clip once

Each step is the update's work: logprobs of every completion token, a token-mean loss over the model's own turns,
backward. Timed after a warm-up, the variants interleaved over --rounds, the median reported; peak memory per
variant on CUDA (torch's allocator; on the CPU the column is empty: this process's high-water mark mixes both).
The ceiling is the FLOPs ratio of the two layouts as they run (`ceiling`): LM tokens, causal attention pairs, the
LM head on the completions (the same in both), the vision tower on the overview (G times or once) and on every clip
(once in both), forward + backward; the per-branch rows are one padded batch (each row as long as the longest
branch), as `repeated_logprobs` forwards them. The speed-up is printed beside it and as its share (%ceil).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

PRESETS = {
    "cpu": {"spec": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                     "intermediate_size": 512}, "P": 512, "C": 128, "S": 32, "G": 8},
    "3b": {"spec": {"hidden_size": 2048, "num_layers": 36, "num_heads": 16, "num_kv_heads": 2,
                    "intermediate_size": 11008, "vision_depth": 32, "vision_hidden_size": 1280, "vision_heads": 16},
           "P": 8192, "C": 2048, "S": 128, "G": 16, "dtype": "bfloat16", "vocab": 151936,
           "vision_intermediate": 3420},
}
TOOL_TEXT = 12  # text tokens of a tool turn around its clip (the <tool_response> frame, the window's times)


def branch_layout(G: int, zooms: list[int]) -> list[int]:
    """The clip count of each of the G branches: zooms repeated in order."""
    return [zooms[i % len(zooms)] for i in range(G)]


def _clip(model, ids: dict, tokens: int, gen: torch.Generator):
    """One clip: its completion tokens (<vs> pads <ve>) and its visual inputs, ~`tokens` LM tokens."""
    from mmpg.bench.batch import video_grid

    vc = model.config.vision_config
    t, h, w = video_grid(tokens + 16)
    n = t * h * w // vc.spatial_merge_size ** 2
    dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    seq = torch.cat([torch.tensor([ids["vision_start"]]), torch.full((n,), ids["video"]),
                     torch.tensor([ids["vision_end"]])])
    visuals = {"pixel_values_videos": torch.randn(t * h * w, dim, generator=gen).to(model.dtype),
               "video_grid_thw": torch.tensor([[t, h, w]])}
    return seq, visuals, t * h * w, h * w


def build_case(model, ids: dict, P: int, C: int, S: int, G: int, zooms: list[int], device, seed: int = 1):
    """(prompt inputs, completion ids [G, L], completion mask, own mask, per-row clips, shape) for the case."""
    from mmpg.bench.batch import TEXT_IDS, make_inputs
    from mmpg.grouping.inputs import merge_visuals

    prompt, _, _, info = make_inputs(model, {"P": P, "S": 1, "G": 1}, ids, device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    rows, owns, visuals, clip_patches, frame_patches = [], [], [], [], 0
    for k in branch_layout(G, zooms):
        parts, own, clips = [torch.randint(0, TEXT_IDS, (S,), generator=gen)], [torch.ones(S)], []
        for _ in range(k):
            seq, vis, patches, frame_patches = _clip(model, ids, C, gen)
            text = torch.randint(0, TEXT_IDS, (TOOL_TEXT,), generator=gen)
            tool = torch.cat([text[: TOOL_TEXT // 2], seq, text[TOOL_TEXT // 2:]])
            parts += [tool, torch.randint(0, TEXT_IDS, (S,), generator=gen)]
            own += [torch.zeros(tool.numel()), torch.ones(S)]
            clips.append(vis)
            clip_patches.append(patches)
        rows.append(torch.cat(parts))
        owns.append(torch.cat(own))
        visuals.append({k: v.to(device) for k, v in merge_visuals(clips).items()} if clips else {})
    width = max(r.numel() for r in rows)
    ids_ = torch.zeros(G, width, dtype=torch.long)
    mask, own_mask = torch.zeros(G, width, dtype=torch.long), torch.zeros(G, width)
    for i, (r, o) in enumerate(zip(rows, owns)):
        ids_[i, :r.numel()], mask[i, :r.numel()], own_mask[i, :r.numel()] = r, 1, o
    shape = {"P": info["P"], "lengths": [r.numel() for r in rows], "video_patches": info.get("video_patches", 0),
             "frame_patches": info.get("frame_patches", 0), "clip_patches": clip_patches,
             "clip_frame_patches": frame_patches}
    return prompt, ids_.to(device), mask.to(device), own_mask.to(device), visuals, shape


def ceiling(dims, shape: dict) -> float:
    """Step FLOPs per-branch / tree (module docstring), forward + backward (3x forward in every term)."""
    from mmpg.bench.flops import attn_per_pair, linear_per_token, vision_flops

    P, lengths = shape["P"], shape["lengths"]
    per_token, per_pair = linear_per_token(dims), attn_per_pair(dims)

    def lm(tokens, pairs):
        return dims.layers * (per_token * tokens + per_pair * pairs)

    head = 2 * dims.hidden * dims.vocab * sum(lengths)
    width = max(lengths)  # the per-branch rows are one batch, each padded to the longest branch
    repeated = lm(len(lengths) * (P + width), len(lengths) * (P + width) ** 2 / 2) + head
    tree = lm(P + sum(lengths), P ** 2 / 2 + sum(n * P + n ** 2 / 2 for n in lengths)) + head
    if dims.vision is not None:
        overview = vision_flops(dims.vision, shape["video_patches"], shape["frame_patches"] or 1)
        clips = sum(vision_flops(dims.vision, p, shape["clip_frame_patches"] or 1) for p in shape["clip_patches"])
        repeated += len(lengths) * overview + clips
        tree += overview + clips
    return repeated / tree


def _step(variant: str, model, prompt, ids, mask, own, visuals, G: int) -> None:
    from mmpg.grouping import grouped_logprobs, repeated_logprobs

    fn = grouped_logprobs if variant == "tree" else repeated_logprobs
    logp = fn(model, prompt, ids, mask, [G], completion_visuals=visuals)
    loss = -(logp.float() * own).sum() / own.sum()
    loss.backward()
    model.zero_grad(set_to_none=True)


def measure(model, case, device, variants: list[str], rounds: int) -> dict:
    """{variant: {"seconds": median step, "peak_mb": CUDA peak or None}}."""
    out = {v: {"times": [], "peak_mb": None} for v in variants}
    for v in variants:  # warm-up (kernels, allocator)
        _step(v, model, *case, model_G(case))
    for _ in range(rounds):
        for v in variants:
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            _step(v, model, *case, model_G(case))
            if device.type == "cuda":
                torch.cuda.synchronize()
                out[v]["peak_mb"] = max(out[v]["peak_mb"] or 0, torch.cuda.max_memory_allocated() / 2 ** 20)
            out[v]["times"].append(time.perf_counter() - t0)
    return {v: {"seconds": statistics.median(r["times"]), "peak_mb": r["peak_mb"]} for v, r in out.items()}


def model_G(case) -> int:
    return int(case[1].shape[0])


def table(rows: list[dict]) -> str:
    lines = ["| G | zooms | P | branch tokens (mean) | per-branch s | tree s | speed-up | ceiling | %ceil | "
             "per-branch MB | tree MB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["measured"]
        a, b = m["per-branch"], m["tree"]
        speed = a["seconds"] / b["seconds"]
        mb = [f"{x['peak_mb']:.0f}" if x["peak_mb"] is not None else "" for x in (a, b)]
        lines.append(f"| {r['G']} | {r['zooms']} | {r['P']} | {r['mean_length']:.0f} | {a['seconds']:.3f} | "
                     f"{b['seconds']:.3f} | {speed:.2f}x | {r['ceiling']:.2f}x | {100 * speed / r['ceiling']:.0f}% | "
                     f"{mb[0]} | {mb[1]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmpg.bench.zoom", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--G", type=int, nargs="+", help="group sizes (default: the preset's)")
    p.add_argument("--P", type=int, help="overview LM tokens (default: the preset's)")
    p.add_argument("--C", type=int, help="LM tokens per clip (default: the preset's)")
    p.add_argument("--S", type=int, help="text tokens per model turn (default: the preset's)")
    p.add_argument("--zooms", type=int, nargs="+", default=[0, 1, 2, 3], help="clips per branch, cycled")
    p.add_argument("--family", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen3_vl"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="auto")
    p.add_argument("--json", help="write the rows here too")
    args = p.parse_args(argv)
    from mmpg.bench.model import build_model
    from mmpg.models.geometry import from_config_dict

    preset = PRESETS[args.preset]
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    case = {"family": args.family, "spec": preset["spec"], "dtype": preset.get("dtype", "float32"),
            **{k: preset[k] for k in ("vocab", "vision_intermediate") if k in preset}}
    model, ids = build_model(case, device)
    dims = from_config_dict(model.config.to_dict(), args.family)
    rows = []
    for G in args.G or [preset["G"]]:
        built = build_case(model, ids, args.P or preset["P"], args.C or preset["C"], args.S or preset["S"], G,
                           args.zooms, device)
        *inputs, shape = built
        measured = measure(model, inputs, device, ["per-branch", "tree"], args.rounds)
        rows.append({"G": G, "zooms": "-".join(map(str, args.zooms)), "P": shape["P"],
                     "mean_length": statistics.mean(shape["lengths"]), "ceiling": ceiling(dims, shape),
                     "measured": measured, "device": str(device), "family": args.family, "preset": args.preset})
    print(f"trajectory tree vs per-branch forward, one update step (logprobs, loss, backward), {args.family}, "
          f"{args.preset} shapes, {device}, median of {args.rounds}")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
