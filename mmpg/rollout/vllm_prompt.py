"""The prompt ids the vLLM engine sends: the trainer's prompt with each video back as the one token vLLM expands.

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
from typing import Callable

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
