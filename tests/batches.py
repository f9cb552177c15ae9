"""Building processor batches for tests: prompts with videos of different sizes, prompts without video, either
padding side, and random right-padded completions."""

from __future__ import annotations

import torch

QUESTIONS = [
    "When does the red circle appear?",
    "Find the moment the blue square moves to the left side of the frame.",
    "No video here: how long is a minute?",
    "Where is the yellow triangle?",
]


def random_video(frames: int, height: int, width: int, seed: int) -> torch.Tensor:
    """[T, C, H, W] uint8 frames, as qwen-vl-utils hands them to the processor."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (frames, 3, height, width), generator=g, dtype=torch.uint8)


def vl_batch(processor, family: str, videos_per_prompt: list[tuple | None], padding_side: str = "left"):
    """One prompt per entry: a (frames, height, width) video or None for a text-only prompt."""
    texts, videos, metadata = [], [], []
    for b, spec in enumerate(videos_per_prompt):
        content = ([{"type": "video"}] if spec else []) + [{"type": "text", "text": QUESTIONS[b % len(QUESTIONS)]}]
        texts.append(processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                   add_generation_prompt=True))
        if spec:
            frames, h, w = spec
            videos.append(random_video(frames, h, w, seed=b))
            metadata.append({"fps": 2.0, "total_num_frames": frames, "frames_indices": list(range(frames))})
    return processor_batch(processor, texts, videos, metadata, padding_side)


def processor_batch(processor, texts, videos, metadata, padding_side: str = "left"):
    """The processor's output for chat texts and their [T, C, H, W] frames (frames sized small for the tests)."""
    kwargs = {}
    if videos:
        kwargs = dict(videos=videos, video_metadata=metadata, do_sample_frames=False,
                      size={"shortest_edge": 28 * 28, "longest_edge": 112 * 112})
    return processor(text=texts, padding=True, padding_side=padding_side, return_tensors="pt", **kwargs)


def text_batch(tokenizer, n_prompts: int, padding_side: str = "left"):
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[b % len(QUESTIONS)] * (b + 1)}],
                                           tokenize=False, add_generation_prompt=True) for b in range(n_prompts)]
    return tokenizer(texts, padding=True, padding_side=padding_side, return_tensors="pt")


def completions(group_sizes: list[int], lengths: list[int], vocab: int, seed: int = 0):
    """[N, S] ids and right-padded mask with the given row lengths (padding ids are random too: they must not
    matter)."""
    assert len(lengths) == sum(group_sizes)
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), width), generator=g)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids, mask


# Trajectory trees (a zoom tool's clips inside completions, tests/test_trajectory_tree.py)
CLIP_TEXT = "<|vision_start|><|video_pad|><|vision_end|>"


def zoom_clip(processor, frames: int, height: int, width: int, seed: int) -> tuple[torch.Tensor, dict]:
    """A zoom clip as a tool turn writes it: the family's video text (Qwen3-VL: a timestamp before each frame) for
    [T, C, H, W] frames -> (its token ids [L], its visual inputs)."""
    from mmpg.data.video_form import released_video_text

    meta = {"fps": 4.0, "total_num_frames": frames, "frames_indices": list(range(frames))}
    out = processor_batch(processor, [released_video_text(processor, CLIP_TEXT)],
                          [random_video(frames, height, width, seed)], [meta])
    visuals = {k: out[k] for k in ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts") if k in out}
    return out["input_ids"][0], visuals


def video_prompts(processor, videos: list[int | None], padding_side: str):
    """One prompt per entry: the seed of its (6, 56, 84) video, or None for a text-only prompt; equal seeds are one
    video asked several questions."""
    from mmpg.data.video_form import released_video_text

    texts, frames, meta = [], [], []
    for b, seed in enumerate(videos):
        content = ([{"type": "video"}] if seed is not None else []) + \
            [{"type": "text", "text": QUESTIONS[b % len(QUESTIONS)]}]
        texts.append(released_video_text(processor, processor.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)))
        if seed is not None:
            frames.append(random_video(6, 56, 84, seed))
            meta.append({"fps": 2.0, "total_num_frames": 6, "frames_indices": list(range(6))})
    return processor_batch(processor, texts, frames, meta, padding_side)


def zoom_branches(model, processor, zooms: list[int], seed: int):
    """Completion rows, one per entry of `zooms`: text, then that many clips (each of its own size) each followed by
    text. -> ids [N, S], right-padded mask, per-row visual inputs."""
    from mmpg.grouping.inputs import merge_visuals, placeholder_token_ids

    g = torch.Generator().manual_seed(seed)
    banned = torch.tensor(placeholder_token_ids(model))
    vocab = model.config.text_config.vocab_size

    def text(n):
        ids = torch.randint(0, vocab, (n,), generator=g)
        return ids[~torch.isin(ids, banned)][:max(1, n - 1)]

    rows, visuals = [], []
    for i, k in enumerate(zooms):
        parts, clips = [text(int(torch.randint(1, 6, (1,), generator=g)))], []
        for z in range(k):
            frames = 2 * int(torch.randint(1, 3, (1,), generator=g))  # 2 or 4 frames (1 or 2 temporal patches)
            size = [(56, 56), (56, 84), (84, 56)][(i + z) % 3]
            ids, vis = zoom_clip(processor, frames, *size, seed=100 * seed + 10 * i + z)
            parts += [ids, text(int(torch.randint(1, 5, (1,), generator=g)))]
            clips.append(vis)
        rows.append(torch.cat(parts))
        visuals.append(merge_visuals(clips) if clips else {})
    width = max(r.numel() for r in rows)
    ids = torch.stack([torch.nn.functional.pad(r, (0, width - r.numel()), value=int(r[0])) for r in rows])
    mask = (torch.arange(width)[None, :] < torch.tensor([r.numel() for r in rows])[:, None]).long()
    return ids, mask, visuals



def assert_recompute_matches(model, inputs, rollout, temperature: float, atol: float) -> None:
    """The rollout's logprobs equal `grouped_logprobs` recomputed on the same responses, within `atol`."""
    from mmpg.grouping import grouped_logprobs

    with torch.no_grad():
        recomputed = grouped_logprobs(model, inputs, rollout.completion_ids, rollout.completion_mask,
                                      rollout.group_sizes, temperature=temperature)
    diff = (recomputed - rollout.logprobs).abs()
    worst = int(diff.argmax())
    assert float(diff.max()) <= atol, \
        f"logprob diff {float(diff.max()):.3g} at row {worst // diff.shape[1]}, token {worst % diff.shape[1]}"


def write_mp4(path, frames, fps: int):
    """A real H.264 mp4 (PyAV) of `frames`, each an HxWx3 uint8 array; returns `path`."""
    import av

    frames = list(frames)
    h, w = frames[0].shape[:2]
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for img in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
