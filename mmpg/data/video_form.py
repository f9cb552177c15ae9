"""Qwen3-VL's video in the prompt as the model was released with it, on every transformers version mmpg supports.

Qwen3-VL's chat template writes a video as one placeholder; the processor expands it into one block per temporal
patch (two frames), each after its time as text (the mean of the patch's two frame times, one decimal):

    template   <|vision_start|><|video_pad|><|vision_end|>
    released   <0.3 seconds><|vision_start|><|video_pad|>*n<|vision_end|><1.3 seconds><|vision_start|>...<|vision_end|>
    5.x        <|vision_start|><0.3 seconds><|vision_start|><|video_pad|>*n<|vision_end|>...<|vision_end|><|vision_end|>

transformers 5.x expands only the `<|video_pad|>` and keeps the template's pair around the blocks (two tokens more
per video, a form no released checkpoint saw), while the released processor (4.57) replaced the whole pair. Every
version expands a bare `<|video_pad|>` into exactly the released blocks, so mmpg hands the Qwen3-VL processor a bare
`<|video_pad|>` and checks the ids it gets back: every `<|vision_start|>` must open a frame (or an image). The
positions follow the ids, as in the released code. Qwen2.5-VL's template pair is its released form and is left as it
is. The vLLM engine sends each video as a bare `<|video_pad|>` too (`mmpg.rollout.vllm`).
"""

from __future__ import annotations

import torch


def writes_frame_blocks(processor) -> bool:
    """Whether the processor expands a video into per-frame `<t seconds><|vision_start|>...<|vision_end|>` blocks:
    Qwen3-VL's processor (which Qwen3-VL-MoE checkpoints load too)."""
    return any(cls.__name__ == "Qwen3VLProcessor" for cls in type(processor).__mro__)


def released_video_text(processor, text: str) -> str:
    """A chat-template text with each video placeholder as the processor must get it to write the released form:
    for Qwen3-VL the template's `<|vision_start|><|video_pad|><|vision_end|>` becomes the bare `<|video_pad|>`;
    any other processor's text is returned unchanged."""
    if not writes_frame_blocks(processor):
        return text
    token = processor.video_token
    return text.replace(f"{processor.vision_start_token}{token}{processor.vision_end_token}", token)


def check_released_form(processor, input_ids: torch.Tensor) -> None:
    """Raise when a Qwen3-VL prompt of `input_ids` [B, P] holds a `<|vision_start|>` that does not open a frame or
    an image (the token after it is not `<|video_pad|>` / `<|image_pad|>`): then the processor wrote a video in
    another form than the released one, and the model would be trained and evaluated on a format it never saw."""
    if not writes_frame_blocks(processor):
        return
    tok = processor.tokenizer
    start, video, image = (tok.convert_tokens_to_ids(t) for t in (processor.vision_start_token, processor.video_token,
                                                                  processor.image_token))
    after = torch.nn.functional.pad(input_ids[:, 1:], (0, 1), value=-1)  # [B, P]: the token after each one
    bad = ((input_ids == start) & (after != video) & (after != image)).nonzero()
    if len(bad):
        import transformers

        b, i = (int(x) for x in bad[0])
        raise RuntimeError(
            f"prompt {b}: the Qwen3-VL processor of transformers {transformers.__version__} wrote "
            f"{tok.decode(input_ids[b, i:i + 4].tolist())!r}... at token {i}, not the released form "
            f"'<t seconds>{processor.vision_start_token}{processor.video_token}...' "
            "(mmpg.data.video_form): this transformers version expands videos in a way mmpg does not know; "
            "use a transformers version in mmpg's supported range")
