"""Evaluation settings: one flat dataclass, merged defaults <- protocol preset <- `key=value` overrides.

    settings = load_settings("time_r1", ["max_new_tokens=512", "batch_size=4"])   # -> EvalSettings

OmegaConf does the merge and the type checks, as for the training config (`mmpg.config`, whose error formatting
is reused): an unknown key is one `UserError` line naming it and the nearest valid names; the CLI prints it and exits
with status 2. The video fields (fps, frames, pixels) and their checks are the config tree's VideoSettings block, the
one training's data.* has. `mmpg eval --fields` lists every setting with its default and help, and the protocols.

Pixel budgets in tokens. A visual token covers factor x factor pixels, factor 28 for Qwen2.5-VL (14-pixel patches
merged 2 x 2) and 32 for Qwen3-VL (16-pixel patches): the same pixel count is 0.77x the tokens on Qwen3-VL. Papers'
code that runs both families gives its budgets in tokens and multiplies by the checkpoint's factor (TimeLens's
`evaluation/utils.py`: `min_tokens * 32 * 32` for Qwen3-VL, `* 28 * 28` for Qwen2.5-VL), so the protocols set
`min_tokens` / `max_tokens` / `total_tokens` and `video_values_for(family)` turns them into pixels once the
checkpoint's family is known. A `*_pixels` setting is an absolute count for every family; giving one on the command
line clears its `*_tokens` twin, and the other way round.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Optional

from mmpg.config import VideoSettings, omegaconf_error, quote_text, video_checks
from mmpg.config import setting
from mmpg.errors import UserError

# Settings that change the numbers (stored in eval.json and the report, compared on a rerun). The others only change
# how fast the same predictions are made.
RUNTIME_ONLY = ("batch_size", "share_videos", "num_workers", "device", "self_check", "prefill_chunk", "decode",
                "cascade_backend", "decode_check",
                "grouping_backend", "frame_cache", "frame_cache_gb")


@dataclass
class EvalSettings(VideoSettings):
    # fps, min_frames, max_frames, min_pixels, max_pixels, total_pixels: VideoSettings' (the same defaults as data.*)
    template: str = setting("time_r1", "Prompt template: time_r1, time_r1_frames, answer_only, zoom (multi-turn: the "
                            "model may call the zoom tool, zoom_*; mmpg/data/prompts.py), or file: the text of "
                            "prompt_file (what the papers' protocols use).")
    zoom_fps: float = setting(4.0, "template=zoom: the zoom tool's frame rate (as training's zoom.fps).")
    zoom_max_frames: int = setting(16, "template=zoom: most frames one zoom returns (as training's zoom.max_frames).")
    zoom_max_turns: int = setting(2, "template=zoom: most tool turns per answer (as training's zoom.max_turns).")
    zoom_list_tools: bool = setting(True, "template=zoom: false leaves the tool's schema out of the system turn (the "
                                    "prompt an SFT stage with sft.list_tools false trained on); the model may still "
                                    "call the tool.")
    prompt_file: Optional[str] = setting(None, "The prompt, from a file; setting it selects template=file. Either the "
                                         "paper's own Python file that holds its prompt (.py: the string is read, the "
                                         "file never run; mmpg eval --fields gives each protocol's file and the "
                                         "command that fetches it) or a text file with {query} (and optionally "
                                         "{duration}) where the sentence (and the video's length) go. The time_r1 / "
                                         "videochat_r1 / tvgbench / timelens protocols need one: mmpg does not ship "
                                         "the papers' prompts.")
    scoring: str = setting("mmpg", "How an answer is scored (mmpg/eval/metrics.py): mmpg (the last <answer> span, "
                           "clamped to the video, as training rewards it), last_span (Time-R1's and VideoChat-R1's "
                           "code: the last 'A to B' anywhere) or timelens (TimeLens's code: the first time pair, "
                           "rounded to seconds). Under last_span and timelens the answer and the ground truth are "
                           "unclamped and every record with a readable span is evaluated, as the papers' loaders keep "
                           "them all.")
    min_tokens: Optional[int] = setting(None, "Smallest frame in visual tokens: min_pixels = min_tokens x factor^2 "
                                        "for the checkpoint's family (factor 28 Qwen2.5-VL, 32 Qwen3-VL), as "
                                        "TimeLens's --min_tokens. Used when min_pixels is null; setting one clears "
                                        "the other.")
    max_tokens: Optional[int] = setting(None, "Largest frame in visual tokens (max_pixels = max_tokens x factor^2; "
                                        "qwen-vl-utils' own cap is 768 tokens). Used when max_pixels is null; setting "
                                        "one clears the other.")
    total_tokens: Optional[int] = setting(None, "Visual-token budget of a whole video, shared by its frames "
                                          "(total_pixels = total_tokens x factor^2), as TimeLens's --total_tokens. "
                                          "Used when total_pixels is null; setting one clears the other.")
    query_clean: str = setting("mmpg", "How the query's text goes into the prompt (mmpg/data/queries.py): mmpg "
                               "(whitespace at the ends and trailing periods dropped, as training), strip (whitespace "
                               "at the ends: Time-R1's Charades-STA / ActivityNet loaders), as_written (the file's "
                               "text: VideoChat-R1, Time-R1's TVGBench loader) or timelens (whitespace runs made one "
                               "space, periods stripped at both ends: TimeLens's parse_query).")
    duplicates: str = setting("count", "Records repeating a (video, query, span): count (each one in the "
                              "denominators, as Time-R1's and VideoChat-R1's code) or once (as TimeLens's "
                              "compute_metrics.py, whose predictions are a dict keyed by video>>>query>>>span; the "
                              "last one kept). The report gives the other denominator's figures beside when they "
                              "differ.")
    dtype: str = setting("auto", "Weights and compute dtype: auto (bfloat16 on GPU, float32 on CPU), float32, "
                         "bfloat16, float16.")
    max_new_tokens: int = setting(256, "Most tokens per answer (greedy decoding); a longer answer is cut and usually "
                                  "unparseable.")
    threshold_rule: str = setting("gt", "Which R1@m convention the report shows first: gt (tIoU > m, Time-R1) or ge "
                                  "(tIoU >= m, VideoChat-R1). Both are always computed.")
    swap_reversed: bool = setting(False, "Read an answer 'END to START' as START to END instead of unparseable.")
    bad_videos: str = setting("fail", "A sample whose video is missing or corrupt: fail (scored IoU 0, counted) or "
                              "skip (left out of the metrics, counted).")
    max_samples: int = setting(0, "Evaluate only the first N samples of the benchmark (0: all).")
    format: str = setting("auto", "Annotation format: auto, charades, captions, time_r1, tvgbench, timelens, jsonl "
                          "(data/README.md).")
    batch_size: int = setting(8, "Prompts per greedy decoding batch (per rank).")
    share_videos: bool = setting(True, "Batch a video's queries together, side by side (whole videos packed up to "
                                 "batch_size queries; a video with more is split), so the video is decoded once per "
                                 "batch and can be prefilled and encoded once for all its questions; false: fixed "
                                 "batches of batch_size queries in annotation order (mmpg/eval/batches.py).")
    prefill_chunk: int = setting(8192, "A prompt longer than this many tokens is prefilled in chunks of it, its video "
                                 "encoded in frame chunks (as training's rollout.prefill_chunk): memory follows the "
                                 "chunk, not the video; the same answers. 0: one forward per batch.")
    num_workers: int = setting(2, "DataLoader workers decoding videos (0: in the main process).")
    frame_cache: str = setting("", "Folder of the decoded-frame cache (empty: off), as training's data.frame_cache: "
                               "frames read from it where a run or `mmpg prepare-videos` stored them with the same "
                               "settings, stored there otherwise.")
    frame_cache_gb: float = setting(100.0, "Most gigabytes frame_cache may hold (least recently used entries "
                                    "deleted past it), as training's data.frame_cache_gb.")
    device: str = setting("auto", "auto (cuda when available), cpu or cuda.")
    decode: str = setting("auto", "How answers are decoded behind the shared prompt, as training's rollout.decode: "
                          "auto / cascade (each prompt's K/V read once per step for all its rows), copy (the "
                          "reference).")
    cascade_backend: str = setting("auto", "Cascade decoding's kernel, as training's rollout.cascade_backend: auto "
                                   "(CUDA: flash if usable, else sdpa, else math; CPU: sdpa), flash, sdpa, math.")
    decode_check: str = setting("auto", "Check the cascade kernel against copy decoding on the first batch and when "
                                "prompts or groups grow, stepping down the chain on a disagreement (one warning "
                                "line), as training's rollout.decode_check: auto (on for CUDA), on, off.")
    self_check: str = setting("on", "Compare the decode engine's logprobs of the first batch's answers (and of any "
                              "later batch with longer prompts or answers) with the repeated forward, in this dtype "
                              "and backend (mmpg.grouping.selfcheck): on (stop on a difference above the dtype's "
                              "bound), warn, off.")
    grouping_backend: str = setting("auto", "Attention backend of the shared prefill (a video's queries prefilled "
                                    "once, mmpg.grouping): auto (flash on CUDA in bf16/fp16 when a usable flash-attn "
                                    "is installed, else sdpa), sdpa, flash, flex; as training's "
                                    "model.grouping_backend.")

    def video_values_for(self, family: str) -> dict:
        """`video_values()` for a checkpoint of `family` (qwen2_5_vl, qwen3_vl): each budget given in tokens made
        pixels with that family's token size, e.g. total_tokens 14336 -> 14336 x 32 x 32 = 14,680,064 pixels on
        Qwen3-VL, 14336 x 28 x 28 = 11,239,424 on Qwen2.5-VL (what `VideoSpec.for_family` takes)."""
        from mmpg.data.video import PATCH_SIZE

        if family not in PATCH_SIZE:
            raise UserError(f"unknown model family {family!r}; choose one of {', '.join(PATCH_SIZE)}")
        values, token = self.video_values(), (2 * PATCH_SIZE[family]) ** 2
        for pixels in ("min_pixels", "max_pixels", "total_pixels"):
            tokens = getattr(self, TWINS[pixels])
            if values[pixels] is None and tokens is not None:
                values[pixels] = tokens * token
        return values


CHOICES = {
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "threshold_rule": ("gt", "ge"),
    "bad_videos": ("fail", "skip"),
    "device": ("auto", "cpu", "cuda"),
    "decode": ("auto", "cascade", "copy"),
    "cascade_backend": ("auto", "flash", "sdpa", "math"),
    "decode_check": ("auto", "on", "off"),
    "self_check": ("on", "warn", "off"),
    "grouping_backend": ("auto", "sdpa", "flash", "flex"),
    "scoring": ("mmpg", "last_span", "timelens"),  # mmpg.eval.metrics.SCORINGS
    "query_clean": ("mmpg", "strip", "as_written", "timelens"),  # mmpg.data.queries.QUERY_CLEANINGS
    "duplicates": ("count", "once"),  # mmpg.eval.metrics.DUPLICATES
}
# A budget given in pixels and the same one in tokens: giving one (key=value) clears the other.
TWINS = {f"{k}_pixels": f"{k}_tokens" for k in ("min", "max", "total")}
TWINS.update({v: k for k, v in TWINS.items()})
FIELDS = [f.name for f in dataclasses.fields(EvalSettings)]


def _unknown(key: str, source: str) -> UserError:
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], FIELDS, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; settings are {', '.join(FIELDS)}"
    return UserError(f"{source}: unknown eval setting '{key}'{hint} (mmpg eval --fields lists them)")


def _validate(s: EvalSettings) -> None:
    from mmpg.data.formats import FORMAT_CHOICES
    from mmpg.eval.protocols import template_names

    if s.prompt_file:
        s.template = "file"
    choices = dict(CHOICES, format=FORMAT_CHOICES, template=tuple(template_names()))
    for key, allowed in choices.items():
        if getattr(s, key) not in allowed:
            raise UserError(f"eval setting '{key}' is {getattr(s, key)!r}; choose one of {', '.join(allowed)}")
    for pixels in ("min_pixels", "max_pixels", "total_pixels"):
        if getattr(s, pixels) is not None and getattr(s, TWINS[pixels]) is not None:
            raise UserError(f"eval settings '{pixels}' and '{TWINS[pixels]}' are both set ({getattr(s, pixels)} "
                            f"pixels, {getattr(s, TWINS[pixels])} tokens); give one of them")
    checks = video_checks(s) + [(k, getattr(s, k) is None or getattr(s, k) > 0, "must be > 0 or null")
                                for k in ("min_tokens", "max_tokens", "total_tokens")] + [
        ("max_new_tokens", s.max_new_tokens >= 1, "must be >= 1"),
        ("batch_size", s.batch_size >= 1, "must be >= 1"),
        ("max_samples", s.max_samples >= 0, "must be >= 0 (0: all)"),
        ("num_workers", s.num_workers >= 0, "must be >= 0"),
        ("frame_cache_gb", s.frame_cache_gb > 0, "must be > 0"),
        ("prefill_chunk", s.prefill_chunk >= 0, "must be >= 0 (0: no chunking)"),
    ]
    for key, ok, what in checks:
        if not ok:
            raise UserError(f"eval setting '{key}' is {getattr(s, key)!r}; it {what}")
    from mmpg.rollout.zoom import ZoomSettings

    if not s.zoom_list_tools and s.template != "zoom":
        raise UserError(f"eval setting 'zoom_list_tools' is false but template is {s.template!r}: it leaves the zoom "
                        "tool's schema out of template=zoom's prompt only")
    problem = ZoomSettings(s.zoom_fps, s.zoom_max_frames, s.zoom_max_turns).problem()
    if problem:  # "zoom.fps=0: ..." -> the eval setting's name
        raise UserError("eval setting " + problem.replace("zoom.", "zoom_", 1))


def load_settings(protocol: str = "default", overrides: list[str] | tuple[str, ...] = ()) -> EvalSettings:
    """EvalSettings defaults <- the protocol's preset <- `key=value` overrides; UserError on a bad key or value."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from mmpg.eval.protocols import get_protocol

    preset = get_protocol(protocol)
    merged = OmegaConf.merge(OmegaConf.structured(EvalSettings), preset.settings)
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if "=" not in item or not key:
            raise UserError(f"override {item!r} must look like key=value, e.g. max_new_tokens=512")
        if key not in FIELDS:
            raise _unknown(key, f"override {item!r}")
        item = quote_text(item, EvalSettings)  # self_check=off stays "off" (YAML would read False)
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as e:
            err = omegaconf_error(e, f"override {item!r}", EvalSettings)
            raise UserError(str(err).replace("config key", "eval setting", 1)) from None
        if key in TWINS:  # min_pixels=N on a protocol that gives min_tokens: the pixel count wins, and vice versa
            merged[TWINS[key]] = None
    settings = OmegaConf.to_object(merged)
    _validate(settings)
    from mmpg.eval.protocols import check_prompt

    check_prompt(preset, settings)
    return settings


def numbers_settings(s: EvalSettings) -> dict:
    """The settings that change the numbers (everything but RUNTIME_ONLY), as a plain dict."""
    return {k: v for k, v in dataclasses.asdict(s).items() if k not in RUNTIME_ONLY}


def describe() -> str:
    """Every setting with its default and help, then the protocols and what each sets."""
    from mmpg.eval.protocols import PROTOCOLS

    lines = ["settings (key=value on the command line):"]
    for f in dataclasses.fields(EvalSettings):
        lines.append(f"  {f.name} = {f.default!r}\n      {f.metadata.get('help', '')}")
    lines.append("\nprotocols (--protocol NAME; settings given as key=value still win):")
    for p in PROTOCOLS.values():
        lines.append(f"  {p.name}: {p.summary}")
        lines += [f"      {k} = {v!r}" for k, v in p.settings.items()]
        lines.append("      " + p.source.replace("\n", "\n      "))
        if p.prompt:
            lines.append(f"      prompt: the paper's own, not shipped: {p.prompt.fetch_command()}, then "
                         f"prompt_file={p.prompt.save_as} (the paper's text: {p.prompt_where})")
    return "\n".join(lines)
