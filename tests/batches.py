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
