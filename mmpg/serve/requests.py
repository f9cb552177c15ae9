"""What the vLLM server makes of a request and its checkpoint: each distinct video of a request once, each prompt as
vLLM's prompt dict, each completion as the answer's token ids, logprobs and finish reason; the bad request's error;
and whether vLLM's on-device pixel normalization would differ from the trainer's processor for a checkpoint.
Runs in the server's environment (`.venv-vllm`): numpy and vLLM's own modules only, imported where needed.
"""

from __future__ import annotations

import numpy as np

from mmpg.serve.wire import video_digest


class RequestError(ValueError):
    """A bad request: answered with status 400 and this message."""


def video_table(meta: dict, arrays: dict) -> list[tuple[tuple, str]]:
    """wire 2 and 3: each distinct video of the request as vLLM's item (frames [T, H, W, 3], metadata) and its content
    name, made once however many prompts ask it."""
    table = []
    for v, video in enumerate(meta.get("videos") or []):
        frames = arrays.get(video.get("key"))
        if frames is None:
            raise RequestError(f"video {v} of the request names tensor {video.get('key')!r}, which it does not hold")
        metadata = processor_metadata(video["metadata"])
        table.append(((np.asarray(frames), metadata), video_digest(frames, metadata)))
    return table


def vllm_prompt(p: dict, arrays: dict, table: list | None) -> dict:
    """One request prompt -> vLLM's prompt dict. table: the request's videos (wire 2 and 3), None for wire 1, where
    the prompt names its own tensor and vLLM hashes its frames itself. Wire 3: prompt["videos"], the prompt's videos
    in order (several in a multi-turn conversation); wire 2: prompt["video"], one or None."""
    prompt = {"prompt_token_ids": [int(t) for t in p["token_ids"]]}
    if "videos" in p:
        picks = p["videos"] or []
        if not isinstance(picks, list):
            raise RequestError(f"a prompt's videos must be a list of table indices, got {picks!r}")
    else:
        video = p.get("video")
        picks = [] if video is None or video is False else [video]
    if not picks:
        return prompt
    items, names = [], []
    for video in picks:
        if table is not None:
            if isinstance(video, bool) or not isinstance(video, int) or not 0 <= video < len(table):
                raise RequestError(f"a prompt names video {video!r}; the request's table holds {len(table)}")
            (frames, metadata), name = table[video]
            names.append(name)
        else:
            frames = arrays.get(video["key"])
            if frames is None:
                raise RequestError(f"request names {video['key']} but holds no such tensor")
            frames, metadata = np.asarray(frames), processor_metadata(video["metadata"])
        # frames [T, H, W, 3] as the trainer's processor saw them (sized by qwen-vl-utils): no resize here either;
        # each item its own metadata dict (vLLM's video loader may write to it), the frames shared
        items.append((frames, dict(metadata)))
    if names:
        prompt["multi_modal_uuids"] = {"video": names}
    prompt["multi_modal_data"] = {"video": items}
    prompt["mm_processor_kwargs"] = {"do_resize": False, "do_sample_frames": False}
    return prompt


def processor_metadata(metadata: dict) -> dict:
    meta = dict(metadata, do_sample_frames=False)
    meta.setdefault("duration", meta["total_num_frames"] / float(meta["fps"]))
    meta.setdefault("video_backend", "mmpg")
    return meta


def normalization_mismatch(checkpoint: str) -> str | None:
    """Why vLLM's on-device pixel normalization would be wrong for this checkpoint's videos, or None.

    vLLM 0.32 (Qwen3-VL, among others) ships raw uint8 patches and rescales / normalizes them in the model with the
    *image* processor's mean, std and rescale factor, for videos too. A checkpoint whose video processor normalizes
    differently (mmpg's tiny Qwen3-VL: CLIP mean/std for images, 0.5 / 0.5 for videos) would then see other pixels
    than the trainer's processor gave its model (measured: logprobs off by up to 0.2). Released Qwen-VL checkpoints
    should normalize both alike (not checked here: no downloads); for any that does not, the server turns the device
    path off (the processor normalizes, as the trainer's does)."""
    from vllm.engine.arg_utils import EngineArgs

    if "mm_device_do_normalize" not in getattr(EngineArgs, "__dataclass_fields__", {}):
        return None  # a vLLM without the device path normalizes in the processor anyway
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(checkpoint)
    except (OSError, ValueError):
        return None  # no multimodal processor: nothing to normalize
    image, video = getattr(processor, "image_processor", None), getattr(processor, "video_processor", None)
    if image is None or video is None:
        return None
    keys = ("do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std")
    differ = {k: (getattr(image, k, None), getattr(video, k, None)) for k in keys
              if _as_list(getattr(image, k, None)) != _as_list(getattr(video, k, None))}
    if not differ:
        return None
    return "the image and video processors differ in " + ", ".join(f"{k} ({i} vs {v})" for k, (i, v) in differ.items())


def _as_list(value):
    return [float(x) for x in value] if isinstance(value, (list, tuple)) else value


class Conflict(RequestError):
    """Answered with status 409: the client's view of the server is stale (a restart)."""


def completion(c, want_logprobs: bool) -> dict:
    """One vLLM CompletionOutput -> token ids, the sampled tokens' logprobs and "stop" / "length"."""
    ids = [int(t) for t in c.token_ids]
    logps = [float(step[t].logprob) for step, t in zip(c.logprobs, ids)] if want_logprobs and c.logprobs else []
    return {"token_ids": ids, "logprobs": logps, "finish_reason": "stop" if c.finish_reason == "stop" else "length"}
