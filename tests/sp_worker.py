"""Run under `torchrun --nproc_per_node 2`: the grouped forward with its row spread over the 2 ranks (sequence
parallelism) against the one-process grouped forward and the repeated forward, on the same batch on every rank.

    python -m torch.distributed.run --nproc_per_node 2 tests/sp_worker.py OUT.json [case ...]

Per case it records the max |logprob| difference against both references, the worst relative gradient difference
of any parameter (the SP gradient averaged over the group, `mmpg.grouping.sequence`: the mean over the ranks is the
one-process gradient), whether the vision tower's gradients were compared, the packed row's length and what the
cut between the ranks falls inside (video, prompt text, a shared video's query tail, a response).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from batches import completions, processor_batch, random_video, video_prompts, vl_batch, zoom_branches  # noqa: E402
from mmpg.grouping import grouped_logprobs, repeated_logprobs  # noqa: E402
from mmpg.grouping.adapters import prefix_positions  # noqa: E402
from mmpg.grouping.inputs import (  # noqa: E402
    VIDEO_FEATURES, VIDEO_PART, check_completions, part_span, placeholder_token_ids, split_visuals_per_prompt,
    supports_encoder_outputs)
from mmpg.grouping.sequence import with_video_features  # noqa: E402
from mmpg.grouping.shares import find_shares, pack_shares  # noqa: E402
from mmpg.grouping.layout import GroupLayout  # noqa: E402
from mmpg.toy.models import TinySpec, build_tiny_model, build_tiny_processor  # noqa: E402

TREE_QUESTIONS = ["When does the red circle appear?", "Find the moment the blue square moves to the left side.",
                  "When is it?", "Where does the yellow triangle first become visible in the frame?"]


def shared_batch(processor, prompts, padding_side="left"):
    """prompts: (frames, h, w, seed) or None, question index; equal specs give equal frames (a shared video)."""
    texts, videos, metadata = [], [], []
    for spec, q in prompts:
        content = ([{"type": "video"}] if spec else []) + [{"type": "text", "text": TREE_QUESTIONS[q]}]
        texts.append(processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                   add_generation_prompt=True))
        if spec:
            frames, h, w, seed = spec
            videos.append(random_video(frames, h, w, seed=seed))
            metadata.append({"fps": 2.0, "total_num_frames": frames, "frames_indices": list(range(frames))})
    return processor_batch(processor, texts, videos, metadata, padding_side)


def cut_kind(model, inputs, ids, mask, groups, sp) -> tuple[int, str]:
    """The packed row's length and what the first token of rank 1's shard is (the row packed as grouped_logprobs
    packs it)."""
    comp = check_completions(inputs, ids, mask, groups, placeholder_token_ids(model))
    visuals = split_visuals_per_prompt(model, inputs)
    prefixes = prefix_positions(model, inputs, visuals)
    shares = find_shares(prefixes, visuals, placeholder_token_ids(model), comp.group_sizes)
    packed, _, row_lens, row_skip = pack_shares(prefixes, comp, shares, "cpu")
    layout = GroupLayout([s.length for s in shares], row_lens, "cpu", row_skip=row_skip)
    cut = -(-layout.total // sp)
    for b in range(layout.num_groups):
        a, e = layout.prefix_span(b)
        if a <= cut < e:  # inside the video: between its first and last placeholder (Qwen3-VL puts text between
            video = (packed[a:e] == model.config.video_token_id).nonzero()[:, 0] + a  # frames)
            inside = video.numel() and int(video[0]) < cut <= int(video[-1])
            return layout.total, "video" if inside else "prompt"
        start = e
        for s, k in zip(row_lens[b], row_skip[b]):
            if start <= cut < start + s:
                return layout.total, "tail" if cut - start < k else "response"
            start += s
    raise AssertionError("cut outside the row")


def _grads(model, fn, weights):
    model.zero_grad(set_to_none=True)
    logps = fn()
    (logps * weights).sum().backward()
    return logps.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def run_case(model, inputs, ids, mask, groups, group, sp) -> dict:
    weights = torch.linspace(0.5, 1.5, ids.numel()).view_as(ids)
    one, one_grads = _grads(model, lambda: grouped_logprobs(model, inputs, ids, mask, groups), weights)
    rep, rep_grads = _grads(model, lambda: repeated_logprobs(model, inputs, ids, mask, groups), weights)
    # the repeated reference on a rank that holds only its part of the pixels: the group encodes the whole videos and
    # passes them as features (a transformers whose forward takes none refuses in one line)
    rank = dist.get_rank(group)
    rep_part = rep_part_grads = refused = None
    rep_part_grad = 0.0
    if supports_encoder_outputs(model):
        rep_part, rep_part_grads = _grads(model, lambda: repeated_logprobs(
            model, own_part(inputs, rank, sp), ids, mask, groups, sequence_group=group), weights)
        for name, ref in rep_grads.items():
            g = rep_part_grads[name].clone()
            dist.all_reduce(g, group=group)
            rep_part_grad = max(rep_part_grad, float((g / sp - ref).norm() / ref.norm().clamp_min(1e-30)))
    else:
        try:
            repeated_logprobs(model, own_part(inputs, rank, sp), ids, mask, groups, sequence_group=group)
        except RuntimeError as e:
            refused = str(e)
    # the whole videos' features as sampling takes them (each video once by key) against the tower on the whole video
    keys = [tuple(g) for g in inputs["video_grid_thw"].tolist()]  # equal grids here: equal videos (shared_batch)
    with torch.no_grad():
        feats = with_video_features(model, own_part(inputs, rank, sp), group, keys)[VIDEO_FEATURES]
        whole = model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"],
                                               return_dict=True).pooler_output
        whole = torch.cat(list(whole)) if isinstance(whole, (tuple, list)) else whole
    seen = []  # pixel rows the vision tower encodes on this rank under SP: its share of the frames, not all
    hook = model.model.visual.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[0]))
    par, par_grads = _grads(model, lambda: grouped_logprobs(model, inputs, ids, mask, groups, sequence_group=group),
                            weights)
    hook.remove()
    # each rank holding only its own part of every video's pixel rows (decoded per rank, `VIDEO_PART`): the same
    # computation, so the same logprobs and gradients
    part, part_grads = _grads(model, lambda: grouped_logprobs(model, own_part(inputs, dist.get_rank(group), sp), ids,
                                                                 mask, groups, sequence_group=group), weights)
    part_grad = max(float((part_grads[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in par_grads.items())
    shares = [None] * sp
    dist.all_gather_object(shares, sum(seen))
    assert set(one_grads) == set(par_grads), set(one_grads) ^ set(par_grads)
    worst, worst_name = 0.0, None
    for name, ref in one_grads.items():
        g = par_grads[name].clone()
        dist.all_reduce(g, group=group)
        rel = float((g / sp - ref).norm() / ref.norm().clamp_min(1e-30))
        if rel > worst:
            worst, worst_name = rel, name
    total, kind = cut_kind(model, inputs, ids, mask, groups, sp)
    return {"logp_vs_grouped": float(((par - one).abs() * mask).max()),
            "logp_vs_repeated": float(((par - rep).abs() * mask).max()),
            "zero_outside_mask": bool(torch.all(par[mask == 0] == 0)),
            "grad_rel": worst, "grad_worst": worst_name, "vision_grads": any("visual" in n for n in one_grads),
            "row": total, "cut": kind, "vision_rows": shares, "pixel_rows": int(inputs["pixel_values_videos"].shape[0]),
            "part_logp": float(((part - par).abs() * mask).max()), "part_grad_rel": part_grad,
            "part_same_grads": set(part_grads) == set(par_grads),
            "rep_part_logp": None if rep_part is None else float(((rep_part - rep).abs() * mask).max()),
            "rep_part_grad_rel": rep_part_grad, "rep_part_refused": refused,
            "rep_part_vision_grads": rep_part_grads is not None and any("visual" in n for n in rep_part_grads),
            "features_max": float((feats - whole).abs().max()), "features_rows": [int(feats.shape[0]), int(whole.shape[0])]}


def run_tree_case(model, processor, group, sp) -> dict:
    """A trajectory tree (branches holding zoom clips, `completion_visuals`) with its row over the group: against the
    one-process grouped forward and the repeated one, with the prompts' videos whole on every rank and as each rank's
    part; the clips are whole on every rank (a tool turn's frames), each rank encoding its share of them too."""
    inputs = video_prompts(processor, [0, None, 1], "left")
    groups = [2, 1, 2]
    ids, mask, clips = zoom_branches(model, processor, [2, 0, 1, 3, 0], seed=7)
    weights = torch.linspace(0.5, 1.5, ids.numel()).view_as(ids)
    one, one_grads = _grads(model, lambda: grouped_logprobs(model, inputs, ids, mask, groups,
                                                            completion_visuals=clips), weights)
    rep = repeated_logprobs(model, inputs, ids, mask, groups, completion_visuals=clips).detach()
    out = {"logp_vs_repeated_one": float(((one - rep).abs() * mask).max())}
    rank = dist.get_rank(group)
    for name, given in (("whole", inputs), ("part", own_part(inputs, rank, sp))):
        par, par_grads = _grads(model, lambda: grouped_logprobs(model, given, ids, mask, groups, sequence_group=group,
                                                                completion_visuals=clips), weights)
        worst = 0.0
        for key, ref in one_grads.items():
            g = par_grads[key].clone()
            dist.all_reduce(g, group=group)
            worst = max(worst, float((g / sp - ref).norm() / ref.norm().clamp_min(1e-30)))
        out[f"{name}_logp"] = float(((par - one).abs() * mask).max())
        out[f"{name}_grad_rel"] = worst
        out[f"{name}_same_grads"] = set(par_grads) == set(one_grads)
    # the repeated reference from each rank's part (the prompts' videos and the clips encoded by the group, as features)
    if supports_encoder_outputs(model):
        rep_part = repeated_logprobs(model, own_part(inputs, rank, sp), ids, mask, groups, sequence_group=group,
                                     completion_visuals=clips).detach()
        out["rep_part_logp"] = float(((rep_part - rep).abs() * mask).max())
    out["vision_grads"] = any("visual" in n for n in one_grads)
    out["clips"] = int(sum(int(c["video_grid_thw"].shape[0]) for c in clips if c))
    return out


def own_part(inputs, rank: int, sp: int) -> dict:
    """The inputs with only rank `rank` of `sp`'s pixel rows of each video (its temporal patch groups), marked
    `VIDEO_PART`: what a rank's loader builds when it decodes only its frames."""
    grid, pixels = inputs["video_grid_thw"], inputs["pixel_values_videos"]
    rows, start = [], 0
    for t, h, w in grid.tolist():
        a, b = part_span(t, rank, sp)
        rows.append(pixels[start + a * h * w: start + b * h * w])
        start += t * h * w
    return {**inputs, "pixel_values_videos": torch.cat(rows), VIDEO_PART: torch.tensor([[rank, sp]] * len(grid))}


def cases(family: str, model, processor, model_kv1, processor_kv1):
    vocab = model.config.text_config.vocab_size
    several = [(8, 112, 112), (4, 112, 56), None, (6, 56, 112)]
    groups = [2, 3, 1, 2]
    lengths = [3, 5, 2, 4, 6, 1, 2, 7]
    for side in ("left", "right"):
        ids, mask = completions(groups, lengths, vocab, seed=1)
        yield f"{family}/several_{side}", model, vl_batch(processor, family, several, side), ids, mask, groups
    ids, mask = completions(groups, lengths, vocab, seed=2)
    yield f"{family}/kv1_replicated", model_kv1, vl_batch(processor_kv1, family, several), ids, mask, groups
    video = (16, 112, 112, 1)
    shared = [(video, 0), (video, 1), (video, 3), ((4, 112, 56, 2), 2)]
    share_groups = [2, 2, 1, 2]
    for seed in range(40):  # response lengths that put the cut inside a shared video's query tail
        g = torch.Generator().manual_seed(seed)
        ids, mask = completions(share_groups, torch.randint(1, 9, (7,), generator=g).tolist(), vocab, seed=seed)
        inputs = shared_batch(processor, shared)
        if cut_kind(model, inputs, ids, mask, share_groups, 2)[1] == "tail":
            yield f"{family}/shared_cut_in_tail", model, inputs, ids, mask, share_groups
            break
    ids, mask = completions([2], [4, 3], vocab, seed=3)  # a long video, short responses: the cut inside the video
    yield f"{family}/cut_in_video", model, vl_batch(processor, family, [(16, 112, 112)]), ids, mask, [2]
    ids, mask = completions([2], [90, 41], vocab, seed=4)  # long responses, odd row: the cut inside a response
    yield f"{family}/cut_in_response_odd", model, vl_batch(processor, family, [(2, 56, 56)]), ids, mask, [2]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    out_path, wanted = argv[0], set(argv[1:])
    dist.init_process_group("gloo")
    group, sp = dist.group.WORLD, dist.get_world_size()
    torch.manual_seed(0)
    results = {}
    for family in ("qwen2_5_vl", "qwen3_vl"):
        if wanted and not any(w.startswith(family) for w in wanted):
            continue
        processor = build_tiny_processor(family, seed=0)
        model = build_tiny_model(family, seed=0, tokenizer=processor.tokenizer)
        spec = TinySpec(num_kv_heads=1)
        processor_kv1 = build_tiny_processor(family, spec, seed=0)
        model_kv1 = build_tiny_model(family, spec, seed=0, tokenizer=processor_kv1.tokenizer)
        for name, m, inputs, ids, mask, groups in cases(family, model, processor, model_kv1, processor_kv1):
            if wanted and name not in wanted and family not in wanted:
                continue
            results[name] = run_case(m, inputs, ids, mask, groups, group, sp)
            if dist.get_rank() == 0:
                print(name, results[name], flush=True)
        name = f"{family}/trajectory_tree"
        if not wanted or name in wanted or family in wanted:
            results[name] = run_tree_case(model, processor, group, sp)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
