"""Evaluation protocols: named presets of the settings that published grounding numbers depend on.

Grounding scores move by points with the prompt, the frame rate, the frame and pixel budget, the answer length and
whether R1@m counts tIoU > m or tIoU >= m. A protocol fixes those, so `mmpg eval --protocol time_r1` evaluates the way
a paper's released code did. Each preset names where every value comes from and says "assumed" where neither the
paper nor the released code fixes it. What mmpg does not reproduce is listed too (see `Protocol.source`).

Pixel budgets are absolute pixel counts as the papers give them (Qwen2.5-VL, 28 x 28 pixels per token); with
Qwen3-VL (32 x 32) the same counts give fewer tokens.
"""

from __future__ import annotations

import dataclasses

from mmpg.errors import UserError

_TOKEN = 28 * 28  # pixels per visual token of Qwen2.5-VL (14 x 14 patches, 2 x 2 merged)

# The grounding prompts of the two released evaluation scripts, word for word ({query} is the sentence), as
# `PromptTemplate` arguments (built on use: importing mmpg.data pulls in torch, which `mmpg --help` should not
# wait for).
EVAL_TEMPLATES: dict[str, dict] = {
    # xiaomi-research/Time-R1, src/vllm_inference/data/config.py, DEFAULT_TG_PROMPT["r1"], with its system prompt
    "time_r1_eval": {"user": (
        'To accurately pinpoint the event "{query}" in the video, determine the precise time period of the event.'
        "\n\nOutput your thought process within the <think> </think> tags, including analysis with either specific "
        "time ranges (xx.xx to xx.xx) in <timestep> </timestep> tags.\n\nThen, provide the start and end times (in "
        'seconds, precise to two decimal places) in the format "start time to end time" within the <answer> '
        '</answer> tags. For example: "12.54 to 17.83".'),
        "system": "You are a helpful assistant."},
    # OpenGVLab/VideoChat-R1, src_eval/evaluate_tg_c8.py, GROUND_TEMPLATE (no system prompt of its own)
    "videochat_r1_eval": {"user": (
        'To accurately pinpoint the event "{query}" in the video, determine the precise time period of the event.'
        "\n\nOutput your thought process within the <think> </think> tags, including analysis with either specific "
        "timestamps (xx.xx) or time ranges (xx.xx to xx.xx) in <timestep> </timestep> tags.\n\nThen, provide the "
        'start and end times (in seconds, precise to two decimal places) in the format "start time to end time" '
        'within the <answer> </answer> tags. For example: "12.54 to 17.83".')},
}


def template_names() -> list[str]:
    from mmpg.data.prompts import TEMPLATES

    return list(TEMPLATES) + list(EVAL_TEMPLATES)


def eval_template(name: str):
    """The `PromptTemplate` called `name`: mmpg's own (mmpg/data/prompts.py) or a protocol's (above)."""
    from mmpg.data.prompts import PromptTemplate, get_template

    return PromptTemplate(**EVAL_TEMPLATES[name]) if name in EVAL_TEMPLATES else get_template(name)


@dataclasses.dataclass(frozen=True)
class Protocol:
    name: str
    summary: str  # one line
    settings: dict  # EvalSettings fields this preset sets
    source: str  # where each number comes from, what is assumed, what mmpg does not reproduce


PROTOCOLS: dict[str, Protocol] = {p.name: p for p in [
    Protocol(
        "default",
        "mmpg's training defaults (data.fps, data.max_frames, pixel budgets in tokens, template time_r1): the "
        "videos look as they did in training. Not a published protocol.",
        {},
        "Source: mmpg's own defaults (mmpg/config.py, mmpg/data/video.py). R1@m shown with tIoU > m first."),
    Protocol(
        "time_r1",
        "Time-R1 (arXiv 2503.13377), as its released evaluation code runs Charades-STA / ActivityNet / TVGBench.",
        {"template": "time_r1_eval", "fps": 2.0, "min_frames": 4, "max_frames": 768, "min_pixels": 16 * _TOKEN,
         "max_pixels": 768 * _TOKEN, "total_pixels": 3584 * _TOKEN, "max_new_tokens": 1024, "threshold_rule": "gt",
         "bad_videos": "fail"},
        "Source: the released code (xiaomi-research/Time-R1), not the paper's text, which was not checked here.\n"
        "template: its R1 grounding prompt and system prompt (src/vllm_inference/data/config.py).\n"
        "total_pixels 3584*28*28 and min_pixels 16*28*28: evaluate.py / build_dataloader defaults.\n"
        "max_new_tokens 1024: scripts/test.sh. threshold_rule gt: eval_all.py counts tIoU > m; an answer without a "
        "span scores 0.\n"
        "fps 2, min_frames 4, max_frames 768, max_pixels 768*28*28: not set by the script; assumed to be "
        "qwen-vl-utils' defaults.\n"
        "bad_videos fail: assumed (the script stops on a missing video).\n"
        "Not reproduced: its parser takes the last 'X to Y' anywhere in the output (mmpg needs <answer> tags and "
        "rejects reversed spans unless swap_reversed=true); scripts/test.sh passes --use_nothink (an empty <think> "
        "after the generation prompt); mmpg drops a trailing period from the query; vLLM bf16 decoding."),
    Protocol(
        "videochat_r1",
        "VideoChat-R1 (arXiv 2504.06958), as its released Charades-STA evaluation script runs.",
        {"template": "videochat_r1_eval", "fps": 2.0, "min_frames": 4, "max_frames": 768, "min_pixels": 16 * _TOKEN,
         "max_pixels": 768 * _TOKEN, "total_pixels": 3584 * _TOKEN, "max_new_tokens": 2048,
         "threshold_rule": "ge", "bad_videos": "skip"},
        "Source: the released code (OpenGVLab/VideoChat-R1, src_eval/evaluate_tg_c8.py and my_qwen_utils.py), not "
        "the paper's text, which was not checked here.\n"
        "template: GROUND_TEMPLATE, no system prompt (Qwen2.5-VL's chat template then adds its default one).\n"
        "total_pixels 3584*28*28, min_pixels 16*28*28: the video element of inference(). max_new_tokens 2048: "
        "inference()'s default. threshold_rule ge: recall counts m <= tIoU.\n"
        "fps 2, min_frames 4, max_frames 768, max_pixels 768*28*28: the constants of its my_qwen_utils.py.\n"
        "bad_videos skip: a sample whose inference raises is left out of the counts there.\n"
        "Not reproduced: the question comes before the video in its user turn (mmpg puts the video first); its "
        "parser takes the last 'X to Y' anywhere in the output; bf16 with flash-attention."),
]}


def get_protocol(name: str) -> Protocol:
    if name not in PROTOCOLS:
        raise UserError(f"unknown protocol {name!r}; choose one of {', '.join(PROTOCOLS)} (mmpg eval --fields "
                        "describes them)")
    return PROTOCOLS[name]


def protocols_help() -> str:
    """One paragraph per protocol for `mmpg eval --help`."""
    return "protocols: " + "; ".join(f"{p.name}: {p.summary}" for p in PROTOCOLS.values())
