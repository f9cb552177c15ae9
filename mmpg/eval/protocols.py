"""Evaluation protocols: named presets of the settings that published grounding numbers depend on.

Grounding scores move by points with the prompt, the frame rate, the frame and pixel budget, the answer length and
whether R1@m counts tIoU > m or >= m. A protocol fixes those, so `mmpg eval --protocol time_r1` evaluates the way a
paper's released code did. Each preset names where every value comes from, says "assumed" where neither the paper
nor the code fixes it, and lists what mmpg does not reproduce (`Protocol.source`).

Budgets are in visual tokens (min_tokens, max_tokens, total_tokens), made pixels with the checkpoint's token size
(`EvalSettings.video_values_for`): 28 x 28 pixels for Qwen2.5-VL, 32 x 32 for Qwen3-VL, as TimeLens's code does.
Time-R1's and VideoChat-R1's code loads Qwen2.5-VL only, so for a Qwen3-VL checkpoint their token counts are kept,
which is assumed. The resulting pixel budgets per family: docs/evaluation.md ("Scoring"). The query goes into the
prompt as each paper's code writes it (`query_clean`, `mmpg.data.queries`), and TimeLens's repeated (video, query,
span) records count once (`duplicates`, `mmpg.eval.metrics.once_per_key`).
"""

from __future__ import annotations

import dataclasses

from mmpg.errors import UserError
from mmpg.eval.paper_prompts import TIME_R1, TIMELENS, VIDEOCHAT_R1, PromptSource


def template_names() -> list[str]:
    from mmpg.data.prompts import TEMPLATES

    return list(TEMPLATES) + ["file"]


def read_prompt_file(path: str):
    """The `PromptTemplate` of a user's prompt file: the paper's own Python file that holds its prompt (`.py`, read
    without running it: mmpg.eval.paper_prompts), or a text file whose whole text is the user turn, with {query}
    (required) and optionally {duration} (or any of mmpg.data.prompts.PLACEHOLDERS); literal braces doubled."""
    import string
    from pathlib import Path

    from mmpg.data.prompts import PromptTemplate
    from mmpg.eval.paper_prompts import read_paper_prompt

    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"prompt_file {path}: not found; pass the paper's file that holds its prompt (mmpg eval "
                        "--fields says which, and how to fetch it) or a text file with {query} where the sentence "
                        "goes")
    if file.suffix == ".py":
        return PromptTemplate(user=read_paper_prompt(file))
    try:
        text = file.read_text(encoding="utf-8-sig").strip()
    except UnicodeDecodeError as e:
        raise UserError(f"prompt_file {path}: not UTF-8 text (byte {e.start})") from None
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(text) if f is not None}
    except ValueError as e:
        raise UserError(f"prompt_file {path}: {e} (write literal braces doubled, {{{{ and }}}})") from None
    if "query" not in fields:
        raise UserError(f"prompt_file {path}: no {{query}} placeholder, so every prompt would be the same; put "
                        "{query} where the sentence goes (a paper's [EVENT] or {} marker becomes {query})")
    try:
        return PromptTemplate(user=text)
    except UserError as e:
        raise UserError(f"prompt_file {path}: {e}") from None


def eval_template(name: str, prompt_file: str | None = None, query_clean: str = "mmpg", *, list_tools: bool = True):
    """The `PromptTemplate` called `name` (mmpg/data/prompts.py), or for "file" the text of `prompt_file`, its
    {query} cleaned by `query_clean` (`mmpg.data.queries`); `list_tools` false leaves a tool's schema out of the
    system turn (as `sft.list_tools`)."""
    from mmpg.data.prompts import get_template

    if name == "file":
        if not prompt_file:
            raise UserError("template=file needs prompt_file=PATH (a text file with {query})")
        template = read_prompt_file(prompt_file)
    else:
        template = get_template(name)
    return dataclasses.replace(template, query_clean=query_clean, list_tools=list_tools)


@dataclasses.dataclass(frozen=True)
class Protocol:
    name: str
    summary: str  # one line
    settings: dict  # EvalSettings fields this preset sets
    source: str  # where each number comes from, what is assumed, what mmpg does not reproduce
    prompt: PromptSource | None = None  # the paper's own prompt: the file it is in (mmpg does not ship its text)

    @property
    def prompt_where(self) -> str:
        """Where the paper's prompt is ("" for mmpg's own protocol)."""
        return self.prompt.where if self.prompt else ""


# Time-R1's released evaluation (evaluate.py, scripts/test.sh, build_dataloader), shared by time_r1 and tvgbench.
_TIME_R1 = {"template": "file", "scoring": "last_span", "fps": 2.0, "min_frames": 4, "max_frames": 768,
            "min_tokens": 16, "max_tokens": 768, "total_tokens": 3584,
            "max_new_tokens": 1024, "threshold_rule": "gt"}
# Said of every protocol whose code runs one family only.
_QWEN25_ONLY = ("Qwen3-VL: assumed. The code loads Qwen2.5-VL only ({loads}), so on a Qwen3-VL checkpoint mmpg "
                "keeps the token counts and multiplies them by 32x32 (16,384 / 786,432 / 3,670,016 pixels), as "
                "TimeLens's code and qwen-vl-utils 0.0.14 scale theirs; the pixel counts as written would give "
                "0.77x the tokens.")

PROTOCOLS: dict[str, Protocol] = {p.name: p for p in [
    Protocol(
        "default",
        "mmpg's training defaults (data.fps, data.max_frames, pixel budgets in tokens, template time_r1): the "
        "videos look as they did in training. Not a published protocol.",
        {},
        "Source: mmpg's own defaults (mmpg/config/tree.py, mmpg/data/video.py). R1@m shown with tIoU > m first. "
        "scoring mmpg: the training parser (the last <answer> span, clamped to the video)."),
    Protocol(
        "time_r1",
        "Time-R1 (arXiv 2503.13377), as its released evaluation code runs Charades-STA / ActivityNet / TVGBench.",
        dict(_TIME_R1, bad_videos="fail", query_clean="strip"),
        "Source: the released code (xiaomi-research/Time-R1), not the paper's text, which was not checked here.\n"
        "template=file: the prompt is the user's prompt_file (the paper's own file: see the prompt line). System "
        "prompt: its 'You are a helpful assistant.', which is also Qwen2.5-VL's chat-template default, so none is "
        "set.\n"
        "query_clean strip: load_charades / load_activitynet in src/vllm_inference/data/data_loader.py take "
        "sentence.strip() and the prompt formats it as is: whitespace at the ends goes, the final period stays "
        "(every Charades-STA query has one).\n"
        "scoring last_span: extract_answer in evaluate.py (the last 'A to B' / 'A and B' anywhere) and compute_IoU "
        "in src/vllm_inference/eval_all.py (raw spans, nothing clamped); mIoU and R1 over every scored query, "
        "each record counted (keyed by its running qid: duplicates count). "
        "Every record with a readable span is evaluated, as load_charades / load_tvgbench keep them all "
        "(zero-length truths score 0, ends past the video unclamped: mmpg/eval/metrics.py).\n"
        "min_tokens 16, total_tokens 3584 (Qwen2.5-VL: 12,544 and 2,809,856 pixels): build_dataloader's "
        "min_pixels=16*28*28 and evaluate.py's --total_pixels default 3584*28*28 (scripts/test.sh passes none).\n"
        "fps 2, min_frames 4, max_frames 768, max_tokens 768 (602,112 pixels): the constants FPS, FPS_MIN_FRAMES, "
        "FPS_MAX_FRAMES, VIDEO_MAX_PIXELS = 768*28*28 of its src/utils/vision_process.py, which the dataset leaves "
        "unset.\n"
        + _QWEN25_ONLY.format(loads="evaluate.py: Qwen2_5_VLForConditionalGeneration; vision_process.py: "
                              "IMAGE_FACTOR 28") + "\n"
        "max_new_tokens 1024: scripts/test.sh. threshold_rule gt: eval_all.py counts tIoU > m; an answer without a "
        "span scores 0.\n"
        "bad_videos fail: assumed (the script stops on a missing video).\n"
        "Not reproduced: scripts/test.sh passes --use_nothink (an empty <think> after the generation prompt); vLLM "
        "bf16 decoding.",
        TIME_R1),
    Protocol(
        "tvgbench",
        "Time-R1's TVGBench (tvgbench.json, 800 queries), as its released evaluation code runs it.",
        dict(_TIME_R1, bad_videos="skip", format="tvgbench", query_clean="as_written"),
        "Source: the released code (xiaomi-research/Time-R1): TVGBench goes through the same evaluate.py, "
        "build_dataloader and eval_all.py as Charades-STA, so every setting but these is time_r1's (see there: "
        "min_tokens 16, max_tokens 768, total_tokens 3584, and their pixels per family).\n"
        "format tvgbench: load_tvgbench in src/vllm_inference/data/data_loader.py (the span from 'answer' \"S-E\", "
        "the video from 'path'); all 800 records evaluated, the 11 zero-length and the one ending past its clip "
        "included.\n"
        "query_clean as_written: load_tvgbench passes 'question' to the prompt unchanged (135 of the 800 end with "
        "a space, which stays).\n"
        "bad_videos skip: load_tvgbench leaves a record out when its video file does not exist.\n"
        "scoring last_span, threshold_rule gt: eval_all.py scores tvgbench like charades (compute_IoU, tIoU > m).",
        TIME_R1),
    Protocol(
        "videochat_r1",
        "VideoChat-R1 (arXiv 2504.06958), as its released Charades-STA evaluation script runs.",
        {"template": "file", "scoring": "last_span", "fps": 2.0, "min_frames": 4, "max_frames": 768,
         "min_tokens": 16, "max_tokens": 768, "total_tokens": 3584, "query_clean": "as_written",
         "max_new_tokens": 2048, "threshold_rule": "ge", "bad_videos": "skip"},
        "Source: the released code (OpenGVLab/VideoChat-R1, src_eval/evaluate_tg_c8.py, renamed "
        "src_eval/evaluate_grounding.py, and my_qwen_utils.py), not the paper's text, which was not checked here.\n"
        "template=file: the prompt is the user's prompt_file (the paper's own file: see the prompt line); no system "
        "prompt (Qwen2.5-VL's chat template then adds its default one).\n"
        "query_clean as_written: GROUND_TEMPLATE.replace('[EVENT]', sentence), the annotation's text unchanged "
        "(its final period and any space at the ends stay).\n"
        "scoring last_span: parse_timestamp_output (the last 'A to B' / 'A and B' anywhere) and the IoU of the raw "
        "spans floored at 0; every record evaluated and counted (create_work_items keeps them all, keyed "
        "{vid}_{sentence_idx}: duplicates count).\n"
        "min_tokens 16, total_tokens 3584 (Qwen2.5-VL: 12,544 and 2,809,856 pixels): the video element of "
        "inference(), 16*28*28 and 3584*28*28. max_new_tokens 2048: inference()'s default. threshold_rule ge: "
        "recall counts m <= tIoU.\n"
        "fps 2, min_frames 4, max_frames 768, max_tokens 768 (602,112 pixels): the constants of its "
        "my_qwen_utils.py (VIDEO_MAX_PIXELS = 768*28*28).\n"
        + _QWEN25_ONLY.format(loads="Qwen2_5_VLForConditionalGeneration; my_qwen_utils.py: IMAGE_FACTOR 28; "
                              "qwen-vl-utils 0.0.10 pinned") + "\n"
        "bad_videos skip: a sample whose inference raises is left out of the counts there.\n"
        "Not reproduced: the question comes before the video in its user turn (mmpg puts the video first); bf16 "
        "with flash-attention.",
        VIDEOCHAT_R1),
    Protocol(
        "timelens",
        "TimeLens-Bench (arXiv 2512.14698: Charades-STA, ActivityNet Captions and QVHighlights re-annotated), as "
        "its released evaluation code runs it; its authors report rankings that flip between these labels and the "
        "original ones, so evaluate both (time_r1 on the original files).",
        {"template": "file", "scoring": "timelens", "format": "timelens", "fps": 2.0, "min_frames": 4,
         "max_frames": 768, "min_tokens": 64, "max_tokens": 768, "total_tokens": 14336, "query_clean": "timelens",
         "duplicates": "once", "max_new_tokens": 512, "threshold_rule": "ge", "bad_videos": "fail"},
        "Source: the released code (TencentARC/TimeLens: timelens/dataset/timelens_data.py, evaluation/utils.py, "
        "evaluation/eval_dataloader.py, evaluation/compute_metrics.py, timelens/utils.py, "
        "scripts/eval_timelens_bench.sh, requirements.txt), not the paper's text, which was not checked here.\n"
        "format timelens: load_annos ({video_id: {duration, spans, queries}}, every record kept, the video "
        "<video_id>.mp4).\n"
        "query_clean timelens: parse_query in timelens_data.py: whitespace runs become one space, then whitespace "
        "and periods are stripped at both ends (a leading period goes too).\n"
        "duplicates once: eval_dataloader.py keys each prediction f\"{video_name}>>>{query}>>>{span}\" and "
        "compute_metrics.py merges them into a dict, num_annos = len(datas): a repeated (video, query, span) counts "
        "once; the report gives the every-record figures beside.\n"
        "template=file: the prompt is the user's prompt_file (the paper's own file: see the prompt line); no system "
        "prompt (the chat template's default).\n"
        "scoring timelens: extract_time's first pair (clock times, then 'A - B', then 'A to B', then two numbers), "
        "rounded to whole seconds (UNIT 1.0), against the file's span; iou() as written. threshold_rule ge: "
        "compute_metrics.py counts tIoU >= m; mIoU and R1 over every counted record.\n"
        "fps 2, min_tokens 64, total_tokens 14336: scripts/eval_timelens_bench.sh (FPS, min_tokens, total_tokens), "
        "which GroundingDataset in evaluation/utils.py multiplies by downsample_rate ** 2: 32 for Qwen3-VL and "
        "TimeLens-8B (65,536 and 14,680,064 pixels), 28 for Qwen2.5-VL and TimeLens-7B (50,176 and 11,239,424).\n"
        "max_tokens 768, min_frames 4, max_frames 768: the pinned qwen-vl-utils 0.0.14 (requirements.txt), whose "
        "fetch_video caps a frame at VIDEO_MAX_TOKEN_NUM 768 x (2 x image_patch_size)^2, image_patch_size 16 for "
        "Qwen3-VL (786,432 pixels) and 14 for Qwen2.5-VL (602,112), and whose smart_nframes uses FPS_MIN_FRAMES "
        "4, FPS_MAX_FRAMES 768. max_new_tokens 512: eval_dataloader.py (greedy).\n"
        "bad_videos fail: assumed (load_annos only warns on a missing video; its DataLoader then fails on it).\n"
        "Not reproduced: TimeLens-7B's own prompt preamble with frame timestamps written between the frames; "
        "a span key printed as the file writes its numbers ([10, 15] and [10.0, 15.0] are two keys there); bf16 "
        "with flash-attention.",
        TIMELENS),
]}


def get_protocol(name: str) -> Protocol:
    if name not in PROTOCOLS:
        raise UserError(f"unknown protocol {name!r}; choose one of {', '.join(PROTOCOLS)} (mmpg eval --fields "
                        "describes them)")
    return PROTOCOLS[name]


def check_prompt(protocol: Protocol, settings) -> None:
    """A protocol whose prompt is a file (template=file) without prompt_file: one line naming the paper's file, the
    command that fetches it and what to pass."""
    if settings.template != "file":
        return
    if not settings.prompt_file:
        if protocol.prompt is None:
            raise UserError("template=file needs prompt_file=PATH (a text file with {query} where the sentence goes)")
        raise UserError(f"protocol {protocol.name} uses its paper's own prompt, which mmpg does not ship: fetch the "
                        f"file that holds it once ({protocol.prompt.fetch_command()}) and pass "
                        f"prompt_file={protocol.prompt.save_as} (mmpg reads {protocol.prompt.name} from it without "
                        f"running it), or prompt_file=PATH, a text file with {{query}} where the sentence goes. The "
                        f"paper's text is in {protocol.prompt_where}.")
    read_prompt_file(settings.prompt_file)
