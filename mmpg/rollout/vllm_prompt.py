"""What the vLLM engine sends and checks: the trainer's prompt ids with each video back as the one token vLLM expands,
each distinct video once, the check that vLLM's expansion is the trainer's prompt, and the request's figures.

vLLM gets the trainer's own token ids (no re-templating) and the decoded frames, and writes each video's tokens again
from the frames, replacing the placeholder its transformers' processor replaces: the lone `<|video_pad|>` on
transformers >= 5.10 (vLLM 0.32, `Qwen3VLMultiModalProcessor._expands_only_video_token`), the template's
`<|vision_start|><|video_pad|><|vision_end|>` on older ones. So each video goes back to one `<|video_pad|>`:

    Qwen2.5-VL             <vs> pad*n <ve>                                              -> <vs> pad <ve>
    Qwen3-VL, released     <0.3 seconds> <vs> pad*n <ve> <1.3 seconds> <vs> pad*n <ve>  -> pad
    Qwen3-VL, 5.x nested   <vs> <0.3 seconds> <vs> pad*n <ve> ... <ve>                  -> <vs> pad <ve>

and vLLM's expansion is the trainer's prompt token for token in each form (the engine checks every request). mmpg's
prompts are in the released form (`mmpg.data.video_form`); a nested prompt built by hand round-trips too. A Qwen3-VL
frame is `<vs> pad+ <ve>` right after its timestamp text (ids that spell `<t seconds>`); the frames of a video follow
each other directly and become one video token (the engine sends one video per prompt).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Callable

import torch

from mmpg.rollout.engine import group_sizes_for
from mmpg.serve.wire import ServerError

TIMESTAMP = re.compile(r"<\d+(?:\.\d+)? seconds>")
MAX_TIMESTAMP_TOKENS = 16  # "<", the digits one by one, ".", a digit, " seconds", ">": 12 tokens up to 10^6 s


def wire_collapser(model, processor) -> Callable[[list[int]], list[int]]:
    """ids [P] -> the ids the engine sends for the model (`collapse_videos` with the model's tokens)."""
    config = model.config
    token = getattr(config, "video_token_id", None)
    start, end = (getattr(config, k, None) for k in ("vision_start_token_id", "vision_end_token_id"))
    brackets = (int(start), int(end)) if start is not None and end is not None else None
    token = int(token) if token is not None else None
    is_timestamp = None
    if getattr(config, "model_type", None) == "qwen3_vl":
        tokenizer = getattr(processor, "tokenizer", processor)
        is_timestamp = lambda ids: TIMESTAMP.fullmatch(tokenizer.decode(ids)) is not None  # noqa: E731
    return lambda ids: collapse_videos(ids, token, brackets, is_timestamp)


def collapse_videos(ids: list[int], token: int | None, brackets: tuple[int, int] | None,
                    is_timestamp: Callable[[list[int]], bool] | None = None) -> list[int]:
    """[P] -> the ids with each video as one video token (module docstring). token: the video token (None: a text
    model, ids unchanged); brackets: (<vs>, <ve>); is_timestamp(ids): whether ids spell a frame's `<t seconds>`
    (None: a family without timestamps). Runs of the video token anywhere else collapse to one."""
    if token is None:
        return ids
    frames = _timed_frames(ids, token, brackets, is_timestamp) if brackets and is_timestamp else []
    out, i, f = [], 0, 0
    while i < len(ids):
        if f < len(frames) and frames[f][0] == i:
            while f < len(frames) and frames[f][0] == i:  # the frames of one video, back to back
                i = frames[f][1]
                f += 1
            out.append(token)
        else:
            out.append(ids[i])
            i += 1
    return [t for k, t in enumerate(out) if t != token or k == 0 or out[k - 1] != token]


def _timed_frames(ids: list[int], token: int, brackets: tuple[int, int],
                  is_timestamp: Callable[[list[int]], bool]) -> list[tuple[int, int]]:
    """[(first, past)]: the span of each frame `<t seconds> <vs> pad+ <ve>` in ids, in order. The timestamp is the
    shortest run of ids before the <vs> that spells one (never reaching into the frame before)."""
    start, end = brackets
    frames, k, floor = [], 0, 0
    while k < len(ids) - 1:
        if ids[k] != start or ids[k + 1] != token:
            k += 1
            continue
        e = k + 1
        while e < len(ids) and ids[e] == token:
            e += 1
        if e < len(ids) and ids[e] == end:
            first = next((j for j in range(k - 1, max(floor, k - MAX_TIMESTAMP_TOKENS) - 1, -1)
                          if is_timestamp(ids[j:k])), None)
            if first is not None:
                frames.append((first, e + 1))
            floor = e + 1
        k = e
    return frames


def distinct_videos(videos: Sequence) -> tuple[list[tuple[torch.Tensor, dict]], list[int | None]]:
    """[B] videos (None: no video) -> the distinct ones as (frames [T, C, H, W], metadata) and each prompt's index
    into them (None for none). Distinct means another object whose frames or metadata differ: the same object is one
    video (the loader hands a video's queries one `DecodedVideo`), and so are two objects with equal metadata and
    equal frames (compared exactly, only when shapes and metadata already agree)."""
    table: list[tuple[torch.Tensor, dict]] = []
    seen: dict[int, int] = {}  # id(video) -> index
    index: list[int | None] = []
    for video in videos:
        if video is None:
            index.append(None)
            continue
        if id(video) not in seen:
            frames, meta = frames_and_metadata(video)
            same = (v for v, (f, m) in enumerate(table)
                    if m == meta and f.shape == frames.shape and f.dtype == frames.dtype and torch.equal(f, frames))
            seen[id(video)] = next(same, len(table))
            if seen[id(video)] == len(table):
                table.append((frames, meta))
        index.append(seen[id(video)])
    return table, index


def rollout_stats(ids: list[list[int]], index: list[int | None], answer: dict, request_bytes: int) -> dict:
    """`VLLMEngine.last_stats` from the server's answer, in `HFEngine.last_stats`' terms: prompts B; prefixes, the
    prompts that do not follow an earlier prompt of the batch with the same video (each video's first query, every
    text-only prompt); shared_prompts, B - prefixes; prefix_tokens, the prompt tokens vLLM computed (its counters:
    looked up in its prefix cache less found there, over every sample's sequence); and vLLM's own cached_tokens,
    processor_runs, videos, request_bytes, timing_s, and version (the server's weights that served it). ids: [B] the prompts' token ids; index: [B] each prompt's video
    in the request's table (None: none)."""
    firsts = {v: b for b, v in reversed(list(enumerate(index))) if v is not None}  # each video's first prompt
    shared = sum(1 for b, v in enumerate(index) if v is not None and firsts[v] != b)
    counters = dict(answer.get("counters") or {})
    if "prefix_cache_queries" in counters and "prefix_cache_hits" in counters:  # vLLM's own count, every sample's
        cached = int(counters["prefix_cache_hits"])
        computed = int(counters["prefix_cache_queries"]) - cached
    else:  # an older vLLM: one sample's figure per prompt
        cached = sum(int(c) for c in answer.get("cached_tokens") or [])
        computed = sum(map(len, ids)) - cached
    return {"prompts": len(ids), "prefixes": len(ids) - shared, "prefix_tokens": computed, "shared_prompts": shared,
            "cached_tokens": cached, "videos": len(firsts), "request_bytes": int(request_bytes),
            "processor_runs": (counters["mm_cache_queries"] - counters["mm_cache_hits"]
                               if "mm_cache_queries" in counters and "mm_cache_hits" in counters else None),
            "timing_s": dict(answer.get("timing_s") or {}), "version": answer.get("version")}


def prompt_ids(prompt_inputs) -> list[list[int]]:
    """[B] lists of the prompts' token ids without padding (either side)."""
    if "input_ids" not in prompt_inputs:
        raise ValueError("prompt_inputs needs 'input_ids' (the processor output for the B prompts)")
    ids = prompt_inputs["input_ids"]  # [B, P]
    mask = prompt_inputs.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask  # [B, P]
    out = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    group_sizes_for(1, len(out))  # refuses an empty batch
    for b, p in enumerate(out):
        if not p:
            raise ValueError(f"prompt {b} is empty (all-zero attention_mask); drop it from the batch")
    return out


def check_prompts(served: list[list[int]] | None, ids: list[list[int]]) -> None:
    """The prompts vLLM ran (its own video expansion) must be the trainer's, token for token: else every logprob
    would be conditioned on another prompt."""
    if served is None:
        raise ServerError("the vLLM server did not return its prompt token ids; is it an older mmpg vllm-serve?")
    for b, (got, want) in enumerate(zip(served, ids)):
        if got != want:
            at = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
            raise ServerError(f"prompt {b}: vLLM expanded it to {len(got)} tokens, the trainer's processor to "
                              f"{len(want)} (first difference at token {at}); the two processors disagree on this "
                              "model family's video tokens (checked: Qwen2.5-VL, and Qwen3-VL with transformers >= "
                              "5.10 on the server, whose timestamps need the frames' fps and frames_indices); use "
                              "rollout.engine=hf")


def frames_and_metadata(video) -> tuple[torch.Tensor, dict]:
    """A DecodedVideo or (frames, metadata) -> frames [T, C, H, W] and the metadata the processor needs."""
    frames, meta = (video.frames, dict(video.metadata)) if hasattr(video, "frames") else (video[0], dict(video[1]))
    meta.setdefault("total_num_frames", int(frames.shape[0]))
    meta.setdefault("frames_indices", list(range(int(frames.shape[0]))))
    if "fps" not in meta:
        raise ValueError("video metadata needs 'fps' (frames per second of the source); qwen-vl-utils gives it")
    return frames, {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in meta.items()}


def video_token_id(model) -> int | None:
    tid = getattr(model.config, "video_token_id", None)
    return int(tid) if tid is not None else None


def eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        raise ValueError("the model's generation_config has no eos_token_id; pass SamplingParams(stop_token_ids=)")
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
