"""How long the vLLM server's sequences must be, known from the config before anything starts.

vLLM refuses a request whose prompt + max_tokens exceeds the server's `max_model_len`, so the server's length is set
from the longest prompt the config can make, and the trainer checks it before the first step:

    worst prompt  = the chat template (system prompt included) around the template's text, rendered by the model's
                    own processor for a sample of a QUERY_TOKENS-token query, a WORST_DURATION_S-second video
                    (its digits in {duration}, {frame_times} and Qwen3-VL's `<t seconds>`) and the largest video
                    the data settings let qwen-vl-utils make (`worst_video_tokens`)
    needed        = worst prompt + rollout.max_new_tokens                (the trainer's check, `check_server_len`)
    server length = needed + MARGIN_TOKENS, rounded up to ROUND_TO       (`mmpg vllm-len`, the launch script)

Video tokens: n frames (even, data.min_frames..data.max_frames) are sized by qwen-vl-utils to at most
cap(n) = min(max_pixels, max(min(768 f², total_pixels / n · 2), int(1.05 · min_pixels))) pixels each (f = 2 · patch,
one LM token per f² pixels after the 2×2 merge), so the video holds at most max over n of n/2 · floor(cap(n) / f²)
tokens. The text is counted exactly: the processor runs on a stand-in video of the largest frame count, one merged
patch per frame (cheap), whose video tokens are then swapped for the worst video's.

What the margin covers: a clip window in the prompt (about 20 tokens), videos past WORST_DURATION_S. A prompt that
still does not fit (a query longer than QUERY_TOKENS, a longer video) is a counted skip in training (`data/too_long`),
not the end of the run. Without the model's processor here (a checkpoint not yet downloaded) the text is bounded
instead of counted: a byte-level tokenizer never makes more tokens than the text has bytes (`estimate`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

from typing import TYPE_CHECKING

from mmpg.errors import UserError

if TYPE_CHECKING:
    from mmpg.data.samples import GroundingSample
    from mmpg.data.video import DecodedVideo, VideoSpec

# torch, the prompt builder and the video module are imported where a length is computed: `mmpg`'s parser builds
# this command's arguments on every command (`add_arguments`), which must not cost a torch import

log = logging.getLogger("mmpg.rollout.lengths")

QUERY_TOKENS = 128  # the longest query of the five public sets: TimeRFT train_2k5, 126 tokens (Qwen2.5-VL tokenizer)
WORST_DURATION_S = 9999.0  # 4-digit seconds in the prompt's times
MARGIN_TOKENS = 64
ROUND_TO = 256
VIDEO_MAX_TOKENS = 768  # qwen-vl-utils' per-frame cap of a video (VIDEO_MAX_TOKEN_NUM), in tokens of f² pixels
CHAT_BYTES = 160  # estimate: the chat template's own text around a user turn (Qwen2.5-VL's default system prompt too)
FRAME_BLOCK_BYTES = 24  # estimate: Qwen3-VL's "<9999.5 seconds><|vision_start|>...<|vision_end|>" per temporal patch


@dataclasses.dataclass(frozen=True)
class WorstPrompt:
    """The config's longest prompt, in LM tokens: video placeholders + everything else."""

    video_tokens: int
    text_tokens: int  # chat template, system prompt, template words, QUERY_TOKENS of query, Qwen3-VL's times
    frames: int  # the frame count that makes the most video tokens
    counted: bool  # True: the model's processor counted the text; False: bounded by its bytes (`estimate`)

    @property
    def tokens(self) -> int:
        return self.video_tokens + self.text_tokens

    def needed(self, max_new_tokens: int) -> int:
        """The server length the trainer requires: the worst prompt and a whole response."""
        return self.tokens + int(max_new_tokens)

    def server_len(self, max_new_tokens: int) -> int:
        """What the launch script gives `mmpg vllm-serve --max-model-len`: needed + margin, rounded up."""
        return -(-(self.needed(max_new_tokens) + MARGIN_TOKENS) // ROUND_TO) * ROUND_TO

    def describe(self, max_new_tokens: int, what: str = "new tokens") -> str:
        """The need in words; `what`: what the response's max_new_tokens tokens are (`response_words`)."""
        how = "counted by the model's processor" if self.counted else "bounded without the model's processor"
        return (f"worst prompt {self.tokens:,} tokens ({self.video_tokens:,} video tokens at {self.frames} frames + "
                f"{self.text_tokens:,} of text, {how}; a {QUERY_TOKENS}-token query) + {int(max_new_tokens)} "
                f"{what}")


def frame_counts(spec: VideoSpec) -> range:
    """The even frame counts qwen-vl-utils may sample under `spec` (min_frames rounded up, max_frames down)."""
    return range(2 * math.ceil(spec.min_frames / 2), 2 * (spec.max_frames // 2) + 1, 2)


def worst_video_tokens(spec: VideoSpec, temporal: int = 2) -> tuple[int, int]:
    """(most LM tokens of one video, the frame count giving them) as qwen-vl-utils sizes frames (module docstring);
    temporal: frames per temporal patch (2 in both Qwen-VL families)."""
    f2 = spec.factor ** 2
    ele = spec.element("")
    best = (0, 0)
    for n in frame_counts(spec):
        cap = min(ele["max_pixels"], max(min(VIDEO_MAX_TOKENS * f2, ele["total_pixels"] / n * 2),
                                         int(ele["min_pixels"] * 1.05)))
        tokens = n // temporal * (int(cap) // f2)
        best = max(best, (tokens, n))
    return best


def data_spec(cfg, patch: int) -> VideoSpec:
    from mmpg.data.video import VideoSpec

    d = cfg.data
    return VideoSpec(fps=d.fps, min_frames=d.min_frames, max_frames=d.max_frames, min_pixels=d.min_pixels,
                     max_pixels=d.max_pixels, total_pixels=d.total_pixels, image_patch_size=patch)


def _stand_in(frames: int, side: int) -> tuple[GroundingSample, DecodedVideo]:
    """A sample of a WORST_DURATION_S-second video whose `frames` frames are one merged patch (side x side) each."""
    import torch

    from mmpg.data.samples import GroundingSample
    from mmpg.data.video import DecodedVideo

    indices = [round(i * (WORST_DURATION_S - 1) / max(1, frames - 1)) for i in range(frames)]
    video = DecodedVideo(frames=torch.zeros(frames, 3, side, side), timestamps=[float(i) for i in indices],
                         sample_fps=frames / WORST_DURATION_S,
                         metadata={"fps": 1.0, "frames_indices": indices, "total_num_frames": int(WORST_DURATION_S),
                                   "video_backend": "none"}, path="<worst case>", duration=WORST_DURATION_S)
    sample = GroundingSample(sample_id="worst", video="<worst case>", duration=WORST_DURATION_S, query="",
                             span=(0.0, 1.0), origin="the config's worst case")
    return sample, video


def worst_prompt(cfg, processor) -> WorstPrompt | None:
    """The config's longest prompt for this processor (module docstring); None for a text-only model (no video
    processor: its prompts are as long as their text)."""
    from mmpg.data.prompts import build_prompt_inputs, get_template

    vp = getattr(processor, "video_processor", None)
    if vp is None:
        return None
    spec = data_spec(cfg, int(vp.patch_size))
    temporal = int(getattr(vp, "temporal_patch_size", 2))
    video_tokens, frames = worst_video_tokens(spec, temporal)
    sample, video = _stand_in(frames, spec.factor)
    inputs = build_prompt_inputs(processor, [sample], [video], get_template(cfg.data.template))
    stand_in_video = frames // temporal  # one token per temporal patch
    text = int(inputs["input_ids"].shape[1]) - stand_in_video + QUERY_TOKENS
    return WorstPrompt(video_tokens=video_tokens, text_tokens=text, frames=frames, counted=True)


def estimate(cfg, family: str | None) -> WorstPrompt:
    """The worst prompt without the model's processor: the video as `worst_prompt` counts it (Qwen2.5-VL's 28-pixel
    tokens unless the family is known to be Qwen3-VL's 32), the text bounded by its bytes, QUERY_TOKENS for the
    query, CHAT_BYTES for the chat template, FRAME_BLOCK_BYTES per temporal patch unless the family is Qwen2.5-VL."""
    from mmpg.data.prompts import get_template
    from mmpg.data.video import PATCH_SIZE

    spec = data_spec(cfg, PATCH_SIZE.get(family or "", PATCH_SIZE["qwen2_5_vl"]))
    video_tokens, frames = worst_video_tokens(spec)
    sample, video = _stand_in(frames, spec.factor)
    template = get_template(cfg.data.template)
    text = len(template.render(sample, video).encode()) + len((template.render_system(sample, video) or "").encode())
    if template.tools:  # the tools' system text (`tools_system`) and a default system prompt before it
        from mmpg.data.prompts import tools_system

        text += len(tools_system(template.tools, "You are a helpful assistant.").encode())
    blocks = 0 if family == "qwen2_5_vl" else frames // 2 * FRAME_BLOCK_BYTES
    return WorstPrompt(video_tokens=video_tokens, text_tokens=text + CHAT_BYTES + blocks + QUERY_TOKENS,
                       frames=frames, counted=False)


def family_of(path: str) -> str | None:
    """The model family of a checkpoint folder (its config.json), or guessed from a hub id's name; None: unknown."""
    from mmpg.data.video import PATCH_SIZE

    config = Path(path).expanduser() / "config.json"
    if config.is_file():
        try:
            family = json.loads(config.read_text()).get("model_type")
        except (OSError, ValueError):
            family = None
        return family if family in PATCH_SIZE else None
    name = path.rsplit("/", 1)[-1].lower().replace(".", "_").replace("-", "_")
    return "qwen3_vl" if name.startswith("qwen3_vl") else "qwen2_5_vl" if name.startswith("qwen2_5_vl") else None


def check_server_len(limit: int, worst: WorstPrompt | None, max_new_tokens: int, url: str,
                     what: str = "new tokens") -> None:
    """Before the first step: the server at `url` must hold the config's worst prompt and a whole response
    (max_new_tokens tokens of `what`: `response_tokens` and `response_words` of a config)."""
    if worst is None or worst.needed(max_new_tokens) <= limit:
        return
    raise UserError(f"the vLLM server at {url} has max_model_len {limit}, below this config's "
                    f"{worst.needed(max_new_tokens):,} ({worst.describe(max_new_tokens, what)}): restart it with "
                    f"--max-model-len {worst.server_len(max_new_tokens)} (`mmpg vllm-len` prints it for a config; "
                    "scripts/train_grounding.sh sets it unless VLLM_MAX_LEN or VLLM_ARGS does), or lower "
                    "data.max_frames / data.total_pixels / rollout.max_new_tokens")


# ---- `mmpg vllm-len` ------------------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("--config", default=None, help="YAML config (configs/*.yaml), as mmpg train takes it")
    p.add_argument("--videos", action="store_true", help="print the server's --videos-per-prompt instead: 1, or with "
                   "the zoom tool (data.template=zoom) 1 + zoom.max_turns")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. data.max_frames=128")


def local_checkpoint(path: str) -> str | None:
    """The folder holding `path`'s config.json on this machine (a checkpoint folder, or a hub id's snapshot in the
    local Hugging Face cache), or None; never the network: counting a prompt is no reason to download a model."""
    folder = Path(path).expanduser()
    if (folder / "config.json").is_file():
        return str(folder)
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(path, "config.json")
    except Exception:  # noqa: BLE001 - no hub library, or a name it refuses: not in its cache either
        return None
    return str(Path(cached).parent) if isinstance(cached, str) else None


def local_processor(cfg):
    """model.path's processor where it is on this machine (never downloaded), else None."""
    from mmpg.models.loading import load_processor

    folder = local_checkpoint(cfg.model.path)
    try:
        return load_processor(folder) if folder else None
    except (UserError, OSError, ValueError) as e:  # a snapshot without its processor files
        log.info("%s: no processor here (%s)", folder, e)
        return None


def config_worst_prompt(cfg, processor=False) -> WorstPrompt:
    """The worst prompt of a config: counted with model.path's processor where it is on this machine, else
    `estimate`d. processor: `local_processor(cfg)` when the caller has it already (False: look here)."""
    if processor is False:
        processor = local_processor(cfg)
    if processor is None:
        return estimate(cfg, family_of(local_checkpoint(cfg.model.path) or cfg.model.path))
    worst = worst_prompt(cfg, processor)
    if worst is None:
        raise UserError(f"{cfg.model.path} is a text-only model: its prompts hold no video to plan the length for")
    return worst


def run(args) -> int:
    """Print the server length for a config on stdout (what the launch script reads), how it was found on stderr."""
    import sys

    from mmpg.config import load_config

    cfg = load_config(args.config, list(args.overrides))
    if getattr(args, "videos", False):
        print(videos_per_prompt(cfg))
        return 0
    processor = local_processor(cfg)
    worst, n = config_worst_prompt(cfg, processor), cfg.rollout.max_new_tokens
    if cfg.data.template == "zoom":  # every turn re-sends the conversation: the longest trajectory is the response
        n = response_tokens(cfg, processor)
    print(f"max_model_len {worst.server_len(n)}: {worst.describe(n, response_words(cfg))} + a {MARGIN_TOKENS}-token "
          f"margin, rounded up to a multiple of {ROUND_TO}", file=sys.stderr)
    print(worst.server_len(n))
    return 0


def worst_clip_tokens(cfg, processor) -> int:
    """The most LM tokens one zoom tool turn adds (data.template=zoom): its text, counted by the model's processor
    on a stand-in clip of zoom.max_frames frames of one merged patch each, whose video tokens are swapped for the
    largest clip the tool returns (zoom.max_frames frames sized as data.* sizes frames)."""
    from mmpg.data.video import VideoSpec
    from mmpg.rollout.zoom import ToolTurn, clip_turn, turn_inputs

    vp = processor.video_processor
    d, z = cfg.data, cfg.zoom
    temporal = int(getattr(vp, "temporal_patch_size", 2))
    spec = VideoSpec(fps=z.fps, min_frames=2, max_frames=z.max_frames, min_pixels=d.min_pixels,
                     max_pixels=d.max_pixels, total_pixels=d.total_pixels, image_patch_size=int(vp.patch_size))
    video_tokens, _ = worst_video_tokens(spec, temporal)
    frames = z.max_frames - z.max_frames % temporal
    _, clip = _stand_in(frames, spec.factor)
    ids, _ = turn_inputs(processor, ToolTurn(clip_turn(WORST_DURATION_S, WORST_DURATION_S), clip=clip))
    return int(ids.numel()) - frames // temporal + video_tokens


def response_tokens(cfg, processor=None) -> int:
    """The longest response behind a prompt: rollout.max_new_tokens, or with the zoom tool (data.template=zoom) the
    longest trajectory's, zoom.max_turns clips of up to `worst_clip_tokens` (bounded by the clip's video tokens and
    a 64-token text allowance without the processor) and zoom.max_turns + 1 model turns of rollout.max_new_tokens:
    what a vLLM server holds behind the worst prompt, every turn being one request of the whole conversation."""
    n = int(cfg.rollout.max_new_tokens)
    if cfg.data.template != "zoom":
        return n
    turns = int(cfg.zoom.max_turns)
    if processor is not None and getattr(processor, "video_processor", None) is not None:
        clip = worst_clip_tokens(cfg, processor)
    else:  # bounded: the clip's video tokens at the larger patch grid, 64 tokens of text, a time per 2 frames
        from mmpg.data.video import VideoSpec

        d, z = cfg.data, cfg.zoom
        spec = VideoSpec(fps=z.fps, min_frames=2, max_frames=z.max_frames, min_pixels=d.min_pixels,
                         max_pixels=d.max_pixels, total_pixels=d.total_pixels, image_patch_size=14)
        clip = worst_video_tokens(spec)[0] + 64 + z.max_frames // 2 * FRAME_BLOCK_BYTES
    return turns * clip + (turns + 1) * n


def response_words(cfg) -> str:
    """What `response_tokens(cfg)` counts, in words: "new tokens", or the longest zoom trajectory's parts."""
    if cfg.data.template != "zoom":
        return "new tokens"
    turns = int(cfg.zoom.max_turns)
    return (f"tokens of the longest zoom trajectory ({turns} clip(s) and {turns + 1} turns of "
            f"rollout.max_new_tokens={cfg.rollout.max_new_tokens})")


def videos_per_prompt(cfg) -> int:
    """The videos one request prompt holds: 1, or with the zoom tool 1 + zoom.max_turns (the overview and every
    clip), what `mmpg vllm-serve --videos-per-prompt` must allow."""
    return 1 + int(cfg.zoom.max_turns) if cfg.data.template == "zoom" else 1


def check_server_videos(have: int, cfg, url: str) -> None:
    """Before the first step: the server at `url` must take as many videos per prompt as the config's requests hold."""
    need = videos_per_prompt(cfg)
    if have < need:
        raise UserError(f"the vLLM server at {url} takes {have} video(s) per prompt; data.template=zoom with "
                        f"zoom.max_turns={cfg.zoom.max_turns} sends up to {need} (the overview and every clip): "
                        f"restart it with --videos-per-prompt {need} (scripts/train_grounding.sh sets it)")


def check_zoom_length(cfg, model_config, processor) -> None:
    """data.template=zoom: the longest trajectory the config allows (the worst prompt, zoom.max_turns tool turns
    of the largest clip, zoom.max_turns + 1 model turns of rollout.max_new_tokens) must fit the model's positions
    (max_position_embeddings), or one UserError line says which settings to lower, before anything trains."""
    config = getattr(model_config, "text_config", model_config)
    limit = getattr(config, "max_position_embeddings", None)
    prompt = worst_prompt(cfg, processor)
    if limit is None or prompt is None:
        return
    clip = worst_clip_tokens(cfg, processor)
    turns = cfg.zoom.max_turns
    total = prompt.tokens + turns * clip + (turns + 1) * cfg.rollout.max_new_tokens
    if total > limit:
        raise UserError(f"zoom.max_frames={cfg.zoom.max_frames}: the longest trajectory is {total} tokens (prompt "
                        f"{prompt.tokens}, {turns} zoom(s) of up to {clip}, {turns + 1} turns of rollout.max_new_tokens="
                        f"{cfg.rollout.max_new_tokens}), past the model's {limit} positions; lower zoom.max_frames, "
                        "zoom.max_turns, data.max_frames or the pixels")

